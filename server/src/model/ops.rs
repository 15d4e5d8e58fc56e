//! Forward and hand-written backward of the transformer's building blocks.
//!
//! Lathe does not use candle's autograd: several candle-nn ops silently drop gradients,
//! candle's matmul backward computes weight gradients for frozen weights, and its graph
//! keeps every intermediate alive. Each block here saves exactly what its backward needs.
//! Everything is built from candle tensor ops, so it runs on any candle device and in any
//! float dtype (f64 for the finite-difference tests).

use candle_core::{DType, Device, Result, Tensor, D};

use super::backend::Backend;
use super::cpu::attention as host_attention;
use super::cpu::gemm::with_slices;
use super::cpu::kernels;
#[cfg(feature = "cuda")]
use super::cuda;

/// `a + b` for tensors of one shape: the fused kernel on the CPU, candle elsewhere.
pub fn add(be: Backend, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if be.fused(a) && be.fused(b) && a.dtype() == b.dtype() {
        return match a.dtype() {
            DType::F64 => kernels::add::<f64>(a, b),
            _ => kernels::add::<f32>(a, b),
        };
    }
    a + b
}

/// `a.matmul(b)` with each operand in a layout that every candle device multiplies.
///
/// cuBLAS (candle's CUDA matmul) takes the last two dims only packed, row-major or
/// transposed, where candle's CPU gemm takes any strides: a view that the CPU multiplies
/// in place (the transposed head view of a packed `k`, say) fails on a GPU. An operand
/// that is not packed is copied first, on every device, so the tests on the CPU run the
/// layouts a GPU gets.
pub fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let a = if gemm_packed(a) {
        a.clone()
    } else {
        a.contiguous()?
    };
    let b = if gemm_packed(b) {
        b.clone()
    } else {
        b.contiguous()?
    };
    a.matmul(&b)
}

/// Whether the last two dims of `t` are a packed row-major or transposed matrix (a
/// dim of one may have any stride), as cuBLAS requires of the rank-2 and rank-3 operands
/// Lathe multiplies; a higher rank counts only when contiguous (candle's CUDA matmul also
/// asks its batch strides to merge).
pub fn gemm_packed(t: &Tensor) -> bool {
    let (dims, stride) = (t.dims(), t.stride());
    let r = dims.len();
    if r < 2 {
        return true;
    }
    if r > 3 {
        return t.is_contiguous();
    }
    let (rows, cols, s_row, s_col) = (dims[r - 2], dims[r - 1], stride[r - 2], stride[r - 1]);
    let row_major = (s_col == 1 || cols == 1) && (s_row == cols || rows == 1);
    let transposed = (s_col == rows || cols == 1) && (s_row == 1 || rows == 1);
    row_major || transposed
}

/// RMSNorm forward over the last dim: returns `y` and what the backward needs.
pub fn rms_norm(be: Backend, x: &Tensor, weight: &Tensor, eps: f64) -> Result<(Tensor, RmsSaved)> {
    if be.fused(x) {
        let (y, rstd) = match x.dtype() {
            DType::F64 => kernels::rms_norm::<f64>(x, weight, eps)?,
            _ => kernels::rms_norm::<f32>(x, weight, eps)?,
        };
        return Ok((y, RmsSaved::Fused { x: x.clone(), rstd }));
    }
    #[cfg(feature = "cuda")]
    if be.cuda(x) {
        let (y, rstd) = cuda::rms_norm(x, weight, eps)?;
        return Ok((y, RmsSaved::Fused { x: x.clone(), rstd }));
    }
    rms_norm_composite(x, weight, eps)
}

/// RMSNorm from candle ops (any device); the reference for the fused kernel.
pub fn rms_norm_composite(x: &Tensor, weight: &Tensor, eps: f64) -> Result<(Tensor, RmsSaved)> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    let rstd = (ms + eps)?.sqrt()?.recip()?;
    let xhat = x.broadcast_mul(&rstd)?;
    let y = xhat.broadcast_mul(weight)?;
    Ok((y, RmsSaved::Composite { xhat, rstd }))
}

