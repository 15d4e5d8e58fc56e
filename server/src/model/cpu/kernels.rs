//! Fused CPU kernels for the row-wise parts of the forward and backward passes.
//!
//! candle runs each elementwise op as its own pass over memory with a fresh allocation;
//! RMSNorm alone is seven passes. These kernels do each block in one or two passes over
//! contiguous rows, in parallel over rows, for f32 and f64. [`crate::model::ops`] calls them for
//! CPU tensors and keeps the composite candle versions for other devices; tests check the
//! two agree.

use std::mem::MaybeUninit;

use candle_core::{DType, Device, Result, Storage, Tensor, WithDType};
use num_traits::Float;
use rayon::prelude::*;

use super::row_loops;
use super::transpose::transpose;
use super::vector_math::{dot as row_dot, dot3, dot_lanes as dot, exp_f32, row_max, sum_exp};

/// Float types the kernels run on.
pub trait Real: WithDType + Float + num_traits::NumAssign + Send + Sync {
    /// `e^self`: for f32 a branch-free polynomial the compiler vectorises (libm's `expf`
    /// is a call per element, and the softmaxes and SwiGLU run about 10^8 of them per
    /// training step); f64, the finite-difference reference, keeps the exact `exp`.
    fn fast_exp(self) -> Self;
}

impl Real for f32 {
    #[inline(always)]
    fn fast_exp(self) -> f32 {
        exp_f32(self)
    }
}

impl Real for f64 {
    #[inline(always)]
    fn fast_exp(self) -> f64 {
        self.exp()
    }
}

/// Whether `t` can go through these kernels.
pub fn supported(t: &Tensor) -> bool {
    t.device().is_cpu() && matches!(t.dtype(), DType::F32 | DType::F64)
}

/// Calls `f` with the contiguous data of `t`.
pub(super) fn with<T: Real, R>(t: &Tensor, f: impl FnOnce(&[T]) -> Result<R>) -> Result<R> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(cpu) => {
            let all = cpu.as_slice::<T>()?;
            let start = layout.start_offset();
            f(&all[start..start + t.elem_count()])
        }
        _ => candle_core::bail!("fused kernels need CPU tensors"),
    }
}

/// Smallest number of `unit`-element chunks worth handing to another thread: below
/// about 32K elements, waking a worker costs more than it saves (decode steps are full
/// of such small calls).
pub(super) fn grain(unit: usize) -> usize {
    (32_768 / unit.max(1)).max(1)
}

/// A vector of `len` values that `fill` writes, without zeroing the memory first as
/// `vec![0; len]` does: the allocator's zeroing of reused memory is one more pass over
/// every activation a training step makes. In debug builds (the tests) the memory holds
/// NaN before `fill` runs, so an element `fill` missed turns the tests' comparisons
/// (`test_util::max_abs_diff`) into NaN, which fails them.
///
/// # Safety
/// `fill` must write every element of the slice it is given.
pub(super) unsafe fn written<T: Real>(
    len: usize,
    fill: impl FnOnce(&mut [MaybeUninit<T>]),
) -> Vec<T> {
    let mut v = Vec::with_capacity(len);
    let spare = &mut v.spare_capacity_mut()[..len];
    if cfg!(debug_assertions) {
        spare.iter_mut().for_each(|e| {
            e.write(T::nan());
        });
    }
    fill(spare);
    // SAFETY: the capacity is at least `len`, and the caller's `fill` wrote all of them.
    unsafe { v.set_len(len) };
    v
}

/// `row` once every element has been written.
///
/// # Safety
/// Every element of `row` must have been written.
unsafe fn assume_written<T>(row: &mut [MaybeUninit<T>]) -> &mut [T] {
    // SAFETY: `MaybeUninit<T>` has `T`'s layout, and the caller wrote every element.
    unsafe { &mut *(row as *mut [MaybeUninit<T>] as *mut [T]) }
}

