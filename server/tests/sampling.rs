//! The sampler against the trainer: same logprobs, reproducible seeds, batched decoding
//! across adapters equal to decoding alone.

mod common;

use candle_core::{Device, Tensor};
use common::*;
use lathe_server::model::cpu::bf16::Kernel;
use lathe_server::model::cpu::quant::BlockArith;
use lathe_server::model::tiny::{tiny_model, tiny_model_q4_1};
use lathe_server::model::{Adapter, Arch, Backend, LoadedModel, PackedBatch, Precision};
use lathe_server::sample::{
    sample, sample_timed, DecodeMode, Picker, SampleJob, SampleTimings, Stop,
};

#[test]
fn sampled_logprobs_equal_the_training_forward() {
    // Random f32 weights: fast mode decodes with 8-bit copies and rescores. Weights made
    // of Q4_1 blocks (a Q4_1 GGUF, like the default model): fast mode decodes with the
    // exact weights and needs no rescoring.
    for (arch, mode, q4_1) in [
        (Arch::Llama, DecodeMode::Exact, false),
        (Arch::Llama, DecodeMode::Fast, false),
        (Arch::Qwen3, DecodeMode::Exact, false),
        (Arch::Qwen3, DecodeMode::Fast, false),
        (Arch::Llama, DecodeMode::Fast, true),
        (Arch::Qwen3, DecodeMode::Fast, true),
    ] {
        let model = if q4_1 {
            tiny_model_q4_1(arch, 1234).unwrap()
        } else {
            tiny(arch)
        };
        let label = format!("{arch:?} {mode:?} q4_1 {q4_1}");
        let timings = assert_sampled_logprobs_are_the_trainers(&model, mode, 1e-4, &label);
        let exact = model.transformer.decode_weights().unwrap().exact();
        assert_eq!(exact, q4_1, "{arch:?}: decode weights exact");
        // Rescoring belongs to the CPU backend's block-quantized decode weights.
        let rescored = mode == DecodeMode::Fast && !q4_1 && test_backend() == Backend::Cpu;
        assert_eq!(!timings.rescore.is_zero(), rescored, "{label}");
    }
}

/// Under bf16 precision a sampled token's log-probability is the trainer's bit for bit,
/// with each bf16 kernel this CPU has (AMX tiles, AVX512-BF16 pairs). Every frozen
/// product of decoding is the trainer's bf16 product with the trainer's kernel (on AMX
/// the block weights' products, which `bf16::tests` checks with Qwen2's q/k/v bias, or
/// the trainer's own product in exact mode and always with AVX512-BF16), and everything around the products (RMSNorm,
/// attention, the LoRA deltas, SwiGLU, the log-softmax) is computed row by row in one
/// order shared by training, prefill and decoding. Any last-bit difference there would
/// now and then round an activation to the neighbouring bf16 value in the next product
/// and move a token's logprob by up to a few hundredths, so the check is exact equality
/// over eight seeds, three architectures and both modes; the control (f32 decoding of
/// the same weights, scored by the bf16 trainer) shows that it can see a difference.
/// Batched decoding still equals decoding alone.
#[test]
fn bf16_sampled_logprobs_equal_the_bf16_trainers() {
    let kernels = lathe_server::model::cpu::bf16::available();
    if kernels.is_empty() {
        eprintln!("this CPU has no bf16 kernel: bf16 stays f32 and is not checked");
        return;
    }
    for &kernel in kernels {
        for arch in [Arch::Llama, Arch::Qwen2, Arch::Qwen3] {
            let mut model = tiny_model_q4_1(arch, 1234).unwrap();
            let precision = model
                .transformer
                .set_precision_with(Precision::Bf16, Some(kernel))
                .unwrap();
            assert_eq!(precision, Precision::Bf16);
            // The block weights decode only where their products are the trainer's (on
            // AMX tiles); with the other kernel decoding takes the trainer's products.
            let blocks_decode = model.transformer.block_arith() == BlockArith::Bf16(kernel);
            assert!(
                blocks_decode || DecodeMode::Fast.on(&model.transformer) == DecodeMode::Exact,
                "{arch:?} {}: decoding's products are not the trainer's",
                kernel.name()
            );
            assert_eq!(blocks_decode, kernel == Kernel::Amx, "{arch:?}");
            // The control: the same weights sampled with f32 products.
            let f32_model = tiny_model_q4_1(arch, 1234).unwrap();
            for mode in [DecodeMode::Fast, DecodeMode::Exact] {
                let label = format!("{arch:?} {mode:?} bf16 {}", kernel.name());
                let same: Vec<f32> = (0..8)
                    .flat_map(|s| sampled_vs_trained(&model, &model, mode, s).0)
                    .collect();
                let f32s: Vec<f32> = (0..8)
                    .flat_map(|s| sampled_vs_trained(&f32_model, &model, mode, s).0)
                    .collect();
                let mean = |d: &[f32]| d.iter().map(|&x| x as f64).sum::<f64>() / d.len() as f64;
                let worst = same.iter().fold(0f32, |m, &x| m.max(x));
                // The control shows that the check can see a difference: the f32
                // products' tokens score differently under the bf16 trainer.
                assert!(
                    mean(&f32s) > 0.0,
                    "{label}: f32 decoding matched bf16 exactly"
                );
                assert!(
                    worst == 0.0,
                    "{label}: mean difference {} (f32 decoding: {}), largest {worst}",
                    mean(&same),
                    mean(&f32s)
                );
            }
            assert_batched_equals_alone(&model, DecodeMode::Fast);
        }
    }
}