/// What RMSNorm's backward needs.
#[derive(Debug)]
pub enum RmsSaved {
    /// From a fused kernel (the CPU's or the GPU's): the input and `1/rms` per row.
    Fused {
        /// Input rows.
        x: Tensor,
        /// `(rows,)`.
        rstd: Tensor,
    },
    /// From the composite path.
    Composite {
        /// Normalised input.
        xhat: Tensor,
        /// `(.., 1)`.
        rstd: Tensor,
    },
}

/// RMSNorm input gradient (the norm weight is frozen):
/// `dx = rstd * (g*dy - xhat * mean(g*dy * xhat))`.
pub fn rms_norm_backward(dy: &Tensor, weight: &Tensor, saved: &RmsSaved) -> Result<Tensor> {
    match saved {
        RmsSaved::Fused { x, rstd } => {
            #[cfg(feature = "cuda")]
            if x.device().is_cuda() {
                return cuda::rms_norm_backward(dy, x, weight, rstd);
            }
            match x.dtype() {
                DType::F64 => kernels::rms_norm_backward::<f64>(dy, x, weight, rstd),
                _ => kernels::rms_norm_backward::<f32>(dy, x, weight, rstd),
            }
        }
        RmsSaved::Composite { xhat, rstd } => {
            let dxhat = dy.broadcast_mul(weight)?;
            let proj = (&dxhat * xhat)?.mean_keepdim(D::Minus1)?;
            let dx = (dxhat - xhat.broadcast_mul(&proj)?)?;
            dx.broadcast_mul(rstd)
        }
    }
}

/// Rotary tables for positions `0..max_len`: `(cos, sin)`, each `(max_len, head_dim/2)`.
#[derive(Debug, Clone)]
pub struct Rope {
    cos: Tensor,
    sin: Tensor,
}

