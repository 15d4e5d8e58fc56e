//! The engine's state and its core loop steps: sessions, the per-run reorder buffers,
//! dispatching batches to the worker and taking their outcomes back. Every method is a
//! plain synchronous function, so the whole engine is testable without channels; the
//! actor (`actor.rs`) only calls them.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::model::LoraSpec;
use crate::store::checkpoints::{CheckpointDir, CheckpointMeta};
use crate::store::db::Db;
use crate::worker::{Batch, Failure, Outcome, RunOp, RunWork, SampleWork, SamplerSource};

use super::futures::Futures;
use super::info::ModelInfo;
use super::scheduler::{self, Candidate, Kind, Limits};
use super::EngineError;

/// Engine settings.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Most training runs loaded at once (`--max-sessions`).
    pub max_sessions: usize,
    /// Token budget of one fused forward pass (`--max-batch-tokens`).
    pub max_batch_tokens: usize,
    /// Most sequences decoded together.
    pub max_sample_streams: usize,
    /// A session without a heartbeat for this long is expired and its runs unloaded.
    pub session_timeout: Duration,
    /// How long a run waits for a missing `seq_id` before skipping it.
    pub reorder_timeout: Duration,
    /// How long finished futures stay retrievable.
    pub future_ttl: Duration,
    /// How long work arriving at an idle worker waits for company (see [`Engine::pump`]).
    pub batch_window: Duration,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_sessions: 64,
            max_batch_tokens: 8192,
            max_sample_streams: 64,
            session_timeout: Duration::from_secs(300),
            reorder_timeout: Duration::from_secs(30),
            future_ttl: Duration::from_secs(3600),
            batch_window: Duration::from_millis(5),
        }
    }
}

/// Sends batches to the worker (a thread in production, a recorder in tests).
pub trait WorkerLink: Send {
    /// Queues a batch; false if the worker is gone.
    fn send(&mut self, batch: Batch) -> bool;
}

impl WorkerLink for crate::worker::WorkerHandle {
    fn send(&mut self, batch: Batch) -> bool {
        crate::worker::WorkerHandle::send(self, batch)
    }
}

pub(super) struct Session {
    pub owner: String,
    pub last_heartbeat: Instant,
    pub runs: Vec<String>,
    pub samplers: Vec<String>,
}

pub(super) struct Queued {
    pub request_id: String,
    pub arrival: u64,
    pub since: Instant,
    pub op: RunOp,
}

pub(super) struct Run {
    pub owner: String,
    pub session_id: String,
    pub spec: LoraSpec,
    /// The next `seq_id` to execute.
    pub next_seq: u64,
    /// Submitted operations by `seq_id`, waiting for their turn.
    pub pending: BTreeMap<u64, Queued>,
    /// Request ids by `seq_id`, to answer a repeated submission with the same future.
    pub seen: BTreeMap<u64, String>,
    pub inflight: bool,
    /// When the run last submitted an operation (to judge whether batching can pay).
    pub last_submit: Instant,
    /// `seq_id`s whose submissions were rejected: nothing will come for them.
    pub skipped: BTreeSet<u64>,
    /// In-memory sampler snapshots taken from this run, least recently used first.
    pub snapshots: VecDeque<String>,
}

pub(super) struct Sampler {
    pub owner: String,
    pub base_model: String,
    pub model_path: Option<String>,
    pub source: SamplerSource,
}

/// What to do when an in-flight request finishes.
pub(super) enum After {
    Nothing,
    /// Record the checkpoint in the index.
    Saved(CheckpointMeta),
    /// The run could not be created: forget it.
    DropRunOnFailure,
    /// The run was unloaded: forget it.
    Unloaded,
}

pub(super) struct Inflight {
    pub run_id: Option<String>,
    pub after: After,
}

