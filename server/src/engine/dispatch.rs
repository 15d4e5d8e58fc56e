//! Dispatching work to the worker and taking its outcomes back: `pump` forms the next
//! batch (fair share across keys, a forward request cut into passes, decoding one step at
//! a time, access checked once more for every checkpoint the batch reads), `complete`
//! resolves futures, joins a request's passes and notes what is still decoding.

use std::path::PathBuf;
use std::time::Instant;

use crate::train::DatumJob;
use crate::worker::{
    Batch, BatchReport, Failure, ForwardResult, Outcome, Pass, Reply, RunOp, RunWork, SampleWork,
    SamplerSource,
};

use super::run_queue::UNORDERED;
use super::runs::MAX_SNAPSHOTS_PER_RUN;
use super::scheduler::{self, Candidate, Kind, Limits, MIN_CHARGE};
use super::state::{After, Inflight, ACTIVE_WINDOW, WORKER_GONE};
use super::Engine;
use super::LoraWidths;
use crate::model::LoraSpec;
use lathe_sdk::types::CheckpointKind;

impl Engine {
    /// Sends the next batch to the worker if it is idle and there is work. Work that
    /// arrives at an idle worker waits `batch_window` first, so that requests sent at the
    /// same moment by several sessions share one pass; the return value is when to call
    /// again for that. While sequences are decoding nothing waits: a sampling request
    /// arriving then joins the decode at its next step.
    pub fn pump(&mut self) -> Option<Instant> {
        if self.busy {
            return None;
        }
        let now = Instant::now();
        let mut oldest: Option<Instant> = None;
        let mut candidates = Vec::new();
        let mut heads: Vec<(String, u64)> = Vec::new();
        let mut owners: Vec<String> = Vec::new();
        let mut owner_index = |owner: &str| match owners.iter().position(|o| o == owner) {
            Some(i) => i,
            None => {
                owners.push(owner.to_string());
                owners.len() - 1
            }
        };
        let pass_budget = self.config.max_batch_tokens;
        for (run_id, run) in &mut self.runs {
            if run.inflight {
                continue;
            }
            let next = run.queue.next_seq();
            // A missing seq_id is waited for, but not forever.
            let Some((seq, q)) = run.queue.ready(now, self.config.reorder_timeout) else {
                continue;
            };
            if seq != next && seq != UNORDERED {
                tracing::warn!(run = %run_id, missing = next, next = seq, "skipping a seq_id that never arrived");
            }
            oldest = Some(oldest.map_or(q.since, |o| o.min(q.since)));
            let kind = match &q.op {
                RunOp::Forward {
                    data, with_grad, ..
                } => Kind::Forward {
                    tokens: next_pass(data, pass_budget).1,
                    with_grad: *with_grad,
                },
                op @ RunOp::ReverseKl { .. } => Kind::Solo {
                    tokens: op.tokens(),
                },
                op => match adapter_work(&self.model.lora_widths, &run.spec, op) {
                    // Large adapters' saves, loads and steps take their time's worth of
                    // the batch and of the key's share, like a pass.
                    tokens if tokens >= MIN_CHARGE as usize => Kind::Solo { tokens },
                    _ => Kind::Other,
                },
            };
            candidates.push(Candidate {
                key: heads.len(),
                arrival: q.arrival,
                owner: owner_index(&run.owner),
                kind,
            });
            heads.push((run_id.clone(), seq));
        }
        let base = heads.len();
        for (i, q) in self.samples.iter().enumerate() {
            oldest = Some(oldest.map_or(q.since, |o: Instant| o.min(q.since)));
            candidates.push(Candidate {
                key: base + i,
                arrival: q.arrival,
                owner: owner_index(&q.owner),
                kind: Kind::Sample {
                    tokens: q.work.job.prompt.len(),
                    streams: q.work.job.num_samples,
                    read: self.adapter_read_tokens(&q.work),
                },
            });
        }
        // The decode step is one candidate, ranked at the most-served key that has
        // sequences decoding (so splitting a decode across keys gains nothing); every such
        // key is charged its own sequences when it runs.
        let decode_key = base + self.samples.len();
        let mut decoders: Vec<(usize, usize)> = Vec::new();
        for (request_id, streams) in &self.decoding {
            // A request with no live sequence is rescoring: its passes are candidates
            // of their own, below.
            if *streams == 0 {
                continue;
            }
            if let Some(inflight) = self.inflight.get(request_id) {
                decoders.push((owner_index(&inflight.owner), *streams));
            }
        }
        let live_streams: usize = decoders.iter().map(|(_, n)| n).sum();
        // Each request whose sampled tokens wait to be rescored: its next pass is a
        // candidate of its key, charged and budgeted like a training pass, named by the
        // request's arrival (so a pass the plan passed over can be reserved).
        let mut rescores: Vec<String> = Vec::new();
        for (request_id, rows) in &self.rescoring {
            if let Some(inflight) = self.inflight.get(request_id) {
                candidates.push(Candidate {
                    key: decode_key + 1 + rescores.len(),
                    arrival: inflight.arrival,
                    owner: owner_index(&inflight.owner),
                    kind: Kind::Rescore { rows: *rows },
                });
                rescores.push(request_id.clone());
            }
        }
        // Waiting only pays when another client may be about to submit too: a run or a
        // sampling client that submitted recently (a lone client never waits).
        self.sample_submits
            .retain(|_, at| now.duration_since(*at) < ACTIVE_WINDOW);
        let active = self
            .runs
            .values()
            .filter(|r| now.duration_since(r.last_submit) < ACTIVE_WINDOW)
            .count()
            + self.sample_submits.len();
        let waits = active > 1 && !self.draining && self.decoding.is_empty();
        if let Some(oldest) = oldest.filter(|_| waits) {
            let ready_at = oldest + self.config.batch_window;
            if now < ready_at {
                return Some(ready_at);
            }
        }
        let limits = Limits {
            max_batch_tokens: self.config.max_batch_tokens,
            max_sample_streams: self.config.max_sample_streams,
            // A request waiting to rescore holds its prompt's cache and its samples: it
            // takes a stream's room until it leaves.
            live_streams: live_streams + rescores.len(),
        };
        let active: Vec<&str> = owners.iter().map(String::as_str).collect();
        let levels = self.service.levels(&active);
        if let Some(&(owner, _)) = decoders.iter().max_by_key(|(o, _)| levels[*o]) {
            candidates.push(Candidate {
                key: decode_key,
                // Ongoing work: older than anything queued.
                arrival: 0,
                owner,
                kind: Kind::Decode {
                    streams: live_streams,
                },
            });
        }
        let chosen = scheduler::plan(&candidates, limits, &levels, &mut self.reserved);
        let picked: std::collections::HashSet<usize> = chosen.iter().copied().collect();
        for c in candidates.iter().filter(|c| picked.contains(&c.key)) {
            if c.key != decode_key {
                self.service.charge(&owners[c.owner], c.kind.charge());
            }
        }
        let mut batch = Batch {
            drop_snapshots: std::mem::take(&mut self.drop_snapshots),
            cancel: std::mem::take(&mut self.cancels),
            ..Default::default()
        };
        for run_id in std::mem::take(&mut self.unload) {
            batch.runs.push(RunWork {
                request_id: String::new(),
                run_id,
                op: RunOp::Unload,
            });
        }
        let mut sample_keys: Vec<usize> = Vec::new();
        let mut refused: Vec<(String, Failure)> = Vec::new();
        for key in chosen {
            if key < base {
                let (run_id, seq) = &heads[key];
                let run = self.runs.get_mut(run_id).expect("head of a live run");
                // Dispatching a head commits the run to it: a seq_id that never arrived
                // before it (its reorder wait ran out) is now past, and refused if it
                // comes late, so this head stays the head until it is done.
                run.queue.commit_to(*seq);
                // A forward request with more than one pass left gives up its next pass
                // and stays at the head of its run.
                let head = run.queue.get_mut(*seq).expect("head exists");
                if let RunOp::Forward {
                    data, with_grad, ..
                } = &mut head.op
                {
                    let (n, _) = next_pass(data, pass_budget);
                    if n < data.len() {
                        let chunk: Vec<DatumJob> = data.drain(..n).collect();
                        let with_grad = *with_grad;
                        let Some(progress) = self.inflight.get_mut(&head.request_id) else {
                            // Cannot happen: a queued request is in flight until answered.
                            let q = run.queue.take(*seq).expect("head exists");
                            tracing::error!(request = %q.request_id, "a queued request had no in-flight entry");
                            refused.push((
                                q.request_id,
                                Failure::server("internal error: lost track of this request"),
                            ));
                            continue;
                        };
                        let first = !progress.more_passes;
                        progress.more_passes = true;
                        run.inflight = true;
                        batch.runs.push(RunWork {
                            request_id: head.request_id.clone(),
                            run_id: run_id.clone(),
                            op: RunOp::Forward {
                                data: chunk,
                                with_grad,
                                pass: Pass { first, last: false },
                            },
                        });
                        continue;
                    }
                }
                let mut q = run.queue.take(*seq).expect("head exists");
                if let RunOp::Forward { pass, .. } = &mut q.op {
                    // Its last pass (or its only one).
                    let progress = self.inflight.get_mut(&q.request_id);
                    let first = progress.as_ref().is_none_or(|p| !p.more_passes);
                    if let Some(p) = progress {
                        p.more_passes = false;
                    }
                    *pass = Pass { first, last: true };
                }
                // Access to a checkpoint is checked when it is used, not when the load
                // was queued: the owner may have unpublished, deleted or replaced it.
                let used = match &mut q.op {
                    RunOp::Load { uri, dir, .. } => Some((&*uri, dir)),
                    RunOp::ReverseKl {
                        reference: Some(uri),
                        dir,
                        ..
                    } => Some((&*uri, dir)),
                    _ => None,
                };
                if let Some((uri, dir)) = used {
                    match self.catalog.readable(&run.owner, uri) {
                        Ok(row) => *dir = self.catalog.dir_of(row).unwrap_or_default(),
                        Err(e) => {
                            refused.push((q.request_id, Failure::user(e.message())));
                            continue;
                        }
                    }
                }
                // A snapshot evicted (by newer ones) before it was taken is not taken: the
                // worker would hold an adapter nothing refers to.
                if let RunOp::Snapshot { sampler_id } = &q.op {
                    if !self.samplers.contains_key(sampler_id) {
                        refused.push((
                            q.request_id,
                            Failure::user(format!(
                                "sampler snapshot {sampler_id} was evicted before it was taken: \
                                 a run keeps its {MAX_SNAPSHOTS_PER_RUN} most recent snapshots"
                            )),
                        ));
                        continue;
                    }
                }
                run.inflight = true;
                batch.runs.push(RunWork {
                    request_id: q.request_id,
                    run_id: run_id.clone(),
                    op: q.op,
                });
            } else if key < decode_key {
                sample_keys.push(key - base);
            } else if key > decode_key {
                batch.rescore.push(rescores[key - decode_key - 1].clone());
            }
        }
        sample_keys.sort_unstable();
        for i in sample_keys.into_iter().rev() {
            let q = self.samples.remove(i).expect("sample exists");
            match self.check_pin(&q.owner, q.pin.as_ref()) {
                Ok(()) => batch.samples.push(q.work),
                Err(e) => refused.push((q.work.request_id, Failure::user(e.message()))),
            }
        }
        batch.samples.reverse();
        // In the order the worker opens their adapters.
        for work in &batch.samples {
            self.sampler_adapter_sent(work);
        }
        // New sequences step with the running ones when the scheduler picks the step; with
        // nothing else decoding, they take their first step at once.
        batch.decode_step =
            picked.contains(&decode_key) || (decoders.is_empty() && !batch.samples.is_empty());
        if batch.decode_step {
            for &(owner, streams) in &decoders {
                self.service.charge(&owners[owner], streams as u64);
            }
        }
        for (request_id, failure) in refused {
            if let Some(Inflight {
                run_id: Some(run_id),
                after: After::DropRunOnFailure,
                ..
            }) = self.inflight.remove(&request_id)
            {
                // A run created from a checkpoint it may no longer read: it never was.
                self.forget_run(&run_id);
            }
            self.futures.resolve(&request_id, Err(failure));
        }
        if batch.is_empty() {
            return None;
        }
        tracing::debug!(
            runs = batch.runs.len(),
            forward_tokens = batch.runs.iter().map(|w| w.op.tokens()).sum::<usize>(),
            samples = batch.samples.len(),
            decode_step = batch.decode_step,
            rescore_passes = batch.rescore.len(),
            live_streams,
            "dispatching a batch"
        );
        let ids = batch.request_ids();
        if self.worker.send(batch) {
            self.busy = true;
        } else {
            for id in ids {
                self.inflight.remove(&id);
                self.futures.resolve(&id, Err(Failure::server(WORKER_GONE)));
            }
            self.worker_died();
        }
        None
    }

