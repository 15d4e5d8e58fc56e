//! The hand-written backward pass against independent references: every trainable
//! tensor gets a gradient, gradients equal central finite differences in f64, and a
//! mixed-adapter batch equals separate runs.

mod common;

use candle_core::{DType, Device, Tensor};
use common::*;
use lathe_server::model::{Adapter, AdapterGrads, Arch, LoadedModel, LoraSpec, Proj, Target};
use lathe_server::train::{
    forward_backward, forward_backward_in_passes, DatumJob, DatumResult, Loss, TokenInputs,
};

fn grads_of(model: &LoadedModel, adapters: &[&Adapter], jobs: &[DatumJob]) -> Vec<AdapterGrads> {
    forward_backward(&model.transformer, adapters, jobs, true)
        .unwrap()
        .1
}

#[test]
fn every_trainable_tensor_gets_a_nonzero_gradient() {
    for arch in [Arch::Llama, Arch::Qwen2, Arch::Qwen3] {
        let model = tiny(arch);
        let vocab = model.transformer.config.vocab_size;
        let adapter = random_adapter(&model, full_spec(4), 1);
        let jobs = [ce_job(1, 12, vocab, 0), ce_job(2, 7, vocab, 0)];
        let grads = grads_of(&model, &[&adapter], &jobs);
        assert_eq!(
            grads[0].pairs.len(),
            adapter.pairs.len(),
            "{arch:?}: a target got no gradient"
        );
        for (target, (da, db)) in &grads[0].pairs {
            for (name, g) in [("A", da), ("B", db)] {
                let norm = g
                    .sqr()
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap();
                assert!(
                    norm > 0.0 && norm.is_finite(),
                    "{arch:?} {target:?} d{name} norm {norm}"
                );
            }
        }
    }
}

/// Sum of `-w * lp` over the jobs, in f64.
fn loss_f64(model: &LoadedModel, adapter: &Adapter, jobs: &[DatumJob]) -> f64 {
    let (res, _) = forward_backward(&model.transformer, &[adapter], jobs, false).unwrap();
    res.iter().map(|r| r.loss).sum()
}

fn entry(t: &Tensor, idx: usize) -> f64 {
    t.flatten_all()
        .unwrap()
        .get(idx)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}

fn with_entry(t: &Tensor, idx: usize, delta: f64) -> Tensor {
    let mut v: Vec<f64> = t.flatten_all().unwrap().to_vec1().unwrap();
    v[idx] += delta;
    Tensor::from_vec(v, t.dims(), &Device::Cpu).unwrap()
}

#[test]
fn lora_gradients_match_central_finite_differences_in_f64() {
    for arch in [Arch::Llama, Arch::Qwen3] {
        let model32 = tiny(arch);
        let vocab = model32.transformer.config.vocab_size;
        let adapter = random_adapter(&model32, full_spec(3), 7)
            .to_dtype(DType::F64)
            .unwrap();
        let model = LoadedModel {
            transformer: model32.transformer.to_dtype(DType::F64).unwrap(),
            ..model32
        };
        let jobs = [ce_job(11, 9, vocab, 0), ce_job(12, 5, vocab, 0)];
        let grads = grads_of(&model, &[&adapter], &jobs);
        let targets = [
            Target::Layer(0, Proj::Q),
            Target::Layer(1, Proj::K),
            Target::Layer(0, Proj::V),
            Target::Layer(1, Proj::O),
            Target::Layer(0, Proj::Gate),
            Target::Layer(1, Proj::Up),
            Target::Layer(0, Proj::Down),
            Target::LmHead,
        ];
        let eps = 1e-5;
        for target in targets {
            let (da, db) = &grads[0].pairs[&target];
            for (which, grad) in [("A", da), ("B", db)] {
                let values: Vec<f64> = grad.flatten_all().unwrap().to_vec1().unwrap();
                let gmax = values.iter().fold(0f64, |m, v| m.max(v.abs()));
                let argmax = values.iter().position(|v| v.abs() == gmax).unwrap();
                // Entries whose gradient is tiny next to the tensor's largest are checked
                // against that scale: there the finite difference is mostly rounding.
                for idx in [argmax, 0, values.len() / 2, values.len() - 1] {
                    let perturbed = |d: f64| {
                        let mut a = adapter.clone();
                        let p = a.pairs.get_mut(&target).unwrap();
                        if which == "A" {
                            p.a = with_entry(&p.a, idx, d);
                        } else {
                            p.b = with_entry(&p.b, idx, d);
                        }
                        loss_f64(&model, &a, &jobs)
                    };
                    let fd = (perturbed(eps) - perturbed(-eps)) / (2.0 * eps);
                    let an = entry(grad, idx);
                    let rel = (an - fd).abs() / an.abs().max(fd.abs()).max(1e-3 * gmax);
                    assert!(
                        rel < 1e-4,
                        "{arch:?} {target:?} d{which}[{idx}]: analytic {an:e} vs finite difference {fd:e} (rel {rel:e})"
                    );
                }
            }
        }
    }
}

