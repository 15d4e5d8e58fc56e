//! The worker: the only owner of the base model and of every run's adapter, optimizer
//! state and accumulated gradient. It executes one [`Batch`] at a time.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use lathe_sdk::types::{CheckpointKind, CheckpointUri};

use super::adapter_cache::SamplerAdapters;
use super::jobs::{
    Batch, BatchReport, Done, Failure, Outcome, RunOp, RunWork, SampleWork, SamplerSource,
};
use super::reply::{CustomTotals, DatumOutput, ForwardResult, Reply};
use crate::model::cpu::pool::on_pool;
use crate::model::{Adapter, AdapterGrads, LoadedModel, ModelError};
use crate::sample::{Admission, DecodeMode, Finished, RunningDecode};
use crate::store::checkpoints::CheckpointMeta;
use crate::store::{peft, Store, StoreError};
use crate::train::adamw::{self, AdamState};
use crate::train::{self, reverse_kl, DatumResult, TrainError};

struct RunModel {
    adapter: Adapter,
    opt: AdamState,
    grads: AdapterGrads,
    has_grad: bool,
    /// The gradient of a request whose passes are still running: it joins `grads` at
    /// its last pass, so a request that fails midway adds nothing.
    staged: AdapterGrads,
}

/// Model, adapters and the code that runs batches on them.
pub struct Worker {
    model: LoadedModel,
    store: Store,
    runs: HashMap<String, RunModel>,
    snapshots: HashMap<String, Arc<Adapter>>,
    /// Checkpoint adapters opened for sampling.
    sampler_adapters: SamplerAdapters,
    /// The sampling requests being decoded, by request id.
    running: RunningDecode<String>,
}

fn model_failure(e: ModelError) -> Failure {
    match e {
        ModelError::Input(m) | ModelError::Lora(m) => Failure::user(m),
        other => Failure::server(other.to_string()),
    }
}

fn train_failure(e: TrainError) -> Failure {
    match e {
        TrainError::Input(m) => Failure::user(m),
        TrainError::Model(m) => model_failure(m),
    }
}

fn store_failure(e: StoreError) -> Failure {
    match e {
        StoreError::Exists(_) | StoreError::Invalid(_) => Failure::user(e.to_string()),
        other => Failure::server(other.to_string()),
    }
}

/// A read of the checkpoint version in `dir` that failed. The engine checked access
/// when it dispatched the batch, but the owner may delete the checkpoint (or it may
/// expire) while the batch waits for the worker, and a delete moves the whole directory
/// away at once: when `dir` is gone, whichever file the read had reached, that is the
/// requester's answer ("deleted"), not a server fault, and it never names the server's
/// paths. A directory that is still there failed for another reason.
fn read_failure(dir: &Path, e: StoreError) -> Failure {
    if !dir.exists() {
        return Failure::user(CHECKPOINT_GONE);
    }
    store_failure(e)
}

/// What a request reading a checkpoint deleted after its access check is told.
pub const CHECKPOINT_GONE: &str =
    "the checkpoint was deleted (or expired) while this request waited; it no longer exists";

fn done(body: Reply) -> Result<Done, Failure> {
    Ok(Done { body, saved: None })
}

impl Worker {
    /// A worker over `model`, saving checkpoints into `store`.
    pub fn new(model: LoadedModel, mode: DecodeMode, store: Store) -> Self {
        Self {
            model,
            store,
            runs: HashMap::new(),
            snapshots: HashMap::new(),
            sampler_adapters: SamplerAdapters::with_budget(0),
            running: RunningDecode::new(mode),
        }
    }

    /// Makes the model's device context current on the calling thread, the one that
    /// runs this worker's batches and drops its adapters, snapshots and caches (see
    /// [`crate::model::backend::make_current`]).
    pub fn make_device_current(&self) -> Result<(), ModelError> {
        crate::model::backend::make_current(self.model.transformer.device())?;
        Ok(())
    }

    /// Keeps up to `bytes` of checkpoint adapters opened for sampling in memory
    /// (none by default).
    pub fn caching_sampler_adapters_up_to(mut self, bytes: u64) -> Self {
        self.sampler_adapters = SamplerAdapters::with_budget(bytes);
        self
    }

