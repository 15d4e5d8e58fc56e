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
/// The bound is on memory: a pass keeps every token's activations for the backward
/// pass, so without it one large request could take the host's memory.
/// ARCHITECTURE.md has the sizing and the measured peaks.
pub const PASS_TOKENS: usize = 1024;

/// Most input tokens in one pass on a GPU: fewer passes, each a fixed set of kernel
/// launches, and larger products for the GPU to fill, while the activations of this
/// many tokens of the default model fit a training GPU's memory beside it
/// (ARCHITECTURE.md has the sizing).
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
    let threads = if model.backend() == crate::model::Backend::Cpu {
        rayon::current_num_threads()
    } else {
        1
    };
    let tokens = |i: usize| jobs[i].tokens.len();
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
        let units = adapter_units(
            &order[start..end],
            |i| jobs[i].adapter,
            tokens,
            pass_tokens,
            threads,
        );
        let unit_tokens: Vec<usize> = units
            .iter()
            .map(|u| u.iter().map(|&i| tokens(i)).sum())
            .collect();
        let ids: Vec<usize> = (0..units.len()).collect();
        for pass in passes(&ids, |u| unit_tokens[u], pass_tokens) {
            let pass: Vec<&[usize]> = pass.iter().map(|&u| units[u]).collect();
            run_group(
                model,
                adapters,
                jobs,
                Pass {
                    units: &pass,
                    k,
                    threads,
                    with_grad,
                },
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

/// The adapter list a part's model pass sees: one slot per unit, holding the unit's
/// adapter. A unit is then a segment of its own, and the backward returns each unit's
/// gradient apart, for [`run_group`] to add up in unit order.
fn unit_slots<'a>(
    adapters: &[&'a Adapter],
    jobs: &[DatumJob],
    units: &[&[usize]],
) -> Vec<&'a Adapter> {
    units.iter().map(|u| adapters[jobs[u[0]].adapter]).collect()
}

/// The forward of the datums of `units` (all with `k` targets per position).
fn forward_part(
    model: &Transformer,
    adapters: &[&Adapter],
    jobs: &[DatumJob],
    units: &[&[usize]],
    k: usize,
    with_grad: bool,
) -> Result<Forwarded, TrainError> {
    let dev = model.device();
    let seqs: Vec<(&[u32], Option<usize>, usize)> = units
        .iter()
        .enumerate()
        .flat_map(|(slot, u)| {
            u.iter()
                .map(move |&i| (jobs[i].tokens.as_slice(), Some(slot), 0))
        })
        .collect();
    let batch = PackedBatch::new(&seqs, dev)?;
    let targets: Vec<u32> = units
        .iter()
        .flat_map(|u| u.iter())
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
    let slots = unit_slots(adapters, jobs, units);
    let (lp, tape) = model.forward_logprobs(&batch, &slots, &targets, with_grad)?;
    let lp: Vec<f64> = lp
        .to_dtype(candle_core::DType::F64)?
        .flatten_all()?
        .to_vec1()?;
    Ok(Forwarded { lp, tape, rows })
}

/// One pass over the model: its units (in order), their targets per position, the
/// threads to spread its parts over, and whether it keeps gradients.
struct Pass<'a> {
    units: &'a [&'a [usize]],
    k: usize,
    threads: usize,
    with_grad: bool,
}