#[test]
fn rl_loss_gradients_flow_through_the_model_like_finite_differences() {
    let model32 = tiny(Arch::Llama);
    let vocab = model32.transformer.config.vocab_size;
    let adapter = random_adapter(&model32, full_spec(2), 3)
        .to_dtype(DType::F64)
        .unwrap();
    let model = LoadedModel {
        transformer: model32.transformer.to_dtype(DType::F64).unwrap(),
        ..model32
    };
    let base = ce_job(5, 8, vocab, 0);
    let job = DatumJob {
        loss: Loss::Ppo {
            clip_low: 0.8,
            clip_high: 1.2,
        },
        inputs: TokenInputs {
            advantages: vec![1.0, -0.5, 2.0, 0.3, -1.0, 0.7, 1.5, -2.0],
            // Sampler log-probs near the model's, some ratios inside and some outside.
            sampler_logprobs: vec![-5.5, -5.6, -5.4, -5.7, -5.3, -5.5, -5.6, -5.5],
            ..Default::default()
        },
        ..base
    };
    let jobs = [job];
    let grads = grads_of(&model, &[&adapter], &jobs);
    let target = Target::Layer(1, Proj::Down);
    let (_, db) = &grads[0].pairs[&target];
    for idx in [0usize, 3] {
        let eps = 1e-6;
        let f = |d: f64| {
            let mut a = adapter.clone();
            let p = a.pairs.get_mut(&target).unwrap();
            p.b = with_entry(&p.b, idx, d);
            loss_f64(&model, &a, &jobs)
        };
        let fd = (f(eps) - f(-eps)) / (2.0 * eps);
        let an = entry(db, idx);
        assert!(
            (an - fd).abs() / an.abs().max(fd.abs()).max(1e-8) < 1e-4,
            "{an} vs {fd}"
        );
    }
}

/// In f64 the batched and separate runs agree to rounding (1e-10): the batching logic is
/// exact. In f32 they differ by accumulation order only (different matmul shapes).
#[test]
fn mixed_adapter_batch_equals_separate_runs() {
    for (dtype, tol) in [(DType::F64, 1e-10), (DType::F32, 1e-4)] {
        for arch in [Arch::Llama, Arch::Qwen3] {
            mixed_equals_separate(arch, dtype, tol);
        }
    }
}

/// A tiny `arch` model and two random adapters on it (spec and seed each), all in
/// `dtype`.
fn tiny_with_adapters(
    arch: Arch,
    dtype: DType,
    specs: [(LoraSpec, u64); 2],
) -> (LoadedModel, Adapter, Adapter) {
    let model32 = tiny(arch);
    let [a, b] = specs.map(|(spec, seed)| {
        random_adapter(&model32, spec, seed)
            .to_dtype(dtype)
            .unwrap()
    });
    let model = LoadedModel {
        transformer: model32.transformer.to_dtype(dtype).unwrap(),
        ..model32
    };
    (model, a, b)
}

