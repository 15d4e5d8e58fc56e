//! Helpers shared by the integration tests: tiny models, adapters with non-zero B,
//! datum builders and sampling jobs.
#![allow(dead_code)]

pub mod http;
pub mod kernels;

use candle_core::{DType, Device, Tensor};
use lathe_server::model::tiny::tiny_model;
use lathe_server::model::{Adapter, Arch, Backend, LoadedModel, LoraSpec};
use lathe_server::sample::{Picker, SampleJob};
use lathe_server::train::{DatumJob, Loss, TokenInputs};
use rand::{rngs::StdRng, Rng, SeedableRng};

/// The first GPU for the tests that need one (`cargo test --features cuda`, as
/// `scripts/gpu-check` runs them), or `None`, and the test is skipped with a word on
/// stderr, when there is none; with `LATHE_REQUIRE_GPU=1` a missing GPU fails the test.
#[cfg(feature = "cuda")]
pub fn gpu() -> Option<Device> {
    match lathe_server::model::DeviceSpec::Cuda(0).open() {
        Ok(device) => Some(device),
        Err(e) if std::env::var("LATHE_REQUIRE_GPU").as_deref() == Ok("1") => panic!("{e}"),
        Err(e) => {
            eprintln!("skipped: {e}");
            None
        }
    }
}

/// The tiny `arch` model, on the backend `LATHE_TEST_BACKEND` names (`cpu`, the default,
/// or `device`: candle's ops on candle's CPU device, what a GPU runs), so that the same
/// tests hold both backends to their references.
pub fn tiny(arch: Arch) -> LoadedModel {
    let mut model = tiny_model(arch, 1234, &Device::Cpu).expect("tiny model");
    model.transformer.set_backend(test_backend()).unwrap();
    model
}

/// The backend `LATHE_TEST_BACKEND` asks for.
pub fn test_backend() -> Backend {
    match std::env::var("LATHE_TEST_BACKEND").as_deref() {
        Ok("device") => Backend::Device,
        Ok("cpu") | Err(_) => Backend::Cpu,
        Ok(other) => panic!("LATHE_TEST_BACKEND={other}: expected cpu or device"),
    }
}

pub fn full_spec(rank: usize) -> LoraSpec {
    LoraSpec {
        rank,
        train_attn: true,
        train_mlp: true,
        train_unembed: true,
    }
}

/// An adapter whose B factors are random too, so every gradient is non-trivial.
pub fn random_adapter(model: &LoadedModel, spec: LoraSpec, seed: u64) -> Adapter {
    let cfg = &model.transformer.config;
    let mut a = Adapter::new(cfg, spec, seed, DType::F32, &Device::Cpu).unwrap();
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed);
    for pair in a.pairs.values_mut() {
        let dims = pair.b.dims().to_vec();
        let n = dims.iter().product::<usize>();
        let v: Vec<f32> = (0..n).map(|_| rng.random_range(-0.3..0.3)).collect();
        pair.b = Tensor::from_vec(v, dims, &Device::Cpu).unwrap();
    }
    a
}

/// Deterministic pseudo-random tokens below `vocab`.
pub fn tokens(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(0..vocab as u32)).collect()
}

/// A cross-entropy datum on random tokens with random weights in [0, 1).
pub fn ce_job(seed: u64, n: usize, vocab: usize, adapter: usize) -> DatumJob {
    let toks = tokens(seed, n + 1, vocab);
    let mut rng = StdRng::seed_from_u64(seed + 99);
    DatumJob {
        tokens: toks[..n].to_vec(),
        targets: toks[1..].to_vec(),
        k: 1,
        adapter,
        loss: Loss::CrossEntropy,
        inputs: TokenInputs {
            weights: (0..n).map(|_| rng.random_range(0.0..1.0)).collect(),
            ..Default::default()
        },
    }
}

pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}

/// `max|a - b| / max|b|`: float error relative to the tensor's scale.
pub fn rel_diff(a: &Tensor, b: &Tensor) -> f64 {
    let scale = b
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap();
    max_abs_diff(a, b) / scale.max(1e-30)
}

/// A sampling job of `n` samples of up to 12 tokens, seeded, with default picking and
/// no stops or prompt logprobs.
pub fn sample_job(prompt: Vec<u32>, adapter: Option<usize>, n: usize, seed: u64) -> SampleJob {
    SampleJob {
        prompt,
        adapter,
        num_samples: n,
        picker: Picker::default(),
        max_tokens: 12,
        stop_strings: vec![],
        stop_tokens: vec![],
        seed: Some(seed),
        prompt_logprobs: false,
        topk_prompt_logprobs: 0,
    }
}