/// Samples three sequences of a five-token prompt with an adapter, and checks each
/// token's logprob against the trainer's forward pass over the whole sequence.
fn assert_sampled_logprobs_are_the_trainers(
    model: &LoadedModel,
    mode: DecodeMode,
    tolerance: f32,
    label: &str,
) -> SampleTimings {
    let (diffs, timings) = sampled_vs_trained(model, model, mode, 0);
    for d in diffs {
        assert!(d < tolerance, "{label}: trainer and sampler differ by {d}");
    }
    timings
}

/// `|trainer − sampler|` for every sampled token: `sampler` samples three sequences of
/// a five-token prompt with an adapter, all from `seed` (0 is the f32 test's case), and
/// each token's logprob is held against `trainer`'s forward pass over the whole sequence
/// (the same model, or the same weights at another precision).
fn sampled_vs_trained(
    sampler: &LoadedModel,
    trainer: &LoadedModel,
    mode: DecodeMode,
    seed: u64,
) -> (Vec<f32>, SampleTimings) {
    let a = random_adapter(trainer, full_spec(4), 3 + seed);
    let prompt = tokens(5 + seed, 9, 256);
    let job = sample_job(prompt.clone(), Some(0), 3, 42 + seed);
    let (out, timings) = sample_timed(
        &sampler.transformer,
        &sampler.tokenizer,
        &[&a],
        &[job],
        mode,
    )
    .unwrap();
    let mut diffs = Vec::new();
    for seq in &out[0].sequences {
        let full: Vec<u32> = prompt.iter().chain(&seq.tokens).copied().collect();
        let inputs = &full[..full.len() - 1];
        let batch = PackedBatch::new(&[(inputs, Some(0), 0)], &Device::Cpu).unwrap();
        let targets =
            Tensor::from_vec(full[1..].to_vec(), (inputs.len(), 1), &Device::Cpu).unwrap();
        let (lp, _) = trainer
            .transformer
            .forward_logprobs(&batch, &[&a], &targets, false)
            .unwrap();
        let lp: Vec<f32> = lp.flatten_all().unwrap().to_vec1().unwrap();
        let trained = &lp[prompt.len() - 1..];
        assert_eq!(trained.len(), seq.logprobs.len());
        diffs.extend(
            trained
                .iter()
                .zip(&seq.logprobs)
                .map(|(x, y)| (x - y).abs()),
        );
    }
    (diffs, timings)
}

