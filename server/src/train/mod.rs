//! Training: Tinker's losses, AdamW, and the multi-adapter forward/backward pass over a
//! batch of datums.

pub mod adamw;
pub mod custom;
pub mod loss;
pub mod reverse_kl;

use candle_core::Tensor;
use rayon::prelude::*;

use crate::model::cpu::pool::on_pool;
use crate::model::{Adapter, AdapterGrads, ModelError, PackedBatch, Transformer};
pub use loss::{CustomInputs, CustomLossRef, Loss, LossEval, TokenInputs};

/// Errors of training operations.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// Bad input: wrong lengths, missing loss inputs, non-finite values.
    #[error("{0}")]
    Input(String),
    /// The model failed.
    #[error(transparent)]
    Model(#[from] ModelError),
}

impl From<candle_core::Error> for TrainError {
    fn from(e: candle_core::Error) -> Self {
        TrainError::Model(ModelError::Candle(e))
    }
}

/// One datum of a forward/backward batch.
#[derive(Debug, Clone)]
pub struct DatumJob {
    /// Input token ids.
    pub tokens: Vec<u32>,
    /// Target ids, `tokens.len() * k`, row-major.
    pub targets: Vec<u32>,
    /// Targets per position (1 except for cross-entropy over several targets).
    pub k: usize,
    /// Index of the datum's adapter in the adapter list.
    pub adapter: usize,
    /// The loss of this datum.
    pub loss: Loss,
    /// Its per-token inputs.
    pub inputs: TokenInputs,
}

/// The per-datum result.
#[derive(Debug, Clone, PartialEq)]
pub struct DatumResult {
    /// Target log-probabilities (`tokens.len() * k`).
    pub logprobs: Vec<f32>,
    /// Per-token loss terms.
    pub elementwise_loss: Vec<f32>,
    /// The datum's loss.
    pub loss: f64,
    /// A custom loss's metrics on this datum, in the loss's order.
    pub metrics: Vec<f64>,
}

/// Most input tokens in one pass over the model. A batch with more runs as several
/// passes, each of whole datums (a datum longer than this runs alone). The losses are
/// sums over datums, so the gradients of the passes add up to the gradient of the whole
/// batch, up to float summation order.
///
/// The bound is on memory. A pass keeps about 1 MB of activations per token for the
/// backward pass (SmolLM2-135M, f32). Measured peak RSS: 1.5 GiB at 512 tokens,
/// 4.6 GiB at 2048, 8.6 GiB at 4096. A 33K-token request (one doctor_patient_queue step)
/// peaked at 14 GB as one pass. Tokens per second stay flat from 512 tokens per pass up.
pub const PASS_TOKENS: usize = 1024;

/// Most input tokens in one pass on a GPU: fewer passes, each a fixed set of kernel
/// launches, and larger products for the GPU to fill, while the activations of this
/// many tokens (about 1 MB each, as above) fit a training GPU's memory beside the model.
pub const GPU_PASS_TOKENS: usize = 8192;

/// The most input tokens of one pass of `model`: [`GPU_PASS_TOKENS`] on a GPU,
/// [`PASS_TOKENS`] otherwise.
pub fn pass_tokens(model: &Transformer) -> usize {
    if model.device().is_cuda() {
        GPU_PASS_TOKENS
    } else {
        PASS_TOKENS
    }
}

/// What one forward/backward call produced, adapter by adapter.
#[derive(Debug)]
pub struct Trained {
    /// Each datum's result (empty for the datums of a failed adapter).
    pub results: Vec<DatumResult>,
    /// Each adapter's gradient (empty without `with_grad`, and for a failed adapter).
    pub grads: Vec<AdapterGrads>,
    /// Why an adapter's datums failed, if they did: a custom loss that failed (or was
    /// over its budget) on one of them. The other adapters' results stand.
    pub failed: Vec<Option<String>>,
}

/// Runs a batch whose datums may belong to different adapters (and use different
/// losses) through the model, in passes of at most [`pass_tokens`] tokens. With
/// `with_grad`, returns each adapter's gradient; adapters without datums get an empty
/// gradient. Any failure fails the call.
pub fn forward_backward(
    model: &Transformer,
    adapters: &[&Adapter],
    jobs: &[DatumJob],
    with_grad: bool,
) -> Result<(Vec<DatumResult>, Vec<AdapterGrads>), TrainError> {
    let out = forward_backward_in_passes(model, adapters, jobs, with_grad, pass_tokens(model))?;
    match out.failed.into_iter().flatten().next() {
        Some(why) => Err(TrainError::Input(why)),
        None => Ok((out.results, out.grads)),
    }
}

