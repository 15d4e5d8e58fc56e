//! What a sampling request is and returns, and [`sample`]: run a set of requests to
//! completion, decoding them together (see [`super::running`] for how: every prompt is
//! prefilled once, each of its samples gets a copy of the cache, and all live sequences,
//! whatever their adapters, advance together in one forward step per token).

use std::sync::Arc;
use std::time::Duration;

use super::logits::Picker;
use super::running::{Admission, Finished, RunningDecode};
use crate::model::cpu::bf16::Precision;
use crate::model::cpu::pool::on_pool;
use crate::model::cpu::quant::BlockArith;
use crate::model::transformer::TopK;
use crate::model::{Adapter, Backend, ModelError, TextTokenizer, Transformer};

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
    /// weights rescore every sampled token in batched passes afterwards, so reported
    /// log-probabilities are the trainer's either way.
    #[default]
    Fast,
    /// The trainer's own weights and products (f32, or bf16 under `--precision bf16`)
    /// pick the tokens: the sampling distribution is exactly the trained policy, without
    /// the block-quantized kernels' speed.
    Exact,
}

impl DecodeMode {
    /// The mode `model` decodes with when `self` is asked for: the block-quantized
    /// decode weights belong to the CPU backend, so the device backend always decodes
    /// with the model's own weights (`Exact`). So does bf16 wherever the block kernels
    /// do not compute the trainer's bf16 products ([`Transformer::block_arith`] is f32):
    /// with the `VDPBF16PS` kernel (a CPU with AVX512-BF16 and no AMX) the trainer's
    /// packed products are the faster way to the same bits (`lathe bench gemm` measures
    /// both), and anywhere else f32 block products would not be the trainer's.
    pub fn on(self, model: &Transformer) -> Self {
        let bf16 = model.precision() == Precision::Bf16;
        match model.backend() {
            Backend::Cpu if bf16 && model.block_arith() == BlockArith::F32 => DecodeMode::Exact,
            Backend::Cpu => self,
            Backend::Device => DecodeMode::Exact,
        }
    }

    /// The mode to serve with when `self` is asked for on this CPU: `Fast` needs the
    /// vectorised block-quantized kernels ([`crate::model::cpu::quant::has_fast_kernels`]);
    /// without them the f32 weights decode faster, so `Exact` is used (same reported
    /// log-probabilities; for Q4_1 models, the same tokens too).
    pub fn on_this_cpu(self) -> Self {
        if self == DecodeMode::Fast && !crate::model::cpu::quant::has_fast_kernels() {
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
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SampleOutput {
    /// `num_samples` sequences.
    pub sequences: Vec<Generated>,
    /// Prompt log-probabilities (first entry `None`), when requested.
    pub prompt_logprobs: Option<Vec<Option<f32>>>,
    /// The `topk_prompt_logprobs` most likely tokens at every prompt position (first
    /// entry `None`) with their log-probabilities, most likely first, when requested.
    pub topk_prompt_logprobs: Option<Vec<Option<TopK>>>,
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
    let shared: Vec<Arc<Adapter>> = adapters.iter().map(|a| Arc::new((*a).clone())).collect();
    let mut admissions = Vec::with_capacity(jobs.len());
    for (i, job) in jobs.iter().enumerate() {
        let adapter = match job.adapter {
            Some(a) => Some(shared.get(a).cloned().ok_or_else(|| {
                ModelError::Input(format!("request {i}: adapter {a} out of range"))
            })?),
            None => None,
        };
        admissions.push(Admission {
            key: i,
            job: job.clone(),
            adapter,
            progress: None,
        });
    }
    let mut running = RunningDecode::new(mode);
    let mut outputs: Vec<Option<SampleOutput>> = vec![None; jobs.len()];
    let mut keep = |finished: Vec<Finished<usize>>| -> Result<(), ModelError> {
        for (i, result) in finished {
            outputs[i] = Some(result.map_err(|e| match e {
                ModelError::Input(m) => ModelError::Input(format!("request {i}: {m}")),
                other => other,
            })?);
        }
        Ok(())
    };
    keep(running.admit(model, admissions))?;
    while !running.is_empty() {
        keep(running.step(model, tokenizer))?;
        keep(running.rescore_all(model))?;
    }
    let outputs = outputs
        .into_iter()
        .map(|o| o.expect("every request finishes"))
        .collect();
    Ok((outputs, running.timings()))
}