/// Prompts prefilled together go through the exact block weights in f32 up to
/// `EXACT_F32_ROWS` rows, past the bf16 tiles' 32, and through the trainer's product
/// beyond: on either side, each segment with its own adapter (Qwen2: with the q/k/v
/// bias), every sampled token's logprob is the trainer's, and each request samples what
/// it samples alone.
#[test]
fn prompts_prefilled_together_through_the_block_weights_are_the_trainers() {
    use lathe_server::model::cpu::decode_weights::{EXACT_F32_ROWS, EXACT_ROWS};
    let model = tiny_model_q4_1(Arch::Qwen2, 77).unwrap();
    assert!(model.transformer.decode_weights().unwrap().exact());
    let adapters = [
        random_adapter(&model, full_spec(4), 20),
        random_adapter(&model, full_spec(2), 21),
    ];
    let refs: Vec<&Adapter> = adapters.iter().collect();
    // Four prompts of `len .. len + 4` tokens: within the block weights' rows, then past.
    let within = EXACT_F32_ROWS / 4 - 4;
    let past = EXACT_F32_ROWS / 4 + 8;
    for prompt_len in [within, past] {
        let jobs: Vec<SampleJob> = (0..4u64)
            .map(|i| {
                sample_job(
                    tokens(30 + i, prompt_len + i as usize, 256),
                    Some(i as usize % 2),
                    1,
                    500 + i,
                )
            })
            .collect();
        let rows: usize = jobs.iter().map(|j| j.prompt.len()).sum();
        assert!(rows > EXACT_ROWS);
        assert_eq!(rows <= EXACT_F32_ROWS, prompt_len == within, "{rows} rows");
        let together = sample(
            &model.transformer,
            &model.tokenizer,
            &refs,
            &jobs,
            DecodeMode::Fast,
        )
        .unwrap();
        for (j, got) in jobs.iter().zip(&together) {
            let seq = &got.sequences[0];
            let alone = sample(
                &model.transformer,
                &model.tokenizer,
                &refs,
                std::slice::from_ref(j),
                DecodeMode::Fast,
            )
            .unwrap();
            assert_eq!(seq.tokens, alone[0].sequences[0].tokens, "{rows} rows");
            let full: Vec<u32> = j.prompt.iter().chain(&seq.tokens).copied().collect();
            let inputs = &full[..full.len() - 1];
            let batch = PackedBatch::new(&[(inputs, j.adapter, 0)], &Device::Cpu).unwrap();
            let targets =
                Tensor::from_vec(full[1..].to_vec(), (inputs.len(), 1), &Device::Cpu).unwrap();
            let (lp, _) = model
                .transformer
                .forward_logprobs(&batch, &refs, &targets, false)
                .unwrap();
            let lp: Vec<f32> = lp.flatten_all().unwrap().to_vec1().unwrap();
            let trained = &lp[j.prompt.len() - 1..];
            for ((x, y), z) in trained
                .iter()
                .zip(&seq.logprobs)
                .zip(&alone[0].sequences[0].logprobs)
            {
                assert!(
                    (x - y).abs() < 1e-4,
                    "{rows} rows: trainer {x}, sampler {y}"
                );
                assert!((y - z).abs() < 1e-4, "{rows} rows: together {y}, alone {z}");
            }
        }
    }
}

#[test]
fn same_seed_same_output_and_different_seeds_differ() {
    let model = tiny(Arch::Llama);
    let prompt = tokens(8, 5, 256);
    // A hot temperature: the random tiny model is very peaked at temperature 1.
    let hot = |seed| SampleJob {
        picker: Picker {
            temperature: 4.0,
            ..Default::default()
        },
        ..sample_job(prompt.clone(), None, 2, seed)
    };
    let run = |seed| {
        sample(
            &model.transformer,
            &model.tokenizer,
            &[],
            &[hot(seed)],
            DecodeMode::Fast,
        )
        .unwrap()
    };
    let a = run(7);
    assert_eq!(a, run(7));
    assert_ne!(a[0].sequences[0].tokens, run(8)[0].sequences[0].tokens);
    // Samples of one request use different streams.
    assert_ne!(a[0].sequences[0].tokens, a[0].sequences[1].tokens);
}

#[test]
fn batched_decoding_over_adapters_equals_decoding_alone() {
    for mode in [DecodeMode::Exact, DecodeMode::Fast] {
        batched_equals_alone(mode);
    }
}

fn batched_equals_alone(mode: DecodeMode) {
    assert_batched_equals_alone(&tiny(Arch::Qwen3), mode);
}

/// Four greedy jobs over two adapters and none decode together as each decodes alone.
fn assert_batched_equals_alone(model: &LoadedModel, mode: DecodeMode) {
    let a = random_adapter(model, full_spec(4), 1);
    let b = random_adapter(model, full_spec(2), 2);
    let greedy = |p: Vec<u32>, ad: Option<usize>| SampleJob {
        picker: Picker {
            temperature: 0.0,
            ..Default::default()
        },
        ..sample_job(p, ad, 1, 0)
    };
    let jobs = vec![
        greedy(tokens(1, 7, 256), Some(0)),
        greedy(tokens(2, 4, 256), Some(1)),
        greedy(tokens(3, 9, 256), None),
        greedy(tokens(4, 5, 256), Some(0)),
    ];
    let together = sample(&model.transformer, &model.tokenizer, &[&a, &b], &jobs, mode).unwrap();
    for (j, got) in jobs.iter().zip(&together) {
        let alone = sample(
            &model.transformer,
            &model.tokenizer,
            &[&a, &b],
            std::slice::from_ref(j),
            mode,
        )
        .unwrap();
        assert_eq!(got.sequences[0].tokens, alone[0].sequences[0].tokens);
        for (x, y) in got.sequences[0]
            .logprobs
            .iter()
            .zip(&alone[0].sequences[0].logprobs)
        {
            assert!((x - y).abs() < 1e-5);
        }
    }
}