    /// Rescores sampled tokens in passes of at most `rows` rows (the engine's batch
    /// budget) instead of the model's training pass size.
    pub fn rescoring_in_passes_of(mut self, rows: usize) -> Self {
        self.running.set_rescore_pass_rows(rows);
        self
    }

    /// Runs a batch: every run operation, with all forward passes fused into one
    /// multi-adapter pass, then new sampling requests join the running decode, then one
    /// decode step if the batch asks for it. A failing request fails alone.
    pub fn run_batch(&mut self, batch: Batch) -> BatchReport {
        for id in &batch.drop_snapshots {
            self.snapshots.remove(id);
        }
        let mut outcomes: Vec<Outcome> = self
            .running
            .cancel(&batch.cancel)
            .into_iter()
            .map(|request_id| Outcome {
                request_id,
                result: Err(Failure::user(CANCELLED)),
            })
            .collect();
        let (forwards, others): (Vec<RunWork>, Vec<RunWork>) = batch
            .runs
            .into_iter()
            .partition(|w| matches!(w.op, RunOp::Forward { .. }));
        // Each operation, and each fused group, is its own unit for a panic: one that
        // panics fails alone, and every other keeps its outcome (a save committed to the
        // index must reach the engine's catalog whatever runs after it).
        for work in others {
            let result = contained(|| self.run_op(&work)).and_then(|r| r);
            outcomes.push(Outcome {
                request_id: work.request_id,
                result,
            });
        }
        for with_grad in [true, false] {
            let group: Vec<&RunWork> = forwards
                .iter()
                .filter(|w| matches!(w.op, RunOp::Forward { with_grad: g, .. } if g == with_grad))
                .collect();
            if !group.is_empty() {
                let ids = group.iter().map(|w| w.request_id.clone());
                outcomes.extend(contained_group(ids, || {
                    self.forward_group(&group, with_grad)
                }));
            }
        }
        if !batch.samples.is_empty() {
            outcomes.extend(self.admit(batch.samples));
        }
        for request_id in &batch.rescore {
            outcomes.extend(self.decoding(Vec::new(), |w| {
                let t = &w.model.transformer;
                let finished = on_pool(|| w.running.rescore(t, request_id));
                sample_outcomes(finished.into_iter().collect())
            }));
        }
        if batch.decode_step {
            outcomes.extend(self.decoding(Vec::new(), |w| {
                let m = &w.model;
                let finished = on_pool(|| w.running.step(&m.transformer, &m.tokenizer));
                sample_outcomes(finished)
            }));
        }
        BatchReport {
            outcomes,
            decoding: self.decoding_now(),
            rescoring: self
                .running
                .rescoring()
                .map(|(k, rows)| (k.clone(), rows))
                .collect(),
        }
    }

    /// The sampling requests still decoding, with their live sequences.
    fn decoding_now(&self) -> Vec<(String, usize)> {
        self.running.live().map(|(k, n)| (k.clone(), n)).collect()
    }

    /// Drops every request being decoded (a panic left their state in doubt); returns
    /// their ids.
    pub(super) fn abandon_decoding(&mut self) -> Vec<String> {
        self.running.clear()
    }

    /// Runs `f` on the running decode; if it panics, every request that was being
    /// decoded fails (their caches may be half written; one the step had already
    /// finished lost its output with the panic) with those of `joining`, and the decode
    /// starts empty.
    fn decoding(
        &mut self,
        joining: Vec<String>,
        f: impl FnOnce(&mut Self) -> Vec<Outcome>,
    ) -> Vec<Outcome> {
        let before: Vec<String> = self.running.live().map(|(k, _)| k.clone()).collect();
        match contained(|| f(self)) {
            Ok(outcomes) => outcomes,
            Err(failure) => {
                self.abandon_decoding();
                let mut ids = before;
                let new: Vec<String> = joining.into_iter().filter(|id| !ids.contains(id)).collect();
                ids.extend(new);
                ids
            }
            .into_iter()
            .map(|request_id| Outcome {
                request_id,
                result: Err(failure.clone()),
            })
            .collect(),
        }
    }