fn out<T: Real>(v: Vec<T>, shape: &[usize]) -> Result<Tensor> {
    Tensor::from_vec(v, shape, &Device::Cpu)
}

/// Fails unless `t` has `dims`: the kernels write every element of their outputs only
/// when their inputs' shapes agree (a mismatch would leave output rows unwritten).
fn expect_dims(what: &str, t: &Tensor, dims: &[usize]) -> Result<()> {
    if t.dims() != dims {
        candle_core::bail!("{what}: shape {:?}, expected {dims:?}", t.dims());
    }
    Ok(())
}

fn cols(t: &Tensor) -> Result<usize> {
    t.dims()
        .last()
        .copied()
        .ok_or_else(|| candle_core::Error::Msg("scalar tensor".into()))
}

/// `a + b` for tensors of one shape (the residual adds): one pass, on rayon's pool, as
/// the other kernels. candle's own elementwise ops hand large tensors to a pool of
/// candle's that spins between calls, which competes for the cores with a pass's
/// threads.
pub fn add<T: Real>(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if a.shape() != b.shape() {
        candle_core::bail!("add: shapes {:?} and {:?} differ", a.shape(), b.shape());
    }
    const CHUNK: usize = 4096;
    let y = with::<T, _>(a, |xs| {
        with::<T, _>(b, |zs| {
            // SAFETY: the chunks of `y` and `xs` pair up, and each element is written.
            let y = unsafe {
                written(xs.len(), |y| {
                    y.par_chunks_mut(CHUNK)
                        .zip(xs.par_chunks(CHUNK).zip(zs.par_chunks(CHUNK)))
                        .with_min_len(grain(CHUNK))
                        .for_each(|(yc, (xc, zc))| row_loops::add(yc, xc, zc))
                })
            };
            Ok(y)
        })
    })?;
    out(y, a.dims())
}

/// RMSNorm over the last dim: returns `(y, rstd)` with `rstd` of shape `(rows,)`.
pub fn rms_norm<T: Real>(x: &Tensor, w: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    let c = cols(x)?;
    if c == 0 {
        candle_core::bail!("rms_norm: rows of no elements");
    }
    expect_dims("rms_norm weight", w, &[c])?;
    let rows = x.elem_count() / c;
    let eps = T::from(eps).expect("eps fits");
    let (y, rstd) = with::<T, _>(x, |xs| {
        with::<T, _>(w, |ws| {
            let mut rstd = vec![T::zero(); rows];
            // SAFETY: each row of `y` pairs with a row of `xs` and is written whole.
            let y = unsafe {
                written(xs.len(), |y| {
                    y.par_chunks_mut(c)
                        .zip(rstd.par_iter_mut())
                        .zip(xs.par_chunks(c))
                        .with_min_len(grain(c))
                        .for_each(|((yr, r), xr)| *r = rms_row(yr, xr, ws, eps))
                })
            };
            Ok((y, rstd))
        })
    })?;
    Ok((out(y, x.dims())?, out(rstd, &[rows])?))
}

/// One RMSNorm row: writes `x r w` to `out` and returns `r = 1 / sqrt(mean(x²) + eps)`.
/// The one definition that training, prefill and decoding share. Panics when the
/// lengths differ.
pub fn rms_row<T: Real>(out: &mut [MaybeUninit<T>], x: &[T], w: &[T], eps: T) -> T {
    let inv_c = T::one() / T::from(x.len()).expect("cols fit");
    let ms = row_dot(x, x) * inv_c;
    let r = T::one() / (ms + eps).sqrt();
    row_loops::norm_scale(out, x, w, r);
    r
}

/// [`rms_row`] of every `w.len()`-wide row of `x`, on the calling thread (the decode
/// step's rows).
pub fn rms_rows(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let c = w.len().max(1);
    assert_eq!(
        x.len() % c,
        0,
        "rms_rows: rows of {c} do not tile {}",
        x.len()
    );
    // SAFETY: every row of the output pairs with a row of `x` and `rms_row` writes it whole.
    unsafe {
        written(x.len(), |y| {
            for (yr, xr) in y.chunks_exact_mut(c).zip(x.chunks_exact(c)) {
                rms_row(yr, xr, w, eps);
            }
        })
    }
}

