//! Scalar maths written so that loops over it vectorise: a polynomial `exp` for f32 (libm's
//! `expf` is a call per element) and row reductions with independent partial results
//! (the compiler must otherwise keep a float reduction in order). The fused kernels
//! ([`super::kernels`]) use them in the softmaxes and SwiGLU.

use multiversion::multiversion;
use num_traits::Float;

use super::kernels::Real;

/// `e^x` within 2 ulp for `x` in `[-87.3, 88]` (clamped outside it, where the result
/// under- or overflows anyway): `x = k ln 2 + r` with `|r| <= ln2 / 2`, Cephes' degree-5
/// polynomial for `e^r`, and `2^k` assembled in the exponent bits. Only arithmetic and
/// bit operations, so loops over it vectorise.
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer
    let x = x.clamp(-87.336_54, 88.0);
    let t = x * std::f32::consts::LOG2_E + ROUND;
    let k = t - ROUND;
    let r = x - k * 0.693_359_4 - k * -2.121_944_4e-4;
    let p = ((((1.987_569_1e-4 * r + 1.398_2e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 0.5;
    let e = p * r * r + r + 1.0;
    let ki = t.to_bits().wrapping_sub(ROUND.to_bits()) as i32;
    e * f32::from_bits(((ki + 127) as u32) << 23)
}

/// Lanes of the accumulators in [`row_max`] and [`sum_exp`]: independent partial results
/// let the compiler vectorise a reduction it must otherwise keep in order. The reductions
/// are compiled for AVX-512 and AVX2 too and picked at run time (the default target has
/// only SSE2); with the lanes explicit, every version computes the same floats.
const LANES: usize = 16;

/// The largest element of a row.
#[multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2+fma"))]
pub fn row_max<T: Real>(row: &[T]) -> T {
    let mut acc = [T::neg_infinity(); LANES];
    let chunks = row.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = if v > *a { v } else { *a };
        }
    }
    let m = tail
        .iter()
        .fold(T::neg_infinity(), |m, &v| Float::max(m, v));
    acc.iter().fold(m, |m, &v| Float::max(m, v))
}

/// `sum_i row_i`.
#[multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2+fma"))]
pub fn sum<T: Real>(row: &[T]) -> T {
    let mut acc = [T::zero(); LANES];
    let chunks = row.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += v;
        }
    }
    let s = tail.iter().fold(T::zero(), |s, &v| s + v);
    acc.iter().fold(s, |s, &v| s + v)
}

/// `sum_i e^(row_i - shift)`.
#[multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2+fma"))]
pub fn sum_exp<T: Real>(row: &[T], shift: T) -> T {
    let mut acc = [T::zero(); LANES];
    let chunks = row.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += (v - shift).fast_exp();
        }
    }
    let s = tail
        .iter()
        .fold(T::zero(), |s, &v| s + (v - shift).fast_exp());
    acc.iter().fold(s, |s, &v| s + v)
}

/// `sum_i a_i b_i` over the shorter of the two, in `LANES` partial sums: the one
/// definition of a row dot product, inlined into callers already compiled for a vector
/// width (the few-rows products) and reached through [`dot`] from the others. [`dots`]
/// computes many at once (attention scores, LoRA's `A x`), bit for bit equal to this.
#[inline(always)]
pub fn dot_lanes<T: Real>(a: &[T], b: &[T]) -> T {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [T::zero(); LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail = (ca.remainder().iter())
        .zip(cb.remainder())
        .fold(T::zero(), |s, (&u, &v)| s + u * v);
    for (x, y) in ca.zip(cb) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    fold_lanes(acc) + tail
}

/// The sum of a dot product's lane partials in halving steps (lane `l` plus lane
/// `l + 8`, then `l + 4`, ...): a fixed order, so every caller gets the same float, and
/// one that runs as a few vector shuffles rather than fifteen dependent additions.
#[inline(always)]
fn fold_lanes<T: Real>(acc: [T; LANES]) -> T {
    // Unrolled by hand: with constant indices the steps become shuffles in registers.
    let mut a = [T::zero(); 8];
    for l in 0..8 {
        a[l] = acc[l] + acc[l + 8];
    }
    let b = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    (b[0] + b[2]) + (b[1] + b[3])
}

/// [`dot_lanes`] compiled for AVX-512 and AVX2 too, picked at run time.
#[multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2+fma"))]
pub fn dot<T: Real>(a: &[T], b: &[T]) -> T {
    dot_lanes(a, b)
}

/// `out[j] = dot_lanes(x, row j)` for every `j < out.len()`, row `j` being the `x.len()`
/// values of `rows` from `j * stride`: bit for bit [`dot_lanes`], with four dot products
/// in flight at once (one alone waits on its own additions), in AVX-512 registers where
/// the CPU has them. The products of attention scores and of LoRA's `A x` in training,
/// prefill and decoding alike, so that a row's numbers never depend on which of them
/// computed it. Panics when `rows` is too short.
pub fn dots(x: &[f32], rows: &[f32], stride: usize, out: &mut [f32]) {
    let (m, n) = (out.len(), x.len());
    if m == 0 {
        return;
    }
    assert!(
        (m - 1).checked_mul(stride).and_then(|e| e.checked_add(n)) <= Some(rows.len()),
        "dots: {m} rows of {n} at stride {stride} need more than {} values",
        rows.len()
    );
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        let mut j = 0;
        while j + 4 <= m {
            // SAFETY: the CPU has AVX-512F, and rows `j..j + 4` lie within `rows` (asserted
            // above for every row below `m`).
            unsafe { avx512::dots4(x, &rows[j * stride..], stride, &mut out[j..j + 4]) };
            j += 4;
        }
        for (i, o) in out.iter_mut().enumerate().skip(j) {
            *o = dot(x, &rows[i * stride..i * stride + n]);
        }
        return;
    }
    for (i, o) in out.iter_mut().enumerate() {
        *o = dot(x, &rows[i * stride..i * stride + n]);
    }
}