impl Rope {
    /// Tables for the Hugging Face rotate-half convention with base `theta`.
    pub fn new(
        head_dim: usize,
        theta: f64,
        max_len: usize,
        dtype: DType,
        dev: &Device,
    ) -> Result<Self> {
        let half = head_dim / 2;
        // transformers computes the inverse frequencies and angles in f32.
        let inv: Vec<f32> = (0..half)
            .map(|i| 1.0 / (theta as f32).powf((2 * i) as f32 / head_dim as f32))
            .collect();
        let mut cos = Vec::with_capacity(max_len * half);
        let mut sin = Vec::with_capacity(max_len * half);
        for p in 0..max_len {
            for f in &inv {
                let a = p as f32 * f;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        Ok(Self {
            cos: Tensor::from_vec(cos, (max_len, half), dev)?.to_dtype(dtype)?,
            sin: Tensor::from_vec(sin, (max_len, half), dev)?.to_dtype(dtype)?,
        })
    }

    /// Longest position covered.
    pub fn max_len(&self) -> usize {
        self.cos.dims()[0]
    }

    /// The `(cos, sin)` rows of the given positions, each `(n, half)`.
    pub fn gather(&self, positions: &Tensor) -> Result<(Tensor, Tensor)> {
        let cos = self.cos.index_select(positions, 0)?;
        let sin = self.sin.index_select(positions, 0)?;
        Ok((cos, sin))
    }
}

/// Rotate-half RoPE on `x` of shape `(n, heads, head_dim)`, `cos`/`sin` `(n, half)`.
pub fn rope(be: Backend, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    if be.fused(x) {
        return match x.dtype() {
            DType::F64 => kernels::rope::<f64>(x, cos, sin, 1.0),
            _ => kernels::rope::<f32>(x, cos, sin, 1.0),
        };
    }
    #[cfg(feature = "cuda")]
    if be.cuda(x) {
        return cuda::rope(x, cos, sin, 1.0);
    }
    rope_composite(x, cos, sin)
}

/// RoPE from candle ops (any device); the reference for the fused kernel.
pub fn rope_composite(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (cos, sin) = (cos.unsqueeze(1)?, sin.unsqueeze(1)?);
    let (cos, sin) = (&cos, &sin);
    let half = x.dim(D::Minus1)? / 2;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    let y1 = (x1.broadcast_mul(cos)? - x2.broadcast_mul(sin)?)?;
    let y2 = (x2.broadcast_mul(cos)? + x1.broadcast_mul(sin)?)?;
    Tensor::cat(&[y1, y2], D::Minus1)
}

/// RoPE is a rotation, so its backward is the rotation by the opposite angle.
pub fn rope_backward(be: Backend, dy: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    if be.fused(dy) {
        return match dy.dtype() {
            DType::F64 => kernels::rope::<f64>(dy, cos, sin, -1.0),
            _ => kernels::rope::<f32>(dy, cos, sin, -1.0),
        };
    }
    #[cfg(feature = "cuda")]
    if be.cuda(dy) {
        return cuda::rope(dy, cos, sin, -1.0);
    }
    rope_composite(dy, cos, &sin.neg()?)
}

/// SwiGLU forward: `silu(gate) * up` for the stacked `gate_up = [gate | up]`, `(n, 2f)`.
pub fn swiglu(be: Backend, gate_up: &Tensor) -> Result<Tensor> {
    if be.fused(gate_up) {
        return match gate_up.dtype() {
            DType::F64 => kernels::swiglu::<f64>(gate_up),
            _ => kernels::swiglu::<f32>(gate_up),
        };
    }
    #[cfg(feature = "cuda")]
    if be.cuda(gate_up) {
        return cuda::swiglu(gate_up);
    }
    let (gate, up) = halves(gate_up)?;
    gate.silu()? * up
}

/// SwiGLU backward: the gradient of the stacked `gate_up`, `[dgate | dup]`.
pub fn swiglu_backward(be: Backend, dy: &Tensor, gate_up: &Tensor) -> Result<Tensor> {
    if be.fused(gate_up) {
        return match gate_up.dtype() {
            DType::F64 => kernels::swiglu_backward::<f64>(dy, gate_up),
            _ => kernels::swiglu_backward::<f32>(dy, gate_up),
        };
    }
    #[cfg(feature = "cuda")]
    if be.cuda(gate_up) {
        return cuda::swiglu_backward(dy, gate_up);
    }
    swiglu_backward_composite(dy, gate_up)
}

/// The gate and up halves of a stacked `(n, 2f)` tensor.
fn halves(gate_up: &Tensor) -> Result<(Tensor, Tensor)> {
    let f = gate_up.dim(1)? / 2;
    Ok((gate_up.narrow(1, 0, f)?, gate_up.narrow(1, f, f)?))
}

/// SwiGLU backward from candle ops; the reference for the fused kernel.
pub fn swiglu_backward_composite(dy: &Tensor, gate_up: &Tensor) -> Result<Tensor> {
    let (gate, up) = halves(gate_up)?;
    let sig = (gate.neg()?.exp()? + 1.0)?.recip()?;
    let silu = (&gate * &sig)?;
    let dup = (dy * &silu)?;
    // d silu / dg = sig * (1 + g * (1 - sig))
    let dsilu = (&sig * ((&gate * sig.affine(-1.0, 1.0)?)? + 1.0)?)?;
    let dgate = ((dy * up)? * dsilu)?;
    Tensor::cat(&[dgate, dup], 1)
}

/// Causal grouped-query attention of one sequence.
///
/// `q` is `(tq, heads*hd)`, `k` and `v` are `(tk, kv_heads*hd)` with `tk >= tq`; query row
/// `i` sits at position `tk - tq + i` and sees keys `0..=tk-tq+i`. Queries of one group
/// are stacked as `(kv_heads, group*tq, hd)` so each group meets its key head in one
/// batched matmul, with no copies of k or v.
pub fn attention(
    be: Backend,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    heads: usize,
    kv_heads: usize,
) -> Result<(Tensor, AttnSaved)> {
    attention_stacked(be, q, k, v, heads, kv_heads, 1)
}

/// [`attention`] of `seqs` sequences of equal length at once, each seeing its own keys
/// alone: `q`, `k` and `v` hold the sequences' rows one after another (`(seqs * t, ..)`,
/// no cached prefix unless `seqs` is 1). Every product and the softmax run once over
/// `seqs * kv_heads` batches instead of once per sequence, which on a GPU saves each
/// sequence's dozen kernel launches; each sequence's numbers are those of [`attention`]
/// up to the order in which a device sums its batched products.
pub fn attention_stacked(
    be: Backend,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    heads: usize,
    kv_heads: usize,
    seqs: usize,
) -> Result<(Tensor, AttnSaved)> {
    let (q_rows, qd) = q.dims2()?;
    let k_rows = k.dim(0)?;
    if seqs == 0 || q_rows % seqs != 0 || k_rows % seqs != 0 || (seqs > 1 && q_rows != k_rows) {
        candle_core::bail!(
            "attention: {q_rows} query and {k_rows} key rows are not {seqs} equal sequences"
        );
    }
    let (b, tq, tk) = (seqs, q_rows / seqs, k_rows / seqs);
    let hd = qd / heads;
    let group = heads / kv_heads;
    let scale = 1.0 / (hd as f64).sqrt();
    // (b*tq, H*hd) -> (b, H, tq, hd) -> (b*KV, G*tq, hd)
    let qh = q
        .reshape((b, tq, heads, hd))?
        .transpose(1, 2)?
        .contiguous()?;
    let qg = qh.reshape((b * kv_heads, group * tq, hd))?;
    let by_head = |t: &Tensor| -> Result<Tensor> {
        t.reshape((b, tk, kv_heads, hd))?
            .transpose(1, 2)?
            .contiguous()?
            .reshape((b * kv_heads, tk, hd))
    };
    let (kh, vh) = (by_head(k)?, by_head(v)?); // (b*KV, tk, hd)
    let (o, p) = if be.fused(&qg) && qg.dtype() == DType::F32 {
        // On the CPU in f32: only the keys each query block sees are multiplied.
        let shape = host_attention::Shape {
            batches: b * kv_heads,
            group,
            tq,
            tk,
            hd,
        };
        let (o, p) = with_slices(&[&qg, &kh, &vh], |s| {
            Ok(host_attention::forward(
                s[0],
                s[1],
                s[2],
                shape,
                scale as f32,
            ))
        })?;
        let dev = qg.device();
        (
            Tensor::from_vec(o, (b * kv_heads, group * tq, hd), dev)?,
            Tensor::from_vec(p, (b * kv_heads, group * tq, tk), dev)?,
        )
    } else {
        let scores = matmul(&qg, &kh.t()?)?; // (b*KV, G*tq, tk), unscaled
        let p = if be.fused(&scores) {
            kernels::causal_softmax::<f64>(&scores, tq, scale)?
        } else {
            causal_softmax_on_device(be, &scores, group, tq, scale)?
        };
        (matmul(&p, &vh)?, p) // (b*KV, G*tq, hd)
    };
    let out = o
        .reshape((b, heads, tq, hd))?
        .transpose(1, 2)?
        .reshape((b * tq, heads * hd))?;
    Ok((
        out,
        AttnSaved {
            qg,
            kh,
            vh,
            p,
            scale,
            heads,
            kv_heads,
            seqs: b,
        },
    ))
}

/// What attention's backward needs.
#[derive(Debug)]
pub struct AttnSaved {
    qg: Tensor,
    kh: Tensor,
    vh: Tensor,
    p: Tensor,
    scale: f64,
    heads: usize,
    kv_heads: usize,
    /// Sequences stacked ([`attention_stacked`]).
    seqs: usize,
}

impl AttnSaved {
    /// Query rows of the forward: the sequences' rows together.
    pub fn rows(&self) -> Result<usize> {
        Ok(self.seqs * self.qg.dim(1)? / (self.heads / self.kv_heads))
    }

    /// The attention probabilities `(sequences * kv_heads, group * tq, tk)`.
    #[cfg(test)]
    pub(crate) fn probabilities(&self) -> &Tensor {
        &self.p
    }
}

/// Attention backward: returns `(dq, dk, dv)` in the input layouts.
pub fn attention_backward(
    be: Backend,
    dout: &Tensor,
    s: &AttnSaved,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (rows, qd) = dout.dims2()?;
    let b = s.seqs;
    let tq = rows / b;
    let hd = qd / s.heads;
    let group = s.heads / s.kv_heads;
    let tk = s.kh.dim(1)?;
    let dog = dout
        .reshape((b, tq, s.heads, hd))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((b * s.kv_heads, group * tq, hd))?;
    let (dqg, dk, dv) = if be.fused(&dog) && dog.dtype() == DType::F32 {
        let shape = host_attention::Shape {
            batches: b * s.kv_heads,
            group,
            tq,
            tk,
            hd,
        };
        let (dq, dk, dv) = with_slices(&[&dog, &s.qg, &s.kh, &s.vh, &s.p], |t| {
            Ok(host_attention::backward(
                t[0],
                t[1],
                t[2],
                t[3],
                t[4],
                shape,
                s.scale as f32,
            ))
        })?;
        let dev = dog.device();
        (
            Tensor::from_vec(dq, (b * s.kv_heads, group * tq, hd), dev)?,
            Tensor::from_vec(dk, (b * s.kv_heads, tk, hd), dev)?,
            Tensor::from_vec(dv, (b * s.kv_heads, tk, hd), dev)?,
        )
    } else {
        let dv = matmul(&s.p.t()?, &dog)?; // (b*KV, tk, hd)
        let dp = matmul(&dog, &s.vh.t()?)?; // (b*KV, G*tq, tk)
        let ds = if be.fused(&dp) {
            kernels::softmax_backward::<f64>(&s.p, &dp, s.scale)?
        } else {
            softmax_backward_on_device(be, &s.p, &dp, s.scale)?
        };
        let dqg = matmul(&ds, &s.kh)?; // (b*KV, G*tq, hd)
        let dk = matmul(&ds.t()?, &s.qg)?; // (b*KV, tk, hd)
        (dqg, dk, dv)
    };
    let dq = dqg
        .reshape((b, s.heads, tq, hd))?
        .transpose(1, 2)?
        .reshape((b * tq, s.heads * hd))?;
    let kvd = s.kv_heads * hd;
    let by_row = |t: Tensor| -> Result<Tensor> {
        t.reshape((b, s.kv_heads, tk, hd))?
            .transpose(1, 2)?
            .reshape((b * tk, kvd))
    };
    Ok((dq, by_row(dk)?, by_row(dv)?))
}

/// The causal softmax of [`attention`] off the CPU fast path: the fused kernel on a GPU,
/// else a mask and [`softmax_last`].
fn causal_softmax_on_device(
    be: Backend,
    scores: &Tensor,
    group: usize,
    tq: usize,
    scale: f64,
) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if be.cuda(scores) {
        return cuda::causal_softmax(scores, tq, scale);
    }
    #[cfg(not(feature = "cuda"))]
    let _ = be;
    let tk = scores.dim(D::Minus1)?;
    let mask = causal_mask(group, tq, tk, scores.dtype(), scores.device())?;
    softmax_last(&(scores * scale)?.broadcast_add(&mask)?)
}

/// The softmax backward of [`attention_backward`] off the CPU fast path:
/// `scale * p * (dp - sum(dp * p))`, fused on a GPU.
fn softmax_backward_on_device(be: Backend, p: &Tensor, dp: &Tensor, scale: f64) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if be.cuda(dp) {
        return cuda::softmax_backward(p, dp, scale);
    }
    #[cfg(not(feature = "cuda"))]
    let _ = be;
    let rowdot = (dp * p)?.sum_keepdim(D::Minus1)?;
    (p * dp.broadcast_sub(&rowdot)?)? * scale
}