/// SwiGLU of the decode step's rows: `silu(g) u` elementwise, [`row_loops::swiglu`] as
/// in training.
pub fn swiglu_rows(g: &[f32], u: &[f32]) -> Vec<f32> {
    // SAFETY: `row_loops::swiglu` writes every element (it panics on other lengths).
    unsafe { written(g.len(), |y| row_loops::swiglu(y, g, u)) }
}

/// RMSNorm input gradient: `dx = rstd * (g*dy - xhat * mean(g*dy * xhat))`.
pub fn rms_norm_backward<T: Real>(
    dy: &Tensor,
    x: &Tensor,
    w: &Tensor,
    rstd: &Tensor,
) -> Result<Tensor> {
    let c = cols(x)?;
    if c == 0 {
        candle_core::bail!("rms_norm_backward: rows of no elements");
    }
    expect_dims("rms_norm_backward weight", w, &[c])?;
    expect_dims("rms_norm_backward output gradient", dy, x.dims())?;
    expect_dims("rms_norm_backward rstd", rstd, &[x.elem_count() / c])?;
    let inv_c = T::one() / T::from(c).expect("cols fit");
    let dx = with::<T, _>(dy, |dys| {
        with::<T, _>(x, |xs| {
            with::<T, _>(w, |ws| {
                with::<T, _>(rstd, |rs| {
                    // SAFETY: each row of `dx` pairs with a row of `xs` and is written whole.
                    let dx = unsafe {
                        written(xs.len(), |dx| {
                            dx.par_chunks_mut(c)
                                .zip(dys.par_chunks(c))
                                .zip(xs.par_chunks(c))
                                .zip(rs.par_iter())
                                .with_min_len(grain(c))
                                .for_each(|(((dxr, dyr), xr), &r)| {
                                    let m = dot3(dyr, ws, xr) * r * inv_c;
                                    row_loops::norm_grad(dxr, dyr, xr, ws, r, m);
                                })
                        })
                    };
                    Ok(dx)
                })
            })
        })
    })?;
    out(dx, x.dims())
}

/// `silu(gate) * up` for `gate_up = [gate | up]`, `(rows, 2f)`: the stacked projection's
/// output is read in place, so the two halves are never copied apart.
pub fn swiglu<T: Real>(gate_up: &Tensor) -> Result<Tensor> {
    let width = cols(gate_up)?;
    if width % 2 != 0 {
        candle_core::bail!("swiglu: {width} columns are not a gate and an up half");
    }
    let f = width / 2;
    let rows = gate_up.elem_count() / (2 * f).max(1);
    let y = with::<T, _>(gate_up, |gu| {
        // SAFETY: each row of `y` (`f` wide) pairs with a row of `gu` and is written whole.
        let y = unsafe {
            written(rows * f, |y| {
                y.par_chunks_mut(f.max(1))
                    .zip(gu.par_chunks((2 * f).max(1)))
                    .with_min_len(grain(2 * f))
                    .for_each(|(yr, gur)| {
                        let (g, u) = gur.split_at(f);
                        row_loops::swiglu(yr, g, u);
                    })
            })
        };
        Ok(y)
    })?;
    out(y, &[rows, f])
}

