//! The engine actor: one tokio task owns the [`Engine`]; everyone else sends it typed
//! [`Command`]s over a bounded channel and awaits the reply (TGI's queue pattern, no
//! shared locks).
//! The actor does no I/O: index reads and writes run on tokio's blocking pool, either
//! between two engine calls (listings, deletes, publishing) or as the engine's queued
//! [`StoreWork`] flushed after each step.

use std::sync::Arc;
use std::time::{Duration, Instant};

use lathe_sdk::types::{CheckpointUri, CheckpointsListResponse, TrainingRun, TrainingRunsResponse};
use tokio::sync::{mpsc, oneshot};

use super::archive::ArchiveSlots;
use super::command::Command;
use super::futures::{FutureResult, Poll};
use super::state::StoreWork;
use super::{rest, Engine, EngineError, Ttl};
use crate::store::Store;
use crate::worker::BatchReport;

/// A cheap, cloneable handle to the engine task.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
    store: Store,
    /// The checkpoint downloads streaming now.
    pub(super) archives: Arc<ArchiveSlots>,
    /// One checkpoint's setting changes (publishing, TTL), one at a time.
    settings: Arc<SettingLocks>,
}

/// Runs each change of a checkpoint's settings (begin in the engine, index write on the
/// blocking pool, finish in the engine) alone among that checkpoint's changes. The index
/// writes of two concurrent changes may land in either order and their finishes reach the
/// actor in either order: without this, an unpublish written last could leave the
/// catalog public (and access open) after a publish finished last, until a restart.
/// Striped by checkpoint: bounded memory, and changes of other checkpoints wait only
/// when they share a stripe.
struct SettingLocks([tokio::sync::Mutex<()>; 64]);

impl SettingLocks {
    fn new() -> Self {
        SettingLocks(std::array::from_fn(|_| tokio::sync::Mutex::new(())))
    }

    async fn lock(&self, uri: &CheckpointUri) -> tokio::sync::MutexGuard<'_, ()> {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (&uri.run_id, uri.kind.type_name(), &uri.name).hash(&mut h);
        self.0[(h.finish() % self.0.len() as u64) as usize]
            .lock()
            .await
    }
}

/// How often housekeeping runs (expiry, reorder timeouts).
const TICK: Duration = Duration::from_millis(500);

