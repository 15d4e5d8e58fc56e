//! A frozen projection with its LoRA deltas, forward and backward, over a packed
//! multi-adapter batch: `y = x Wᵀ (+ b) + s (x Aᵀ) Bᵀ` for each segment's own adapter.
//!
//! A projection may be stacked (q/k/v, gate/up): one weight whose output columns are
//! split into parts, each its own LoRA target. On the CPU in f32 — training's hot path —
//! the frozen product goes straight through `gemm` ([`super::cpu::gemm`], or the bf16
//! products), and each delta is added to it in place row by row ([`super::cpu::lora_rows`],
//! the order the decode step shares), each part's columns read and written through
//! strides. Elsewhere (f64 checks, CUDA) the same maths runs as candle ops: a stacked
//! projection's parts together ([`super::lora_stack`]) unless the SGMV kernels take a
//! decode step's short segments, a single target through [`lora_forward`] /
//! [`lora_backward`] (`lora_forward` itself takes the row-by-row deltas for host f32
//! tensors); tests hold the paths equal.

use candle_core::{Device, Result, Tensor};

use super::backend::Backend;
use super::cpu::bf16::{self, Bf16Ref};
use super::cpu::decode_weights::DecodeLinear;
use super::cpu::gemm::{gemm, with_slices, Mat, MatMut};
use super::cpu::input_grad;
use super::cpu::kernels;
use super::cpu::lora_rows;
use super::cpu::quant::BlockArith;
use super::lora::{
    lora_backward, lora_forward, Adapter, AdapterGrads, LoraCache, LoraPair, Segment, Target,
};
use super::lora_stack;
use super::ops;
use super::weights::{matmul_input_grad, matmul_t};

/// A frozen weight `(out, in)`, its bias, and the LoRA target of each slice of its
/// output columns, in order (their widths add up to `out`).
#[derive(Debug, Clone, Copy)]
pub struct Projection<'a> {
    /// `(out, in)`.
    pub weight: &'a Tensor,
    /// `(out,)`.
    pub bias: Option<&'a Tensor>,
    /// `(target, width)` of each output slice.
    pub parts: &'a [(Target, usize)],
    /// The weight packed for bf16 products, when the model computes in bf16: then the
    /// frozen products of the CPU path (not the LoRA deltas) run in bf16.
    pub bf16: Option<Bf16Ref<'a>>,
    /// Which implementation computes the products.
    pub backend: Backend,
    /// Whether a product of at most [`kernels::FEW_ROWS`] rows may take the few-rows
    /// kernel (f32 on the CPU backend). Set for the passes that fill KV caches (prefill,
    /// decoding), where it pays; unset for passes that score or train datums, where a
    /// datum's numbers must not depend on how many rows share its pass, and the kernel
    /// sums in another order than gemm.
    pub few_rows: bool,
}

/// The pair and scale a segment uses for `target`, if its adapter trains it.
fn pair_of<'a>(
    seg: &Segment,
    target: Target,
    adapters: &[&'a Adapter],
) -> Option<(&'a LoraPair, f64)> {
    let adapter = adapters[seg.adapter?];
    adapter.pairs.get(&target).map(|p| (p, adapter.scale()))
}

/// Whether the CPU `gemm` path applies: the CPU backend, and everything involved is an
/// f32 CPU tensor.
fn on_host(
    tensors: &[&Tensor],
    proj: &Projection,
    segs: &[Segment],
    adapters: &[&Adapter],
) -> bool {
    let host = |t: &Tensor| proj.backend.host_f32(t);
    tensors.iter().all(|t| host(t))
        && host(proj.weight)
        && proj.bias.is_none_or(host)
        && proj.parts.iter().all(|&(target, _)| {
            segs.iter()
                .filter_map(|s| pair_of(s, target, adapters))
                .all(|(p, _)| host(&p.a) && host(&p.b))
        })
}

fn host_tensor(data: Vec<f32>, rows: usize, cols: usize) -> Result<Tensor> {
    Tensor::from_vec(data, (rows, cols), &Device::Cpu)
}