    /// Takes a finished batch's report: records checkpoints, resolves futures, notes the
    /// requests still decoding.
    pub fn complete(&mut self, report: impl Into<BatchReport>) {
        let report = report.into();
        self.busy = false;
        let before = std::mem::replace(&mut self.decoding, report.decoding);
        self.rescoring = report.rescoring;
        // A request that left the decode must have an outcome; one that has none (a
        // worker bug) fails rather than waiting forever and holding its key's limits.
        for (request_id, _) in before {
            let answered = report.outcomes.iter().any(|o| o.request_id == request_id)
                || self.decoding.iter().any(|(r, _)| *r == request_id);
            if !answered && self.inflight.remove(&request_id).is_some() {
                tracing::error!(request = %request_id, "a sampling request left the decode without an outcome");
                self.futures.resolve(
                    &request_id,
                    Err(Failure::server(
                        "internal error: this sampling request was lost by the worker",
                    )),
                );
            }
        }
        for outcome in report.outcomes {
            let Some(mut inflight) = self.inflight.remove(&outcome.request_id) else {
                continue;
            };
            if let (Err(_), Some((dir, _))) = (&outcome.result, &inflight.adapter) {
                // Perhaps its adapter could not be read, and the worker's cache does not
                // keep it: the engine's picture forgets it too (after a failure for
                // another reason, the next request pays a read the worker may skip).
                self.worker_adapters.remove(dir);
            }
            if let Some(run) = inflight.run_id.as_ref().and_then(|r| self.runs.get_mut(r)) {
                run.inflight = false;
            }
            if inflight.more_passes {
                self.pass_done(outcome, inflight);
                continue;
            }
            let partial = inflight.partial.take();
            let result = match (outcome.result, inflight.after) {
                (Ok(mut done), _) if done.saved.is_some() => {
                    // The worker committed the save to the index before answering.
                    self.catalog.saved(done.saved.take().expect("checked"));
                    Ok(done.body)
                }
                (Ok(done), After::Unloaded) => {
                    if let Some(id) = &inflight.run_id {
                        self.forget_run(id);
                    }
                    Ok(done.body)
                }
                (Err(f), After::DropRunOnFailure) => {
                    if let Some(id) = &inflight.run_id {
                        self.forget_run(id);
                    }
                    Err(f)
                }
                (r, _) => r.map(|d| d.body),
            };
            let result = match partial {
                Some(earlier) => {
                    result.and_then(|last| join_passes(Some(earlier), last).map(Reply::Forward))
                }
                None => result,
            };
            self.futures.resolve(&outcome.request_id, result);
        }
    }