impl EngineHandle {
    /// Sends the command `make` builds around a reply channel, and awaits the answer.
    pub(super) async fn request<R>(
        &self,
        make: impl FnOnce(oneshot::Sender<R>) -> Command,
    ) -> Result<R, EngineError> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(make(tx))
            .await
            .map_err(|_| EngineError::Unavailable("the engine has stopped".into()))?;
        rx.await.map_err(|_| {
            if self.tx.is_closed() {
                EngineError::Unavailable("the engine has stopped".into())
            } else {
                // The actor dropped the reply without sending it: this call panicked and
                // was contained (see `run`).
                EngineError::Internal(
                    "internal error while handling this request (logged on the server)".into(),
                )
            }
        })
    }

    /// Waits up to `timeout` for a future's result; `Ok(None)` means still pending. The
    /// result counts as retrieved (it goes a minute later).
    pub async fn retrieve(
        &self,
        owner: String,
        request_id: String,
        timeout: Duration,
    ) -> Result<Option<FutureResult>, EngineError> {
        self.retrieve_marking(owner, request_id, timeout, true)
            .await
    }

    /// [`EngineHandle::retrieve`], with the result counting as retrieved only once
    /// [`EngineHandle::mark_retrieved`] says it was handed over (with `mark` false).
    pub async fn retrieve_marking(
        &self,
        owner: String,
        request_id: String,
        timeout: Duration,
        mark: bool,
    ) -> Result<Option<FutureResult>, EngineError> {
        let poll = self
            .poll_future(owner, request_id.clone(), mark)
            .await?
            .ok_or_else(|| {
                EngineError::NotFound(format!(
                    "unknown request {request_id} (a result is kept for a minute after it is \
                     retrieved, and unretrieved results may be dropped past the server's \
                     --max-result-bytes)"
                ))
            })?;
        match poll {
            Poll::Ready(r) => Ok(Some(r)),
            Poll::Wait(rx) => match tokio::time::timeout(timeout, rx).await {
                Ok(Ok(r)) => Ok(Some(r)),
                Ok(Err(_)) => Err(EngineError::Unavailable("the engine has stopped".into())),
                Err(_) => Ok(None),
            },
        }
    }

    /// Runs blocking store work on the blocking pool.
    pub(super) async fn blocking<R: Send + 'static>(
        &self,
        f: impl FnOnce(&Store) -> Result<R, EngineError> + Send + 'static,
    ) -> Result<R, EngineError> {
        let store = self.store.clone();
        tokio::task::spawn_blocking(move || f(&store))
            .await
            .map_err(|e| EngineError::Internal(format!("store task failed: {e}")))?
    }

    /// A page of the owner's runs, newest first.
    pub async fn list_runs(
        &self,
        owner: String,
        offset: usize,
        limit: usize,
    ) -> Result<TrainingRunsResponse, EngineError> {
        self.blocking(move |s| rest::list_runs(s, &owner, offset, limit))
            .await
    }

    /// One of the owner's runs.
    pub async fn get_run(&self, owner: String, run_id: String) -> Result<TrainingRun, EngineError> {
        self.blocking(move |s| rest::get_run(s, &owner, &run_id))
            .await
    }

    /// A run's checkpoints that the owner may see.
    pub async fn list_run_checkpoints(
        &self,
        owner: String,
        run_id: String,
    ) -> Result<CheckpointsListResponse, EngineError> {
        self.blocking(move |s| rest::list_run_checkpoints(s, &owner, &run_id))
            .await
    }

    /// A page of the owner's checkpoints, newest first.
    pub async fn list_user_checkpoints(
        &self,
        owner: String,
        offset: usize,
        limit: usize,
    ) -> Result<CheckpointsListResponse, EngineError> {
        self.blocking(move |s| rest::list_user_checkpoints(s, &owner, offset, limit))
            .await
    }

    /// Runs a begin/store/finish flow on its own task, so a client that disconnects
    /// midway cannot leave the engine's catalog and the index disagreeing.
    pub(super) async fn detached<R: Send + 'static>(
        &self,
        flow: impl std::future::Future<Output = Result<R, EngineError>> + Send + 'static,
    ) -> Result<R, EngineError> {
        tokio::spawn(flow)
            .await
            .map_err(|e| EngineError::Internal(format!("engine task failed: {e}")))?
    }

    /// Deletes one of the owner's checkpoints: hidden at once, files then index row
    /// removed off the actor (see `store::data_dir`). Runs to completion even if the
    /// caller goes away.
    pub async fn delete_checkpoint(
        &self,
        owner: String,
        uri: CheckpointUri,
    ) -> Result<(), EngineError> {
        let this = self.clone();
        self.detached(async move { this.delete_checkpoint_now(owner, uri).await })
            .await
    }

    async fn delete_checkpoint_now(
        &self,
        owner: String,
        uri: CheckpointUri,
    ) -> Result<(), EngineError> {
        let version = self.begin_delete(owner, uri.clone()).await??;
        let (u, v) = (uri.clone(), version.clone());
        let result = self.blocking(move |s| Ok(s.delete(&u, &v)?)).await;
        self.finish_delete(uri, version, result.is_ok()).await?;
        result.map(|_| ())
    }

    /// Publishes or unpublishes one of the owner's checkpoints. Unpublishing revokes
    /// access before the index is written. Runs to completion even if the caller goes.
    pub async fn set_public(
        &self,
        owner: String,
        uri: CheckpointUri,
        public: bool,
    ) -> Result<(), EngineError> {
        let this = self.clone();
        self.detached(async move { this.set_public_now(owner, uri, public).await })
            .await
    }

    async fn set_public_now(
        &self,
        owner: String,
        uri: CheckpointUri,
        public: bool,
    ) -> Result<(), EngineError> {
        let _alone = self.settings.lock(&uri).await;
        let (was, version) = self.begin_set_public(owner, uri.clone(), public).await??;
        let (u, v) = (uri.clone(), version.clone());
        let result = self
            .blocking(move |s| Ok(s.set_public(&u, &v, public)?))
            .await
            .and_then(|current| replaced_check(&uri, current));
        self.finish_set_public(uri, version, public, was, result.is_ok())
            .await?;
        result
    }

    /// Sets or clears the TTL of one of the owner's checkpoints. Runs to completion even
    /// if the caller goes away.
    pub async fn set_ttl(
        &self,
        owner: String,
        uri: CheckpointUri,
        ttl: Option<Ttl>,
    ) -> Result<(), EngineError> {
        let this = self.clone();
        self.detached(async move { this.set_ttl_now(owner, uri, ttl).await })
            .await
    }

    async fn set_ttl_now(
        &self,
        owner: String,
        uri: CheckpointUri,
        ttl: Option<Ttl>,
    ) -> Result<(), EngineError> {
        let _alone = self.settings.lock(&uri).await;
        let (at, version) = self.begin_set_ttl(owner, uri.clone(), ttl).await??;
        let (u, v) = (uri.clone(), version.clone());
        let current = self
            .blocking(move |s| Ok(s.set_expiry(&u, &v, at)?))
            .await?;
        replaced_check(&uri, current)?;
        self.finish_set_ttl(uri, version, at).await
    }

    /// A sender the worker thread uses to hand its batch reports back.
    pub fn outcome_sink(&self) -> impl Fn(BatchReport) + Send + 'static {
        let tx = self.tx.clone();
        move |report| {
            let _ = tx.blocking_send(Command::Complete(report));
        }
    }

    /// Whether the engine and its worker can serve: `Err` says why not. An engine that
    /// does not answer within `timeout` is unhealthy too.
    pub async fn health(&self, timeout: Duration) -> Result<(), String> {
        match tokio::time::timeout(timeout, self.engine_health()).await {
            Ok(Ok(health)) => health,
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!(
                "the engine did not answer within {} s",
                timeout.as_secs()
            )),
        }
    }

    /// Stops taking work, lets the running batch finish (up to `grace`), fails what was
    /// still queued.
    pub async fn shutdown(&self, grace: Duration) {
        let _ = self.begin_shutdown().await;
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            match self.is_idle().await {
                Ok(true) | Err(_) => break,
                Ok(false) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }
}

