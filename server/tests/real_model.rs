//! Tests on the default model (SmolLM2-135M-Instruct). They need `scripts/fetch-model`;
//! without the file they report that they were skipped, unless `LATHE_REQUIRE_MODEL=1`
//! (set by `.ci/run`), where a missing model is a failure.

use candle_core::{DType, Device, Tensor};
use lathe_sdk::types::AdamParams;
use lathe_server::model::{
    default_model_path, Adapter, ChatMessage, LoadedModel, LoraSpec, PackedBatch,
};
use lathe_server::sample::{sample, sample_timed, DecodeMode, Picker, SampleJob};
use lathe_server::train::adamw::{self, AdamState};
use lathe_server::train::{forward_backward, DatumJob, Loss, TokenInputs};

fn load() -> Option<LoadedModel> {
    let path = default_model_path();
    if !path.exists() {
        if std::env::var("LATHE_REQUIRE_MODEL").as_deref() == Ok("1") {
            panic!(
                "default model missing at {}; run scripts/fetch-model",
                path.display()
            );
        }
        eprintln!("skipped: default model not fetched (run scripts/fetch-model)");
        return None;
    }
    Some(LoadedModel::load("default", &Device::Cpu).expect("default model loads"))
}

fn chat(model: &LoadedModel, question: &str) -> Vec<u32> {
    let text = model
        .chat_template
        .as_ref()
        .expect("SmolLM2 has a chat template")
        .render(&[ChatMessage::new("user", question)], true)
        .unwrap();
    model.tokenizer.encode(&text).unwrap()
}

#[derive(serde::Deserialize)]
struct Reference {
    prompt: String,
    input_ids: Vec<u32>,
    stride: usize,
    strided_logits: Vec<Vec<f32>>,
    top5_ids: Vec<Vec<u32>>,
    top5_logits: Vec<Vec<f32>>,
}

/// Logits of the chat prompt against transformers (scripts/reference/logits_reference.py).
#[test]
fn logits_match_transformers() {
    let Some(model) = load() else { return };
    let r: Reference =
        serde_json::from_str(include_str!("data/smollm2_logits_reference.json")).unwrap();
    // Template and tokenizer reproduce the reference prompt and ids.
    let rendered = model
        .chat_template
        .as_ref()
        .unwrap()
        .render(
            &[ChatMessage::new(
                "user",
                "What is 2+3? Answer with only the number.",
            )],
            true,
        )
        .unwrap();
    assert_eq!(rendered, r.prompt);
    assert_eq!(model.tokenizer.encode(&r.prompt).unwrap(), r.input_ids);

    let t = &model.transformer;
    let n = r.input_ids.len();
    // Full logits through the training forward: ask for every `stride`-th vocab entry and
    // each row's top 5 as targets.
    let vocab = t.config.vocab_size;
    let cols: Vec<u32> = (0..vocab as u32).step_by(r.stride).collect();
    let k = cols.len() + 5;
    let mut targets = Vec::with_capacity(n * k);
    for row in 0..n {
        targets.extend_from_slice(&cols);
        targets.extend_from_slice(&r.top5_ids[row]);
    }
    let batch = PackedBatch::new(&[(&r.input_ids, None, 0)], &Device::Cpu).unwrap();
    let targets = Tensor::from_vec(targets, (n, k), &Device::Cpu).unwrap();
    let (lp, _) = t.forward_logprobs(&batch, &[], &targets, false).unwrap();
    let lp: Vec<Vec<f32>> = lp.to_vec2().unwrap();
    // Logprobs differ from logits by the row's log-sum-exp. Anchoring each row at the
    // reference's top-1 logit compares every logit's distance from the top-1, which
    // is what a shift-invariant softmax sees.
    let mut max_diff = 0f32;
    for ((ours, strided), top5) in lp.iter().zip(&r.strided_logits).zip(&r.top5_logits) {
        let lse = top5[0] - ours[cols.len()];
        for (got, want) in ours.iter().zip(strided) {
            max_diff = max_diff.max((got + lse - want).abs());
        }
        for (got, want) in ours[cols.len()..].iter().zip(top5) {
            max_diff = max_diff.max((got + lse - want).abs());
        }
    }
    eprintln!("max |logit difference| vs transformers: {max_diff:e}");
    assert!(max_diff < 1e-3, "max abs logit difference {max_diff}");
}

