//! The engine's state and its core loop steps: sessions, the per-run reorder buffers,
//! dispatching batches to the worker and taking their outcomes back. Every method is a
//! plain synchronous function, so the whole engine is testable without channels; the
//! actor (`actor.rs`) only calls them.

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use lathe_sdk::types::CheckpointUri;

use crate::model::LoraSpec;
use crate::store::checkpoints::CheckpointDir;
use crate::store::db::{CheckpointRow, RunRow};
use crate::worker::{Batch, ByteLru, Failure, RunOp, SampleWork, SamplerSource};

use super::catalog::Catalog;
use super::ended::{EndReason, Ended, EndedSessions};
use super::futures::Futures;
use super::info::ModelInfo;
use super::limits::KeyLimits;
use super::run_queue::{Admit, Queued, RunQueue};
use super::scheduler::{Reserved, Service};
use super::EngineError;

/// Engine settings.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Most training runs loaded at once (`--max-sessions`).
    pub max_sessions: usize,
    /// Tokens of one batch (`--max-batch-tokens`) between two scheduling decisions: the
    /// fused forward passes, new prompts and a decode step (one token per sequence)
    /// share it. A larger forward request runs as several passes of whole datums.
    pub max_batch_tokens: usize,
    /// Most sequences decoded together (`--max-sample-streams`).
    pub max_sample_streams: usize,
    /// A session without a heartbeat for this long is expired and its runs unloaded.
    pub session_timeout: Duration,
    /// How long a run waits for a missing `seq_id` before skipping it.
    pub reorder_timeout: Duration,
    /// How long finished futures stay retrievable.
    pub future_ttl: Duration,
    /// How long work arriving at an idle worker waits for company (see [`Engine::pump`]).
    pub batch_window: Duration,
    /// What each API key may use at once.
    pub limits: KeyLimits,
    /// Memory finished results may hold until retrieved; past it, the oldest go first.
    pub max_result_bytes: usize,
    /// Bytes of adapter state all loaded runs, their sampler snapshots and the worker's
    /// cache of checkpoint adapters opened for sampling may hold together (see
    /// [`Engine::adapter_memory`]); the cache is given
    /// [`EngineConfig::sampler_cache_bytes`] of it.
    pub max_adapter_bytes: u64,
}

impl EngineConfig {
    /// The part of `max_adapter_bytes` kept for the worker's cache of checkpoint
    /// adapters opened for sampling.
    pub fn sampler_cache_bytes(&self) -> u64 {
        self.max_adapter_bytes / crate::worker::SAMPLER_CACHE_SHARE
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_sessions: 64,
            max_batch_tokens: crate::train::PASS_TOKENS,
            max_sample_streams: 64,
            session_timeout: Duration::from_secs(300),
            reorder_timeout: Duration::from_secs(30),
            future_ttl: Duration::from_secs(3600),
            batch_window: Duration::from_millis(5),
            limits: KeyLimits::default(),
            max_result_bytes: 1 << 30,
            max_adapter_bytes: 32 << 30,
        }
    }
}

/// Sends batches to the worker (a thread in production, a recorder in tests).
pub trait WorkerLink: Send {
    /// Queues a batch; false if the worker is gone.
    fn send(&mut self, batch: Batch) -> bool;

    /// Whether the worker is still running.
    fn is_alive(&self) -> bool {
        true
    }
}

impl WorkerLink for crate::worker::WorkerHandle {
    fn send(&mut self, batch: Batch) -> bool {
        crate::worker::WorkerHandle::send(self, batch)
    }

    fn is_alive(&self) -> bool {
        crate::worker::WorkerHandle::is_alive(self)
    }
}

/// What every request gets once the worker thread is gone.
pub(super) const WORKER_GONE: &str =
    "the model worker has stopped (see the server log); the server must be restarted";

pub(super) struct Session {
    pub owner: String,
    pub last_heartbeat: Instant,
    pub runs: Vec<String>,
    pub samplers: Vec<String>,
    /// Custom losses created in the session, by `loss_id`.
    pub custom_losses: Vec<(String, std::sync::Arc<crate::train::custom::CustomLoss>)>,
    /// The future each custom loss's creation answered with, given again to a repeated
    /// creation while it lasts (so repeats mint no new futures).
    pub custom_loss_futures: HashMap<String, String>,
}

