//! The device backend (candle's ops only: what a GPU runs), run on candle's CPU device,
//! against the CPU fast paths (fused kernels, gemm with in-place LoRA deltas, the host
//! KV cache and decode step): training and sampling give the same numbers, f32 to 1e-5
//! and f64 to 1e-10.

mod common;

use candle_core::DType;
use common::*;
use lathe_server::model::{Adapter, Arch, Backend, LoadedModel, LoraSpec, Precision, Transformer};
use lathe_server::sample::{sample, DecodeMode, Picker, SampleJob, SampleOutput};
use lathe_server::train::{forward_backward, DatumJob, DatumResult};

/// The tiny `arch` model in `dtype` on `backend`, and two adapters with random B (one
/// on every projection and the head, one on attention only) in `dtype`.
fn model_on(arch: Arch, dtype: DType, backend: Backend) -> (LoadedModel, [Adapter; 2]) {
    let model32 = tiny(arch);
    let attn_only = LoraSpec {
        rank: 2,
        train_attn: true,
        train_mlp: false,
        train_unembed: false,
    };
    let adapters = [(full_spec(4), 31), (attn_only, 32)].map(|(spec, seed)| {
        random_adapter(&model32, spec, seed)
            .to_dtype(dtype)
            .unwrap()
    });
    let mut transformer = model32.transformer.to_dtype(dtype).unwrap();
    transformer.set_backend(backend).unwrap();
    assert_eq!(transformer.backend(), backend);
    (
        LoadedModel {
            transformer,
            ..model32
        },
        adapters,
    )
}

/// Datums of mixed lengths, interleaved between the two adapters; the last has two
/// targets per position.
fn jobs(vocab: usize) -> Vec<DatumJob> {
    let mut jobs = vec![
        ce_job(1, 10, vocab, 0),
        ce_job(2, 6, vocab, 1),
        ce_job(3, 17, vocab, 0),
        ce_job(4, 5, vocab, 1),
        ce_job(5, 3, vocab, 0),
    ];
    let wide = &mut jobs[4];
    wide.k = 2;
    wide.targets = wide
        .targets
        .iter()
        .flat_map(|&t| [t, (t + 1) % vocab as u32])
        .collect();
    wide.inputs.weights = wide.inputs.weights.iter().flat_map(|&w| [w, w]).collect();
    jobs
}

fn train(model: &Transformer, adapters: &[Adapter; 2], jobs: &[DatumJob]) -> TrainRun {
    let refs: Vec<&Adapter> = adapters.iter().collect();
    forward_backward(model, &refs, jobs, true).unwrap()
}

type TrainRun = (Vec<DatumResult>, Vec<lathe_server::model::AdapterGrads>);

/// Losses and log-probabilities agree to 1e-5 in f32 and 1e-10 in f64 (relative, where
/// larger than 1). Gradients agree to 1e-10 in f64; in f32 a block's LoRA gradient is
/// the end of a chain of f32 products summed in different orders by the two backends
/// (gemm's blocking against candle's matmul, fused against composite reductions), and
/// each backend is within 1e-5 of the f64 gradients of the same datums, so the two are
/// held within 2e-5 of each other and each within 1.5e-5 of f64 (`max|a - b| / max|b|`).
#[test]
fn the_device_backend_trains_like_the_cpu_fast_path() {
    for (dtype, tol) in [(DType::F64, 1e-10), (DType::F32, 1e-5)] {
        for arch in [Arch::Llama, Arch::Qwen2, Arch::Qwen3] {
            let what = format!("{arch:?} {dtype:?}");
            let (fast, adapters) = model_on(arch, dtype, Backend::Cpu);
            let (device, _) = model_on(arch, dtype, Backend::Device);
            let jobs = jobs(fast.transformer.config.vocab_size);
            let (want_out, want_grads) = train(&fast.transformer, &adapters, &jobs);
            let (got_out, got_grads) = train(&device.transformer, &adapters, &jobs);
            for (w, g) in want_out.iter().zip(&got_out) {
                assert!(
                    (w.loss - g.loss).abs() <= tol * w.loss.abs().max(1.0),
                    "{what}: loss {} vs {}",
                    w.loss,
                    g.loss
                );
                assert_close(&what, &w.logprobs, &g.logprobs, tol.max(1e-6));
            }
            let (between, from_f64) = match dtype {
                DType::F64 => (tol, None),
                _ => {
                    let (reference, f64_adapters) = model_on(arch, DType::F64, Backend::Device);
                    let (_, f64_grads) = train(&reference.transformer, &f64_adapters, &jobs);
                    (2e-5, Some(f64_grads))
                }
            };
            for (i, (w, g)) in want_grads.iter().zip(&got_grads).enumerate() {
                assert!(!w.pairs.is_empty(), "{what}: no gradients to compare");
                assert_eq!(w.pairs.len(), g.pairs.len(), "{what}: targets");
                for (t, (wa, wb)) in &w.pairs {
                    let (ga, gb) = &g.pairs[t];
                    for (name, got, want) in [("dA", ga, wa), ("dB", gb, wb)] {
                        let d = rel_diff(got, want);
                        assert!(d <= between, "{what} {t:?} {name} differs by {d}");
                    }
                    let Some(f64_grads) = &from_f64 else { continue };
                    let (ra, rb) = &f64_grads[i].pairs[t];
                    for (name, reference, ours) in [("dA", ra, [wa, ga]), ("dB", rb, [wb, gb])] {
                        for (backend, x) in ["cpu", "device"].iter().zip(ours) {
                            let d = rel_diff(&x.to_dtype(DType::F64).unwrap(), reference);
                            assert!(d <= 1.5e-5, "{what} {t:?} {name} {backend} vs f64: {d}");
                        }
                    }
                }
            }
        }
    }
}