    /// A pass of a forward request with more passes queued finished: keep its results
    /// for the last one, or fail the whole request (its remaining passes are dropped,
    /// and the worker discards the gradient of its finished ones).
    fn pass_done(&mut self, outcome: Outcome, mut inflight: Inflight) {
        let id = outcome.request_id;
        let run = inflight.run_id.as_ref().and_then(|r| self.runs.get_mut(r));
        let Some(run) = run else {
            // The run was unloaded meanwhile; its future was answered then.
            return;
        };
        let Some(seq) = run.queue.head_of(&id) else {
            return;
        };
        let joined = outcome
            .result
            .and_then(|done| join_passes(inflight.partial.take(), done.body));
        match joined {
            Ok(body) => {
                inflight.partial = Some(body);
                self.inflight.insert(id, inflight);
            }
            Err(failure) => {
                run.queue.take(seq);
                self.futures.resolve(&id, Err(failure));
            }
        }
    }
}

/// A forward request's results so far (`earlier` passes, if any) joined to its `next`
/// pass's.
fn join_passes(earlier: Option<ForwardResult>, next: Reply) -> Result<ForwardResult, Failure> {
    let next = next.into_forward()?;
    Ok(match earlier {
        Some(mut joined) => {
            joined.append(next);
            joined
        }
        None => next,
    })
}