/// All engine state.
pub struct Engine {
    pub(super) model: ModelInfo,
    pub(super) config: EngineConfig,
    pub(super) db: Db,
    pub(super) checkpoints: CheckpointDir,
    pub(super) sessions: HashMap<String, Session>,
    pub(super) expired_sessions: HashSet<String>,
    pub(super) runs: HashMap<String, Run>,
    pub(super) samplers: HashMap<String, Sampler>,
    pub(super) futures: Futures,
    pub(super) samples: VecDeque<(u64, Instant, SampleWork)>,
    /// When each sampling client (a sampler id, or an owner's base model or checkpoint
    /// path) last submitted, so that `pump` knows whether others may be about to.
    pub(super) sample_submits: HashMap<String, Instant>,
    pub(super) inflight: HashMap<String, Inflight>,
    pub(super) drop_snapshots: Vec<String>,
    pub(super) unload: Vec<String>,
    pub(super) arrivals: u64,
    pub(super) worker: Box<dyn WorkerLink>,
    pub(super) busy: bool,
    pub(super) draining: bool,
}

/// A run or sampling client that submitted within this long counts as active for
/// batching decisions.
const ACTIVE_WINDOW: Duration = Duration::from_secs(2);

/// Unix seconds now.
pub fn now_unix() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