/// SwiGLU backward: the gradient of `gate_up`, `(rows, 2f)` = `[dgate | dup]`, laid out
/// like the stacked projection it flows back into.
pub fn swiglu_backward<T: Real>(dy: &Tensor, gate_up: &Tensor) -> Result<Tensor> {
    let width = cols(gate_up)?;
    if width % 2 != 0 {
        candle_core::bail!("swiglu_backward: {width} columns are not a gate and an up half");
    }
    let f = width / 2;
    let rows = gate_up.elem_count() / width.max(1);
    expect_dims("swiglu_backward output gradient", dy, &[rows, f])?;
    let d = with::<T, _>(dy, |d| {
        with::<T, _>(gate_up, |gu| {
            // SAFETY: each row of `dgu` pairs with a row of `gu`, and both of its halves
            // are written whole.
            let dgu = unsafe {
                written(gu.len(), |dgu| {
                    dgu.par_chunks_mut((2 * f).max(1))
                        .zip(gu.par_chunks((2 * f).max(1)).zip(d.par_chunks(f.max(1))))
                        .with_min_len(grain(2 * f))
                        .for_each(|(dr, (gur, dyr))| {
                            let (g, u) = gur.split_at(f);
                            let (dg, du) = dr.split_at_mut(f);
                            row_loops::swiglu_grad(dg, du, g, u, dyr);
                        })
                })
            };
            Ok(dgu)
        })
    })?;
    out(d, gate_up.dims())
}

/// Rotate-half RoPE on `(n, heads, hd)` with `cos`, `sin` of shape `(n, hd/2)`; `sign`
/// -1 rotates backwards (the backward pass).
pub fn rope<T: Real>(x: &Tensor, cos: &Tensor, sin: &Tensor, sign: f64) -> Result<Tensor> {
    let dims = x.dims().to_vec();
    let &[n, heads, hd] = dims.as_slice() else {
        candle_core::bail!("rope: shape {dims:?} is not (n, heads, head dim)");
    };
    let half = hd / 2;
    expect_dims("rope cos", cos, &[n, half])?;
    expect_dims("rope sin", sin, &[n, half])?;
    let sign = T::from(sign).expect("sign fits");
    let y = with::<T, _>(x, |xs| {
        with::<T, _>(cos, |cs| {
            with::<T, _>(sin, |ss| {
                if hd % 2 != 0 {
                    candle_core::bail!("rope: head dim {hd} is odd");
                }
                // SAFETY: each row of `y` pairs with a row of `xs`; for every head, `i`
                // and `i + half` over `0..half` cover its `hd` (even) elements.
                let y = unsafe {
                    written(xs.len(), |y| {
                        y.par_chunks_mut((heads * hd).max(1))
                            .zip(xs.par_chunks((heads * hd).max(1)))
                            .zip(cs.par_chunks(half.max(1)).zip(ss.par_chunks(half.max(1))))
                            .with_min_len(grain(heads * hd))
                            .for_each(|((yr, xr), (c, s))| {
                                for h in 0..heads {
                                    let xo = &xr[h * hd..(h + 1) * hd];
                                    let yo = &mut yr[h * hd..(h + 1) * hd];
                                    row_loops::rope(yo, xo, &c[..half], &s[..half], sign);
                                }
                            })
                    })
                };
                Ok(y)
            })
        })
    })?;
    out(y, &dims)
}

/// Scaled causal softmax, in one pass per row, of `scores` `(b, g*tq, tk)`: row `r`
/// is query `r % tq`, at position `tk - tq + r % tq`, and sees keys up to it.
pub fn causal_softmax<T: Real>(scores: &Tensor, tq: usize, scale: f64) -> Result<Tensor> {
    let tk = cols(scores)?;
    let Some(offset) = tk.checked_sub(tq) else {
        candle_core::bail!("causal_softmax: {tq} queries after {tk} keys");
    };
    let scale = T::from(scale).expect("scale fits");
    let p = with::<T, _>(scores, |s| {
        let fill = |p: &mut [MaybeUninit<T>]| {
            p.par_chunks_mut(tk.max(1))
                .zip(s.par_chunks(tk.max(1)))
                .enumerate()
                .with_min_len(grain(tk))
                .for_each(|(r, (pr, sr))| {
                    let visible = (offset + r % tq + 1).min(tk);
                    let max = sr[..visible]
                        .iter()
                        .fold(T::neg_infinity(), |m, &v| Float::max(m, v))
                        * scale;
                    let mut sum = T::zero();
                    let (seen, masked) = pr.split_at_mut(visible);
                    for (o, &v) in seen.iter_mut().zip(&sr[..visible]) {
                        sum += *o.write((v * scale - max).fast_exp());
                    }
                    masked.iter_mut().for_each(|o| {
                        o.write(T::zero());
                    });
                    // SAFETY: every element of `seen` was written just above.
                    let seen = unsafe { assume_written(seen) };
                    let inv = T::one() / sum;
                    seen.iter_mut().for_each(|o| *o *= inv);
                })
        };
        // SAFETY: each row of `p` pairs with a row of `s`; its first `visible` elements
        // are written, then the rest (the masked keys) with zeros.
        let p = unsafe { written(s.len(), fill) };
        Ok(p)
    })?;
    out(p, scores.dims())
}