    /// New sampling requests join the running decode: their adapters resolved, their
    /// prompts prefilled together. A request that cannot start fails alone.
    fn admit(&mut self, works: Vec<SampleWork>) -> Vec<Outcome> {
        let mut outcomes = Vec::new();
        let mut admissions = Vec::with_capacity(works.len());
        for work in works {
            match contained(|| self.sampler_adapter(&work.source)).and_then(|r| r) {
                Ok(adapter) => admissions.push(Admission {
                    key: work.request_id,
                    job: work.job,
                    adapter,
                    progress: work.progress,
                }),
                Err(failure) => outcomes.push(Outcome {
                    request_id: work.request_id,
                    result: Err(failure),
                }),
            }
        }
        // A panic while admitting fails the new requests as well as those decoding.
        let new: Vec<String> = admissions.iter().map(|a| a.key.clone()).collect();
        outcomes.extend(self.decoding(new, |w| {
            let t = &w.model.transformer;
            sample_outcomes(on_pool(|| w.running.admit(t, admissions)))
        }));
        outcomes
    }

    fn run_op(&mut self, work: &RunWork) -> Result<Done, Failure> {
        let run_id = work.run_id.as_str();
        match &work.op {
            RunOp::Create { spec, seed } => {
                let t = &self.model.transformer;
                let adapter = Adapter::new(&t.config, *spec, *seed, t.weights.dtype(), t.device())
                    .map_err(model_failure)?;
                self.runs
                    .insert(run_id.to_string(), RunModel::fresh(adapter));
                done(Reply::ModelCreated {
                    model_id: run_id.to_string(),
                })
            }
            RunOp::Load {
                uri,
                dir,
                optimizer,
                create,
            } => {
                let (adapter, opt) = read_checkpoint(&self.model, dir, *optimizer)?;
                if !*create {
                    let run = self.run(run_id)?;
                    if run.adapter.spec != adapter.spec {
                        return Err(Failure::user(format!(
                            "checkpoint {uri} has LoRA {:?} but run {run_id} has {:?}",
                            adapter.spec, run.adapter.spec
                        )));
                    }
                }
                let mut fresh = RunModel::fresh(adapter);
                if let Some(opt) = opt {
                    fresh.opt = opt;
                }
                self.runs.insert(run_id.to_string(), fresh);
                done(Reply::WeightsLoaded {
                    path: uri.to_string(),
                })
            }
            RunOp::OptimStep(params) => {
                let run = self.runs.get_mut(run_id).ok_or_else(|| unknown(run_id))?;
                if !run.has_grad {
                    return Err(Failure::user(
                        "optim_step without an accumulated gradient: call forward_backward first",
                    ));
                }
                let backend = self.model.transformer.backend();
                let report =
                    adamw::step(backend, &mut run.adapter, &mut run.opt, &run.grads, params)
                        .map_err(train_failure)?;
                run.grads = AdapterGrads::default();
                run.has_grad = false;
                done(Reply::Optimized(report))
            }
            RunOp::Save { meta, overwrite } => self.save(run_id, meta, *overwrite),
            RunOp::Snapshot { sampler_id } => {
                let adapter = self.run(run_id)?.adapter.clone();
                self.snapshots.insert(sampler_id.clone(), Arc::new(adapter));
                done(Reply::SamplerSnapshot {
                    sampling_session_id: sampler_id.clone(),
                })
            }
            RunOp::Unload => {
                self.runs.remove(run_id);
                done(Reply::Unloaded {
                    model_id: run_id.to_string(),
                })
            }
            RunOp::ReverseKl {
                data,
                reference,
                dir,
                temperature,
            } => {
                let source = match reference {
                    Some(_) => SamplerSource::Checkpoint(dir.clone()),
                    None => SamplerSource::Base,
                };
                let reference = self.sampler_adapter(&source)?;
                let run = self.runs.get_mut(run_id).ok_or_else(|| unknown(run_id))?;
                let (results, grads) = reverse_kl::forward_backward(
                    &self.model.transformer,
                    &run.adapter,
                    reference.as_deref(),
                    data,
                    *temperature,
                    true,
                )
                .map_err(train_failure)?;
                run.grads
                    .merge(grads)
                    .map_err(|e| Failure::server(e.to_string()))?;
                run.has_grad = true;
                done(Reply::ReverseKl(results))
            }
            RunOp::Forward { .. } => unreachable!("forward ops run fused"),
        }
    }

    fn run(&self, run_id: &str) -> Result<&RunModel, Failure> {
        self.runs.get(run_id).ok_or_else(|| unknown(run_id))
    }