/// `x Wᵀ (+ b)` plus each segment's LoRA delta, and what the backward pass needs (one
/// cache per part). `x` is `(n, in)`; the output is `(n, out)`.
pub fn forward(
    x: &Tensor,
    proj: &Projection,
    segs: &[Segment],
    adapters: &[&Adapter],
) -> Result<(Tensor, Vec<LoraCache>)> {
    if !on_host(&[x], proj, segs, adapters) {
        let y = matmul_t(proj.backend, x, proj.weight)?;
        let y = match proj.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        };
        return add_deltas(proj.backend, x, y, proj.parts, segs, adapters);
    }
    let (n, d_in) = x.dims2()?;
    let d_out = proj.weight.dim(0)?;
    // A handful of rows (short requests, prefill of a few tokens) is bound by reading the
    // weight; the few-rows kernel reads it once where gemm would first repack all of it.
    // In bf16 every product stays bf16, so that a datum's numbers do not depend on how
    // many rows it happened to share a pass with.
    let few = proj.few_rows && n <= kernels::FEW_ROWS && proj.bf16.is_none();
    let mut y = if few {
        with_slices(&[x], |s| {
            kernels::matmul_t_few_rows_host(s[0], n, proj.weight)
        })?
    } else {
        vec![0f32; n * d_out]
    };
    let mut us = Vec::new();
    if let Some(b) = proj.bias {
        let b: Vec<f32> = b.to_vec1()?;
        for row in y.chunks_exact_mut(d_out) {
            if few {
                row.iter_mut().zip(&b).for_each(|(v, b)| *v += b);
            } else {
                row.copy_from_slice(&b);
            }
        }
    }
    with_slices(&[x, proj.weight], |s| {
        let (xs, ws) = (Mat::new(s[0], n, d_in), Mat::new(s[1], d_out, d_in));
        let mut out = MatMut::new(&mut y, n, d_out, d_out);
        if !few {
            match proj.bf16 {
                Some(p) => bf16::gemm(
                    p.kernel,
                    &mut out,
                    xs,
                    &p.weight.forward,
                    proj.bias.is_some(),
                ),
                None => gemm(&mut out, xs, ws.t(), 1.0, proj.bias.is_some()),
            }
        }
        us = add_host_deltas(xs, &mut out, proj.parts, segs, adapters)?;
        Ok(())
    })?;
    Ok((
        host_tensor(y, n, d_out)?,
        caches_of(us, proj.parts.len(), segs)?,
    ))
}

/// `u = x Aᵀ` of one segment's pair for one part: `(part, segment, u, rank)`.
type HostU = (usize, usize, Vec<f32>, usize);

/// Adds each part's LoRA deltas to `out` (`(n, out)`, the frozen product of `xs`) in
/// place, row by row ([`lora_rows`]); returns each segment's `u` for the caches.
fn add_host_deltas(
    xs: Mat<'_>,
    out: &mut MatMut<'_>,
    parts: &[(Target, usize)],
    segs: &[Segment],
    adapters: &[&Adapter],
) -> Result<Vec<HostU>> {
    let mut us = Vec::new();
    let mut col = 0;
    for (pi, &(target, width)) in parts.iter().enumerate() {
        for (si, seg) in segs.iter().enumerate() {
            let Some((pair, scale)) = pair_of(seg, target, adapters) else {
                continue;
            };
            let r = pair.a.dim(0)?;
            let mut u = vec![0f32; seg.len * r];
            with_slices(&[&pair.a, &pair.b], |ab| {
                lora_rows::add_deltas(
                    ab[0],
                    &lora_rows::transposed(ab[1], width, r),
                    scale as f32,
                    xs.rows(seg.start, seg.len),
                    &mut out.block(seg.start, seg.len, col, width),
                    &mut u,
                );
                Ok(())
            })?;
            us.push((pi, si, u, r));
        }
        col += width;
    }
    Ok(us)
}

/// Each part's cache from [`add_host_deltas`]'s `u`s.
fn caches_of(us: Vec<HostU>, parts: usize, segs: &[Segment]) -> Result<Vec<LoraCache>> {
    let mut caches = vec![vec![None; segs.len()]; parts];
    for (pi, si, u, r) in us {
        caches[pi][si] = Some(host_tensor(u, segs[si].len, r)?);
    }
    Ok(caches)
}

/// `x` through the decode weights `d` (their products in `arith`) plus each part's LoRA
/// deltas, added in place in the product's own buffer as [`forward`] adds them. `x` and
/// every pair the segments use must be f32 on the CPU, as the decode weights are.
pub fn forward_decoded(
    x: &Tensor,
    d: &DecodeLinear,
    arith: BlockArith,
    parts: &[(Target, usize)],
    segs: &[Segment],
    adapters: &[&Adapter],
) -> Result<(Tensor, Vec<LoraCache>)> {
    let (n, d_in) = x.dims2()?;
    let d_out: usize = parts.iter().map(|&(_, w)| w).sum();
    let (y, us) = with_slices(&[x], |s| {
        let mut y = d.forward_host(s[0], n, arith)?;
        if y.len() != n * d_out {
            candle_core::bail!("{} outputs for {n} rows of {d_out}", y.len());
        }
        let mut out = MatMut::new(&mut y, n, d_out, d_out);
        let us = add_host_deltas(Mat::new(s[0], n, d_in), &mut out, parts, segs, adapters)?;
        Ok((y, us))
    })?;
    Ok((host_tensor(y, n, d_out)?, caches_of(us, parts.len(), segs)?))
}