pub(super) struct Run {
    pub owner: String,
    pub session_id: String,
    pub spec: LoraSpec,
    /// Its operations in `seq_id` order.
    pub queue: RunQueue,
    pub inflight: bool,
    /// When the run last submitted an operation (to judge whether batching can pay).
    pub last_submit: Instant,
    /// In-memory sampler snapshots taken from this run, least recently used first.
    pub snapshots: VecDeque<String>,
}

pub(super) struct Sampler {
    pub owner: String,
    pub base_model: String,
    pub model_path: Option<String>,
    pub source: SamplerSource,
    /// The checkpoint version a session opened on a checkpoint samples from: access and
    /// version are checked again at every request and at dispatch.
    pub pin: Option<Pin>,
    /// Copies of its client that joined (`join_sampling_session`); the original is 0.
    pub clients: u64,
}

/// A checkpoint version a sampler uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Pin {
    pub uri: CheckpointUri,
    pub version: String,
}

/// A queued sampling request.
pub(super) struct QueuedSample {
    pub arrival: u64,
    pub since: Instant,
    pub owner: String,
    pub pin: Option<Pin>,
    pub work: SampleWork,
}

/// Index writes the engine decided on, done off the actor by `actor.rs` (the engine
/// does no I/O itself).
#[derive(Debug, Default)]
pub struct StoreWork {
    /// New runs to record.
    pub new_runs: Vec<RunRow>,
    /// Runs' latest activity (Unix seconds), coalesced between flushes.
    pub touched: HashMap<String, i64>,
    /// Checkpoints whose TTL passed, hidden already, to delete (URI and version).
    pub expired: Vec<(CheckpointUri, String)>,
}

impl StoreWork {
    /// Whether there is nothing to write.
    pub fn is_empty(&self) -> bool {
        self.new_runs.is_empty() && self.touched.is_empty() && self.expired.is_empty()
    }
}

/// What to do when an in-flight request finishes.
pub(super) enum After {
    Nothing,
    /// The run could not be created: forget it.
    DropRunOnFailure,
    /// The run was unloaded: forget it.
    Unloaded,
}

pub(super) struct Inflight {
    pub run_id: Option<String>,
    pub after: After,
    /// Who submitted it (per-key limits count it).
    pub owner: String,
    /// Sampling tokens it holds (0 for run operations).
    pub sample_tokens: usize,
    /// A sampling request's arrival (0 for run operations): it names the request's
    /// rescoring passes to the scheduler.
    pub arrival: u64,
    /// A forward request whose next passes are still queued: the pass now in the worker
    /// is not its last.
    pub more_passes: bool,
    /// The joined results of a forward request's finished passes.
    pub partial: Option<crate::worker::ForwardResult>,
    /// A save, from when it is queued until it is answered: whether it adds a name, and
    /// its estimated bytes (the checkpoint quota counts it as stored meanwhile).
    pub save: Option<(bool, u64)>,
    /// A sampling request on a checkpoint: the adapter's directory and f32 size (its
    /// copies in the worker count while the request is queued or decoding).
    pub adapter: Option<(PathBuf, u64)>,
}

/// All engine state.
pub struct Engine {
    pub(super) model: ModelInfo,
    pub(super) config: EngineConfig,
    pub(super) catalog: Catalog,
    pub(super) store_work: StoreWork,
    pub(super) sessions: HashMap<String, Session>,
    /// Sessions that ended recently (answered 410, not 404).
    pub(super) ended_sessions: EndedSessions,
    pub(super) runs: HashMap<String, Run>,
    pub(super) samplers: HashMap<String, Sampler>,
    pub(super) futures: Futures,
    pub(super) samples: VecDeque<QueuedSample>,
    /// When each sampling client (a sampler id, or an owner's base model or checkpoint
    /// path) last submitted, so that `pump` knows whether others may be about to.
    pub(super) sample_submits: HashMap<String, Instant>,
    pub(super) inflight: HashMap<String, Inflight>,
    /// Interpolations being written: each output's owner and estimated bytes, counted
    /// in the owner's checkpoint quota until it is recorded or abandoned.
    pub(super) interpolating: HashMap<CheckpointUri, (String, u64)>,
    /// The worker's cache of checkpoint adapters for sampling as the engine expects it
    /// (fed the same directories in the same order): a sample whose adapter is in it
    /// or held by a decode is not charged the adapter's read.
    pub(super) worker_adapters: ByteLru<()>,
    /// The sampling requests the worker is decoding, with their live sequences, as of
    /// its last report.
    pub(super) decoding: Vec<(String, usize)>,
    /// The sampling requests at the worker whose tokens wait to be rescored, with the
    /// rows of each one's next pass (a candidate of its key, charged like a training
    /// pass), as of its last report.
    pub(super) rescoring: Vec<(String, usize)>,
    /// Sampling requests at the worker whose clients cancelled them, for the next batch.
    pub(super) cancels: Vec<String>,
    pub(super) drop_snapshots: Vec<String>,
    pub(super) unload: Vec<String>,
    pub(super) arrivals: u64,
    /// Tokens run per API key: the scheduler's fair-share clock.
    pub(super) service: Service,
    /// The candidate the last plan passed over, taken first by the next.
    pub(super) reserved: Reserved,
    pub(super) worker: Box<dyn WorkerLink>,
    pub(super) busy: bool,
    pub(super) draining: bool,
    /// The worker thread died: nothing can run any more.
    pub(super) worker_gone: bool,
}

