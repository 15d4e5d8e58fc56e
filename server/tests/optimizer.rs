//! AdamW against PyTorch goldens, and checkpoint round trips.

mod common;

use candle_core::{Device, Tensor};
use common::*;
use lathe_sdk::types::AdamParams;
use lathe_server::model::AdapterGrads;
use lathe_server::model::{Adapter, Arch, Backend, LoraSpec, Target};
use lathe_server::store::peft;
use lathe_server::train::adamw::{self, AdamState};
use lathe_server::train::forward_backward;

#[derive(serde::Deserialize)]
struct Golden {
    hyper: AdamParams,
    a0: Vec<f32>,
    b0: Vec<f32>,
    shape_a: Vec<usize>,
    shape_b: Vec<usize>,
    steps: Vec<GoldenStep>,
}

#[derive(serde::Deserialize)]
struct GoldenStep {
    grad_a: Vec<f32>,
    grad_b: Vec<f32>,
    pre_clip_norm: f64,
    a: Vec<f32>,
    b: Vec<f32>,
    exp_avg_a: Vec<f32>,
    exp_avg_sq_b: Vec<f32>,
}

fn close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-6 + 1e-5 * w.abs(),
            "{what}[{i}]: {g} vs torch {w}"
        );
    }
}

/// Replays scripts/reference/adamw_reference.py's two torch.optim.AdamW steps (weight
/// decay on; clipping active on step 1, inactive on step 2), as the CPU backend computes
/// them (one loop over buffers) and as the device backend does (candle's ops).
#[test]
fn adamw_matches_pytorch() {
    adamw_matches_pytorch_on(Backend::Cpu, &Device::Cpu);
    adamw_matches_pytorch_on(Backend::Device, &Device::Cpu);
}

/// The same goldens on a GPU (`cargo test --features cuda`, as `scripts/gpu-check` runs
/// it): Lathe's fused AdamW kernel and gradient norm. Without a GPU this test fails when
/// `LATHE_REQUIRE_GPU=1` and otherwise says it was skipped.
#[cfg(feature = "cuda")]
#[test]
fn adamw_on_a_gpu_matches_pytorch() {
    if let Some(device) = gpu() {
        adamw_matches_pytorch_on(Backend::Device, &device);
    }
}

fn adamw_matches_pytorch_on(backend: Backend, dev: &Device) {
    let golden: Golden = serde_json::from_str(include_str!("data/adamw_reference.json")).unwrap();
    let t = |v: &[f32], s: &[usize]| Tensor::from_vec(v.to_vec(), s, dev).unwrap();
    let target = Target::LmHead;
    let mut adapter = Adapter {
        spec: LoraSpec {
            rank: golden.shape_a[0],
            train_attn: false,
            train_mlp: false,
            train_unembed: true,
        },
        alpha: 1.0,
        pairs: [(
            target,
            lathe_server::model::lora::LoraPair {
                a: t(&golden.a0, &golden.shape_a),
                b: t(&golden.b0, &golden.shape_b),
            },
        )]
        .into(),
    };
    let mut state = AdamState::default();
    for (i, s) in golden.steps.iter().enumerate() {
        let mut grads = AdapterGrads::default();
        grads
            .accumulate(
                target,
                t(&s.grad_a, &golden.shape_a),
                t(&s.grad_b, &golden.shape_b),
            )
            .unwrap();
        let report = adamw::step(backend, &mut adapter, &mut state, &grads, &golden.hyper).unwrap();
        assert!(
            (report.grad_norm - s.pre_clip_norm).abs() < 1e-5 * s.pre_clip_norm,
            "step {i} norm"
        );
        assert_eq!(
            report.clipped,
            i == 0,
            "clipping should be active on step 1 only"
        );
        let pair = &adapter.pairs[&target];
        close(&pair.a.flatten_all().unwrap().to_vec1().unwrap(), &s.a, "a");
        close(&pair.b.flatten_all().unwrap().to_vec1().unwrap(), &s.b, "b");
        let (ma, mb) = &state.moments[&target];
        close(
            &ma.m.flatten_all().unwrap().to_vec1().unwrap(),
            &s.exp_avg_a,
            "exp_avg a",
        );
        close(
            &mb.v.flatten_all().unwrap().to_vec1().unwrap(),
            &s.exp_avg_sq_b,
            "exp_avg_sq b",
        );
    }
}