/// How many datums from the front of `data` make the next pass of at most `budget`
/// tokens (at least one, however long), and their tokens.
pub(super) fn next_pass(data: &[DatumJob], budget: usize) -> (usize, usize) {
    let mut tokens = 0;
    for (i, d) in data.iter().enumerate() {
        let n = d.tokens.len();
        if i > 0 && tokens + n > budget {
            return (i, tokens);
        }
        tokens += n;
    }
    (data.len(), tokens)
}

impl Engine {
    /// The bytes of the checkpoint adapter a sampling request reads in the worker.
    fn sampler_adapter_read<'a>(&self, work: &'a SampleWork) -> Option<(&'a PathBuf, u64)> {
        let SamplerSource::Checkpoint(dir) = &work.source else {
            return None;
        };
        let (_, bytes) = self.inflight.get(&work.request_id)?.adapter.as_ref()?;
        Some((dir, *bytes))
    }

    /// The work of reading a sampling request's checkpoint adapter, in tokens (as
    /// [`adapter_work`] reckons a load), unless the worker's cache keeps it. The read
    /// takes the worker's time as a load does, so requests cycling through
    /// checkpoints pay for it like training does. (A decode of the same directory also spares the read, but the
    /// engine cannot know that one will still be running when this request joins, so
    /// only the cache counts.)
    pub(super) fn adapter_read_tokens(&self, work: &SampleWork) -> usize {
        match self.sampler_adapter_read(work) {
            Some((dir, bytes)) if !self.worker_adapters.contains(dir) => {
                usize::try_from(bytes / ADAPTER_BYTES_PER_TOKEN).unwrap_or(usize::MAX)
            }
            _ => 0,
        }
    }

    /// A sampling request went to the worker: its adapter is in the worker's cache now
    /// (if it fits), as [`crate::worker::Worker`] keeps it.
    fn sampler_adapter_sent(&mut self, work: &SampleWork) {
        if let Some((dir, bytes)) = self.sampler_adapter_read(work) {
            let dir = dir.clone();
            self.worker_adapters.insert(dir, (), bytes);
        }
    }
}