/// A run or sampling client that submitted within this long counts as active for
/// batching decisions.
pub(super) const ACTIVE_WINDOW: Duration = Duration::from_secs(2);

/// Unix seconds now.
pub fn now_unix() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

impl Engine {
    /// An engine over the index's checkpoint rows and the directory their files are in,
    /// driving `worker`.
    pub fn new(
        model: ModelInfo,
        config: EngineConfig,
        checkpoints: Vec<CheckpointRow>,
        checkpoint_dir: CheckpointDir,
        worker: Box<dyn WorkerLink>,
    ) -> Self {
        let result_budget = config.max_result_bytes;
        let cache_budget = config.sampler_cache_bytes();
        Self {
            model,
            config,
            catalog: Catalog::new(checkpoints, checkpoint_dir),
            store_work: StoreWork::default(),
            sessions: HashMap::new(),
            ended_sessions: EndedSessions::default(),
            runs: HashMap::new(),
            samplers: HashMap::new(),
            futures: Futures::with_budget(result_budget),
            samples: VecDeque::new(),
            sample_submits: HashMap::new(),
            inflight: HashMap::new(),
            interpolating: HashMap::new(),
            worker_adapters: ByteLru::with_budget(cache_budget),
            decoding: Vec::new(),
            rescoring: Vec::new(),
            cancels: Vec::new(),
            drop_snapshots: Vec::new(),
            unload: Vec::new(),
            arrivals: 0,
            service: Service::default(),
            reserved: Reserved::default(),
            worker,
            busy: false,
            draining: false,
            worker_gone: false,
        }
    }

    /// The served model.
    pub fn model(&self) -> &ModelInfo {
        &self.model
    }

    pub(super) fn next_arrival(&mut self) -> u64 {
        self.arrivals += 1;
        self.arrivals
    }

    pub(super) fn check_open(&self) -> Result<(), EngineError> {
        if self.worker_gone {
            return Err(EngineError::Unavailable(WORKER_GONE.into()));
        }
        if self.draining {
            return Err(EngineError::Unavailable(
                "the server is shutting down".into(),
            ));
        }
        Ok(())
    }

    /// Opens a session for `owner`.
    pub fn create_session(&mut self, owner: &str) -> Result<String, EngineError> {
        self.check_open()?;
        self.check_sessions(owner)?;
        let id = uuid::Uuid::new_v4().to_string();
        self.sessions.insert(
            id.clone(),
            Session {
                owner: owner.to_string(),
                last_heartbeat: Instant::now(),
                runs: Vec::new(),
                samplers: Vec::new(),
                custom_losses: Vec::new(),
                custom_loss_futures: HashMap::new(),
            },
        );
        Ok(id)
    }

    /// Keeps a session alive.
    pub fn heartbeat(&mut self, owner: &str, session_id: &str) -> Result<(), EngineError> {
        if let Some(ended) = self.ended(owner, session_id) {
            return Err(EngineError::Gone(ended.describe(session_id)));
        }
        match self.sessions.get_mut(session_id) {
            Some(s) if s.owner == owner => {
                s.last_heartbeat = Instant::now();
                Ok(())
            }
            _ => Err(EngineError::NotFound(format!(
                "unknown session {session_id}"
            ))),
        }
    }

    pub(super) fn session_mut(
        &mut self,
        owner: &str,
        session_id: &str,
    ) -> Result<&mut Session, EngineError> {
        if let Some(ended) = self.ended(owner, session_id) {
            return Err(EngineError::Gone(ended.describe(session_id)));
        }
        match self.sessions.get_mut(session_id) {
            Some(s) if s.owner == owner => Ok(s),
            _ => Err(EngineError::NotFound(format!(
                "unknown session {session_id}"
            ))),
        }
    }