fn mixed_equals_separate(arch: Arch, dtype: DType, tol: f64) {
    let attn_only = LoraSpec {
        rank: 2,
        train_attn: true,
        train_mlp: false,
        train_unembed: false,
    };
    let (model, a, b) = tiny_with_adapters(arch, dtype, [(full_spec(4), 21), (attn_only, 22)]);
    let vocab = model.transformer.config.vocab_size;
    // Interleaved on purpose: the batch must regroup rows by adapter.
    let jobs = vec![
        ce_job(1, 10, vocab, 0),
        ce_job(2, 6, vocab, 1),
        ce_job(3, 8, vocab, 0),
        ce_job(4, 5, vocab, 1),
    ];
    let (mixed_out, mixed_grads) =
        forward_backward(&model.transformer, &[&a, &b], &jobs, true).unwrap();
    for (ai, adapter) in [&a, &b].into_iter().enumerate() {
        let own = own_jobs(&jobs, ai);
        let (alone_out, alone_grads) =
            forward_backward(&model.transformer, &[adapter], &own, true).unwrap();
        let mixed_for_adapter: Vec<_> = jobs
            .iter()
            .zip(&mixed_out)
            .filter(|(j, _)| j.adapter == ai)
            .collect();
        for ((_, m), s) in mixed_for_adapter.iter().zip(&alone_out) {
            for (x, y) in m.logprobs.iter().zip(&s.logprobs) {
                assert!(
                    (x - y).abs() < 1e-5 * x.abs().max(1.0),
                    "{arch:?} logprob {x} vs {y}"
                );
            }
        }
        assert_grads_close(&mixed_grads[ai], &alone_grads[0], tol, &format!("{arch:?}"));
    }
}

/// The datums of adapter `ai`, as a batch of their own (adapter 0).
fn own_jobs(jobs: &[DatumJob], ai: usize) -> Vec<DatumJob> {
    jobs.iter()
        .filter(|j| j.adapter == ai)
        .map(|j| DatumJob {
            adapter: 0,
            ..j.clone()
        })
        .collect()
}

/// Both gradients cover the same targets, every dA and dB within `tol` (relative).
fn assert_grads_close(got: &AdapterGrads, want: &AdapterGrads, tol: f64, what: &str) {
    assert_eq!(got.pairs.len(), want.pairs.len(), "{what}: targets");
    for (t, (da, db)) in &got.pairs {
        let (wa, wb) = &want.pairs[t];
        for (name, g, w) in [("dA", da, wa), ("dB", db, wb)] {
            let d = rel_diff(g, w);
            assert!(d < tol, "{what} {t:?} {name} differs by {d}");
        }
    }
}

/// Five datums of mixed lengths, interleaved between adapters 0 and 1.
fn five_mixed_jobs(vocab: usize) -> Vec<DatumJob> {
    vec![
        ce_job(1, 10, vocab, 0),
        ce_job(2, 6, vocab, 1),
        ce_job(3, 8, vocab, 0),
        ce_job(4, 5, vocab, 1),
        ce_job(5, 3, vocab, 0),
    ]
}

/// Two runs of the same batch agree: every datum's loss within `tol` (relative) and
/// logprobs within 1e-5, every adapter's gradient within `tol`.
fn assert_runs_close(
    want: &(Vec<DatumResult>, Vec<AdapterGrads>),
    got: &(Vec<DatumResult>, Vec<AdapterGrads>),
    tol: f64,
    what: &str,
) {
    for (w, g) in want.0.iter().zip(&got.0) {
        assert!(
            (w.loss - g.loss).abs() < tol * w.loss.abs().max(1.0),
            "{what}"
        );
        for (x, y) in w.logprobs.iter().zip(&g.logprobs) {
            assert!(
                (x - y).abs() < 1e-5 * x.abs().max(1.0),
                "{what}: {x} vs {y}"
            );
        }
    }
    for (w, g) in want.1.iter().zip(&got.1) {
        assert_grads_close(g, w, tol, what);
    }
}