/// Bytes of adapter traffic reckoned as one token of a training pass: on the CPU a
/// token of a pass takes a few milliseconds, about what writing or updating a MiB of
/// adapter state does.
const ADAPTER_BYTES_PER_TOKEN: u64 = 1 << 20;

/// The work of an operation on a run's adapter (`spec`), in tokens: its bytes of
/// adapter state written, read or updated (the optimizer's two moments and the
/// gradient triple an Adam step's traffic, and a training checkpoint's), over
/// [`ADAPTER_BYTES_PER_TOKEN`], and a save at least [`MIN_CHARGE`] (for its syncs).
/// Operations below [`MIN_CHARGE`] tokens ride along with
/// every batch (`scheduler::Kind::Other`); larger ones are scheduled by fair share
/// within the batch budget, so a key with many large adapters cannot add seconds of
/// saves, loads and steps to every batch of everyone's.
fn adapter_work(widths: &LoraWidths, spec: &LoraSpec, op: &RunOp) -> usize {
    let bytes = match op {
        RunOp::Save { meta, .. } => {
            widths.checkpoint_bytes(spec, meta.kind == CheckpointKind::Training.type_name())
        }
        RunOp::Load { optimizer, .. } => widths.checkpoint_bytes(spec, *optimizer),
        // Parameters, gradients and Adam's two moments.
        RunOp::OptimStep(_) => widths.adapter_bytes(spec).saturating_mul(4),
        RunOp::Snapshot { .. } | RunOp::Create { .. } => widths.adapter_bytes(spec),
        _ => 0,
    };
    let tokens = usize::try_from(bytes / ADAPTER_BYTES_PER_TOKEN).unwrap_or(usize::MAX);
    match op {
        // A save syncs about ten files and directories whatever its size, so even the
        // smallest never rides along: a key saving tiny adapters in a loop would add
        // its fsyncs to every batch of everyone's.
        RunOp::Save { .. } => tokens.max(MIN_CHARGE as usize),
        _ => tokens,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::checkpoints::CheckpointMeta;

    /// SmolLM2-135M's: 30 layers of hidden 576, kv 192, intermediate 1536.
    const SMOLLM2: LoraWidths = LoraWidths {
        attn: 30 * ((576 + 576) * 2 + (576 + 192) * 2),
        mlp: 30 * (576 + 1536) * 3,
        unembed: 49152 + 576,
    };

    fn spec(rank: usize) -> LoraSpec {
        LoraSpec {
            rank,
            train_attn: true,
            train_mlp: true,
            train_unembed: false,
        }
    }

    #[test]
    fn adapter_work_is_counted_in_tokens_small_steps_ride_along_and_saves_never_do() {
        let save = RunOp::Save {
            meta: CheckpointMeta::for_test("r", "training", "x", "o"),
            overwrite: false,
        };
        let step = RunOp::OptimStep(Default::default());
        // Rank 8: a 9.8 MB adapter; its training checkpoint (with Adam's moments) 29 MB,
        // saved at the minimum charge (its syncs), never riding along.
        assert_eq!(adapter_work(&SMOLLM2, &spec(8), &save), MIN_CHARGE as usize);
        assert_eq!(adapter_work(&SMOLLM2, &spec(1), &save), MIN_CHARGE as usize);
        assert!(adapter_work(&SMOLLM2, &spec(8), &step) < MIN_CHARGE as usize);
        // Rank 256: about 0.9 GB to write, a pass's worth of tokens.
        let big = adapter_work(&SMOLLM2, &spec(256), &save);
        assert!((850..=950).contains(&big), "{big}");
        assert!(adapter_work(&SMOLLM2, &spec(256), &step) > big);
        assert_eq!(adapter_work(&SMOLLM2, &spec(256), &RunOp::Unload), 0);
    }
}
