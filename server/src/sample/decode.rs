//! Batched KV-cache decoding: every prompt is prefilled once, each of its samples gets a
//! copy of the cache, and all live sequences — whatever their adapters — advance together
//! in one forward step per token.

use std::time::{Duration, Instant};

use candle_core::{DType, Tensor};
use rand::{rngs::StdRng, SeedableRng};
use rayon::prelude::*;

use super::logits::{token_logprob, Picker};
use crate::model::host_decode::{HostDecoder, StepRow};
use crate::model::pool::on_pool;
use crate::model::transformer::TopK;
use crate::model::{Adapter, KvCache, ModelError, PackedBatch, TextTokenizer, Transformer};

/// New tokens generated when a request sets no `max_tokens`.
pub const DEFAULT_MAX_TOKENS: usize = 256;

/// Which weights choose the tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DecodeMode {
    /// Block-quantized decode weights pick the tokens (a sixth to a quarter of the f32
    /// memory traffic per token). Where they reproduce the f32 weights exactly (every
    /// Q4_1 GGUF model, the default one included) this *is* the trained policy. Where
    /// they do not (8-bit copies of f32 or bf16 weights), the tokens follow the 8-bit
    /// model's distribution, which differs by quantisation noise, and the f32 trainer
    /// weights rescore every sampled token in one batched pass afterwards, so reported
    /// log-probabilities are the trainer's either way.
    #[default]
    Fast,
    /// The f32 trainer weights pick the tokens: the sampling distribution is exactly the
    /// trained policy, at f32 decoding speed.
    Exact,
}

impl DecodeMode {
    /// The mode to serve with when `self` is asked for on this CPU: `Fast` needs the
    /// vectorised block-quantized kernels ([`crate::model::quant::has_fast_kernels`]);
    /// without them the f32 weights decode faster, so `Exact` is used (same reported
    /// log-probabilities; for Q4_1 models, the same tokens too).
    pub fn on_this_cpu(self) -> Self {
        if self == DecodeMode::Fast && !crate::model::quant::has_fast_kernels() {
            DecodeMode::Exact
        } else {
            self
        }
    }
}

/// One sampling request: a prompt, its adapter, and how to sample.
#[derive(Debug, Clone)]
pub struct SampleJob {
    /// Prompt token ids (non-empty).
    pub prompt: Vec<u32>,
    /// Index into the adapter list; `None` samples the base model.
    pub adapter: Option<usize>,
    /// Independent samples to draw.
    pub num_samples: usize,
    /// Token choice.
    pub picker: Picker,
    /// Most new tokens per sample.
    pub max_tokens: usize,
    /// Stop when one of these strings appears in the new text.
    pub stop_strings: Vec<String>,
    /// Stop when one of these tokens is produced (the tokenizer's EOS always stops).
    pub stop_tokens: Vec<u32>,
    /// Seed; sample `i` uses `seed + i`. `None` draws from the OS.
    pub seed: Option<u64>,
    /// Also return the log-probability of every prompt token after the first.
    pub prompt_logprobs: bool,
    /// Also return this many most likely tokens at every prompt position after the first
    /// (0: none).
    pub topk_prompt_logprobs: usize,
}

impl SampleJob {
    /// Tokens this request holds while it runs: `num_samples x (prompt + max_tokens)`
    /// (what per-key sampling limits count).
    pub fn token_budget(&self) -> usize {
        self.num_samples
            .saturating_mul(self.prompt.len().saturating_add(self.max_tokens))
    }
}

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// A stop token or string.
    Stop,
    /// `max_tokens` reached.
    Length,
}

/// One generated sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct Generated {
    /// New tokens, including the stop token that ended it.
    pub tokens: Vec<u32>,
    /// Model log-probability of each new token.
    pub logprobs: Vec<f32>,
    /// Why it ended.
    pub stop: Stop,
}

/// The result of one [`SampleJob`].
#[derive(Debug, Clone, PartialEq)]
pub struct SampleOutput {
    /// `num_samples` sequences.
    pub sequences: Vec<Generated>,
    /// Prompt log-probabilities (first entry `None`), when requested.
    pub prompt_logprobs: Option<Vec<Option<f32>>>,
    /// The `topk_prompt_logprobs` most likely tokens at every prompt position (first
    /// entry `None`) with their log-probabilities, most likely first, when requested.
    pub topk_prompt_logprobs: Option<Vec<Option<TopK>>>,
}

