//! Helpers shared by the model's unit tests.

use candle_core::{DType, Device, Tensor};
use rand::{rngs::StdRng, Rng, SeedableRng};

/// An f64 tensor of values uniform in `(-bound, bound)`, deterministic in `seed`.
pub fn uniform(shape: &[usize], bound: f64, seed: u64) -> Tensor {
    let mut rng = StdRng::seed_from_u64(seed);
    let n = shape.iter().product();
    let v: Vec<f64> = (0..n).map(|_| rng.random_range(-bound..bound)).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).expect("shape matches")
}

/// An f32 `(rows, cols)` matrix of values uniform in `(-1, 1)`, deterministic in `seed`.
pub fn uniform_matrix(rows: usize, cols: usize, seed: u64) -> Tensor {
    uniform(&[rows, cols], 1.0, seed)
        .to_dtype(DType::F32)
        .expect("f32")
}

/// The largest entry of `t`, in f64; NaN when any entry is NaN (candle's `max` skips a
/// NaN, which would hide an element a kernel never wrote).
pub fn max_entry(t: &Tensor) -> f64 {
    let all: Vec<f64> = t
        .flatten_all()
        .and_then(|d| d.to_dtype(DType::F64))
        .and_then(|d| d.to_vec1())
        .expect("a tensor");
    assert!(!all.is_empty(), "the largest entry of an empty tensor");
    all.into_iter().fold(f64::NEG_INFINITY, |m, v| {
        if v.is_nan() || m.is_nan() {
            f64::NAN
        } else {
            m.max(v)
        }
    })
}

/// `max |a - b|`, in f64: NaN (which fails every `< tolerance`) when either holds a NaN.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    max_entry(&(a - b).and_then(|d| d.abs()).expect("same shapes"))
}
