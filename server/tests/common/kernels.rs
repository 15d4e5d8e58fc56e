//! Comparison helpers of the kernel tests (`cuda_kernels.rs`, `cuda_decode.rs`): seeded
//! f64 inputs on the CPU, their f32 copies on a device, and the relative error of a
//! device result against an f64 reference.

use candle_core::{DType, Device, Tensor};
use rand::{rngs::StdRng, Rng, SeedableRng};

use super::max_abs_diff;

/// Values uniform in `(-bound, bound)`, f64 on the CPU, deterministic in `seed`.
pub fn uniform(shape: &[usize], bound: f64, seed: u64) -> Tensor {
    let mut rng = StdRng::seed_from_u64(seed);
    let n = shape.iter().product();
    let v: Vec<f64> = (0..n).map(|_| rng.random_range(-bound..bound)).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// `t` in f32 on `dev`.
pub fn on(t: &Tensor, dev: &Device) -> Tensor {
    t.to_dtype(DType::F32).unwrap().to_device(dev).unwrap()
}

/// `max|got - want| / max(1, max|want|)`, with `got` brought back from the GPU.
pub fn rel(got: &Tensor, want: &Tensor) -> f64 {
    let got = got
        .to_device(&Device::Cpu)
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap();
    assert_eq!(got.dims(), want.dims());
    let scale = max_abs_diff(want, &want.zeros_like().unwrap());
    max_abs_diff(&got, want) / scale.max(1.0)
}

/// The kernels' tolerance against an f64 composite.
pub const TOL: f64 = 2e-5;