struct Stream {
    job: usize,
    cache: KvCache,
    logits: Vec<f32>,
    rng: StdRng,
    out: Generated,
    done: bool,
}

/// Wall time of each phase of a [`sample`] call, for benchmarks.
#[derive(Debug, Clone, Copy, Default)]
pub struct SampleTimings {
    /// Prompts through the f32 weights, filling the KV caches.
    pub prefill: Duration,
    /// Token-by-token decoding.
    pub decode: Duration,
    /// Fast mode's f32 rescoring of the sampled tokens (zero in exact mode and when the
    /// decode weights are exact).
    pub rescore: Duration,
}

/// Runs all jobs to completion, decoding their samples together.
pub fn sample(
    model: &Transformer,
    tokenizer: &TextTokenizer,
    adapters: &[&Adapter],
    jobs: &[SampleJob],
    mode: DecodeMode,
) -> Result<Vec<SampleOutput>, ModelError> {
    sample_timed(model, tokenizer, adapters, jobs, mode).map(|(out, _)| out)
}

/// [`sample`], also returning how long each phase took.
pub fn sample_timed(
    model: &Transformer,
    tokenizer: &TextTokenizer,
    adapters: &[&Adapter],
    jobs: &[SampleJob],
    mode: DecodeMode,
) -> Result<(Vec<SampleOutput>, SampleTimings), ModelError> {
    on_pool(|| sample_on_pool(model, tokenizer, adapters, jobs, mode))
}