#[test]
fn stop_tokens_strings_and_length_end_sequences() {
    let model = tiny(Arch::Llama);
    let prompt = tokens(9, 6, 256);
    let base = sample(
        &model.transformer,
        &model.tokenizer,
        &[],
        &[sample_job(prompt.clone(), None, 1, 3)],
        DecodeMode::Fast,
    )
    .unwrap();
    let seq = &base[0].sequences[0];
    assert_eq!(seq.tokens.len(), 12);
    assert_eq!(seq.stop, Stop::Length);
    // Stop at the third generated token, by id.
    let stop_tok = seq.tokens[2];
    let first = seq.tokens.iter().position(|&t| t == stop_tok).unwrap();
    let by_token = SampleJob {
        stop_tokens: vec![stop_tok],
        ..sample_job(prompt.clone(), None, 1, 3)
    };
    let out = sample(
        &model.transformer,
        &model.tokenizer,
        &[],
        &[by_token],
        DecodeMode::Fast,
    )
    .unwrap();
    assert_eq!(out[0].sequences[0].stop, Stop::Stop);
    assert_eq!(out[0].sequences[0].tokens, seq.tokens[..=first].to_vec());
    // Stop by string: the decoded text of the first four tokens.
    let text = model.tokenizer.decode(&seq.tokens[..4]).unwrap();
    let by_string = SampleJob {
        stop_strings: vec![text.clone()],
        ..sample_job(prompt.clone(), None, 1, 3)
    };
    let out = sample(
        &model.transformer,
        &model.tokenizer,
        &[],
        &[by_string],
        DecodeMode::Fast,
    )
    .unwrap();
    assert_eq!(out[0].sequences[0].stop, Stop::Stop);
    assert!(model
        .tokenizer
        .decode(&out[0].sequences[0].tokens)
        .unwrap()
        .contains(&text));
    assert!(out[0].sequences[0].tokens.len() <= 4);
}

#[test]
fn prompt_logprobs_start_with_none_and_match_the_trainer() {
    let model = tiny(Arch::Qwen3);
    let prompt = tokens(10, 6, 256);
    let j = SampleJob {
        prompt_logprobs: true,
        topk_prompt_logprobs: 0,
        max_tokens: 1,
        ..sample_job(prompt.clone(), None, 1, 0)
    };
    let out = sample(
        &model.transformer,
        &model.tokenizer,
        &[],
        &[j],
        DecodeMode::Fast,
    )
    .unwrap();
    let plp = out[0].prompt_logprobs.as_ref().unwrap();
    assert_eq!(plp.len(), prompt.len());
    assert!(plp[0].is_none() && plp[1..].iter().all(|x| x.is_some_and(|v| v < 0.0)));

    // Batched with another request and an adapter, the prompt scores still equal the
    // training forward's.
    let a = random_adapter(&model, full_spec(2), 4);
    let other = sample_job(tokens(11, 4, 256), None, 1, 0);
    let scored = SampleJob {
        prompt_logprobs: true,
        topk_prompt_logprobs: 0,
        max_tokens: 1,
        ..sample_job(prompt.clone(), Some(0), 1, 0)
    };
    let out = sample(
        &model.transformer,
        &model.tokenizer,
        &[&a],
        &[other, scored],
        DecodeMode::Fast,
    )
    .unwrap();
    assert!(out[0].prompt_logprobs.is_none());
    let plp = out[1].prompt_logprobs.as_ref().unwrap();
    let inputs = &prompt[..prompt.len() - 1];
    let batch = PackedBatch::new(&[(inputs, Some(0), 0)], &Device::Cpu).unwrap();
    let targets = Tensor::from_vec(prompt[1..].to_vec(), (inputs.len(), 1), &Device::Cpu).unwrap();
    let (lp, _) = model
        .transformer
        .forward_logprobs(&batch, &[&a], &targets, false)
        .unwrap();
    let lp: Vec<f32> = lp.flatten_all().unwrap().to_vec1().unwrap();
    for (got, want) in plp[1..].iter().zip(&lp) {
        assert!((got.unwrap() - want).abs() < 1e-4, "{got:?} vs {want}");
    }
}