/// Softmax over the last dim, stabilised by the row max.
pub fn softmax_last(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?;
    let e = x.broadcast_sub(&max)?.exp()?;
    let sum = e.sum_keepdim(D::Minus1)?;
    e.broadcast_div(&sum)
}

/// Log-probabilities of `targets (n, k)` under `logits (n, V)`: `(lp (n, k), lse (n,))`.
pub fn logprobs_at(be: Backend, logits: &Tensor, targets: &Tensor) -> Result<(Tensor, Tensor)> {
    if be.fused(logits) {
        return match logits.dtype() {
            DType::F64 => kernels::logprobs_at::<f64>(logits, targets),
            _ => kernels::logprobs_at::<f32>(logits, targets),
        };
    }
    #[cfg(feature = "cuda")]
    if be.cuda(logits) {
        return cuda::logprobs_at(logits, targets);
    }
    let lse = logsumexp_last(logits)?;
    let picked = logits.gather(targets, 1)?;
    Ok((picked.broadcast_sub(&lse)?, lse.squeeze(1)?))
}

/// Gradient of [`logprobs_at`] w.r.t. the logits: `scatter(d) - softmax * sum_k d`.
pub fn logprobs_at_backward(
    be: Backend,
    logits: &Tensor,
    lse: &Tensor,
    targets: &Tensor,
    d: &Tensor,
) -> Result<Tensor> {
    if be.fused(logits) {
        return match logits.dtype() {
            DType::F64 => kernels::logprobs_at_backward::<f64>(logits, lse, targets, d),
            _ => kernels::logprobs_at_backward::<f32>(logits, lse, targets, d),
        };
    }
    #[cfg(feature = "cuda")]
    if be.cuda(logits) {
        return cuda::logprobs_at_backward(logits, lse, targets, d);
    }
    let probs = logits.broadcast_sub(&lse.unsqueeze(1)?)?.exp()?;
    let dsum = d.sum_keepdim(D::Minus1)?;
    let scattered = probs.zeros_like()?.scatter_add(targets, d, 1)?;
    scattered - probs.broadcast_mul(&dsum)?
}