/// [`forward_backward`] with passes of at most `pass_tokens` input tokens, where a
/// custom loss failing on one adapter's datums fails that adapter alone ([`Trained`]):
/// the shared model pass is not repeated for the others.
pub fn forward_backward_in_passes(
    model: &Transformer,
    adapters: &[&Adapter],
    jobs: &[DatumJob],
    with_grad: bool,
    pass_tokens: usize,
) -> Result<Trained, TrainError> {
    on_pool(|| forward_backward_on_pool(model, adapters, jobs, with_grad, pass_tokens))
}

/// `group` cut into consecutive passes of at most `budget` tokens, `tokens(i)` being
/// datum `i`'s; a datum over the budget is a pass of its own.
fn passes(group: &[usize], tokens: impl Fn(usize) -> usize, budget: usize) -> Vec<&[usize]> {
    let mut out = Vec::new();
    let (mut start, mut used) = (0, 0);
    for (at, &i) in group.iter().enumerate() {
        let n = tokens(i);
        if at > start && used + n > budget {
            out.push(&group[start..at]);
            (start, used) = (at, 0);
        }
        used += n;
    }
    if start < group.len() {
        out.push(&group[start..]);
    }
    out
}

fn forward_backward_on_pool(
    model: &Transformer,
    adapters: &[&Adapter],
    jobs: &[DatumJob],
    with_grad: bool,
    pass_tokens: usize,
) -> Result<Trained, TrainError> {
    if jobs.is_empty() {
        return Err(TrainError::Input("no data".into()));
    }
    for (i, j) in jobs.iter().enumerate() {
        if j.tokens.is_empty() {
            return Err(TrainError::Input(format!(
                "datum {i} has an empty model input"
            )));
        }
        if j.k == 0 || j.targets.len() != j.tokens.len() * j.k {
            return Err(TrainError::Input(format!(
                "datum {i}: target_tokens has {} values for {} input tokens",
                j.targets.len(),
                j.tokens.len()
            )));
        }
        if j.adapter >= adapters.len() {
            return Err(TrainError::Input(format!("datum {i}: unknown adapter")));
        }
        if j.loss.is_rl() && j.k != 1 {
            return Err(TrainError::Input(format!(
                "datum {i}: RL losses take one target per position"
            )));
        }
        j.inputs
            .validate(&j.loss, j.targets.len())
            .map_err(|e| TrainError::Input(format!("datum {i}: {e}")))?;
    }
    // Group datums by adapter so each adapter's rows are contiguous; keep each group's
    // width k uniform by packing different k separately.
    let mut order: Vec<usize> = (0..jobs.len()).collect();
    order.sort_by_key(|&i| (jobs[i].k, jobs[i].adapter));
    let mut results: Vec<Option<DatumResult>> = vec![None; jobs.len()];
    let mut grads = vec![AdapterGrads::default(); adapters.len()];
    let mut losses = LossBudgets::new(adapters.len());
    let mut start = 0;
    while start < order.len() {
        let k = jobs[order[start]].k;
        let end = order[start..]
            .iter()
            .position(|&i| jobs[i].k != k)
            .map_or(order.len(), |p| start + p);
        for pass in passes(&order[start..end], |i| jobs[i].tokens.len(), pass_tokens) {
            run_group(
                model,
                adapters,
                jobs,
                pass,
                k,
                with_grad,
                &mut results,
                &mut grads,
                &mut losses,
            )?;
        }
        start = end;
    }
    for (grad, failed) in grads.iter_mut().zip(&losses.failed) {
        if failed.is_some() {
            *grad = AdapterGrads::default();
        }
    }
    Ok(Trained {
        results: results
            .into_iter()
            .map(|r| r.expect("every datum ran"))
            .collect(),
        grads,
        failed: losses.failed,
    })
}

/// Per adapter: why its custom loss failed, and the elements its evaluations used.
struct LossBudgets {
    failed: Vec<Option<String>>,
    used: Vec<usize>,
}

impl LossBudgets {
    fn new(adapters: usize) -> Self {
        Self {
            failed: vec![None; adapters],
            used: vec![0; adapters],
        }
    }

