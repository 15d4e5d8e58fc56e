//! What a finished operation answers, as domain values. The worker produces these and
//! the engine stores them; only the api layer turns them into wire types (JSON or
//! protobuf, as the client asks), so the worker never writes the wire.

use lathe_sdk::types::CheckpointKind;

use super::Failure;
use crate::sample::SampleOutput;
use crate::train::adamw::StepReport;
use crate::train::reverse_kl::KlResult;

/// A successful operation's result.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    /// `create_model`: the new run.
    ModelCreated {
        /// The run id.
        model_id: String,
    },
    /// `load_weights`: the checkpoint loaded.
    WeightsLoaded {
        /// Its `tinker://` URI.
        path: String,
    },
    /// `optim_step`.
    Optimized(StepReport),
    /// `save_weights` or `save_weights_for_sampler` with a name.
    Saved {
        /// Which kind of checkpoint.
        kind: CheckpointKind,
        /// Its `tinker://` URI.
        path: String,
    },
    /// `save_weights_for_sampler` without a name: an in-memory snapshot.
    SamplerSnapshot {
        /// The sampling session on it.
        sampling_session_id: String,
    },
    /// `unload_model`.
    Unloaded {
        /// The run id.
        model_id: String,
    },
    /// `forward` or `forward_backward`.
    Forward(ForwardResult),
    /// `asample`.
    Sample(SampleOutput),
    /// MinT's reverse-KL step.
    ReverseKl(Vec<KlResult>),
    /// `create_custom_loss`: the loss's id.
    CustomLossCreated {
        /// Names the loss in `forward_backward` requests.
        loss_id: String,
    },
    /// MinT's `checkpoints/interpolate`: the new sampler checkpoint.
    Interpolated {
        /// Its `tinker://` URI.
        path: String,
        /// The sources, as asked.
        source_paths: Vec<String>,
        /// Their coefficients.
        coefficients: Vec<f64>,
    },
}

/// The outputs of a forward pass over a request's datums, in order.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ForwardResult {
    /// One entry per datum.
    pub datums: Vec<DatumOutput>,
    /// The batch's loss: the sum of the datums' losses.
    pub loss: f64,
    /// What a custom loss adds: its metrics and its linearised loss.
    pub custom: Option<CustomTotals>,
}

/// A custom loss's totals over a request's datums.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct CustomTotals {
    /// The metric keys (`custom/<name>:sum` or `:mean`), in the loss's order.
    pub keys: Vec<String>,
    /// Each metric summed over the datums (a `:mean` is divided when answered).
    pub sums: Vec<f64>,
    /// The sum of the per-token terms `dLoss/dlp * lp` (the loss's linearisation, what
    /// tinker's client-side path reports as `surrogate_loss:sum`).
    pub surrogate: f64,
}

/// One datum's outputs. Both arrays hold `positions * k` values, row-major, where `k`
/// is the number of targets per position (1 for the usual `[n]` targets).
#[derive(Debug, Clone, PartialEq)]
pub struct DatumOutput {
    /// Target log-probabilities.
    pub logprobs: Vec<f32>,
    /// Per-token loss terms.
    pub elementwise_loss: Vec<f32>,
    /// Targets per position.
    pub k: usize,
}

impl ForwardResult {
    /// Appends the results of the request's next pass (the losses are sums over
    /// datums, so they add).
    pub fn append(&mut self, next: ForwardResult) {
        self.datums.extend(next.datums);
        self.loss += next.loss;
        match (&mut self.custom, next.custom) {
            (Some(mine), Some(theirs)) => {
                mine.sums
                    .iter_mut()
                    .zip(theirs.sums)
                    .for_each(|(a, b)| *a += b);
                mine.surrogate += theirs.surrogate;
            }
            (mine, theirs) => *mine = mine.take().or(theirs),
        }
    }
}

impl Reply {
    /// Roughly the heap bytes the result holds, for the futures table's budget.
    pub fn approx_bytes(&self) -> usize {
        const BASE: usize = 64;
        match self {
            Reply::ModelCreated { model_id: s }
            | Reply::WeightsLoaded { path: s }
            | Reply::Saved { path: s, .. }
            | Reply::SamplerSnapshot {
                sampling_session_id: s,
            }
            | Reply::Unloaded { model_id: s }
            | Reply::CustomLossCreated { loss_id: s } => BASE + s.len(),
            Reply::Optimized(_) => BASE,
            Reply::ReverseKl(r) => BASE + 32 * r.len(),
            Reply::Interpolated {
                path, source_paths, ..
            } => {
                BASE + path.len()
                    + source_paths
                        .iter()
                        .map(|p| BASE + p.len() + 8)
                        .sum::<usize>()
            }
            Reply::Forward(f) => {
                BASE + f
                    .datums
                    .iter()
                    .map(|d| BASE + 4 * (d.logprobs.len() + d.elementwise_loss.len()))
                    .sum::<usize>()
                    + f.custom.as_ref().map_or(0, |c| {
                        c.keys.iter().map(|k| BASE + k.len() + 8).sum::<usize>()
                    })
            }
            Reply::Sample(s) => {
                let per_position = |n: usize| 8 * n;
                BASE + s
                    .sequences
                    .iter()
                    .map(|g| BASE + per_position(g.tokens.len()))
                    .sum::<usize>()
                    + s.prompt_logprobs
                        .as_ref()
                        .map_or(0, |p| per_position(p.len()))
                    + s.topk_prompt_logprobs.as_ref().map_or(0, |rows| {
                        rows.iter()
                            .map(|r| BASE + r.as_ref().map_or(0, |r| per_position(r.len())))
                            .sum()
                    })
            }
        }
    }

    /// The forward result, for joining a request's passes.
    pub fn into_forward(self) -> Result<ForwardResult, Failure> {
        match self {
            Reply::Forward(f) => Ok(f),
            _ => Err(Failure::server(
                "internal error: a forward pass answered another kind of result",
            )),
        }
    }
}