/// Softmax backward with the scale folded in: `ds = scale * p * (dp - sum(dp * p))`.
pub fn softmax_backward<T: Real>(p: &Tensor, dp: &Tensor, scale: f64) -> Result<Tensor> {
    let tk = cols(p)?;
    expect_dims("softmax_backward gradient", dp, p.dims())?;
    let scale = T::from(scale).expect("scale fits");
    let ds = with::<T, _>(p, |ps| {
        with::<T, _>(dp, |dps| {
            // SAFETY: each row of `ds` pairs with a row of `ps` and is written whole.
            let ds = unsafe {
                written(ps.len(), |ds| {
                    ds.par_chunks_mut(tk.max(1))
                        .zip(ps.par_chunks(tk.max(1)).zip(dps.par_chunks(tk.max(1))))
                        .with_min_len(grain(tk))
                        .for_each(|(o, (pr, dr))| {
                            let dot = pr.iter().zip(dr).fold(T::zero(), |a, (&x, &y)| a + x * y);
                            for ((v, &x), &y) in o.iter_mut().zip(pr).zip(dr) {
                                v.write(scale * x * (y - dot));
                            }
                        })
                })
            };
            Ok(ds)
        })
    })?;
    out(ds, p.dims())
}

/// Log-softmax at the targets: `(lp (n, k), lse (n,))` from `logits (n, V)` and u32
/// `targets (n, k)`. Two passes over each row (max, then sum of exponentials).
pub fn logprobs_at<T: Real>(logits: &Tensor, targets: &Tensor) -> Result<(Tensor, Tensor)> {
    let v = cols(logits)?;
    let k = cols(targets)?;
    let rows = logits.elem_count() / v;
    let tg: Vec<u32> = targets.flatten_all()?.to_vec1()?;
    let (lp, lse) = with::<T, _>(logits, |ls| {
        let mut lp = vec![T::zero(); rows * k];
        let mut lse = vec![T::zero(); rows];
        lp.par_chunks_mut(k)
            .zip(lse.par_iter_mut())
            .zip(ls.par_chunks(v).zip(tg.par_chunks(k)))
            .for_each(|((lpr, l), (row, t))| {
                let max = row_max(row);
                *l = sum_exp(row, max).ln() + max;
                for (o, &ti) in lpr.iter_mut().zip(t) {
                    *o = row[ti as usize] - *l;
                }
            });
        Ok((lp, lse))
    })?;
    Ok((out(lp, &[rows, k])?, out(lse, &[rows])?))
}