    /// Queues a run operation in `seq_id` order and returns its request id. A repeated
    /// `(run, seq_id)` returns the first submission's request id.
    pub(super) fn enqueue(
        &mut self,
        owner: &str,
        run_id: &str,
        seq_id: Option<u64>,
        op: RunOp,
        after: After,
    ) -> Result<String, EngineError> {
        self.enqueue_at(owner, run_id, Some(seq_id), op, after)
    }

    /// Queues a run operation that takes no `seq_id` (see [`RunQueue::push_unordered`]).
    pub(super) fn enqueue_unordered(
        &mut self,
        owner: &str,
        run_id: &str,
        op: RunOp,
    ) -> Result<String, EngineError> {
        self.enqueue_at(owner, run_id, None, op, After::Nothing)
    }

    /// [`Self::enqueue`] at `Some(seq_id)`, or unordered at `None`.
    fn enqueue_at(
        &mut self,
        owner: &str,
        run_id: &str,
        place: Option<Option<u64>>,
        op: RunOp,
        after: After,
    ) -> Result<String, EngineError> {
        let seq_id = place.flatten();
        self.check_open()?;
        self.loaded_run(owner, run_id)?;
        if let Some(first) = self.repeated(owner, run_id, seq_id) {
            // A retried submission answers with its first future, whatever the limits.
            return Ok(first);
        }
        // The operation the run is waiting for is admitted even at the key's queue limit:
        // refusing it would leave the queue full of operations waiting for it.
        let awaited = seq_id.is_some_and(|s| s == self.runs[run_id].queue.next_seq());
        if !awaited {
            self.check_queue(owner)?;
        }
        self.check_request_tokens(op.tokens())?;
        let arrival = self.next_arrival();
        let run = self.loaded_run(owner, run_id)?;
        let request_id = uuid::Uuid::new_v4().to_string();
        let queued = Queued {
            request_id: request_id.clone(),
            arrival,
            since: Instant::now(),
            op,
        };
        if place.is_some() {
            let seq = match run.queue.admit(seq_id, run_id)? {
                Admit::Repeat(existing) => return Ok(existing),
                Admit::At(seq) => seq,
            };
            run.queue.push(seq, queued);
        } else {
            run.queue.push_unordered(queued);
        }
        let session_id = run.session_id.clone();
        run.last_submit = Instant::now();
        self.futures.insert(request_id.clone(), owner);
        self.inflight.insert(
            request_id.clone(),
            Inflight {
                run_id: Some(run_id.to_string()),
                after,
                owner: owner.to_string(),
                sample_tokens: 0,
                arrival: 0,
                more_passes: false,
                partial: None,
                save: None,
                adapter: None,
            },
        );
        // Work on a run keeps its session alive, heartbeat or not.
        if let Some(s) = self.sessions.get_mut(&session_id) {
            s.last_heartbeat = Instant::now();
        }
        self.store_work
            .touched
            .insert(run_id.to_string(), now_unix());
        Ok(request_id)
    }

    /// The request id of an earlier submission of `(run, seq_id)` by `owner`: a client
    /// re-sending a submission (after a lost response) gets its first future back, before
    /// any check that the first one's own effects would now fail (a save's name exists,
    /// a snapshot would be taken twice).
    pub(super) fn repeated(
        &self,
        owner: &str,
        run_id: &str,
        seq_id: Option<u64>,
    ) -> Option<String> {
        let run = self.runs.get(run_id).filter(|r| r.owner == owner)?;
        run.queue.seen(seq_id?).cloned()
    }

    /// Records that the submission with `seq_id` on a run was rejected, so the run's
    /// later operations do not wait for it. (Clients number operations before the server
    /// sees them; a rejected one would otherwise leave a hole in the order.)
    pub fn skip_seq(&mut self, owner: &str, run_id: &str, seq: u64) {
        if let Some(run) = self.runs.get_mut(run_id).filter(|r| r.owner == owner) {
            run.queue.skip(seq);
        }
    }