/// One pass: its datums forward, their losses, and backward into `grads`.
///
/// On a CPU pool of several threads the pass runs as that many parts of whole units,
/// side by side ([`parts_for_threads`]): each part's products are as large as the
/// kernels need, and the threads stay busy for a whole part instead of meeting at every
/// operation. The losses are evaluated in datum order between the two halves, so a
/// custom loss's budget is spent as in one pass, and the units' gradients are added in
/// unit order, so a pass's result depends neither on which thread ran what nor on how
/// the units were grouped into parts.
fn run_group(
    model: &Transformer,
    adapters: &[&Adapter],
    jobs: &[DatumJob],
    pass: Pass<'_>,
    results: &mut [Option<DatumResult>],
    grads: &mut [AdapterGrads],
    losses: &mut LossBudgets,
) -> Result<(), TrainError> {
    let Pass {
        units,
        k,
        threads,
        with_grad,
    } = pass;
    let ids: Vec<usize> = (0..units.len()).collect();
    let unit_tokens = |u: usize| units[u].iter().map(|&i| jobs[i].tokens.len()).sum();
    let parts: Vec<Vec<&[usize]>> = parts_for_threads(&ids, unit_tokens, threads)
        .into_iter()
        .map(|p| p.iter().map(|&u| units[u]).collect())
        .collect();
    let forwards: Vec<Result<Forwarded, TrainError>> = parts
        .par_iter()
        .map(|part| forward_part(model, adapters, jobs, part, k, with_grad))
        .collect();
    let mut backwards = Vec::with_capacity(parts.len());
    for (part, forwarded) in parts.iter().zip(forwards) {
        let Forwarded { lp, tape, rows } = forwarded?;
        let mut dlp = Vec::with_capacity(lp.len());
        let mut offset = 0;
        for &i in part.iter().flat_map(|u| u.iter()) {
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
            backwards.push((part, tape, dlp, rows));
        }
    }
    let part_grads: Vec<_> = backwards
        .into_par_iter()
        .map(|(part, tape, dlp, rows)| {
            let dlp = Tensor::from_vec(dlp, (rows, k), model.device())
                .and_then(|d| d.to_dtype(model.weights.dtype()));
            let unit_grads = match dlp {
                Ok(dlp) => model.backward(tape, &unit_slots(adapters, jobs, part), &dlp),
                Err(e) => Err(e.into()),
            };
            (part, unit_grads)
        })
        .collect();
    for (part, unit_grads) in part_grads {
        for (unit, g) in part.iter().zip(unit_grads?) {
            grads[jobs[unit[0]].adapter].merge(g)?;
        }
    }
    Ok(())
}

/// `group` (datums sorted by adapter) cut into units, each adapter's own datums first
/// cut into passes of at most `budget` tokens ([`passes`]), then each of those into
/// `threads` parts ([`parts_for_threads`]). A unit is one segment of a pass and its
/// gradient is computed apart; an adapter's gradient is the sum of its units' gradients
/// in unit order. Since an adapter's units depend on its own datums alone (and the
/// budget and thread count), never on the other adapters' datums that happen to share
/// its batch, neither do its gradient's last bits: a run replayed from a checkpoint
/// trains to the same weights whatever other sessions did beside it.
fn adapter_units(
    group: &[usize],
    adapter: impl Fn(usize) -> usize,
    tokens: impl Fn(usize) -> usize + Copy,
    budget: usize,
    threads: usize,
) -> Vec<&[usize]> {
    let mut out = Vec::new();
    for run in group.chunk_by(|&a, &b| adapter(a) == adapter(b)) {
        for pass in passes(run, tokens, budget) {
            let total: usize = pass.iter().map(|&i| tokens(i)).sum();
            let parts = threads.min((total / MIN_UNIT_TOKENS).max(1));
            out.extend(parts_for_threads(pass, tokens, parts));
        }
    }
    out
}

/// Fewest tokens a unit is cut to ([`adapter_units`]). Each unit keeps a whole gradient
/// of its adapter until the pass is summed, so a pass holds at most its adapters plus
/// `budget / MIN_UNIT_TOKENS` of them, however many threads the pool has; a part this
/// small is not worth a thread of its own anyway.
const MIN_UNIT_TOKENS: usize = 64;

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
    use super::{adapter_units, parts_for_threads, passes};

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
    fn an_adapters_units_depend_on_its_own_datums_alone() {
        let tokens = [100, 60, 300, 50, 90, 150, 40];
        let adapter = [0, 0, 0, 1, 1, 1, 1];
        let group: Vec<usize> = (0..tokens.len()).collect();
        let units = adapter_units(&group, |i| adapter[i], |i| tokens[i], 300, 2);
        // Adapter 0: passes [100, 60] and [300], the first in two parts; adapter 1:
        // passes [50, 90, 150] and [40], the first in two parts, the second too short
        // (under 64 tokens) to be cut.
        let want: Vec<&[usize]> = vec![&[0], &[1], &[2], &[3, 4], &[5], &[6]];
        assert_eq!(units, want);
        // No more units than 64-token pieces, whatever the threads.
        let many = adapter_units(&group[3..], |i| adapter[i], |i| tokens[i], 300, 16);
        let want_many: Vec<&[usize]> = vec![&[3], &[4], &[5], &[6]];
        assert_eq!(many, want_many);
        // The same units with no neighbour before them, or with another one.
        let alone = adapter_units(&group[3..], |i| adapter[i], |i| tokens[i], 300, 2);
        assert_eq!(alone, &want[3..]);
        let mut other = vec![7];
        other.extend(3..7);
        let tokens_with = |i: usize| if i == 7 { 245 } else { tokens[i] };
        let with = adapter_units(
            &other,
            |i| if i == 7 { 0 } else { adapter[i] },
            tokens_with,
            300,
            2,
        );
        assert_eq!(&with[1..], &want[3..]);
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