/// Gradient of the target log-probs w.r.t. the logits, given `d = dLoss/dlp (n, k)`:
/// `dlogits = scatter(d) - softmax * sum_k d`, recomputing the softmax from `lse`.
pub fn logprobs_at_backward<T: Real>(
    logits: &Tensor,
    lse: &Tensor,
    targets: &Tensor,
    d: &Tensor,
) -> Result<Tensor> {
    let v = cols(logits)?;
    let k = cols(targets)?;
    let rows = logits.elem_count() / v.max(1);
    if k == 0 {
        candle_core::bail!("logprobs_at_backward: no targets");
    }
    expect_dims("logprobs_at_backward targets", targets, &[rows, k])?;
    expect_dims("logprobs_at_backward gradient", d, &[rows, k])?;
    expect_dims("logprobs_at_backward lse", lse, &[rows])?;
    let tg: Vec<u32> = targets.flatten_all()?.to_vec1()?;
    let dl = with::<T, _>(logits, |ls| {
        with::<T, _>(lse, |lses| {
            with::<T, _>(d, |ds| {
                let fill = |dl: &mut [MaybeUninit<T>]| {
                    dl.par_chunks_mut(v.max(1))
                        .zip(ls.par_chunks(v.max(1)))
                        .zip(
                            lses.par_iter()
                                .zip(ds.par_chunks(k.max(1)).zip(tg.par_chunks(k.max(1)))),
                        )
                        .for_each(|((o, row), (&l, (dr, t)))| {
                            let total = dr.iter().fold(T::zero(), |a, &x| a + x);
                            row_loops::neg_softmax_times(o, row, l, total);
                            // SAFETY: the loop above wrote the whole row.
                            let o = unsafe { assume_written(o) };
                            for (&ti, &dv) in t.iter().zip(dr) {
                                o[ti as usize] += dv;
                            }
                        })
                };
                // SAFETY: each row of `dl` pairs with a row of `ls` and is written whole
                // before the targets' entries are added to.
                let dl = unsafe { written(ls.len(), fill) };
                Ok(dl)
            })
        })
    })?;
    out(dl, logits.dims())
}

/// Most rows for which [`matmul_t_few_rows`] beats gemm: gemm packs the whole weight
/// matrix on every call, which for a handful of rows (decoding) triples the memory
/// traffic of a bandwidth-bound product.
pub const FEW_ROWS: usize = 16;

/// `x W^T` for f32 `x (m, k)` with `m <= FEW_ROWS` and `w (n, k)`: every weight row is
/// read once, straight from memory, and dotted with each row of `x`.
pub fn matmul_t_few_rows(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (m, k) = x.dims2()?;
    let n = w.dims2()?.0;
    let yt = with::<f32, _>(x, |xs| with::<f32, _>(w, |ws| Ok(few_rows_t(xs, m, k, ws))))?;
    from_transposed(yt, n, m)
}

/// [`matmul_t_few_rows`] over plain buffers: `xs` is `(m, k)`, `w` a tensor `(n, k)`.
/// Returns `(m, n)` row-major.
pub fn matmul_t_few_rows_host(xs: &[f32], m: usize, w: &Tensor) -> Result<Vec<f32>> {
    let (n, k) = w.dims2()?;
    if xs.len() != m * k {
        candle_core::bail!("few-rows matmul: {} inputs for {m} rows of {k}", xs.len());
    }
    let yt = with::<f32, _>(w, |ws| Ok(few_rows_t(xs, m, k, ws)))?;
    Ok(transpose(yt, n, m))
}

/// `(n, m)`: every weight row's outputs for all `m` rows together.
fn few_rows_t(xs: &[f32], m: usize, k: usize, ws: &[f32]) -> Vec<f32> {
    let n = ws.len() / k;
    let mut yt = vec![0f32; n * m];
    const BLOCK: usize = 64;
    yt.par_chunks_mut(BLOCK * m)
        .zip(ws.par_chunks(BLOCK * k))
        .with_min_len(grain(BLOCK * k))
        .for_each(|(out, wrows)| dot_block(xs, m, k, wrows, out));
    yt
}

/// The few-rows kernels write `(n, m)` (one weight row's outputs together); callers want
/// `(m, n)`.
pub(super) fn from_transposed(yt: Vec<f32>, n: usize, m: usize) -> Result<Tensor> {
    out(transpose(yt, n, m), &[m, n])
}