    /// A run of `owner` that is loaded in the worker.
    pub(super) fn loaded_run(
        &mut self,
        owner: &str,
        run_id: &str,
    ) -> Result<&mut Run, EngineError> {
        if self.runs.get(run_id).is_some_and(|r| r.owner == owner) {
            return Ok(self.runs.get_mut(run_id).expect("checked"));
        }
        Err(EngineError::NotFound(
            if self.catalog.has_checkpoint_of_run(owner, run_id) {
                format!(
                    "training run {run_id} is no longer loaded (its session expired or the \
                     server restarted); resume it from one of its checkpoints with \
                     create_training_client_from_state"
                )
            } else {
                format!("unknown training run {run_id} (or it is no longer loaded and saved no checkpoint)")
            },
        ))
    }

    /// The worker thread is gone: every request in flight or queued fails with a clear
    /// error, and new work is refused (503), so no client waits forever.
    pub(super) fn worker_died(&mut self) {
        if self.worker_gone {
            return;
        }
        tracing::error!("the model worker thread has stopped; failing every pending request");
        self.worker_gone = true;
        self.busy = false;
        self.decoding.clear();
        self.rescoring.clear();
        let mut queued = self.take_queued();
        queued.extend(self.inflight.keys().cloned());
        for id in queued {
            self.inflight.remove(&id);
            self.futures.resolve(&id, Err(Failure::server(WORKER_GONE)));
        }
    }

    /// Whether the engine can serve: `Err` says why not (the worker died, or the server
    /// is shutting down).
    pub fn health(&self) -> Result<(), String> {
        if self.worker_gone || !self.worker.is_alive() {
            return Err(WORKER_GONE.into());
        }
        if self.draining {
            return Err("the server is shutting down".into());
        }
        Ok(())
    }

    /// Drops a run from memory, failing whatever it still had queued.
    pub(super) fn forget_run(&mut self, run_id: &str) {
        if let Some(mut run) = self.runs.remove(run_id) {
            for q in run.queue.drain() {
                self.inflight.remove(&q.request_id);
                self.futures.resolve(
                    &q.request_id,
                    Err(Failure::user(format!("training run {run_id} was unloaded"))),
                );
            }
            if let Some(s) = self.sessions.get_mut(&run.session_id) {
                s.runs.retain(|r| r != run_id);
            }
            // Its in-memory sampler snapshots go too, in the worker as well.
            let closed = run.snapshots.iter().cloned().collect();
            self.futures.completions.forget_samplers(&closed);
            for snapshot in run.snapshots {
                self.samplers.remove(&snapshot);
                if let Some(s) = self.sessions.get_mut(&run.session_id) {
                    s.samplers.retain(|x| x != &snapshot);
                }
                self.drop_snapshots.push(snapshot);
            }
        }
    }

    /// The owner's session that ended recently, if it did.
    pub(super) fn ended(&self, owner: &str, session_id: &str) -> Option<&Ended> {
        self.ended_sessions
            .get(session_id)
            .filter(|e| e.owner == owner)
    }

    /// Ends a live session: its runs are unloaded (their queued work fails; they stay
    /// resumable from their checkpoints) and its samplers closed.
    pub(super) fn end_session(&mut self, id: &str, reason: EndReason, now: Instant) {
        let Some(session) = self.sessions.remove(id) else {
            return;
        };
        tracing::info!(session = %id, runs = session.runs.len(), ?reason, "session ended; unloading its runs");
        for run_id in &session.runs {
            self.forget_run(run_id);
            self.unload.push(run_id.clone());
        }
        let closed = session.samplers.iter().cloned().collect();
        self.futures.completions.forget_samplers(&closed);
        for sampler in &session.samplers {
            if let Some(s) = self.samplers.remove(sampler) {
                if let SamplerSource::Snapshot(snap) = s.source {
                    self.drop_snapshots.push(snap);
                }
            }
        }
        self.ended_sessions
            .insert(id.to_string(), &session.owner, reason, now);
    }

    /// `POST /sessions/{id}/finish`: the client is done with the session. Finishing an
    /// ended session again is a no-op (the first reason stays).
    pub fn finish_session(
        &mut self,
        owner: &str,
        session_id: &str,
        status: &str,
    ) -> Result<(), EngineError> {
        if self.ended(owner, session_id).is_some() {
            return Ok(());
        }
        match self.sessions.get(session_id) {
            Some(s) if s.owner == owner => {
                let reason = EndReason::Finished(status.to_string());
                self.end_session(session_id, reason, Instant::now());
                Ok(())
            }
            _ => Err(EngineError::NotFound(format!(
                "unknown session {session_id}"
            ))),
        }
    }

