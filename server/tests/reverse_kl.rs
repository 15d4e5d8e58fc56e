//! Reverse-KL distillation through the whole model against central finite differences
//! in f64, and its value against a direct computation from the two models' logits.

mod common;

use candle_core::{DType, Device, Tensor};
use common::*;
use lathe_server::model::{Adapter, Arch, LoadedModel, Proj, Target};
use lathe_server::train::reverse_kl::{forward_backward, KlDatum};

fn f64_model(arch: Arch) -> LoadedModel {
    let m = tiny(arch);
    LoadedModel {
        transformer: m.transformer.to_dtype(DType::F64).unwrap(),
        ..m
    }
}

fn data(vocab: usize) -> Vec<KlDatum> {
    vec![
        KlDatum {
            student: tokens(1, 4, vocab),
            reference: tokens(2, 6, vocab),
            completion: tokens(3, 5, vocab),
            weights: vec![1.0, 0.5, 0.0, 2.0, 1.0],
        },
        KlDatum {
            student: tokens(4, 3, vocab),
            reference: tokens(4, 3, vocab),
            completion: tokens(5, 1, vocab),
            weights: vec![1.5],
        },
    ]
}

fn loss(model: &LoadedModel, student: &Adapter, reference: &Adapter, t: f64) -> f64 {
    let (r, _) = forward_backward(
        &model.transformer,
        student,
        Some(reference),
        &data(model.transformer.config.vocab_size),
        t,
        false,
    )
    .unwrap();
    r.iter().map(|r| r.loss).sum()
}

fn with_entry(t: &Tensor, idx: usize, delta: f64) -> Tensor {
    let mut v: Vec<f64> = t.flatten_all().unwrap().to_vec1().unwrap();
    v[idx] += delta;
    Tensor::from_vec(v, t.dims(), &Device::Cpu).unwrap()
}

#[test]
fn student_gradients_match_central_finite_differences_in_f64() {
    for arch in [Arch::Llama, Arch::Qwen3] {
        let model = f64_model(arch);
        let student = random_adapter(&model, full_spec(3), 7)
            .to_dtype(DType::F64)
            .unwrap();
        let reference = random_adapter(&model, full_spec(2), 9)
            .to_dtype(DType::F64)
            .unwrap();
        let t = 0.8;
        let vocab = model.transformer.config.vocab_size;
        let (results, grads) = forward_backward(
            &model.transformer,
            &student,
            Some(&reference),
            &data(vocab),
            t,
            true,
        )
        .unwrap();
        assert!(results.iter().all(|r| r.loss > 0.0), "{results:?}");
        assert_eq!(results[0].tokens, 4, "zero weights do not count");
        for target in [
            Target::Layer(0, Proj::Q),
            Target::Layer(1, Proj::Down),
            Target::LmHead,
        ] {
            let (da, db) = &grads.pairs[&target];
            for (which, grad) in [("A", da), ("B", db)] {
                let values: Vec<f64> = grad.flatten_all().unwrap().to_vec1().unwrap();
                let gmax = values.iter().fold(0f64, |m, v| m.max(v.abs()));
                assert!(gmax > 0.0, "{arch:?} {target:?} d{which} is zero");
                let argmax = values.iter().position(|v| v.abs() == gmax).unwrap();
                for idx in [argmax, 0, values.len() - 1] {
                    let at = |d: f64| {
                        let mut a = student.clone();
                        let p = a.pairs.get_mut(&target).unwrap();
                        if which == "A" {
                            p.a = with_entry(&p.a, idx, d);
                        } else {
                            p.b = with_entry(&p.b, idx, d);
                        }
                        loss(&model, &a, &reference, t)
                    };
                    let eps = 1e-5;
                    let fd = (at(eps) - at(-eps)) / (2.0 * eps);
                    let an = values[idx];
                    let rel = (an - fd).abs() / an.abs().max(fd.abs()).max(1e-3 * gmax);
                    assert!(
                        rel < 1e-4,
                        "{arch:?} {target:?} d{which}[{idx}]: {an:e} vs finite difference {fd:e}"
                    );
                }
            }
        }
    }
}