#[test]
fn too_long_requests_are_rejected() {
    let model = tiny(Arch::Llama);
    let j = SampleJob {
        max_tokens: 10_000,
        ..sample_job(vec![1, 2, 3], None, 1, 0)
    };
    let err = sample(
        &model.transformer,
        &model.tokenizer,
        &[],
        &[j],
        DecodeMode::Fast,
    )
    .unwrap_err();
    assert!(err.to_string().contains("context limit"), "{err}");
}

#[test]
fn host_decode_steps_equal_the_tensor_decode_path() {
    use lathe_server::model::cpu::decode_step::{HostAdapter, HostDecoder, StepRow};
    use lathe_server::model::KvCache;
    // Llama, Qwen2 (q/k/v biases) and Qwen3 (q/k norms); a batch mixing two adapters, the
    // base model and prompts of different lengths, over several steps.
    for (arch, quantized) in [
        (Arch::Llama, true),
        (Arch::Qwen2, true),
        (Arch::Qwen3, true),
        (Arch::Qwen2, false),
    ] {
        // The CPU backend's own decode step, whichever backend the other tests use.
        let model = tiny_model(arch, 1234, &Device::Cpu).unwrap();
        let t = &model.transformer;
        let a = random_adapter(&model, full_spec(4), 1);
        let b = random_adapter(&model, full_spec(2), 2);
        let adapters = [&a, &b];
        let prompts = [tokens(1, 7, 256), tokens(2, 4, 256), tokens(3, 9, 256)];
        let which = [Some(0), Some(1), None];
        let seqs: Vec<(&[u32], Option<usize>, usize)> = prompts
            .iter()
            .zip(which)
            .map(|(p, ad)| (p.as_slice(), ad, 0))
            .collect();
        let batch = PackedBatch::new(&seqs, &Device::Cpu).unwrap();
        let mut caches: Vec<KvCache> = (0..3).map(|_| KvCache::default()).collect();
        let mut refs: Vec<&mut KvCache> = caches.iter_mut().collect();
        t.forward_cached(&batch, &adapters, &mut refs, false)
            .unwrap();
        let mut host_caches: Vec<KvCache> = caches.iter().map(|c| c.try_clone().unwrap()).collect();
        let host_adapters = [
            HostAdapter::new(t, &a).unwrap(),
            HostAdapter::new(t, &b).unwrap(),
        ];
        let host = HostDecoder::new(t, host_adapters.iter().collect(), quantized)
            .unwrap()
            .expect("CPU f32 model");
        for step in 0..4u32 {
            let toks: Vec<[u32; 1]> = (0..3).map(|i| [(step * 31 + i * 7) % 256]).collect();
            let seqs: Vec<(&[u32], Option<usize>, usize)> = toks
                .iter()
                .zip(which)
                .zip(&caches)
                .map(|((tok, ad), c)| (tok.as_slice(), ad, c.len()))
                .collect();
            let batch = PackedBatch::new(&seqs, &Device::Cpu).unwrap();
            let mut refs: Vec<&mut KvCache> = caches.iter_mut().collect();
            let want: Vec<f32> = t
                .forward_cached(&batch, &adapters, &mut refs, quantized)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let rows: Vec<StepRow> = toks
                .iter()
                .zip(which)
                .zip(&host_caches)
                .map(|((tok, ad), c)| StepRow {
                    token: tok[0],
                    adapter: ad,
                    position: c.len(),
                })
                .collect();
            let mut refs: Vec<&mut KvCache> = host_caches.iter_mut().collect();
            let got = host.step(&rows, &mut refs).unwrap();
            assert_eq!(got.len(), want.len());
            let diff = got
                .iter()
                .zip(&want)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            assert!(
                diff < 1e-4,
                "{arch:?} {quantized}: step {step}: max diff {diff}"
            );
            assert!(caches
                .iter()
                .zip(&host_caches)
                .all(|(x, y)| x.len() == y.len()));
        }
        // Bad rows are refused, not a panic.
        let mut refs: Vec<&mut KvCache> = host_caches.iter_mut().take(1).collect();
        let bad = StepRow {
            token: 100_000,
            adapter: None,
            position: 0,
        };
        assert!(host.step(&[bad], &mut refs).is_err());
    }
}