    /// `cancel_future`: the client gave up on a sampling request. A queued one fails at
    /// once; one being decoded is dropped from the decode at the next batch (its
    /// sequences stop) and then fails; a finished one stays as it is. Training
    /// operations cannot be cancelled: later operations of their run depend on them.
    pub fn cancel_future(&mut self, owner: &str, request_id: &str) -> Result<(), EngineError> {
        match self.futures.is_pending(request_id, owner) {
            None => Err(EngineError::NotFound(format!(
                "unknown request {request_id}"
            ))),
            Some(false) => Ok(()),
            Some(true) => {
                if let Some(i) = self
                    .samples
                    .iter()
                    .position(|q| q.work.request_id == request_id)
                {
                    self.samples.remove(i);
                    self.inflight.remove(request_id);
                    let cancelled = crate::worker::CANCELLED;
                    self.futures
                        .resolve(request_id, Err(Failure::user(cancelled)));
                    return Ok(());
                }
                let is_run_op = self
                    .inflight
                    .get(request_id)
                    .is_some_and(|i| i.run_id.is_some());
                if is_run_op {
                    return Err(EngineError::BadRequest(format!(
                        "request {request_id} is a training operation; only sampling requests \
                         can be cancelled"
                    )));
                }
                if !self.cancels.iter().any(|c| c == request_id) {
                    self.cancels.push(request_id.to_string());
                }
                Ok(())
            }
        }
    }

    /// Periodic housekeeping: expire silent sessions, old futures and checkpoints whose
    /// TTL passed.
    pub fn tick(&mut self, now: Instant) {
        if !self.worker.is_alive() {
            self.worker_died();
        }
        let timeout = self.config.session_timeout;
        let expired: Vec<String> = self
            .sessions
            .iter()
            .filter(|(_, s)| now.saturating_duration_since(s.last_heartbeat) > timeout)
            .map(|(id, _)| id.clone())
            .collect();
        for id in expired {
            self.end_session(&id, EndReason::Expired, now);
        }
        self.ended_sessions.expire(now);
        self.futures.expire(now, self.config.future_ttl);
        for (uri, version) in self.catalog.take_expired(now_unix()) {
            tracing::info!(checkpoint = %uri, "checkpoint TTL passed; deleting it");
            self.store_work.expired.push((uri, version));
        }
    }

    /// Takes the index writes decided since the last call; `with_touches` also takes the
    /// coalesced activity times (flushed less often: they are only shown in listings).
    pub fn take_store_work(&mut self, with_touches: bool) -> StoreWork {
        let touched = if with_touches {
            std::mem::take(&mut self.store_work.touched)
        } else {
            HashMap::new()
        };
        StoreWork {
            new_runs: std::mem::take(&mut self.store_work.new_runs),
            touched,
            expired: std::mem::take(&mut self.store_work.expired),
        }
    }

    /// Whether `owner` may still sample from `pin` (a checkpoint version): its own or
    /// published, and not replaced or deleted since the sampler was opened.
    pub(super) fn check_pin(&self, owner: &str, pin: Option<&Pin>) -> Result<(), EngineError> {
        let Some(pin) = pin else { return Ok(()) };
        let row = self.catalog.readable(owner, &pin.uri)?;
        if row.version != pin.version {
            return Err(EngineError::NotFound(format!(
                "checkpoint {} was replaced since this sampler was opened; open a new \
                 sampling client on it",
                pin.uri
            )));
        }
        Ok(())
    }

    /// Stops accepting work; queued (not started) work fails with category `server`.
    pub fn begin_shutdown(&mut self) {
        self.draining = true;
        let queued = self.take_queued();
        for id in queued {
            self.inflight.remove(&id);
            self.futures.resolve(
                &id,
                Err(Failure::server(
                    "the server shut down before this request ran",
                )),
            );
        }
    }

    /// Removes every queued (not dispatched) run operation and sampling request; returns
    /// their request ids.
    fn take_queued(&mut self) -> Vec<String> {
        self.runs
            .values_mut()
            .flat_map(|r| r.queue.drain())
            .map(|q| q.request_id)
            .chain(self.samples.drain(..).map(|q| q.work.request_id))
            .collect()
    }

    /// Whether the worker has nothing running: no batch, no sequence being decoded.
    pub fn is_idle(&self) -> bool {
        !self.busy && self.decoding.is_empty()
    }

    /// Number of live sessions (tests, metrics).
    pub fn session_count(&self) -> usize {
        self.sessions.len()
    }
}