/// Log-sum-exp over the last dim, `(n, 1)`.
pub fn logsumexp_last(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?;
    let sum = x.broadcast_sub(&max)?.exp()?.sum_keepdim(D::Minus1)?;
    sum.log()? + max
}

/// Additive causal mask `(G*tq, tk)`: 0 where row `g*tq + i` may see key `j`, else -inf.
fn causal_mask(group: usize, tq: usize, tk: usize, dtype: DType, dev: &Device) -> Result<Tensor> {
    let offset = tk - tq;
    let mut m = Vec::with_capacity(group * tq * tk);
    for _ in 0..group {
        for i in 0..tq {
            for j in 0..tk {
                m.push(if j <= offset + i {
                    0f32
                } else {
                    f32::NEG_INFINITY
                });
            }
        }
    }
    Tensor::from_vec(m, (group * tq, tk), dev)?.to_dtype(dtype)
}

/// A row's most likely next tokens with their log-probabilities, most likely first.
pub type TopK = Vec<(u32, f32)>;

/// The `k` largest entries of `row` as `(token, logit - lse)`, largest first, ties by
/// token id.
pub fn top_k(row: &[f32], lse: f32, k: usize) -> TopK {
    let order = |a: &usize, b: &usize| row[*b].total_cmp(&row[*a]).then(a.cmp(b));
    let mut idx: Vec<usize> = (0..row.len()).collect();
    let k = k.min(row.len());
    if k < idx.len() {
        idx.select_nth_unstable_by(k, order);
        idx.truncate(k);
    }
    idx.sort_unstable_by(order);
    idx.into_iter().map(|i| (i as u32, row[i] - lse)).collect()
}