#[test]
fn the_loss_is_the_divergence_of_the_two_models_next_token_distributions() {
    let model = f64_model(Arch::Llama);
    let t = &model.transformer;
    let student = random_adapter(&model, full_spec(2), 1)
        .to_dtype(DType::F64)
        .unwrap();
    let vocab = t.config.vocab_size;
    // One completion token after the same prompt: the KL of the two models' next-token
    // distributions at the prompt's end, computed here from sampled-style log-probs of
    // every token (forward with every vocabulary entry as a target).
    let prompt = tokens(8, 5, vocab);
    let d = KlDatum {
        student: prompt.clone(),
        reference: prompt.clone(),
        completion: vec![3],
        weights: vec![1.0],
    };
    let (r, _) = forward_backward(t, &student, None, &[d], 1.0, false).unwrap();
    let lp = |adapter: Option<&Adapter>| -> Vec<f64> {
        let adapters: Vec<&Adapter> = adapter.into_iter().collect();
        let batch = lathe_server::model::PackedBatch::new(
            &[(prompt.as_slice(), adapter.map(|_| 0), 0)],
            &Device::Cpu,
        )
        .unwrap();
        let all: Vec<u32> = (0..prompt.len()).flat_map(|_| 0..vocab as u32).collect();
        let targets = Tensor::from_vec(all, (prompt.len(), vocab), &Device::Cpu).unwrap();
        let (lp, _) = t
            .forward_logprobs(&batch, &adapters, &targets, false)
            .unwrap();
        let lp: Vec<Vec<f64>> = lp.to_vec2().unwrap();
        lp[prompt.len() - 1].clone()
    };
    let (q, p) = (lp(Some(&student)), lp(None));
    let kl: f64 = q.iter().zip(&p).map(|(q, p)| q.exp() * (q - p)).sum();
    assert!((r[0].loss - kl).abs() < 1e-9, "{} vs {kl}", r[0].loss);
    assert!(kl > 1e-6);
}

/// The device backend (candle's ops, on candle's CPU device) distils as the CPU fast
/// paths do: the same losses and student gradients, to 1e-10 in f64 (the whole-vocabulary
/// logits go through the output head's other entry point, not the training pass's).
#[test]
fn the_device_backend_distils_like_the_cpu_fast_path() {
    for arch in [Arch::Llama, Arch::Qwen3] {
        let fast = f64_model(arch);
        let mut device = f64_model(arch);
        device
            .transformer
            .set_backend(lathe_server::model::Backend::Device)
            .unwrap();
        let student = random_adapter(&fast, full_spec(2), 11)
            .to_dtype(DType::F64)
            .unwrap();
        let reference = random_adapter(&fast, full_spec(3), 12)
            .to_dtype(DType::F64)
            .unwrap();
        let vocab = fast.transformer.config.vocab_size;
        let run = |m: &LoadedModel| {
            forward_backward(
                &m.transformer,
                &student,
                Some(&reference),
                &data(vocab),
                1.5,
                true,
            )
            .unwrap()
        };
        let (want, want_grads) = run(&fast);
        let (got, got_grads) = run(&device);
        for (w, g) in want.iter().zip(&got) {
            assert!(
                (w.loss - g.loss).abs() <= 1e-10 * w.loss.abs().max(1.0),
                "{arch:?}"
            );
        }
        assert!(!want_grads.pairs.is_empty());
        for (t, (wa, wb)) in &want_grads.pairs {
            let (ga, gb) = &got_grads.pairs[t];
            assert!(rel_diff(ga, wa) <= 1e-10, "{arch:?} {t:?} dA");
            assert!(rel_diff(gb, wb) <= 1e-10, "{arch:?} {t:?} dB");
        }
    }
}