/// [`dots`] in AVX-512 registers.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::LANES;

    /// Four of [`super::dots`]'s products, each [`super::dot_lanes`]'s operations in the
    /// same order: lane-wise products added per lane, the lanes folded in halves, the
    /// tail added last.
    ///
    /// # Safety
    /// The CPU must have AVX-512F, `out` must hold 4 values, and `rows` must hold
    /// `3 * stride + x.len()` values.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn dots4(x: &[f32], rows: &[f32], stride: usize, out: &mut [f32]) {
        let n = x.len();
        assert!(
            out.len() == 4 && rows.len() >= 3 * stride + n,
            "dots4: sizes"
        );
        let whole = n / LANES * LANES;
        let (xp, rp) = (x.as_ptr(), rows.as_ptr());
        let mut acc = [_mm512_setzero_ps(); 4];
        for c in (0..whole).step_by(LANES) {
            // SAFETY: `c + LANES <= n`, and row `g` holds `n` values from `g * stride`.
            let xc = unsafe { _mm512_loadu_ps(xp.add(c)) };
            for (g, a) in acc.iter_mut().enumerate() {
                let r = unsafe { _mm512_loadu_ps(rp.add(g * stride + c)) };
                *a = _mm512_add_ps(*a, _mm512_mul_ps(xc, r));
            }
        }
        for (g, (a, o)) in acc.into_iter().zip(out.iter_mut()).enumerate() {
            let row = &rows[g * stride..g * stride + n];
            let tail = (whole..n).fold(0f32, |s, i| s + x[i] * row[i]);
            *o = fold(a) + tail;
        }
    }

    /// [`super::fold_lanes`]: lane `l` plus lane `l + 8`, then `l + 4`, `l + 2`, `l + 1`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn fold(a: __m512) -> f32 {
        let lo = _mm512_castps512_ps256(a);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
        let h = _mm256_add_ps(lo, hi);
        let q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
        let e = _mm_add_ps(q, _mm_movehl_ps(q, q));
        _mm_cvtss_f32(_mm_add_ss(e, _mm_shuffle_ps(e, e, 1)))
    }
}

/// `sum_i a_i b_i c_i` over the shortest of the three.
#[multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2+fma"))]
pub fn dot3<T: Real>(a: &[T], b: &[T], c: &[T]) -> T {
    let n = a.len().min(b.len()).min(c.len());
    let (a, b, c) = (&a[..n], &b[..n], &c[..n]);
    let mut acc = [T::zero(); LANES];
    let whole = n / LANES * LANES;
    for i in (0..whole).step_by(LANES) {
        let (x, y, z) = (&a[i..i + LANES], &b[i..i + LANES], &c[i..i + LANES]);
        for l in 0..LANES {
            acc[l] += x[l] * y[l] * z[l];
        }
    }
    let s = (whole..n).fold(T::zero(), |s, i| s + a[i] * b[i] * c[i]);
    acc.iter().fold(s, |s, &v| s + v)
}

/// `e^((x - shift) * scale)` of every element of `row`.
#[multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2+fma"))]
pub fn exp_scaled(row: &[f32], shift: f32, scale: f32) -> Vec<f32> {
    row.iter().map(|&x| exp_f32((x - shift) * scale)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_matches_a_plain_loop() {
        for n in [0, 1, 15, 16, 17, 100] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            let want: f64 = a.iter().zip(&b).map(|(&x, &y)| x as f64 * y as f64).sum();
            assert!((dot(&a, &b) as f64 - want).abs() < 1e-5, "dot of {n}");
        }
    }

    #[test]
    fn fast_exp_is_within_two_ulp_of_exp_over_its_range() {
        let mut worst = 0f64;
        for i in 0..=200_000 {
            let x = -87.3 + 175.3 * i as f32 / 200_000.0;
            let want = (x as f64).exp();
            let rel = ((exp_f32(x) as f64 - want) / want).abs();
            worst = worst.max(rel);
        }
        assert!(worst < 2.4e-7, "worst relative error {worst:e}");
        assert_eq!(exp_f32(0.0), 1.0);
        // Far outside the range it saturates instead of producing garbage.
        assert!(exp_f32(-1000.0) < 1.2e-38 && exp_f32(1000.0) > 1e38);
        assert!(exp_f32(1000.0).is_finite());
    }

    #[test]
    fn vectorised_reductions_match_plain_folds() {
        let row: Vec<f32> = (0..1003)
            .map(|i| ((i * 37) % 101) as f32 * 0.13 - 6.0)
            .collect();
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        assert_eq!(row_max(&row), max);
        let want: f64 = row.iter().map(|&v| ((v - max) as f64).exp()).sum();
        assert!(((sum_exp(&row, max) as f64 - want) / want).abs() < 1e-6);
        let total: f64 = row.iter().map(|&v| v as f64).sum();
        assert!((sum(&row) as f64 - total).abs() < 1e-3);
    }
}