#[test]
fn topk_prompt_logprobs_are_the_trainers_most_likely_tokens() {
    let model = tiny(Arch::Llama);
    let vocab = model.transformer.config.vocab_size;
    let a = random_adapter(&model, full_spec(2), 5);
    let prompt = tokens(12, 7, 256);
    let k = 5;
    // Batched with a request that asks for nothing, which must get nothing.
    let jobs = [
        sample_job(tokens(13, 3, 256), None, 1, 0),
        SampleJob {
            topk_prompt_logprobs: k,
            max_tokens: 1,
            ..sample_job(prompt.clone(), Some(0), 1, 0)
        },
    ];
    let out = sample(
        &model.transformer,
        &model.tokenizer,
        &[&a],
        &jobs,
        DecodeMode::Fast,
    )
    .unwrap();
    assert!(out[0].topk_prompt_logprobs.is_none() && out[1].prompt_logprobs.is_none());
    let topk = out[1].topk_prompt_logprobs.as_ref().unwrap();
    assert_eq!(topk.len(), prompt.len());
    assert!(topk[0].is_none());
    // Reference: every token's log-probability at every position from the training
    // forward, sorted.
    let inputs = &prompt[..prompt.len() - 1];
    let rows = inputs.len();
    let batch = PackedBatch::new(&[(inputs, Some(0), 0)], &Device::Cpu).unwrap();
    let all: Vec<u32> = (0..rows).flat_map(|_| 0..vocab as u32).collect();
    let targets = Tensor::from_vec(all, (rows, vocab), &Device::Cpu).unwrap();
    let (lp, _) = model
        .transformer
        .forward_logprobs(&batch, &[&a], &targets, false)
        .unwrap();
    let lp: Vec<Vec<f32>> = lp.to_vec2().unwrap();
    for (pos, got) in topk[1..].iter().enumerate() {
        let got = got.as_ref().unwrap();
        assert_eq!(got.len(), k);
        let mut want: Vec<(usize, f32)> = lp[pos].iter().copied().enumerate().collect();
        want.sort_by(|x, y| y.1.total_cmp(&x.1));
        for ((tok, l), (wtok, wl)) in got.iter().zip(&want) {
            assert!((l - wl).abs() < 1e-4, "position {}: {l} vs {wl}", pos + 1);
            // Near-ties may swap order; the token's own score must still match.
            assert!(*tok as usize == *wtok || (lp[pos][*tok as usize] - l).abs() < 1e-4);
        }
        assert!(got.windows(2).all(|w| w[0].1 >= w[1].1));
    }
}

#[test]
fn more_rows_than_the_few_rows_kernels_take_decode_the_same_as_one() {
    // 18 samples of one request step together (past the few-rows limit of 16, so the
    // host step's products go through gemm); each equals its seed's sample drawn alone.
    let model = tiny(Arch::Qwen2);
    let a = random_adapter(&model, full_spec(2), 6);
    let prompt = tokens(14, 5, 256);
    let together = sample(
        &model.transformer,
        &model.tokenizer,
        &[&a],
        &[sample_job(prompt.clone(), Some(0), 18, 100)],
        DecodeMode::Exact,
    )
    .unwrap();
    for (i, got) in together[0].sequences.iter().enumerate() {
        let alone = sample(
            &model.transformer,
            &model.tokenizer,
            &[&a],
            &[sample_job(prompt.clone(), Some(0), 1, 100 + i as u64)],
            DecodeMode::Exact,
        )
        .unwrap();
        let want = &alone[0].sequences[0];
        assert_eq!(got.tokens, want.tokens, "sample {i}");
        for (x, y) in got.logprobs.iter().zip(&want.logprobs) {
            assert!((x - y).abs() < 1e-4, "sample {i}: {x} vs {y}");
        }
    }
}

#[test]
fn exact_mode_never_touches_the_block_quantized_weights() {
    // Exact mode decodes with the f32 weights; on a CPU without the fast block kernels
    // their portable path is many times slower, so exact mode must not route even a
    // prompt through them.
    let model = tiny_model_q4_1(Arch::Llama, 7).unwrap();
    let t = &model.transformer;
    let jobs = [sample_job(tokens(1, 7, 256), None, 2, 3)];
    sample(t, &model.tokenizer, &[], &jobs, DecodeMode::Exact).unwrap();
    assert!(!t.has_decode_weights());
    sample(t, &model.tokenizer, &[], &jobs, DecodeMode::Fast).unwrap();
    assert!(t.has_decode_weights());
}