/// Adds each part's LoRA deltas to the frozen output `y` (for the quantized decode
/// weights' products, and off the CPU): one target through [`lora_forward`], several
/// through the SGMV kernels where they apply, else [`lora_stack::forward`].
pub fn add_deltas(
    be: Backend,
    x: &Tensor,
    y: Tensor,
    parts: &[(Target, usize)],
    segs: &[Segment],
    adapters: &[&Adapter],
) -> Result<(Tensor, Vec<LoraCache>)> {
    if let [(target, _)] = parts {
        let (y, cache) = lora_forward(be, x, y, *target, segs, adapters)?;
        return Ok((y, vec![cache]));
    }
    // On a GPU, every part's deltas of a decode step in two launches.
    #[cfg(feature = "cuda")]
    if let Some(done) = super::lora::lora_forward_sgmv(be, x, &y, parts, segs, adapters)? {
        return Ok(done);
    }
    lora_stack::forward(be, x, y, parts, segs, adapters)
}

/// Backward of [`forward`]: accumulates each adapter's `dA`, `dB` into `grads` and
/// returns the input gradient `dy W + Σ s (dy B) A`. `dy` is `(n, out)`, stacked like
/// the output.
pub fn backward(
    x: &Tensor,
    dy: &Tensor,
    proj: &Projection,
    segs: &[Segment],
    adapters: &[&Adapter],
    caches: &[LoraCache],
    grads: &mut [AdapterGrads],
) -> Result<Tensor> {
    if !on_host(&[x, dy], proj, segs, adapters) {
        let dx = matmul_input_grad(proj.backend, dy, proj.weight)?;
        if let ([(target, _)], [cache]) = (proj.parts, caches) {
            return match lora_backward(x, dy, *target, segs, adapters, cache, grads)? {
                Some(extra) => ops::add(proj.backend, &dx, &extra),
                None => Ok(dx),
            };
        }
        return lora_stack::backward(
            proj.backend,
            x,
            dy,
            dx,
            proj.parts,
            segs,
            adapters,
            caches,
            grads,
        );
    }
    let (n, d_in) = x.dims2()?;
    let d_out = proj.weight.dim(0)?;
    let few = proj.few_rows && n <= kernels::FEW_ROWS && proj.bf16.is_none();
    let mut dx = if few {
        with_slices(&[dy], |s| input_grad::dy_w(s[0], n, proj.weight))?
    } else {
        vec![0f32; n * d_in]
    };
    let mut pair_grads = Vec::new();
    with_slices(&[x, dy, proj.weight], |s| {
        let xs = Mat::new(s[0], n, d_in);
        let dys = Mat::new(s[1], n, d_out);
        let mut dxm = MatMut::new(&mut dx, n, d_in, d_in);
        if !few {
            match proj.bf16 {
                Some(p) => bf16::gemm(p.kernel, &mut dxm, dys, &p.weight.input_grad, false),
                None => gemm(&mut dxm, dys, Mat::new(s[2], d_out, d_in), 1.0, false),
            }
        }
        let mut col = 0;
        for (&(target, width), cache) in proj.parts.iter().zip(caches) {
            for (seg, u) in segs.iter().zip(cache) {
                let (Some(u), Some((pair, scale))) = (u, pair_of(seg, target, adapters)) else {
                    continue;
                };
                let r = pair.a.dim(0)?;
                let scale = scale as f32;
                let dyp = dys.rows(seg.start, seg.len).cols(col, width);
                let xseg = xs.rows(seg.start, seg.len);
                let (mut du, mut da, mut db) = (
                    vec![0f32; seg.len * r],
                    vec![0f32; r * d_in],
                    vec![0f32; width * r],
                );
                with_slices(&[&pair.a, &pair.b, u], |abu| {
                    let (a, b, u) = (
                        Mat::new(abu[0], r, d_in),
                        Mat::new(abu[1], width, r),
                        Mat::new(abu[2], seg.len, r),
                    );
                    // y = s u Bᵀ with u = x Aᵀ.
                    let mut dum = MatMut::new(&mut du, seg.len, r, r);
                    gemm(&mut dum, dyp, b, scale, false);
                    let du = Mat::new(&du, seg.len, r);
                    gemm(
                        &mut MatMut::new(&mut db, width, r, r),
                        dyp.t(),
                        u,
                        scale,
                        false,
                    );
                    gemm(
                        &mut MatMut::new(&mut da, r, d_in, d_in),
                        du.t(),
                        xseg,
                        1.0,
                        false,
                    );
                    gemm(
                        &mut dxm.block(seg.start, seg.len, 0, d_in),
                        du,
                        a,
                        1.0,
                        true,
                    );
                    Ok(())
                })?;
                pair_grads.push((seg.adapter, target, da, db, r, width));
            }
            col += width;
        }
        Ok(())
    })?;
    for (ai, target, da, db, r, width) in pair_grads {
        let ai = ai.expect("a segment with a pair has an adapter");
        grads[ai].accumulate(
            target,
            host_tensor(da, r, d_in)?,
            host_tensor(db, width, r)?,
        )?;
    }
    host_tensor(dx, n, d_in)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::lora::{LoraSpec, Proj};
    use crate::model::test_util::{max_abs_diff, max_entry, uniform};
    use crate::model::tiny::tiny_config;
    use crate::model::Arch;
    use candle_core::DType;

    /// An adapter on every projection with random (not zero) `B`, in f64.
    fn adapter(seed: u64) -> Adapter {
        let cfg = tiny_config(Arch::Qwen2);
        let spec = LoraSpec {
            rank: 4,
            train_attn: true,
            train_mlp: true,
            train_unembed: false,
        };
        let mut a = Adapter::new(&cfg, spec, seed, DType::F64, &Device::Cpu).unwrap();
        for (i, p) in a.pairs.values_mut().enumerate() {
            p.b = uniform(p.b.dims(), 0.5, seed * 100 + i as u64);
        }
        a
    }

    fn f32s(ad: &Adapter) -> Adapter {
        ad.to_dtype(DType::F32).unwrap()
    }

    /// Few rows go through the few-rows kernels where allowed, else through gemm, as
    /// more rows do.
    #[test]
    fn the_host_paths_equal_candle_ops_in_f64_for_a_stacked_mixed_adapter_batch() {
        for (rows, few_rows) in [(1, true), (1, false), (3, true)] {
            check_host_path(rows, few_rows);
        }
    }

    /// A batch of `5k, 3k, 6k` rows: two adapters with base-model rows between them.
    fn check_host_path(k: usize, few_rows: bool) {
        let cfg = tiny_config(Arch::Qwen2);
        let (d, qd, kvd) = (cfg.hidden_size, cfg.q_dim(), cfg.kv_dim());
        let out = qd + 2 * kvd;
        let parts = [
            (Target::Layer(1, Proj::Q), qd),
            (Target::Layer(1, Proj::K), kvd),
            (Target::Layer(1, Proj::V), kvd),
        ];
        let segs = [
            Segment {
                start: 0,
                len: 5 * k,
                adapter: Some(1),
            },
            Segment {
                start: 5 * k,
                len: 3 * k,
                adapter: None,
            },
            Segment {
                start: 8 * k,
                len: 6 * k,
                adapter: Some(0),
            },
        ];
        let n = 14 * k;
        let (x, w, b, dy) = (
            uniform(&[n, d], 1.0, 1),
            uniform(&[out, d], 0.3, 2),
            uniform(&[out], 0.3, 3),
            uniform(&[n, out], 1.0, 4),
        );
        let (a0, a1) = (adapter(5), adapter(6));
        let run = |dtype: DType, adapters: &[&Adapter]| {
            let cast = |t: &Tensor| t.to_dtype(dtype).unwrap();
            let (x, w, b, dy) = (cast(&x), cast(&w), cast(&b), cast(&dy));
            let proj = Projection {
                weight: &w,
                bias: Some(&b),
                parts: &parts,
                bf16: None,
                backend: Backend::Cpu,
                few_rows,
            };
            let (y, caches) = forward(&x, &proj, &segs, adapters).unwrap();
            let mut grads = vec![AdapterGrads::default(); 2];
            let dx = backward(&x, &dy, &proj, &segs, adapters, &caches, &mut grads).unwrap();
            (y, dx, grads)
        };
        let (y64, dx64, g64) = run(DType::F64, &[&a0, &a1]);
        let (a0f, a1f) = (f32s(&a0), f32s(&a1));
        let (y32, dx32, g32) = run(DType::F32, &[&a0f, &a1f]);
        let diff = |a: &Tensor, b: &Tensor| max_abs_diff(a, &b.to_dtype(DType::F64).unwrap());
        assert!(diff(&y64, &y32) < 1e-5);
        assert!(diff(&dx64, &dx32) < 1e-5);
        for (want, got) in g64.iter().zip(&g32) {
            assert_eq!(want.pairs.len(), 3, "q, k and v each get a gradient");
            for (t, (da, db)) in &want.pairs {
                let (ga, gb) = &got.pairs[t];
                assert!(diff(da, ga) < 1e-4 && diff(db, gb) < 1e-4);
            }
        }
        // The base-model rows carry the frozen product alone.
        let base = x
            .matmul(&w.t().unwrap())
            .unwrap()
            .broadcast_add(&b)
            .unwrap();
        let rows = |t: &Tensor, start| t.narrow(0, start, k).unwrap().to_dtype(DType::F64).unwrap();
        assert!(max_abs_diff(&rows(&base, 5 * k), &rows(&y32, 5 * k)) < 1e-5);
        // ... and adapted rows do not.
        assert!(max_abs_diff(&rows(&base, 0), &rows(&y32, 0)) > 1e-2);
        assert!(max_abs_diff(&rows(&base, 10 * k), &rows(&y32, 10 * k)) > 1e-2);
    }

    /// In bf16 the frozen products differ from f64 by at most `(2u + u²) Σ|x w|` per
    /// element (`u = 2⁻⁸`; the derivation is in `bf16::tests`), plus f32 accumulation;
    /// the LoRA deltas stay f32.
    #[test]
    fn the_bf16_path_is_within_the_bf16_rounding_bound_of_f64() {
        let Some(kernel) = bf16::kernel() else {
            eprintln!("this CPU has no bf16 kernel; nothing to check");
            return;
        };
        // A few rows stay bf16 too (not the f32 few-rows kernel): a datum's numbers must
        // not depend on how many rows share its pass.
        for n in [5, 70] {
            check_bf16_path(kernel, n);
        }
    }

    fn check_bf16_path(kernel: bf16::Kernel, n: usize) {
        let cfg = tiny_config(Arch::Qwen2);
        let (d, qd) = (cfg.hidden_size, cfg.q_dim());
        let parts = [(Target::Layer(0, Proj::Q), qd)];
        let segs = [Segment {
            start: 0,
            len: n,
            adapter: Some(0),
        }];
        let (x, w, dy) = (
            uniform(&[n, d], 1.0, 11),
            uniform(&[qd, d], 0.3, 12),
            uniform(&[n, qd], 1.0, 13),
        );
        let ad = adapter(14);
        let packed = bf16::PackedWeight::from_tensor(&w).unwrap();
        let run = |dtype: DType, adapters: &[&Adapter], bf16: Option<Bf16Ref>| {
            let cast = |t: &Tensor| t.to_dtype(dtype).unwrap();
            let (x, w, dy) = (cast(&x), cast(&w), cast(&dy));
            let proj = Projection {
                weight: &w,
                bias: None,
                parts: &parts,
                bf16,
                backend: Backend::Cpu,
                few_rows: true,
            };
            let (y, caches) = forward(&x, &proj, &segs, adapters).unwrap();
            let mut grads = vec![AdapterGrads::default()];
            let dx = backward(&x, &dy, &proj, &segs, adapters, &caches, &mut grads).unwrap();
            (
                y.to_dtype(DType::F64).unwrap(),
                dx.to_dtype(DType::F64).unwrap(),
            )
        };
        let (y64, dx64) = run(DType::F64, &[&ad], None);
        let ad32 = f32s(&ad);
        let p = Bf16Ref {
            kernel,
            weight: &packed,
        };
        let (y16, dx16) = run(DType::F32, &[&ad32], Some(p));
        // Σ|x w| and Σ|dy| |w| per element, in f64.
        let (xa, wa, dya) = (x.abs().unwrap(), w.abs().unwrap(), dy.abs().unwrap());
        let y_scale = xa.matmul(&wa.t().unwrap()).unwrap();
        let dx_scale = dya.matmul(&wa).unwrap();
        let u = 1.0 / 256.0;
        let within = |got: &Tensor, want: &Tensor, scale: &Tensor, what: &str| {
            let err = (got - want).unwrap().abs().unwrap();
            let bound = ((scale * (2.0 * u + u * u)).unwrap() + 1e-5).unwrap();
            let over = max_entry(&(err - bound).unwrap());
            assert!(over <= 0.0, "{what}: {over} over the bf16 bound");
        };
        within(&y16, &y64, &y_scale, "y");
        within(&dx16, &dx64, &dx_scale, "dx");
        // And the rounding is really there: bf16 differs from f32 by more than f32 noise.
        let (y32, _) = run(DType::F32, &[&ad32], None);
        assert!(max_abs_diff(&y16, &y32) > 1e-4);
    }
}