#[cfg(test)]
mod tests {
    //! The fused CPU kernels against the composite candle versions they replace.
    use super::*;

    use crate::model::test_util::{max_abs_diff as diff, uniform};

    fn rand(shape: &[usize], seed: u64) -> Tensor {
        uniform(shape, 2.0, seed)
    }

    #[test]
    fn products_take_only_layouts_that_cublas_multiplies() {
        let k = rand(&[5, 3, 4], 1); // (tk, kv_heads, hd), packed
        let heads = k.transpose(0, 1).unwrap(); // (kv_heads, tk, hd), rows strided by 12
        assert!(!gemm_packed(&heads) && !gemm_packed(&heads.t().unwrap()));
        let packed = heads.contiguous().unwrap();
        assert!(gemm_packed(&packed) && gemm_packed(&packed.t().unwrap()));
        let rows = rand(&[6, 4], 2).narrow(0, 1, 3).unwrap();
        assert!(gemm_packed(&rows) && gemm_packed(&rows.t().unwrap()));
        assert!(!gemm_packed(&rand(&[6, 4], 3).narrow(1, 1, 2).unwrap()));
        // The product is the same, copied or not.
        let q = rand(&[3, 7, 4], 4);
        let want = q.matmul(&heads.t().unwrap()).unwrap();
        assert!(diff(&matmul(&q, &heads.t().unwrap()).unwrap(), &want) < 1e-12);
    }