    /// Evaluates datum `job`'s loss unless its adapter has already failed; a failure (or
    /// a panic, or the adapter's evaluations passing [`custom::MAX_PASS_ELEMENTS`])
    /// marks the adapter failed and yields `None`.
    fn evaluate(&mut self, job: &DatumJob, lp: &[f64]) -> Option<LossEval> {
        let a = job.adapter;
        if self.failed[a].is_some() {
            return None;
        }
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            loss::evaluate(&job.loss, lp, &job.inputs)
        }));
        let why = match outcome {
            Ok(Ok(ev)) => {
                self.used[a] = self.used[a].saturating_add(ev.elements);
                if self.used[a] <= custom::MAX_PASS_ELEMENTS {
                    return Some(ev);
                }
                format!(
                    "the custom loss's evaluations in this request exceed {} tensor \
                     elements in one pass; send fewer or shorter datums per request",
                    custom::MAX_PASS_ELEMENTS
                )
            }
            Ok(Err(e)) => e.to_string(),
            Err(panic) => {
                let msg = crate::panics::panic_message(panic.as_ref());
                tracing::error!("a loss evaluation panicked (contained): {msg}");
                format!("internal error evaluating the loss: {msg}")
            }
        };
        self.failed[a] = Some(why);
        None
    }
}

/// One part of a pass after its forward: the packed rows' target log-probabilities and,
/// with gradients, the tape its backward needs.
struct Forwarded {
    lp: Vec<f64>,
    tape: Option<crate::model::Tape>,
    rows: usize,
}

/// The forward of datums `part` (all with `k` targets per position).
fn forward_part(
    model: &Transformer,
    adapters: &[&Adapter],
    jobs: &[DatumJob],
    part: &[usize],
    k: usize,
    with_grad: bool,
) -> Result<Forwarded, TrainError> {
    let dev = model.device();
    let seqs: Vec<(&[u32], Option<usize>, usize)> = part
        .iter()
        .map(|&i| (jobs[i].tokens.as_slice(), Some(jobs[i].adapter), 0))
        .collect();
    let batch = PackedBatch::new(&seqs, dev)?;
    let targets: Vec<u32> = part
        .iter()
        .flat_map(|&i| jobs[i].targets.iter().copied())
        .collect();
    let vocab = model.config.vocab_size;
    if let Some(bad) = targets.iter().find(|&&t| t as usize >= vocab) {
        return Err(TrainError::Input(format!(
            "target token {bad} is out of range for a vocabulary of {vocab}"
        )));
    }
    let rows = batch.rows();
    let targets = Tensor::from_vec(targets, (rows, k), dev)?;
    let (lp, tape) = model.forward_logprobs(&batch, adapters, &targets, with_grad)?;
    let lp: Vec<f64> = lp
        .to_dtype(candle_core::DType::F64)?
        .flatten_all()?
        .to_vec1()?;
    Ok(Forwarded { lp, tape, rows })
}

/// One pass: datums `group` (all with `k` targets per position) forward, their losses,
/// and backward into `grads`.
///
/// On a CPU pool of several threads the pass runs as that many parts of whole datums,
/// side by side ([`parts_for_threads`]): each part's products are as large as the
/// kernels need, and the threads stay busy for a whole part instead of meeting at every
/// operation. The losses are evaluated in datum order between the two halves, so a
/// custom loss's budget is spent as in one pass, and the parts' gradients are added in
/// part order, so a pass's result does not depend on which thread ran what.
#[allow(clippy::too_many_arguments)]
fn run_group(
    model: &Transformer,
    adapters: &[&Adapter],
    jobs: &[DatumJob],
    group: &[usize],
    k: usize,
    with_grad: bool,
    results: &mut [Option<DatumResult>],
    grads: &mut [AdapterGrads],
    losses: &mut LossBudgets,
) -> Result<(), TrainError> {
    let threads = if model.backend() == crate::model::Backend::Cpu {
        rayon::current_num_threads()
    } else {
        1
    };
    let parts = parts_for_threads(group, |i| jobs[i].tokens.len(), threads);
    let forwards: Vec<Result<Forwarded, TrainError>> = parts
        .par_iter()
        .map(|part| forward_part(model, adapters, jobs, part, k, with_grad))
        .collect();
    let mut backwards = Vec::with_capacity(parts.len());
    for (part, forwarded) in parts.iter().zip(forwards) {
        let Forwarded { lp, tape, rows } = forwarded?;
        let mut dlp = Vec::with_capacity(lp.len());
        let mut offset = 0;
        for &i in *part {
            let n = jobs[i].targets.len();
            let slice = &lp[offset..offset + n];
            results[i] = Some(match losses.evaluate(&jobs[i], slice) {
                Some(ev) => {
                    dlp.extend_from_slice(&ev.grad);
                    DatumResult {
                        logprobs: slice.iter().map(|&x| x as f32).collect(),
                        elementwise_loss: ev.elementwise,
                        loss: ev.total,
                        metrics: ev.metrics,
                    }
                }
                // Its adapter failed: the datum adds nothing to any gradient.
                None => {
                    dlp.resize(dlp.len() + n, 0.0);
                    DatumResult {
                        logprobs: Vec::new(),
                        elementwise_loss: Vec::new(),
                        loss: 0.0,
                        metrics: Vec::new(),
                    }
                }
            });
            offset += n;
        }
        if let Some(tape) = tape {
            backwards.push((tape, dlp, rows));
        }
    }
    let dev = model.device();
    let part_grads: Vec<Result<Vec<AdapterGrads>, TrainError>> = backwards
        .into_par_iter()
        .map(|(tape, dlp, rows)| {
            let dlp = Tensor::from_vec(dlp, (rows, k), dev)?.to_dtype(model.weights.dtype())?;
            Ok(model.backward(tape, adapters, &dlp)?)
        })
        .collect();
    for part in part_grads {
        for (a, g) in part?.into_iter().enumerate() {
            grads[a].merge(g)?;
        }
    }
    Ok(())
}