fn dot_block(xs: &[f32], m: usize, k: usize, wrows: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU supports AVX-512F, checked just above.
            return unsafe { dot_block_avx512(xs, m, k, wrows, out) };
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            // SAFETY: the CPU supports AVX2 and FMA, checked just above.
            return unsafe { dot_block_avx2(xs, m, k, wrows, out) };
        }
    }
    dot_block_generic(xs, m, k, wrows, out)
}

/// AVX-512 version: each 16-float piece of a weight row is loaded once and multiplied
/// into up to four activation rows.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dot_block_avx512(xs: &[f32], m: usize, k: usize, wrows: &[f32], out: &mut [f32]) {
    use std::arch::x86_64::*;
    let full = k / 16 * 16;
    for (o, wr) in wrows.chunks_exact(k).enumerate() {
        let mut mi = 0;
        while mi < m {
            let r = (m - mi).min(4);
            let mut acc = [_mm512_setzero_ps(); 4];
            let mut c = 0;
            while c < full {
                // SAFETY: c + 16 <= full <= k, the length of `wr` and of each x row.
                let wv = _mm512_loadu_ps(wr.as_ptr().add(c));
                for (j, a) in acc.iter_mut().enumerate().take(r) {
                    let xv = _mm512_loadu_ps(xs.as_ptr().add((mi + j) * k + c));
                    *a = _mm512_fmadd_ps(wv, xv, *a);
                }
                c += 16;
            }
            for (j, a) in acc.iter().enumerate().take(r) {
                let row = &xs[(mi + j) * k..(mi + j + 1) * k];
                let mut total = _mm512_reduce_add_ps(*a);
                for i in full..k {
                    total += wr[i] * row[i];
                }
                out[o * m + mi + j] = total;
            }
            mi += r;
        }
    }
}

/// AVX2 version: each 16-float piece of a weight row is loaded once (two registers) and
/// multiplied into up to four activation rows, with two accumulators per row so eight
/// independent FMA chains hide the FMA latency (one chain per row, as in a plain dot
/// product, leaves most of the FMA units idle).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_block_avx2(xs: &[f32], m: usize, k: usize, wrows: &[f32], out: &mut [f32]) {
    use std::arch::x86_64::*;
    // The loads below index `xs` unchecked up to row `m - 1`.
    assert!(xs.len() >= m * k && out.len() >= wrows.len() / k.max(1) * m);
    let full = k / 16 * 16;
    for (o, wr) in wrows.chunks_exact(k).enumerate() {
        let mut mi = 0;
        while mi < m {
            let r = (m - mi).min(4);
            let mut lo = [_mm256_setzero_ps(); 4];
            let mut hi = [_mm256_setzero_ps(); 4];
            let mut c = 0;
            while c < full {
                // SAFETY: c + 16 <= full <= k, the length of `wr` and of each of the
                // `m` x rows (`xs` holds `m * k`, asserted above).
                let w0 = _mm256_loadu_ps(wr.as_ptr().add(c));
                let w1 = _mm256_loadu_ps(wr.as_ptr().add(c + 8));
                for j in 0..r {
                    let x = xs.as_ptr().add((mi + j) * k + c);
                    lo[j] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x), lo[j]);
                    hi[j] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x.add(8)), hi[j]);
                }
                c += 16;
            }
            for j in 0..r {
                let row = &xs[(mi + j) * k..(mi + j + 1) * k];
                let mut lanes = [0f32; 8];
                _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_add_ps(lo[j], hi[j]));
                let mut total: f32 = lanes.iter().sum();
                for i in full..k {
                    total += wr[i] * row[i];
                }
                out[o * m + mi + j] = total;
            }
            mi += r;
        }
    }
}

/// Dot products of each weight row with each `x` row, with 16 independent lanes so the
/// compiler vectorises it for whatever features the caller enabled.
#[inline(always)]
fn dot_block_generic(xs: &[f32], m: usize, k: usize, wrows: &[f32], out: &mut [f32]) {
    for (o, wr) in wrows.chunks_exact(k).enumerate() {
        for (mi, x) in xs.chunks_exact(k).take(m).enumerate() {
            out[o * m + mi] = dot(wr, x);
        }
    }
}