/// A publish or TTL write found the version it applied to replaced by a save meanwhile
/// (`current` false): the new version was not touched, and the client is told to ask again.
fn replaced_check(uri: &CheckpointUri, current: bool) -> Result<(), EngineError> {
    if current {
        Ok(())
    } else {
        Err(EngineError::BadRequest(format!(
            "checkpoint {uri} was replaced (or deleted) while this request ran; send it again"
        )))
    }
}

/// A channel for the engine over `store`; the engine itself is built later (its worker
/// needs the handle), then started with [`run`].
pub fn channel(store: Store) -> (EngineHandle, mpsc::Receiver<Command>) {
    let (tx, rx) = mpsc::channel(1024);
    let archives = Arc::default();
    (
        EngineHandle {
            tx,
            store,
            archives,
            settings: Arc::new(SettingLocks::new()),
        },
        rx,
    )
}

/// Writes the engine's queued index work on the blocking pool, then tells the engine
/// which expired checkpoints are gone. A failed write is logged; an expired checkpoint
/// whose delete failed becomes visible again and is retried at the next tick.
async fn flush(store: Store, engine: mpsc::WeakSender<Command>, work: StoreWork) {
    let done = tokio::task::spawn_blocking(move || {
        for run in &work.new_runs {
            if let Err(e) = store.insert_run(run) {
                tracing::warn!(run = %run.id, "recording a new run: {e}");
            }
        }
        if !work.touched.is_empty() {
            let touched: Vec<(String, i64)> = work.touched.into_iter().collect();
            if let Err(e) = store.touch_runs(&touched) {
                tracing::warn!("recording runs' activity: {e}");
            }
        }
        let now = super::now_unix();
        work.expired
            .into_iter()
            .map(|(uri, version)| {
                let outcome = store.delete_expired(&uri, &version, now).map_err(|e| {
                    tracing::warn!(checkpoint = %uri, "deleting an expired checkpoint: {e}");
                });
                (uri, version, outcome.ok())
            })
            .collect::<Vec<_>>()
    })
    .await;
    let (Ok(done), Some(tx)) = (done, engine.upgrade()) else {
        return;
    };
    if done.is_empty() {
        return;
    }
    let _ = tx.send(Command::ExpiredDeleted(done)).await;
}

/// Runs one step of the actor, containing a panic to that step: the engine state is
/// plain data whose every method leaves it usable, so one request's bug fails that
/// request (its reply is dropped, which its caller reports as a 500) instead of stopping
/// the engine for every tenant.
fn contained(what: &str, step: impl FnOnce()) {
    if let Err(panic) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(step)) {
        let msg = crate::worker::panic_message(panic.as_ref());
        tracing::error!("engine {what} panicked (contained; the engine goes on): {msg}");
    }
}

/// The actor loop: apply messages, tick housekeeping, keep the worker fed. Ends when
/// every handle is dropped. A panic in any step is contained to it.
pub async fn run(mut engine: Engine, mut rx: mpsc::Receiver<Command>, handle: EngineHandle) {
    let (store, weak) = (handle.store.clone(), handle.tx.downgrade());
    drop(handle);
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut wake: Option<Instant> = None;
    loop {
        let window = async {
            match wake {
                Some(at) => tokio::time::sleep_until(at.into()).await,
                None => std::future::pending().await,
            }
        };
        let mut ticked = false;
        tokio::select! {
            msg = rx.recv() => match msg {
                Some(command) => contained("request", || command.apply(&mut engine)),
                None => break,
            },
            _ = tick.tick() => {
                ticked = true;
                contained("housekeeping", || engine.tick(Instant::now()))
            }
            _ = window => {}
        }
        wake = None;
        contained("scheduler", || wake = engine.pump());
        let work = engine.take_store_work(ticked);
        if !work.is_empty() {
            tokio::spawn(flush(store.clone(), weak.clone(), work));
        }
    }
}