/// `group` cut into at most `threads` consecutive parts of whole datums with about
/// equal tokens (`tokens(i)` being datum `i`'s), to run side by side. The cut depends
/// only on the datums and the thread count.
fn parts_for_threads(
    group: &[usize],
    tokens: impl Fn(usize) -> usize,
    threads: usize,
) -> Vec<&[usize]> {
    let parts = threads.clamp(1, group.len().max(1));
    let total: usize = group.iter().map(|&i| tokens(i)).sum();
    let mut out = Vec::with_capacity(parts);
    let (mut start, mut used) = (0, 0);
    for (at, &i) in group.iter().enumerate() {
        // Close the current part once it holds its share of the tokens so far, leaving
        // at least one datum for each part still to come.
        let share = total * (out.len() + 1) / parts;
        let left = group.len() - at;
        let parts_left = parts - out.len() - 1;
        if at > start && parts_left > 0 && (used >= share || left == parts_left) {
            out.push(&group[start..at]);
            start = at;
        }
        used += tokens(i);
    }
    if start < group.len() {
        out.push(&group[start..]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{parts_for_threads, passes};

    #[test]
    fn parts_for_threads_split_whole_datums_evenly() {
        let tokens = [128, 128, 128, 128];
        let group: Vec<usize> = (0..4).collect();
        assert_eq!(
            parts_for_threads(&group, |i| tokens[i], 2),
            vec![&[0, 1][..], &[2, 3]]
        );
        assert_eq!(
            parts_for_threads(&group, |i| tokens[i], 1),
            vec![&group[..]]
        );
        // More threads than datums: a datum a part.
        assert_eq!(parts_for_threads(&group, |i| tokens[i], 16).len(), 4);
        // One long datum and short ones: the long one is a part of its own.
        let uneven = [300, 10, 10, 10, 10];
        let group: Vec<usize> = (0..5).collect();
        assert_eq!(
            parts_for_threads(&group, |i| uneven[i], 2),
            vec![&[0][..], &[1, 2, 3, 4]]
        );
        // Every datum lands in exactly one part, in order, and no part is empty.
        for threads in 1..8 {
            for n in 1..9 {
                let group: Vec<usize> = (0..n).collect();
                let parts = parts_for_threads(&group, |i| 1 + (i * 7) % 5, threads);
                assert!(parts.len() <= threads && parts.iter().all(|p| !p.is_empty()));
                assert_eq!(parts.concat(), group);
            }
        }
        assert!(parts_for_threads(&[], |_| 1, 2).is_empty());
    }

    #[test]
    fn passes_hold_whole_datums_within_the_budget() {
        let lengths = [5, 4, 3, 9, 1, 1];
        let group: Vec<usize> = (0..lengths.len()).collect();
        let cut = passes(&group, |i| lengths[i], 9);
        // 5 + 4; 3 (3 + 9 is over); 9 alone; 1 + 1.
        assert_eq!(cut, vec![&[0, 1][..], &[2], &[3], &[4, 5]]);
        // A datum over the budget still runs, alone.
        assert_eq!(passes(&group, |i| lengths[i], 2).len(), 5);
        assert_eq!(passes(&group, |i| lengths[i], usize::MAX), vec![&group[..]]);
        assert!(passes(&[], |_| 1, 4).is_empty());
    }
}