fn sample_on_pool(
    model: &Transformer,
    tokenizer: &TextTokenizer,
    adapters: &[&Adapter],
    jobs: &[SampleJob],
    mode: DecodeMode,
) -> Result<(Vec<SampleOutput>, SampleTimings), ModelError> {
    let dev = model.device();
    let quantized = mode == DecodeMode::Fast;
    for (i, j) in jobs.iter().enumerate() {
        if j.prompt.is_empty() {
            return Err(ModelError::Input(format!("request {i}: empty prompt")));
        }
        if j.prompt.len() + j.max_tokens > model.max_seq_len() {
            return Err(ModelError::Input(format!(
                "request {i}: prompt of {} tokens plus max_tokens {} exceeds the context limit of {}",
                j.prompt.len(),
                j.max_tokens,
                model.max_seq_len()
            )));
        }
    }
    // Prefill every prompt in one batch.
    let mut caches: Vec<KvCache> = vec![KvCache::default(); jobs.len()];
    let seqs: Vec<(&[u32], Option<usize>, usize)> = jobs
        .iter()
        .map(|j| (j.prompt.as_slice(), j.adapter, 0))
        .collect();
    let start = Instant::now();
    let batch = PackedBatch::new(&seqs, dev)?;
    // Prompts are prefilled with the f32 weights: the product is compute-bound, and each
    // prompt's KV cache is then exact whatever the batch looks like. When prompt
    // log-probabilities are asked for, the same pass scores the prompts.
    let mut refs: Vec<&mut KvCache> = caches.iter_mut().collect();
    let topk = jobs
        .iter()
        .map(|j| j.topk_prompt_logprobs)
        .max()
        .unwrap_or(0);
    let (first, prompt_lp, prompt_topk) = if topk > 0 || jobs.iter().any(|j| j.prompt_logprobs) {
        // Row i of a prompt predicts token i+1; the last row's target is a placeholder.
        let targets: Vec<u32> = jobs
            .iter()
            .flat_map(|j| j.prompt[1..].iter().copied().chain([0]))
            .collect();
        let rows = targets.len();
        let targets = Tensor::from_vec(targets, (rows, 1), dev)?;
        let (logits, lp, alternatives) =
            model.forward_cached_topk(&batch, adapters, &mut refs, &targets, topk)?;
        let lp: Vec<f32> = lp.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        (logits, Some(lp), alternatives)
    } else {
        // Prompts may go through the decode weights only when those are the f32 weights
        // exactly; each product then picks its kernel by row count (a short prompt is
        // faster through the block kernels, a long one stays f32).
        let through_decode_weights = quantized && model.decode_weights()?.exact();
        (
            model.forward_cached(&batch, adapters, &mut refs, through_decode_weights)?,
            None,
            Vec::new(),
        )
    };
    drop(refs);
    let first: Vec<Vec<f32>> = first.to_dtype(DType::F32)?.to_vec2()?;
    let prefilled = Instant::now();
    let mut streams = Vec::new();
    for (ji, job) in jobs.iter().enumerate() {
        for s in 0..job.num_samples {
            let rng = match job.seed {
                Some(seed) => StdRng::seed_from_u64(seed.wrapping_add(s as u64)),
                None => StdRng::from_os_rng(),
            };
            streams.push(Stream {
                job: ji,
                cache: caches[ji].clone(),
                logits: first[ji].clone(),
                rng,
                out: Generated {
                    tokens: Vec::new(),
                    logprobs: Vec::new(),
                    stop: Stop::Length,
                },
                done: job.max_tokens == 0,
            });
        }
    }
    // On the CPU, decode steps run over plain buffers (see `model::host_decode`).
    let host = HostDecoder::new(model, adapters, quantized)?;
    // Grouped by adapter once, so every decode step's batch has one segment per adapter.
    // The sort is stable: the samples of a request keep their order.
    streams.sort_by_key(|st| jobs[st.job].adapter);
    loop {
        // Each stream picks from its own logits with its own generator, so streams pick
        // in parallel: a pick reads the whole vocabulary row.
        let pick = |st: &mut Stream| -> Result<(), ModelError> {
            let job = &jobs[st.job];
            let tok = job.picker.pick(&st.logits, &mut st.rng);
            st.out.tokens.push(tok as u32);
            st.out.logprobs.push(token_logprob(&st.logits, tok) as f32);
            let stopped = job.stop_tokens.contains(&(tok as u32))
                || tokenizer.eos_ids().contains(&(tok as u32))
                || (!job.stop_strings.is_empty()
                    && hits_stop_string(tokenizer, &st.out.tokens, &job.stop_strings)?);
            if stopped {
                st.out.stop = Stop::Stop;
                st.done = true;
            } else if st.out.tokens.len() >= job.max_tokens {
                st.done = true;
            }
            Ok(())
        };
        if streams.len() > 1 {
            streams
                .par_iter_mut()
                .filter(|s| !s.done)
                .try_for_each(pick)?;
        } else {
            streams.iter_mut().filter(|s| !s.done).try_for_each(pick)?;
        }
        let mut live: Vec<&mut Stream> = streams.iter_mut().filter(|s| !s.done).collect();
        if live.is_empty() {
            break;
        }
        if let Some(host) = &host {
            let rows: Vec<StepRow> = live
                .iter()
                .map(|st| StepRow {
                    token: *st.out.tokens.last().expect("a token"),
                    adapter: jobs[st.job].adapter,
                    position: st.cache.len(),
                })
                .collect();
            let mut refs: Vec<&mut KvCache> = live.iter_mut().map(|st| &mut st.cache).collect();
            let logits = host.step(&rows, &mut refs)?;
            let vocab = logits.len() / rows.len();
            for (st, row) in live.iter_mut().zip(logits.chunks_exact(vocab)) {
                st.logits.clear();
                st.logits.extend_from_slice(row);
            }
            continue;
        }
        let last: Vec<[u32; 1]> = live
            .iter()
            .map(|st| [*st.out.tokens.last().expect("a token")])
            .collect();
        let seqs: Vec<(&[u32], Option<usize>, usize)> = live
            .iter()
            .zip(&last)
            .map(|(st, t)| (t.as_slice(), jobs[st.job].adapter, st.cache.len()))
            .collect();
        let batch = PackedBatch::new(&seqs, dev)?;
        let mut refs: Vec<&mut KvCache> = live.iter_mut().map(|st| &mut st.cache).collect();
        let logits = model.forward_cached(&batch, adapters, &mut refs, quantized)?;
        let rows: Vec<Vec<f32>> = logits.to_dtype(DType::F32)?.to_vec2()?;
        for (st, row) in live.iter_mut().zip(rows) {
            st.logits = row;
        }
    }
    let decoded = Instant::now();
    let rescored = if quantized && !model.decode_weights()?.exact() {
        rescore(model, adapters, jobs, &caches, &mut streams)?;
        decoded.elapsed()
    } else {
        Duration::ZERO
    };
    let timings = SampleTimings {
        prefill: prefilled.duration_since(start),
        decode: decoded.duration_since(prefilled),
        rescore: rescored,
    };
    let mut outputs: Vec<SampleOutput> = Vec::with_capacity(jobs.len());
    let mut offset = 0;
    for job in jobs {
        let n = job.prompt.len();
        let prompt_logprobs = match (&prompt_lp, job.prompt_logprobs) {
            (Some(lp), true) => Some(
                std::iter::once(None)
                    .chain(lp[offset..offset + n - 1].iter().map(|&x| Some(x)))
                    .collect(),
            ),
            _ => None,
        };
        // Position i's alternatives come from row i - 1, like its log-probability.
        let topk_prompt_logprobs =
            (job.topk_prompt_logprobs > 0).then(|| {
                std::iter::once(None)
                    .chain(prompt_topk[offset..offset + n - 1].iter().map(|row| {
                        Some(row.iter().take(job.topk_prompt_logprobs).copied().collect())
                    }))
                    .collect()
            });
        offset += n;
        outputs.push(SampleOutput {
            sequences: Vec::with_capacity(job.num_samples),
            prompt_logprobs,
            topk_prompt_logprobs,
        });
    }
    for st in streams {
        outputs[st.job].sequences.push(st.out);
    }
    Ok((outputs, timings))
}