    fn save(
        &mut self,
        run_id: &str,
        meta: &CheckpointMeta,
        overwrite: bool,
    ) -> Result<Done, Failure> {
        let kind = meta.kind().expect("engine sends a valid kind");
        let run = self.runs.get(run_id).ok_or_else(|| unknown(run_id))?;
        let base = self.model.name.clone();
        let (version, bytes) = self
            .store
            .checkpoints()
            .write_version(meta, |dir| {
                peft::save_adapter(dir, &run.adapter, &base)?;
                if kind == CheckpointKind::Training {
                    peft::save_optimizer(dir, &run.opt)?;
                }
                Ok(())
            })
            .map_err(store_failure)?;
        // The index switches to the new version before the client hears it is saved.
        let row = self
            .store
            .commit_save(meta, &version, bytes, overwrite)
            .map_err(store_failure)?;
        let uri = CheckpointUri {
            run_id: run_id.to_string(),
            kind,
            name: meta.name.clone(),
        }
        .to_string();
        Ok(Done {
            body: Reply::Saved { kind, path: uri },
            saved: Some(row),
        })
    }

    fn forward_group(&mut self, group: &[&RunWork], with_grad: bool) -> Vec<Outcome> {
        match self.try_forward(group, with_grad) {
            Ok(outcomes) => outcomes,
            // One bad request (an error, or a panic in the fused pass) must not fail the
            // others: run each alone.
            Err(_) if group.len() > 1 => group
                .iter()
                .flat_map(|w| self.forward_group(std::slice::from_ref(w), with_grad))
                .collect(),
            Err(failure) => vec![Outcome {
                request_id: group[0].request_id.clone(),
                result: Err(failure),
            }],
        }
    }

    fn try_forward(
        &mut self,
        group: &[&RunWork],
        with_grad: bool,
    ) -> Result<Vec<Outcome>, Failure> {
        let mut jobs = Vec::new();
        let mut spans = Vec::new();
        for (i, work) in group.iter().enumerate() {
            self.run(&work.run_id)?;
            let RunOp::Forward { data, .. } = &work.op else {
                unreachable!()
            };
            spans.push(jobs.len()..jobs.len() + data.len());
            jobs.extend(data.iter().cloned().map(|mut d| {
                d.adapter = i;
                d
            }));
        }
        let adapters: Vec<&Adapter> = group
            .iter()
            .map(|w| &self.runs[&w.run_id].adapter)
            .collect();
        // A panic in the pass leaves every run as it was (gradients merge below, after
        // it), so each request can run again alone.
        let trained = contained(|| {
            #[cfg(test)]
            tests::failpoint(group);
            train::forward_backward_in_passes(
                &self.model.transformer,
                &adapters,
                &jobs,
                with_grad,
                train::pass_tokens(&self.model.transformer),
            )
        })
        .and_then(|r| r.map_err(train_failure))?;
        let mut outcomes = Vec::with_capacity(group.len());
        let results = &trained.results;
        for (((work, span), grad), failed) in group
            .iter()
            .zip(spans)
            .zip(trained.grads)
            .zip(trained.failed)
        {
            let RunOp::Forward { data, pass, .. } = &work.op else {
                unreachable!()
            };
            // Its loss failed on one of its datums: it fails alone, the others stand.
            if let Some(why) = failed {
                outcomes.push(Outcome {
                    request_id: work.request_id.clone(),
                    result: Err(Failure::user(why)),
                });
                continue;
            }
            if with_grad {
                let run = self.runs.get_mut(&work.run_id).expect("checked above");
                if pass.first {
                    run.staged = AdapterGrads::default();
                }
                let merged = run.staged.merge(grad).and_then(|()| {
                    if pass.last {
                        let staged = std::mem::take(&mut run.staged);
                        run.grads.merge(staged)?;
                        run.has_grad = true;
                    }
                    Ok(())
                });
                if let Err(e) = merged {
                    outcomes.push(Outcome {
                        request_id: work.request_id.clone(),
                        result: Err(Failure::server(e.to_string())),
                    });
                    continue;
                }
            }
            let body = Reply::Forward(forward_output(&results[span], data));
            outcomes.push(Outcome {
                request_id: work.request_id.clone(),
                result: done(body),
            });
        }
        Ok(outcomes)
    }