/// Asks the CPU to bring the cache lines of `len` bytes from `start` into the cache: for
/// kernels that stream weight rows one after another, which the hardware prefetchers
/// follow too late. A hint only: it never faults, whatever the address.
#[inline(always)]
pub(crate) fn prefetch_lines(start: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let end = start.wrapping_add(len);
        let mut line = start.wrapping_sub(start as usize % 64);
        while line < end {
            // SAFETY: a prefetch never faults and changes nothing but the cache.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(line.cast()) };
            line = line.wrapping_add(64);
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (start, len);
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::model::test_util::{max_abs_diff, uniform_matrix as randn};

    fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
        max_abs_diff(a, b)
    }

    #[test]
    fn add_matches_candle() {
        for (rows, cols) in [(3, 5), (100, 576), (1, 1)] {
            let (a, b) = (randn(rows, cols, 1), randn(rows, cols, 2));
            let want = (&a + &b).unwrap();
            assert_eq!(max_diff(&add::<f32>(&a, &b).unwrap(), &want), 0.0);
            let (a, b) = (
                a.to_dtype(DType::F64).unwrap(),
                b.to_dtype(DType::F64).unwrap(),
            );
            let want = (&a + &b).unwrap();
            assert_eq!(max_diff(&add::<f64>(&a, &b).unwrap(), &want), 0.0);
        }
        // A strided operand is made contiguous first; different shapes are refused.
        let a = randn(4, 6, 3);
        let at = a.t().unwrap();
        let want = (&at + &at).unwrap();
        assert_eq!(max_diff(&add::<f32>(&at, &at).unwrap(), &want), 0.0);
        assert!(add::<f32>(&a, &randn(6, 4, 4)).is_err());
    }

    #[test]
    fn portable_kernels_match_gemm() {
        // The paths used on CPUs without AVX-512 (this machine always takes AVX-512).
        let (m, k, n) = (3, 70, 5);
        let (x, w) = (randn(m, k, 7), randn(n, k, 8));
        let want = x.matmul(&w.t().unwrap()).unwrap();
        let xs: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
        let ws: Vec<f32> = w.flatten_all().unwrap().to_vec1().unwrap();
        let mut yt = vec![0f32; n * m];
        dot_block_generic(&xs, m, k, &ws, &mut yt);
        assert!(max_diff(&from_transposed(yt, n, m).unwrap(), &want) < 1e-4);
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn avx2_kernel_matches_gemm_whatever_the_cpu_prefers() {
        // Called directly: a CPU with AVX-512 would never pick it through `dot_block`.
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
            return;
        }
        for k in [576, 70, 8, 16] {
            let n = 9;
            let w = randn(n, k, 3);
            let ws: Vec<f32> = w.flatten_all().unwrap().to_vec1().unwrap();
            for m in 1..=FEW_ROWS {
                let x = randn(m, k, 11 + m as u64);
                let want = x.matmul(&w.t().unwrap()).unwrap();
                let xs: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
                let mut yt = vec![0f32; n * m];
                // SAFETY: the CPU supports AVX2 and FMA, checked above.
                unsafe { dot_block_avx2(&xs, m, k, &ws, &mut yt) };
                let got = from_transposed(yt, n, m).unwrap();
                assert!(max_diff(&got, &want) < 1e-4, "m={m} k={k}");
            }
        }
    }

    #[test]
    fn few_rows_matmul_matches_gemm_for_every_row_count_and_odd_widths() {
        for k in [64, 70, 8] {
            let w = randn(150, k, 1);
            for m in 1..=FEW_ROWS {
                let x = randn(m, k, m as u64);
                let want = x.matmul(&w.t().unwrap()).unwrap();
                let got = matmul_t_few_rows(&x, &w).unwrap();
                assert_eq!(got.dims(), want.dims());
                assert!(max_diff(&got, &want) < 1e-4, "m={m} k={k}");
            }
        }
    }
}