/// Replaces each stream's log-probabilities with the f32 trainer's. The first token was
/// drawn from the f32 prefill's logits, so its log-probability is already exact; the
/// others are scored in one batched pass over the generated tokens, continuing copies of
/// the prompts' f32 KV caches.
fn rescore(
    model: &Transformer,
    adapters: &[&Adapter],
    jobs: &[SampleJob],
    prompt_caches: &[KvCache],
    streams: &mut [Stream],
) -> Result<(), ModelError> {
    // `streams` is grouped by adapter, so this order is too.
    let order: Vec<usize> = (0..streams.len())
        .filter(|&i| streams[i].out.tokens.len() >= 2)
        .collect();
    if order.is_empty() {
        return Ok(());
    }
    let seqs: Vec<(&[u32], Option<usize>, usize)> = order
        .iter()
        .map(|&i| {
            let toks = &streams[i].out.tokens;
            let job = &jobs[streams[i].job];
            (&toks[..toks.len() - 1], job.adapter, job.prompt.len())
        })
        .collect();
    let batch = PackedBatch::new(&seqs, model.device())?;
    let targets: Vec<u32> = order
        .iter()
        .flat_map(|&i| streams[i].out.tokens[1..].iter().copied())
        .collect();
    let rows = targets.len();
    let targets = Tensor::from_vec(targets, (rows, 1), model.device())?;
    let mut caches: Vec<KvCache> = order
        .iter()
        .map(|&i| prompt_caches[streams[i].job].clone())
        .collect();
    let mut refs: Vec<&mut KvCache> = caches.iter_mut().collect();
    let (_, lp) = model.forward_cached_logprobs(&batch, adapters, &mut refs, &targets)?;
    let lp: Vec<f32> = lp.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    let mut offset = 0;
    for &i in &order {
        let n = streams[i].out.tokens.len() - 1;
        streams[i].out.logprobs[1..].copy_from_slice(&lp[offset..offset + n]);
        offset += n;
    }
    Ok(())
}

/// Whether the text ends in a stop string. Checked after every token, so only a window
/// that can hold the newest occurrence is decoded: a stop string of `L` bytes spans at
/// most `L` tokens (every token is at least one byte), plus one for a split character.
fn hits_stop_string(
    tokenizer: &TextTokenizer,
    tokens: &[u32],
    stops: &[String],
) -> Result<bool, ModelError> {
    let longest = stops.iter().map(String::len).max().unwrap_or(0);
    let window = &tokens[tokens.len().saturating_sub(longest + 1)..];
    let text = tokenizer.decode(window)?;
    Ok(stops
        .iter()
        .any(|s| !s.is_empty() && text.contains(s.as_str())))
}