    fn sampler_adapter(&mut self, source: &SamplerSource) -> Result<Option<Arc<Adapter>>, Failure> {
        match source {
            SamplerSource::Base => Ok(None),
            SamplerSource::Snapshot(id) => self
                .snapshots
                .get(id)
                .cloned()
                .map(Some)
                .ok_or_else(|| Failure::user(format!("sampler {id} no longer exists"))),
            SamplerSource::Checkpoint(dir) => {
                let model = &self.model;
                let adapter = self
                    .sampler_adapters
                    .get_or_read(dir, || read_checkpoint(model, dir, false).map(|(a, _)| a))?;
                Ok(Some(adapter))
            }
        }
    }
}

/// Reads a checkpoint's adapter (in the model's dtype) and, if asked, its optimizer
/// state.
fn read_checkpoint(
    model: &LoadedModel,
    dir: &Path,
    optimizer: bool,
) -> Result<(Adapter, Option<AdamState>), Failure> {
    let t = &model.transformer;
    let adapter = peft::load_adapter(dir, &t.config, t.device())
        .and_then(|a| Ok(a.to_dtype(t.weights.dtype())?))
        .map_err(|e| read_failure(dir, e))?;
    let opt = if optimizer {
        Some(peft::load_optimizer(dir, t.device()).map_err(|e| read_failure(dir, e))?)
    } else {
        None
    };
    Ok((adapter, opt))
}

impl RunModel {
    fn fresh(adapter: Adapter) -> Self {
        Self {
            adapter,
            opt: AdamState::default(),
            grads: AdapterGrads::default(),
            has_grad: false,
            staged: AdapterGrads::default(),
        }
    }
}

/// The outcomes of sampling requests that left the decode.
fn sample_outcomes(finished: Vec<Finished<String>>) -> Vec<Outcome> {
    finished
        .into_iter()
        .map(|(request_id, result)| Outcome {
            request_id,
            result: result
                .map(|out| Done {
                    body: Reply::Sample(out),
                    saved: None,
                })
                .map_err(model_failure),
        })
        .collect()
}

/// Runs `f`, turning a panic into a server failure (logged).
fn contained<T>(f: impl FnOnce() -> T) -> Result<T, Failure> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|panic| {
        let msg = super::jobs::panic_message(panic.as_ref());
        tracing::error!("worker operation panicked (contained): {msg}");
        Failure::server(format!("internal error: {msg}"))
    })
}

/// Runs a group's `f`; if it panics, each of `ids` fails with the panic.
fn contained_group(
    ids: impl Iterator<Item = String>,
    f: impl FnOnce() -> Vec<Outcome>,
) -> Vec<Outcome> {
    match contained(f) {
        Ok(outcomes) => outcomes,
        Err(failure) => ids
            .map(|request_id| Outcome {
                request_id,
                result: Err(failure.clone()),
            })
            .collect(),
    }
}

/// What a sampling request cancelled by its client answers.
pub const CANCELLED: &str = "cancelled by the client (cancel_future)";

fn unknown(run_id: &str) -> Failure {
    Failure::user(format!("training run {run_id} is not loaded"))
}

/// One request's forward outputs.
fn forward_output(results: &[DatumResult], data: &[train::DatumJob]) -> ForwardResult {
    let custom = data.first().and_then(|d| match &d.loss {
        train::Loss::Custom(loss) => Some(CustomTotals {
            keys: loss.0.metric_keys().map(str::to_string).collect(),
            sums: (0..loss.0.metric_keys().count())
                .map(|m| results.iter().map(|r| r.metrics[m]).sum())
                .collect(),
            surrogate: results
                .iter()
                .flat_map(|r| &r.elementwise_loss)
                .map(|&x| f64::from(x))
                .sum(),
        }),
        _ => None,
    });
    ForwardResult {
        custom,
        loss: results.iter().map(|r| r.loss).sum(),
        datums: results
            .iter()
            .zip(data)
            .map(|(r, d)| DatumOutput {
                logprobs: r.logprobs.clone(),
                elementwise_loss: r.elementwise_loss.clone(),
                k: d.k,
            })
            .collect(),
    }
}

#[cfg(test)]
#[path = "runner_tests.rs"]
mod tests;