#[test]
fn bad_hyper_parameters_are_rejected() {
    for p in [
        AdamParams {
            learning_rate: f64::NAN,
            ..Default::default()
        },
        AdamParams {
            learning_rate: f64::INFINITY,
            ..Default::default()
        },
        AdamParams {
            beta1: 1.0,
            ..Default::default()
        },
        AdamParams {
            weight_decay: -1.0,
            ..Default::default()
        },
        // 0 / (0 + eps) on a fresh adapter's A: NaN.
        AdamParams {
            eps: 0.0,
            ..Default::default()
        },
        AdamParams {
            eps: 1e-46,
            ..Default::default()
        },
        // Finite in f64, infinite in the f32 update.
        AdamParams {
            learning_rate: 1e39,
            ..Default::default()
        },
    ] {
        assert!(adamw::validate(&p).is_err(), "{p:?}");
    }
}

fn train_step(
    model: &lathe_server::model::LoadedModel,
    adapter: &mut Adapter,
    state: &mut AdamState,
    seed: u64,
) -> f64 {
    let vocab = model.transformer.config.vocab_size;
    let jobs = [ce_job(seed, 10, vocab, 0)];
    let (res, mut grads) = forward_backward(&model.transformer, &[&*adapter], &jobs, true).unwrap();
    let p = AdamParams {
        learning_rate: 1e-2,
        weight_decay: 0.01,
        grad_clip_norm: 1.0,
        ..Default::default()
    };
    adamw::step(Backend::Cpu, adapter, state, &grads.remove(0), &p).unwrap();
    res[0].loss
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

#[test]
fn save_load_round_trips_bit_exactly_and_training_continues_identically() {
    let model = tiny(Arch::Qwen3);
    let cfg = &model.transformer.config;
    let mut adapter =
        Adapter::new(cfg, full_spec(4), 17, candle_core::DType::F32, &Device::Cpu).unwrap();
    let mut state = AdamState::default();
    for s in 0..3 {
        train_step(&model, &mut adapter, &mut state, s);
    }
    let dir = std::env::temp_dir().join(format!("lathe-ckpt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    peft::save_adapter(&dir, &adapter, "tiny").unwrap();
    peft::save_optimizer(&dir, &state).unwrap();
    let mut loaded = peft::load_adapter(&dir, cfg, &Device::Cpu).unwrap();
    let mut loaded_state = peft::load_optimizer(&dir, &Device::Cpu).unwrap();
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(config["r"], 4);
    assert_eq!(config["lora_alpha"], 32.0);
    assert_eq!(config["target_modules"].as_array().unwrap().len(), 8);
    std::fs::remove_dir_all(&dir).unwrap();

    assert_eq!(loaded.spec, adapter.spec);
    assert_eq!(loaded_state.step, 3);
    for (t, p) in &adapter.pairs {
        assert_eq!(bits(&p.a), bits(&loaded.pairs[t].a));
        assert_eq!(bits(&p.b), bits(&loaded.pairs[t].b));
        let (ma, mb) = &state.moments[t];
        let (la, lb) = &loaded_state.moments[t];
        assert_eq!(bits(&ma.m), bits(&la.m));
        assert_eq!(bits(&mb.v), bits(&lb.v));
    }
    for s in 3..5 {
        let l1 = train_step(&model, &mut adapter, &mut state, s);
        let l2 = train_step(&model, &mut loaded, &mut loaded_state, s);
        assert_eq!(
            l1.to_bits(),
            l2.to_bits(),
            "loss after resuming differs at step {s}"
        );
    }
    for (t, p) in &adapter.pairs {
        assert_eq!(bits(&p.b), bits(&loaded.pairs[t].b));
    }
}

#[test]
fn loading_a_checkpoint_for_another_model_fails_clearly() {
    let small = tiny(Arch::Llama);
    let other = tiny(Arch::Qwen3);
    let adapter = Adapter::new(
        &small.transformer.config,
        full_spec(2),
        1,
        candle_core::DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let dir = std::env::temp_dir().join(format!("lathe-ckpt-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    peft::save_adapter(&dir, &adapter, "tiny").unwrap();
    // Same shapes but the Qwen3 tiny model has an untied head: the tensors still match, so
    // break the config instead.
    let mut cfg = other.transformer.config.clone();
    cfg.hidden_size = 64;
    let err = peft::load_adapter(&dir, &cfg, &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(err.contains("expected shape"), "{err}");
    assert!(peft::load_optimizer(&dir, &Device::Cpu).is_err());
    std::fs::remove_dir_all(&dir).unwrap();
}