    #[test]
    fn fused_rms_norm_matches_composite() {
        let (x, w, dy) = (rand(&[5, 3, 8], 1), rand(&[8], 2), rand(&[5, 3, 8], 3));
        let (y1, s1) = rms_norm(Backend::Cpu, &x, &w, 1e-5).unwrap();
        let (y2, s2) = rms_norm_composite(&x, &w, 1e-5).unwrap();
        assert!(matches!(s1, RmsSaved::Fused { .. }));
        assert!(diff(&y1, &y2) < 1e-12);
        let d1 = rms_norm_backward(&dy, &w, &s1).unwrap();
        let d2 = rms_norm_backward(&dy, &w, &s2).unwrap();
        assert!(diff(&d1, &d2) < 1e-12);
    }

    #[test]
    fn fused_rope_matches_composite_both_ways() {
        let (x, cos, sin) = (rand(&[6, 2, 8], 4), rand(&[6, 4], 5), rand(&[6, 4], 6));
        assert!(
            diff(
                &rope(Backend::Cpu, &x, &cos, &sin).unwrap(),
                &rope_composite(&x, &cos, &sin).unwrap()
            ) < 1e-12
        );
        let back = rope_backward(Backend::Cpu, &x, &cos, &sin).unwrap();
        let want = rope_composite(&x, &cos, &sin.neg().unwrap()).unwrap();
        assert!(diff(&back, &want) < 1e-12);
    }

    #[test]
    fn fused_swiglu_matches_composite() {
        let (gu, dy) = (rand(&[7, 18], 7), rand(&[7, 9], 9));
        let (g, u) = (gu.narrow(1, 0, 9).unwrap(), gu.narrow(1, 9, 9).unwrap());
        let want = (g.silu().unwrap() * &u).unwrap();
        assert!(diff(&swiglu(Backend::Cpu, &gu).unwrap(), &want) < 1e-12);
        let fused = swiglu_backward(Backend::Cpu, &dy, &gu).unwrap();
        let composite = swiglu_backward_composite(&dy, &gu).unwrap();
        assert_eq!(fused.dims(), &[7, 18]);
        assert!(diff(&fused, &composite) < 1e-12);
    }

