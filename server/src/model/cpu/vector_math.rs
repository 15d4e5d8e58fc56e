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
/// width (the decode step, the few-rows products, the host KV attention) and reached
/// through [`dot`] from the others.
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
    acc.iter().fold(T::zero(), |s, &v| s + v) + tail
}

/// [`dot_lanes`] compiled for AVX-512 and AVX2 too, picked at run time.
#[multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2+fma"))]
pub fn dot<T: Real>(a: &[T], b: &[T]) -> T {
    dot_lanes(a, b)
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

/// Replaces every element `x` of `row` by `e^(x * scale - shift)` and returns their sum.
#[multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2+fma"))]
pub fn exp_in_place(row: &mut [f32], scale: f32, shift: f32) -> f32 {
    let mut acc = [0f32; LANES];
    let mut chunks = row.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for (s, v) in acc.iter_mut().zip(c.iter_mut()) {
            *v = exp_f32(*v * scale - shift);
            *s += *v;
        }
    }
    let mut s = 0f32;
    for v in chunks.into_remainder() {
        *v = exp_f32(*v * scale - shift);
        s += *v;
    }
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
    fn dot_and_exp_in_place_match_plain_loops() {
        for n in [0, 1, 15, 16, 17, 100] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            let want: f64 = a.iter().zip(&b).map(|(&x, &y)| x as f64 * y as f64).sum();
            assert!((dot(&a, &b) as f64 - want).abs() < 1e-5, "dot of {n}");
            let mut row = a.clone();
            let sum = exp_in_place(&mut row, 0.5, 0.25);
            for (got, &x) in row.iter().zip(&a) {
                let want = ((x as f64) * 0.5 - 0.25).exp();
                assert!((*got as f64 - want).abs() < 1e-6 * want, "exp of {x}");
            }
            let want: f64 = a.iter().map(|&x| ((x as f64) * 0.5 - 0.25).exp()).sum();
            assert!(
                (sum as f64 - want).abs() < 1e-5 * want.max(1.0),
                "sum of {n}"
            );
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