#[test]
fn greedy_answer_to_two_plus_three_contains_five() {
    let Some(model) = load() else { return };
    let prompt = chat(&model, "What is 2+3? Answer with only the number.");
    let job = SampleJob {
        prompt,
        adapter: None,
        num_samples: 1,
        picker: Picker {
            temperature: 0.0,
            ..Default::default()
        },
        max_tokens: 16,
        stop_strings: vec![],
        stop_tokens: vec![],
        seed: Some(0),
        prompt_logprobs: false,
        topk_prompt_logprobs: 0,
    };
    let out = sample(
        &model.transformer,
        &model.tokenizer,
        &[],
        &[job],
        DecodeMode::Fast,
    )
    .unwrap();
    let text = model.tokenizer.decode(&out[0].sequences[0].tokens).unwrap();
    eprintln!("greedy answer: {text:?}");
    assert!(text.contains('5'), "{text:?}");
}

#[test]
fn fast_decoding_uses_the_exact_weights_and_reports_the_trainers_logprobs() {
    let Some(model) = load() else { return };
    let t = &model.transformer;
    // Every projection of the Q4_1 file is decoded from its own 4-bit blocks, the
    // embedding from its 8-bit ones: no approximation, so no rescoring pass.
    assert!(
        t.decode_weights().unwrap().exact(),
        "{}",
        t.decode_weights().unwrap().summary()
    );
    let prompt = chat(&model, "Write a short poem about the sea.");
    let job = SampleJob {
        prompt: prompt.clone(),
        adapter: None,
        num_samples: 2,
        picker: Picker::default(),
        max_tokens: 24,
        stop_strings: vec![],
        stop_tokens: vec![],
        seed: Some(3),
        prompt_logprobs: false,
        topk_prompt_logprobs: 0,
    };
    let (out, timings) = sample_timed(t, &model.tokenizer, &[], &[job], DecodeMode::Fast).unwrap();
    assert!(timings.rescore.is_zero());
    let mut worst = 0f32;
    for seq in &out[0].sequences {
        let full: Vec<u32> = prompt.iter().chain(&seq.tokens).copied().collect();
        let inputs = &full[..full.len() - 1];
        let batch = PackedBatch::new(&[(inputs, None, 0)], &Device::Cpu).unwrap();
        let targets =
            Tensor::from_vec(full[1..].to_vec(), (inputs.len(), 1), &Device::Cpu).unwrap();
        let (lp, _) = t.forward_logprobs(&batch, &[], &targets, false).unwrap();
        let lp: Vec<f32> = lp.flatten_all().unwrap().to_vec1().unwrap();
        let trained = &lp[prompt.len() - 1..];
        assert_eq!(trained.len(), seq.logprobs.len());
        for (x, y) in trained.iter().zip(&seq.logprobs) {
            worst = worst.max((x - y).abs());
        }
    }
    eprintln!("max |trainer - sampler| logprob: {worst:e}");
    assert!(worst < 1e-4, "{worst}");
}

#[test]
fn twenty_steps_of_cross_entropy_cut_the_loss_by_ninety_percent() {
    let Some(model) = load() else { return };
    let t = &model.transformer;
    let prompt = chat(&model, "What is the capital of France?");
    let answer = model
        .tokenizer
        .encode("The capital of France is Paris.<|im_end|>")
        .unwrap();
    let tokens: Vec<u32> = prompt.iter().chain(&answer).copied().collect();
    let n = tokens.len() - 1;
    let weights: Vec<f32> = (0..n)
        .map(|i| if i + 1 >= prompt.len() { 1.0 } else { 0.0 })
        .collect();
    let job = DatumJob {
        tokens: tokens[..n].to_vec(),
        targets: tokens[1..].to_vec(),
        k: 1,
        adapter: 0,
        loss: Loss::CrossEntropy,
        inputs: TokenInputs {
            weights,
            ..Default::default()
        },
    };
    let spec = LoraSpec {
        rank: 8,
        train_attn: true,
        train_mlp: true,
        train_unembed: false,
    };
    let mut adapter = Adapter::new(&t.config, spec, 0, DType::F32, &Device::Cpu).unwrap();
    let mut state = AdamState::default();
    let params = AdamParams {
        learning_rate: 1e-3,
        ..Default::default()
    };
    let mut losses = Vec::new();
    for _ in 0..20 {
        let (res, mut grads) =
            forward_backward(t, &[&adapter], std::slice::from_ref(&job), true).unwrap();
        losses.push(res[0].loss);
        adamw::step(
            t.backend(),
            &mut adapter,
            &mut state,
            &grads.remove(0),
            &params,
        )
        .unwrap();
    }
    let (res, _) = forward_backward(t, &[&adapter], std::slice::from_ref(&job), false).unwrap();
    let last = res[0].loss;
    eprintln!(
        "loss: first {:.4}, after 20 steps {last:.4}; curve {losses:.3?}",
        losses[0]
    );
    assert!(
        last < 0.1 * losses[0],
        "loss went from {} to {last}",
        losses[0]
    );
}