    #[test]
    fn fused_causal_softmax_and_backward_match_composite() {
        // Two groups of 3 queries at the end of 5 keys (a KV-cache step).
        let (group, tq, tk, scale) = (2, 3, 5, 0.5);
        let scores = rand(&[2, group * tq, tk], 10);
        let dp = rand(&[2, group * tq, tk], 11);
        let p = kernels::causal_softmax::<f64>(&scores, tq, scale).unwrap();
        let mask = causal_mask(group, tq, tk, DType::F64, &Device::Cpu).unwrap();
        let want = softmax_last(&(&scores * scale).unwrap().broadcast_add(&mask).unwrap()).unwrap();
        assert!(diff(&p, &want) < 1e-12);
        let ds = kernels::softmax_backward::<f64>(&p, &dp, scale).unwrap();
        let rowdot = (&dp * &p).unwrap().sum_keepdim(D::Minus1).unwrap();
        let want = ((&p * dp.broadcast_sub(&rowdot).unwrap()).unwrap() * scale).unwrap();
        assert!(diff(&ds, &want) < 1e-12);
    }

    /// Three sequences of equal length stacked give each sequence's attention and
    /// gradients alone, on the fused CPU path and on the device backend's composites.
    #[test]
    fn stacked_attention_equals_each_sequence_alone() {
        let (heads, kv_heads, hd, t, seqs) = (4, 2, 3, 5, 3);
        let q = rand(&[seqs * t, heads * hd], 20);
        let k = rand(&[seqs * t, kv_heads * hd], 21);
        let v = rand(&[seqs * t, kv_heads * hd], 22);
        let dout = rand(&[seqs * t, heads * hd], 23);
        for be in [Backend::Cpu, Backend::Device] {
            let (out, saved) = attention_stacked(be, &q, &k, &v, heads, kv_heads, seqs).unwrap();
            assert_eq!(saved.rows().unwrap(), seqs * t);
            let (dq, dk, dv) = attention_backward(be, &dout, &saved).unwrap();
            for i in 0..seqs {
                let rows = |x: &Tensor| x.narrow(0, i * t, t).unwrap();
                let (o1, s1) =
                    attention(be, &rows(&q), &rows(&k), &rows(&v), heads, kv_heads).unwrap();
                let (dq1, dk1, dv1) = attention_backward(be, &rows(&dout), &s1).unwrap();
                for (got, want) in [(&out, &o1), (&dq, &dq1), (&dk, &dk1), (&dv, &dv1)] {
                    assert!(diff(&rows(got), want) < 1e-12, "{be:?}, sequence {i}");
                }
            }
        }
        // Sequences that are not equal, or a cached prefix beside others, are refused.
        assert!(attention_stacked(Backend::Cpu, &q, &k, &v, heads, kv_heads, 4).is_err());
        let longer_k = rand(&[seqs * t + 3, kv_heads * hd], 24);
        assert!(attention_stacked(
            Backend::Cpu,
            &q,
            &longer_k,
            &longer_k,
            heads,
            kv_heads,
            seqs
        )
        .is_err());
    }

    #[test]
    fn fused_logprobs_at_matches_composite() {
        let logits = rand(&[4, 11], 12);
        let targets = Tensor::new(&[[1u32, 3], [0, 0], [10, 2], [5, 9]], &Device::Cpu).unwrap();
        let d = rand(&[4, 2], 13);
        let (lp, lse) = logprobs_at(Backend::Cpu, &logits, &targets).unwrap();
        let want_lse = logsumexp_last(&logits).unwrap();
        let want_lp = logits
            .gather(&targets, 1)
            .unwrap()
            .broadcast_sub(&want_lse)
            .unwrap();
        assert!(diff(&lp, &want_lp) < 1e-12);
        let got = logprobs_at_backward(Backend::Cpu, &logits, &lse, &targets, &d).unwrap();
        let probs = logits.broadcast_sub(&want_lse).unwrap().exp().unwrap();
        let dsum = d.sum_keepdim(D::Minus1).unwrap();
        let want = (probs
            .zeros_like()
            .unwrap()
            .scatter_add(&targets, &d, 1)
            .unwrap()
            - probs.broadcast_mul(&dsum).unwrap())
        .unwrap();
        assert!(diff(&got, &want) < 1e-12);
    }
}
