//! Forward and hand-written backward of the transformer's building blocks.
//!
//! Lathe does not use candle's autograd: several candle-nn ops silently drop gradients,
//! candle's matmul backward computes weight gradients for frozen weights, and its graph
//! keeps every intermediate alive. Each block here saves exactly what its backward needs.
//! Everything is built from candle tensor ops, so it runs on any candle device and in any
//! float dtype (f64 for the finite-difference tests).

use candle_core::{DType, Device, Result, Tensor, D};

/// RMSNorm forward over the last dim: returns `y` and the saved `(xhat, rstd)`.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<(Tensor, RmsSaved)> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    let rstd = (ms + eps)?.sqrt()?.recip()?;
    let xhat = x.broadcast_mul(&rstd)?;
    let y = xhat.broadcast_mul(weight)?;
    Ok((y, RmsSaved { xhat, rstd }))
}

/// What RMSNorm's backward needs.
#[derive(Debug)]
pub struct RmsSaved {
    xhat: Tensor,
    rstd: Tensor,
}

/// RMSNorm input gradient (the norm weight is frozen):
/// `dx = rstd * (g*dy - xhat * mean(g*dy * xhat))`.
pub fn rms_norm_backward(dy: &Tensor, weight: &Tensor, saved: &RmsSaved) -> Result<Tensor> {
    let dxhat = dy.broadcast_mul(weight)?;
    let proj = (&dxhat * &saved.xhat)?.mean_keepdim(D::Minus1)?;
    let dx = (dxhat - saved.xhat.broadcast_mul(&proj)?)?;
    dx.broadcast_mul(&saved.rstd)
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

    /// The `(cos, sin)` rows of the given positions, shaped `(n, 1, half)` to broadcast
    /// over heads.
    pub fn gather(&self, positions: &Tensor) -> Result<(Tensor, Tensor)> {
        let cos = self.cos.index_select(positions, 0)?.unsqueeze(1)?;
        let sin = self.sin.index_select(positions, 0)?.unsqueeze(1)?;
        Ok((cos, sin))
    }
}

/// Rotate-half RoPE on `x` of shape `(n, heads, head_dim)`.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let half = x.dim(D::Minus1)? / 2;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    let y1 = (x1.broadcast_mul(cos)? - x2.broadcast_mul(sin)?)?;
    let y2 = (x2.broadcast_mul(cos)? + x1.broadcast_mul(sin)?)?;
    Tensor::cat(&[y1, y2], D::Minus1)
}

/// RoPE is a rotation, so its backward is the rotation by the opposite angle.
pub fn rope_backward(dy: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    rope(dy, cos, &sin.neg()?)
}

/// SwiGLU forward: `silu(gate) * up`.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    gate.silu()? * up
}

/// SwiGLU backward: returns `(dgate, dup)`.
pub fn swiglu_backward(dy: &Tensor, gate: &Tensor, up: &Tensor) -> Result<(Tensor, Tensor)> {
    let sig = (gate.neg()?.exp()? + 1.0)?.recip()?;
    let silu = (gate * &sig)?;
    let dup = (dy * &silu)?;
    // d silu / dg = sig * (1 + g * (1 - sig))
    let dsilu = (&sig * ((gate * sig.affine(-1.0, 1.0)?)? + 1.0)?)?;
    let dgate = ((dy * up)? * dsilu)?;
    Ok((dgate, dup))
}

/// Causal grouped-query attention of one sequence.
///
/// `q` is `(tq, heads*hd)`, `k` and `v` are `(tk, kv_heads*hd)` with `tk >= tq`; query row
/// `i` sits at position `tk - tq + i` and sees keys `0..=tk-tq+i`. Queries of one group
/// are stacked as `(kv_heads, group*tq, hd)` so each group meets its key head in one
/// batched matmul, with no copies of k or v.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    heads: usize,
    kv_heads: usize,
) -> Result<(Tensor, AttnSaved)> {
    let (tq, qd) = q.dims2()?;
    let tk = k.dim(0)?;
    let hd = qd / heads;
    let group = heads / kv_heads;
    let scale = 1.0 / (hd as f64).sqrt();
    // (tq, H, hd) -> (H, tq, hd) -> (KV, G*tq, hd)
    let qh = q.reshape((tq, heads, hd))?.transpose(0, 1)?.contiguous()?;
    let qg = qh.reshape((kv_heads, group * tq, hd))?;
    let kh = k.reshape((tk, kv_heads, hd))?.transpose(0, 1)?; // (KV, tk, hd) view
    let vh = v
        .reshape((tk, kv_heads, hd))?
        .transpose(0, 1)?
        .contiguous()?;
    let scores = (qg.matmul(&kh.t()?)? * scale)?; // (KV, G*tq, tk)
    let mask = causal_mask(group, tq, tk, q.dtype(), q.device())?;
    let scores = scores.broadcast_add(&mask)?;
    let p = softmax_last(&scores)?;
    let o = p.matmul(&vh)?; // (KV, G*tq, hd)
    let out = o
        .reshape((heads, tq, hd))?
        .transpose(0, 1)?
        .reshape((tq, heads * hd))?;
    Ok((
        out,
        AttnSaved {
            qg,
            kh: kh.contiguous()?,
            vh,
            p,
            scale,
            heads,
            kv_heads,
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
}

/// Attention backward: returns `(dq, dk, dv)` in the input layouts.
pub fn attention_backward(dout: &Tensor, s: &AttnSaved) -> Result<(Tensor, Tensor, Tensor)> {
    let (tq, qd) = dout.dims2()?;
    let hd = qd / s.heads;
    let group = s.heads / s.kv_heads;
    let tk = s.kh.dim(1)?;
    let dog = dout
        .reshape((tq, s.heads, hd))?
        .transpose(0, 1)?
        .contiguous()?
        .reshape((s.kv_heads, group * tq, hd))?;
    let dv = s.p.t()?.matmul(&dog)?; // (KV, tk, hd)
    let dp = dog.matmul(&s.vh.t()?)?; // (KV, G*tq, tk)
    let rowdot = (&dp * &s.p)?.sum_keepdim(D::Minus1)?;
    let ds = ((s.p.clone() * dp.broadcast_sub(&rowdot)?)? * s.scale)?;
    let dqg = ds.matmul(&s.kh)?; // (KV, G*tq, hd)
    let dk = ds.t()?.matmul(&s.qg)?; // (KV, tk, hd)
    let dq = dqg
        .reshape((s.heads, tq, hd))?
        .transpose(0, 1)?
        .reshape((tq, s.heads * hd))?;
    let kvd = s.kv_heads * hd;
    let dk = dk.transpose(0, 1)?.reshape((tk, kvd))?;
    let dv = dv.transpose(0, 1)?.reshape((tk, kvd))?;
    Ok((dq, dk, dv))
}

/// Softmax over the last dim, stabilised by the row max.
pub fn softmax_last(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?;
    let e = x.broadcast_sub(&max)?.exp()?;
    let sum = e.sum_keepdim(D::Minus1)?;
    e.broadcast_div(&sum)
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