/// Prompts on the base model and on each adapter: greedy decodes with their prompts'
/// log-probabilities and top tokens, and a seeded hot one.
fn sample_jobs(vocab: usize) -> Vec<SampleJob> {
    let job = |seed: u64, len: usize, adapter: Option<usize>, temperature: f64| SampleJob {
        prompt: tokens(seed, len, vocab),
        adapter,
        num_samples: if temperature > 0.0 { 3 } else { 1 },
        picker: Picker {
            temperature,
            ..Default::default()
        },
        max_tokens: 10,
        stop_strings: vec![],
        stop_tokens: vec![],
        seed: Some(seed),
        prompt_logprobs: true,
        topk_prompt_logprobs: 3,
    };
    vec![
        job(11, 7, None, 0.0),
        job(12, 4, Some(0), 0.0),
        job(13, 12, Some(1), 0.0),
        job(14, 5, Some(0), 0.7),
    ]
}

fn run_samples(
    model: &LoadedModel,
    adapters: &[Adapter; 2],
    mode: DecodeMode,
) -> Vec<SampleOutput> {
    let refs: Vec<&Adapter> = adapters.iter().collect();
    let jobs = sample_jobs(model.transformer.config.vocab_size);
    sample(&model.transformer, &model.tokenizer, &refs, &jobs, mode).unwrap()
}

fn assert_close(what: &str, want: &[f32], got: &[f32], tol: f64) {
    assert_eq!(want.len(), got.len(), "{what}: lengths");
    for (x, y) in want.iter().zip(got) {
        let d = (f64::from(*x) - f64::from(*y)).abs();
        assert!(d <= tol * f64::from(x.abs()).max(1.0), "{what}: {x} vs {y}");
    }
}

#[test]
fn the_device_backend_samples_like_the_cpu_fast_path() {
    // Sampled log-probabilities are reported in f32 whatever the model's dtype.
    for (dtype, tol) in [(DType::F64, 1e-6), (DType::F32, 1e-5)] {
        for arch in [Arch::Llama, Arch::Qwen2, Arch::Qwen3] {
            let what = format!("{arch:?} {dtype:?}");
            let (fast, adapters) = model_on(arch, dtype, Backend::Cpu);
            let (device, _) = model_on(arch, dtype, Backend::Device);
            let want = run_samples(&fast, &adapters, DecodeMode::Exact);
            let got = run_samples(&device, &adapters, DecodeMode::Exact);
            // Fast mode's block-quantized weights belong to the CPU backend: the device
            // backend decodes with its own weights either way.
            let got_fast_mode = run_samples(&device, &adapters, DecodeMode::Fast);
            assert_eq!(
                got, got_fast_mode,
                "{what}: fast mode on the device backend"
            );
            for (j, (w, g)) in want.iter().zip(&got).enumerate() {
                let what = format!("{what} job {j}");
                assert_eq!(w.sequences.len(), g.sequences.len(), "{what}");
                for (ws, gs) in w.sequences.iter().zip(&g.sequences) {
                    assert_eq!(ws.tokens, gs.tokens, "{what}: sampled tokens");
                    assert_eq!(ws.stop, gs.stop, "{what}: stop");
                    assert_close(&what, &ws.logprobs, &gs.logprobs, tol);
                }
                let flat = |o: &SampleOutput| -> Vec<f32> {
                    let lp = o.prompt_logprobs.as_ref().expect("asked for");
                    lp.iter().flatten().copied().collect()
                };
                assert_close(&format!("{what} prompt"), &flat(w), &flat(g), tol);
                let top = |o: &SampleOutput| -> (Vec<u32>, Vec<f32>) {
                    let rows = o.topk_prompt_logprobs.as_ref().expect("asked for");
                    rows.iter().flatten().flatten().copied().unzip()
                };
                let ((wt, wl), (gt, gl)) = (top(w), top(g));
                assert_eq!(wt, gt, "{what}: top prompt tokens");
                assert_close(&format!("{what} top"), &wl, &gl, tol);
            }
        }
    }
}

#[test]
fn bf16_products_belong_to_the_cpu_backend() {
    let (mut model, _) = model_on(Arch::Llama, DType::F32, Backend::Device);
    let err = model
        .transformer
        .set_precision(Precision::Bf16)
        .unwrap_err()
        .to_string();
    assert!(err.contains("CPU backend"), "{err}");
    // Choosing the device backend drops bf16 products a model had.
    let (mut model, _) = model_on(Arch::Llama, DType::F32, Backend::Cpu);
    let _ = model.transformer.set_precision(Precision::Bf16).unwrap();
    model.transformer.set_backend(Backend::Device).unwrap();
    assert_eq!(model.transformer.precision(), Precision::F32);
}