/// On a pool of several threads a pass runs as parts of whole datums side by side. The
/// per-datum results and summed gradients equal one thread's single pass (to rounding
/// in f64; f32 differs in product shapes and summation order only), and a pass gives
/// the same bits every time on the same pool, whichever thread ran which part.
#[test]
fn a_pass_split_across_threads_equals_one_thread() {
    let pool = |n| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build()
            .unwrap()
    };
    let (one, three) = (pool(1), pool(3));
    for (dtype, tol) in [(DType::F64, 1e-10), (DType::F32, 1e-4)] {
        let (model, a, b) =
            tiny_with_adapters(Arch::Qwen3, dtype, [(full_spec(4), 41), (full_spec(2), 42)]);
        let jobs = five_mixed_jobs(model.transformer.config.vocab_size);
        let adapters = [&a, &b];
        let run = |p: &rayon::ThreadPool| {
            p.install(|| forward_backward(&model.transformer, &adapters, &jobs, true).unwrap())
        };
        let serial = run(&one);
        let (split_out, split_grads) = run(&three);
        let split = (split_out.clone(), split_grads.clone());
        assert_runs_close(&serial, &split, tol, &format!("{dtype:?}"));
        for _ in 0..3 {
            let (again_out, again_grads) = run(&three);
            assert_eq!(again_out, split_out, "{dtype:?}: results vary between runs");
            for (g, h) in again_grads.iter().zip(&split_grads) {
                for (t, (da, db)) in &g.pairs {
                    let (ha, hb) = &h.pairs[t];
                    assert_eq!(rel_diff(da, ha), 0.0, "{dtype:?} {t:?} dA varies");
                    assert_eq!(rel_diff(db, hb), 0.0, "{dtype:?} {t:?} dB varies");
                }
            }
        }
    }
}

/// An adapter's results and gradient do not depend, to the last bit, on which other
/// adapters' datums share its batch, nor on where the batch's passes fall: its datums
/// are cut into units by their own lengths, each unit's gradient is computed apart, and
/// the units' gradients are added in order. A resumed run replays a session's steps
/// beside different neighbours, and must train to the same weights.
#[test]
fn an_adapters_gradient_is_the_same_bits_whatever_shares_its_batch() {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    let (model, a, b) = tiny_with_adapters(
        Arch::Qwen3,
        DType::F32,
        [(full_spec(4), 51), (full_spec(2), 52)],
    );
    let vocab = model.transformer.config.vocab_size;
    let run = |adapters: &[&Adapter], jobs: &[DatumJob], budget: usize| {
        pool.install(|| {
            forward_backward_in_passes(&model.transformer, adapters, jobs, true, budget).unwrap()
        })
    };
    // Datums long enough to be cut into several units, and one of a few rows, which
    // alone makes a pass short enough for the few-rows kernels that decoding uses. (Not
    // fewer than 9 rows: the `gemm` crate sums products of at most 256 outputs in another
    // order, which this model's 32-wide projections reach below that; a real model's are
    // 256 wide or more. `cpu::gemm`'s own test holds one row against many.)
    let mine: [&[(u64, usize)]; 2] = [&[(1, 40), (2, 50), (3, 45)], &[(8, 9)]];
    for (own, budget) in mine.into_iter().flat_map(|m| [(m, 64), (m, 1024)]) {
        let own: Vec<DatumJob> = own
            .iter()
            .map(|&(seed, n)| ce_job(seed, n, vocab, 0))
            .collect();
        let alone = run(&[&a], &own, budget);
        let neighbours: [&[(u64, usize)]; 3] = [
            &[(4, 30)],
            &[(4, 30), (5, 40)],
            &[(6, 17), (4, 30), (5, 40), (7, 33)],
        ];
        for theirs in neighbours {
            // The neighbour is adapter 0, so its datums come first in the batch and
            // shift where the passes and the threads' parts fall.
            let mut jobs: Vec<DatumJob> = theirs
                .iter()
                .map(|&(seed, n)| ce_job(seed, n, vocab, 0))
                .collect();
            jobs.extend(own.iter().map(|j| DatumJob {
                adapter: 1,
                ..j.clone()
            }));
            let mixed = run(&[&b, &a], &jobs, budget);
            let what = format!("budget {budget}, beside {theirs:?}");
            assert_eq!(
                &mixed.results[theirs.len()..],
                &alone.results[..],
                "{what}: results"
            );
            for (t, (da, db)) in &alone.grads[0].pairs {
                let (ma, mb) = &mixed.grads[1].pairs[t];
                assert_eq!(rel_diff(ma, da), 0.0, "{what}: {t:?} dA");
                assert_eq!(rel_diff(mb, db), 0.0, "{what}: {t:?} dB");
            }
        }
    }
}