impl Engine {
    /// An engine over an open index and checkpoint directory, driving `worker`.
    pub fn new(
        model: ModelInfo,
        config: EngineConfig,
        db: Db,
        checkpoints: CheckpointDir,
        worker: Box<dyn WorkerLink>,
    ) -> Self {
        Self {
            model,
            config,
            db,
            checkpoints,
            sessions: HashMap::new(),
            expired_sessions: HashSet::new(),
            runs: HashMap::new(),
            samplers: HashMap::new(),
            futures: Futures::default(),
            samples: VecDeque::new(),
            sample_submits: HashMap::new(),
            inflight: HashMap::new(),
            drop_snapshots: Vec::new(),
            unload: Vec::new(),
            arrivals: 0,
            worker,
            busy: false,
            draining: false,
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
        let id = uuid::Uuid::new_v4().to_string();
        self.sessions.insert(
            id.clone(),
            Session {
                owner: owner.to_string(),
                last_heartbeat: Instant::now(),
                runs: Vec::new(),
                samplers: Vec::new(),
            },
        );
        Ok(id)
    }

    /// Keeps a session alive.
    pub fn heartbeat(&mut self, owner: &str, session_id: &str) -> Result<(), EngineError> {
        match self.sessions.get_mut(session_id) {
            Some(s) if s.owner == owner => {
                s.last_heartbeat = Instant::now();
                Ok(())
            }
            _ if self.expired_sessions.contains(session_id) => Err(EngineError::Gone(format!(
                "session {session_id} expired after {} s without a heartbeat",
                self.config.session_timeout.as_secs()
            ))),
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
        if self.expired_sessions.contains(session_id) {
            return Err(EngineError::Gone(format!("session {session_id} expired")));
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
        self.check_open()?;
        let arrival = self.next_arrival();
        let run = self.loaded_run(owner, run_id)?;
        let seq = match seq_id {
            Some(s) => s,
            None => run
                .pending
                .keys()
                .next_back()
                .map_or(run.next_seq, |&k| k + 1)
                .max(run.next_seq),
        };
        if let Some(existing) = run.seen.get(&seq) {
            return Ok(existing.clone());
        }
        run.skipped.remove(&seq);
        let session_id = run.session_id.clone();
        if seq < run.next_seq {
            return Err(EngineError::BadRequest(format!(
                "seq_id {seq} of {run_id} was already executed (next is {})",
                run.next_seq
            )));
        }
        let request_id = uuid::Uuid::new_v4().to_string();
        run.seen.insert(seq, request_id.clone());
        run.last_submit = Instant::now();
        // Keep the dedupe window bounded.
        while run.seen.len() > 4096 {
            run.seen.pop_first();
        }
        run.pending.insert(
            seq,
            Queued {
                request_id: request_id.clone(),
                arrival,
                since: Instant::now(),
                op,
            },
        );
        self.futures.insert(request_id.clone(), owner);
        self.inflight.insert(
            request_id.clone(),
            Inflight {
                run_id: Some(run_id.to_string()),
                after,
            },
        );
        // Work on a run keeps its session alive, heartbeat or not.
        if let Some(s) = self.sessions.get_mut(&session_id) {
            s.last_heartbeat = Instant::now();
        }
        let _ = self.db.touch_run(run_id, now_unix());
        Ok(request_id)
    }

    /// Records that the submission with `seq_id` on a run was rejected, so the run's
    /// later operations do not wait for it. (Clients number operations before the server
    /// sees them; a rejected one would otherwise leave a hole in the order.)
    pub fn skip_seq(&mut self, owner: &str, run_id: &str, seq: u64) {
        if let Some(run) = self.runs.get_mut(run_id).filter(|r| r.owner == owner) {
            if seq >= run.next_seq && !run.seen.contains_key(&seq) {
                run.skipped.insert(seq);
            }
        }
    }

    /// A run of `owner` that is loaded in the worker.
    pub(super) fn loaded_run(
        &mut self,
        owner: &str,
        run_id: &str,
    ) -> Result<&mut Run, EngineError> {
        match self.runs.get(run_id) {
            Some(r) if r.owner == owner => {}
            _ => {
                let known = self.db.run(run_id)?.is_some_and(|r| r.owner == owner);
                return Err(if known {
                    EngineError::NotFound(format!(
                        "training run {run_id} is no longer loaded (its session expired or the \
                         server restarted); resume it from one of its checkpoints with \
                         create_training_client_from_state"
                    ))
                } else {
                    EngineError::NotFound(format!("unknown training run {run_id}"))
                });
            }
        }
        Ok(self.runs.get_mut(run_id).expect("checked"))
    }

    /// Sends the next batch to the worker if it is idle and there is work. Work that
    /// arrives at an idle worker waits `batch_window` first, so that requests sent at the
    /// same moment by several sessions share one pass; the return value is when to call
    /// again for that.
    pub fn pump(&mut self) -> Option<Instant> {
        if self.busy {
            return None;
        }
        let now = Instant::now();
        let mut oldest: Option<Instant> = None;
        let mut candidates = Vec::new();
        let mut heads: Vec<(String, u64)> = Vec::new();
        for (run_id, run) in &mut self.runs {
            while run.skipped.remove(&run.next_seq) {
                run.next_seq += 1;
            }
            if run.inflight {
                continue;
            }
            let Some((&seq, q)) = run.pending.first_key_value() else {
                continue;
            };
            if seq != run.next_seq {
                // A missing seq_id: wait for it, but not forever.
                if now.duration_since(q.since) < self.config.reorder_timeout {
                    continue;
                }
                tracing::warn!(run = %run_id, missing = run.next_seq, next = seq, "skipping a seq_id that never arrived");
            }
            oldest = Some(oldest.map_or(q.since, |o| o.min(q.since)));
            let kind = match &q.op {
                RunOp::Forward { with_grad, .. } => Kind::Forward {
                    tokens: q.op.tokens(),
                    with_grad: *with_grad,
                },
                _ => Kind::Other,
            };
            candidates.push(Candidate {
                key: heads.len(),
                arrival: q.arrival,
                kind,
            });
            heads.push((run_id.clone(), seq));
        }
        let base = heads.len();
        for (i, (arrival, since, s)) in self.samples.iter().enumerate() {
            oldest = Some(oldest.map_or(*since, |o: Instant| o.min(*since)));
            candidates.push(Candidate {
                key: base + i,
                arrival: *arrival,
                kind: Kind::Sample {
                    tokens: s.job.prompt.len(),
                    streams: s.job.num_samples,
                },
            });
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
        if let Some(oldest) = oldest.filter(|_| active > 1 && !self.draining) {
            let ready_at = oldest + self.config.batch_window;
            if now < ready_at {
                return Some(ready_at);
            }
        }
        let limits = Limits {
            max_batch_tokens: self.config.max_batch_tokens,
            max_sample_streams: self.config.max_sample_streams,
        };
        let chosen = scheduler::plan(&candidates, limits);
        let mut batch = Batch {
            drop_snapshots: std::mem::take(&mut self.drop_snapshots),
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
        for key in chosen {
            if key < base {
                let (run_id, seq) = &heads[key];
                let run = self.runs.get_mut(run_id).expect("head of a live run");
                let q = run.pending.remove(seq).expect("head exists");
                run.next_seq = seq + 1;
                run.inflight = true;
                batch.runs.push(RunWork {
                    request_id: q.request_id,
                    run_id: run_id.clone(),
                    op: q.op,
                });
            } else {
                sample_keys.push(key - base);
            }
        }
        sample_keys.sort_unstable();
        for i in sample_keys.into_iter().rev() {
            let (_, _, s) = self.samples.remove(i).expect("sample exists");
            batch.samples.push(s);
        }
        batch.samples.reverse();
        if batch.is_empty() {
            return None;
        }
        tracing::debug!(
            runs = batch.runs.len(),
            forward_tokens = batch.runs.iter().map(|w| w.op.tokens()).sum::<usize>(),
            samples = batch.samples.len(),
            "dispatching a batch"
        );
        if self.worker.send(batch) {
            self.busy = true;
        } else {
            tracing::error!("the worker thread is gone");
        }
        None
    }

    /// Takes a finished batch's outcomes: records checkpoints, resolves futures.
    pub fn complete(&mut self, outcomes: Vec<Outcome>) {
        self.busy = false;
        for outcome in outcomes {
            let Some(inflight) = self.inflight.remove(&outcome.request_id) else {
                continue;
            };
            if let Some(run) = inflight.run_id.as_ref().and_then(|r| self.runs.get_mut(r)) {
                run.inflight = false;
            }
            let result = match (outcome.result, inflight.after) {
                (Ok(done), After::Saved(meta)) => {
                    match self
                        .db
                        .insert_checkpoint(&meta, done.saved_bytes.unwrap_or(0))
                    {
                        Ok(()) => Ok(done.body),
                        Err(e) => Err(Failure::server(e.to_string())),
                    }
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
            self.futures.resolve(&outcome.request_id, result);
        }
    }

    /// Drops a run from memory, failing whatever it still had queued.
    pub(super) fn forget_run(&mut self, run_id: &str) {
        if let Some(run) = self.runs.remove(run_id) {
            for (_, q) in run.pending {
                self.inflight.remove(&q.request_id);
                self.futures.resolve(
                    &q.request_id,
                    Err(Failure::user(format!("training run {run_id} was unloaded"))),
                );
            }
            if let Some(s) = self.sessions.get_mut(&run.session_id) {
                s.runs.retain(|r| r != run_id);
            }
        }
    }

    /// Periodic housekeeping: expire silent sessions, old futures and checkpoints whose
    /// TTL passed.
    pub fn tick(&mut self, now: Instant) {
        let timeout = self.config.session_timeout;
        let expired: Vec<String> = self
            .sessions
            .iter()
            .filter(|(_, s)| now.saturating_duration_since(s.last_heartbeat) > timeout)
            .map(|(id, _)| id.clone())
            .collect();
        for id in expired {
            let session = self.sessions.remove(&id).expect("listed");
            tracing::info!(session = %id, runs = session.runs.len(), "session expired; unloading its runs");
            for run_id in &session.runs {
                self.forget_run(run_id);
                self.unload.push(run_id.clone());
            }
            for sampler in &session.samplers {
                if let Some(s) = self.samplers.remove(sampler) {
                    if let SamplerSource::Snapshot(snap) = s.source {
                        self.drop_snapshots.push(snap);
                    }
                }
            }
            self.expired_sessions.insert(id);
        }
        self.futures.expire(now, self.config.future_ttl);
        match self.db.expired(now_unix()) {
            Ok(rows) => {
                for row in rows {
                    let m = &row.meta;
                    if let Some(kind) = m.kind() {
                        tracing::info!(run = %m.run_id, name = %m.name, "checkpoint TTL passed; deleting it");
                        let _ = self.checkpoints.remove(&m.run_id, kind, &m.name);
                        let _ = self.db.delete_checkpoint(&m.run_id, &m.kind, &m.name);
                    }
                }
            }
            Err(e) => tracing::warn!("checking checkpoint TTLs: {e}"),
        }
    }

    /// Stops accepting work; queued (not started) work fails with category `server`.
    pub fn begin_shutdown(&mut self) {
        self.draining = true;
        let queued: Vec<String> = self
            .runs
            .values_mut()
            .flat_map(|r| std::mem::take(&mut r.pending).into_values())
            .map(|q| q.request_id)
            .chain(self.samples.drain(..).map(|(_, _, s)| s.request_id))
            .collect();
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

    /// Whether the worker has nothing running.
    pub fn is_idle(&self) -> bool {
        !self.busy
    }

    /// Number of live sessions (tests, metrics).
    pub fn session_count(&self) -> usize {
        self.sessions.len()
    }
}