/// A batch cut into passes (a datum or two each) gives the same per-datum results and
/// summed gradients as one pass: exactly up to rounding in f64.
#[test]
fn a_batch_run_in_passes_equals_one_pass() {
    for (dtype, tol) in [(DType::F64, 1e-10), (DType::F32, 1e-4)] {
        let (model, a, b) =
            tiny_with_adapters(Arch::Llama, dtype, [(full_spec(4), 31), (full_spec(2), 32)]);
        let jobs = five_mixed_jobs(model.transformer.config.vocab_size);
        let adapters = [&a, &b];
        let whole =
            forward_backward_in_passes(&model.transformer, &adapters, &jobs, true, usize::MAX)
                .unwrap();
        // 12 tokens a pass: datums in adapter order (10, 8, 3 tokens for adapter 0, then
        // 6 and 5 for adapter 1) make three passes: [10], [8, 3], [6, 5].
        let cut =
            forward_backward_in_passes(&model.transformer, &adapters, &jobs, true, 12).unwrap();
        assert_runs_close(
            &(whole.results, whole.grads),
            &(cut.results, cut.grads),
            tol,
            &format!("{dtype:?}"),
        );
    }
}

#[test]
fn fresh_adapter_with_zero_b_gives_exactly_the_base_logprobs() {
    let model = tiny(Arch::Qwen3);
    let vocab = model.transformer.config.vocab_size;
    let fresh = Adapter::new(
        &model.transformer.config,
        full_spec(8),
        5,
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let job = ce_job(9, 16, vocab, 0);
    let (with_lora, _) = forward_backward(
        &model.transformer,
        &[&fresh],
        std::slice::from_ref(&job),
        false,
    )
    .unwrap();
    // The same tokens through the base model alone (no adapter on any row).
    let batch =
        lathe_server::model::PackedBatch::new(&[(&job.tokens, None, 0)], &Device::Cpu).unwrap();
    let targets =
        Tensor::from_vec(job.targets.clone(), (job.targets.len(), 1), &Device::Cpu).unwrap();
    let (base, _) = model
        .transformer
        .forward_logprobs(&batch, &[], &targets, false)
        .unwrap();
    let base: Vec<f32> = base.flatten_all().unwrap().to_vec1().unwrap();
    assert_eq!(with_lora[0].logprobs, base);
}

#[test]
fn gradients_accumulate_across_calls() {
    let model = tiny(Arch::Llama);
    let vocab = model.transformer.config.vocab_size;
    let a = random_adapter(&model, full_spec(2), 4);
    let j1 = ce_job(31, 6, vocab, 0);
    let j2 = ce_job(32, 9, vocab, 0);
    let both = grads_of(&model, &[&a], &[j1.clone(), j2.clone()]);
    let mut acc = grads_of(&model, &[&a], &[j1]).remove(0);
    acc.merge(grads_of(&model, &[&a], &[j2]).remove(0)).unwrap();
    for (t, (da, db)) in &both[0].pairs {
        let (xa, xb) = &acc.pairs[t];
        assert!(rel_diff(da, xa) < 1e-5 && rel_diff(db, xb) < 1e-5, "{t:?}");
    }
}

/// A custom loss `-(logprobs ** 2).sum()` when `scalar`, and one whose value is not a
/// 0-d tensor (it fails on every datum) otherwise.
fn custom_loss(scalar: bool) -> lathe_server::train::CustomLossRef {
    use lathe_server::train::custom::CustomLoss;
    let call = |name: &str, target: &str, args: serde_json::Value| {
        serde_json::json!({"op": "call_function", "name": name, "target": target,
                           "args": args, "kwargs": {}})
    };
    let last = if scalar { "neg" } else { "sq" };
    let graph = serde_json::json!({"format": 1, "nodes": [
        {"op": "placeholder", "name": "logprobs", "target": "logprobs", "args": [], "kwargs": {}},
        call("sq", "operator.mul", serde_json::json!([{"ref": "logprobs"}, {"ref": "logprobs"}])),
        call("s", "torch.sum", serde_json::json!([{"ref": "sq"}])),
        call("neg", "operator.neg", serde_json::json!([{"ref": "s"}])),
        {"op": "output", "name": "output", "target": "output",
         "args": [{"tuple": [{"ref": last}, {"dict": {}}]}], "kwargs": {}}
    ]});
    let inputs = vec![lathe_sdk::types::CustomLossInput {
        name: "logprobs".into(),
        rank: 1,
    }];
    let loss = CustomLoss::compile("t", &inputs, &serde_json::from_value(graph).unwrap()).unwrap();
    lathe_server::train::CustomLossRef(std::sync::Arc::new(loss))
}

fn custom_job(seed: u64, n: usize, vocab: usize, adapter: usize, scalar: bool) -> DatumJob {
    DatumJob {
        loss: Loss::Custom(custom_loss(scalar)),
        inputs: TokenInputs {
            custom: Some(lathe_server::train::CustomInputs {
                logprobs_shape: vec![n],
                inputs: Vec::new(),
            }),
            ..Default::default()
        },
        ..ce_job(seed, n, vocab, adapter)
    }
}

/// Several requests share one model pass; one whose custom loss fails on its second
/// datum fails alone, and the others get exactly what they get alone.
#[test]
fn a_failing_custom_loss_fails_its_own_adapter_and_no_other() {
    let (model, a, b) = tiny_with_adapters(
        Arch::Llama,
        DType::F32,
        [(full_spec(4), 31), (full_spec(4), 32)],
    );
    let vocab = model.transformer.config.vocab_size;
    let c = random_adapter(&model, full_spec(4), 33);
    let jobs = vec![
        custom_job(1, 9, vocab, 0, true),
        ce_job(2, 6, vocab, 1),
        custom_job(3, 5, vocab, 0, false),
        custom_job(4, 7, vocab, 2, true),
    ];
    let out =
        forward_backward_in_passes(&model.transformer, &[&a, &b, &c], &jobs, true, 64).unwrap();
    let why = out.failed[0].as_deref().unwrap();
    assert!(why.contains("0-d"), "{why}");
    assert!(out.failed[1].is_none() && out.failed[2].is_none());
    assert!(
        out.grads[0].pairs.is_empty(),
        "a failed adapter keeps no gradient"
    );
    for (ai, adapter) in [(1, &b), (2, &c)] {
        let own = own_jobs(&jobs, ai);
        let (alone, grads) = forward_backward(&model.transformer, &[adapter], &own, true).unwrap();
        let shared: Vec<_> = jobs
            .iter()
            .zip(&out.results)
            .filter(|(j, _)| j.adapter == ai)
            .map(|(_, r)| r)
            .collect();
        for (s, a) in shared.iter().zip(&alone) {
            assert!((s.loss - a.loss).abs() < 1e-4 * a.loss.abs().max(1.0));
        }
        assert_grads_close(&out.grads[ai], &grads[0], 1e-3, "shared pass");
    }
    // The strict entry point fails the call with the loss's reason.
    let err = forward_backward(&model.transformer, &[&a, &b, &c], &jobs, true).unwrap_err();
    assert!(err.to_string().contains("0-d"));
}
