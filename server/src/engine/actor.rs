//! The engine actor: one tokio task owns the [`Engine`]; everyone else sends it closures
//! over a bounded channel and awaits the reply (TGI's queue pattern, no shared locks).

use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};

use super::futures::{FutureResult, Poll};
use super::{Engine, EngineError};
use crate::worker::Outcome;

type Message = Box<dyn FnOnce(&mut Engine) + Send>;

/// A cheap, cloneable handle to the engine task.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Message>,
}

/// How often housekeeping runs (expiry, reorder timeouts).
const TICK: Duration = Duration::from_millis(500);

impl EngineHandle {
    /// Runs `f` on the engine and returns its result.
    pub async fn call<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Engine) -> R + Send + 'static,
    ) -> Result<R, EngineError> {
        let (tx, rx) = oneshot::channel();
        let msg: Message = Box::new(move |engine| {
            let _ = tx.send(f(engine));
        });
        self.tx
            .send(msg)
            .await
            .map_err(|_| EngineError::Unavailable("the engine has stopped".into()))?;
        rx.await
            .map_err(|_| EngineError::Unavailable("the engine has stopped".into()))
    }

    /// Waits up to `timeout` for a future's result; `Ok(None)` means still pending.
    pub async fn retrieve(
        &self,
        owner: String,
        request_id: String,
        timeout: Duration,
    ) -> Result<Option<FutureResult>, EngineError> {
        let rid = request_id.clone();
        let poll = self
            .call(move |e| e.futures.poll(&rid, &owner))
            .await?
            .ok_or_else(|| EngineError::NotFound(format!("unknown request {request_id}")))?;
        match poll {
            Poll::Ready(r) => Ok(Some(r)),
            Poll::Wait(rx) => match tokio::time::timeout(timeout, rx).await {
                Ok(Ok(r)) => Ok(Some(r)),
                Ok(Err(_)) => Err(EngineError::Unavailable("the engine has stopped".into())),
                Err(_) => Ok(None),
            },
        }
    }

    /// A tar of a checkpoint `owner` may read, built off the actor and the async threads
    /// (it reads every file of the checkpoint).
    pub async fn checkpoint_archive(
        &self,
        owner: String,
        uri: lathe_sdk::types::CheckpointUri,
    ) -> Result<Vec<u8>, EngineError> {
        let dir = self.call(move |e| e.checkpoint_dir(&owner, &uri)).await??;
        tokio::task::spawn_blocking(move || crate::store::checkpoints::archive(&dir))
            .await
            .map_err(|e| EngineError::Internal(e.to_string()))?
            .map_err(EngineError::from)
    }

    /// A sender the worker thread uses to hand outcomes back.
    pub fn outcome_sink(&self) -> impl Fn(Vec<Outcome>) + Send + 'static {
        let tx = self.tx.clone();
        move |outcomes| {
            let msg: Message = Box::new(move |engine| engine.complete(outcomes));
            let _ = tx.blocking_send(msg);
        }
    }

    /// Stops taking work, lets the running batch finish (up to `grace`), fails what was
    /// still queued.
    pub async fn shutdown(&self, grace: Duration) {
        let _ = self.call(|e| e.begin_shutdown()).await;
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            match self.call(|e| e.is_idle()).await {
                Ok(true) | Err(_) => break,
                Ok(false) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }
}

/// A channel for the engine; the engine itself is built later (its worker needs the
/// handle), then started with [`run`].
pub fn channel() -> (EngineHandle, mpsc::Receiver<Message>) {
    let (tx, rx) = mpsc::channel(1024);
    (EngineHandle { tx }, rx)
}

/// The actor loop: apply messages, tick housekeeping, keep the worker fed. Ends when
/// every handle is dropped.
pub async fn run(mut engine: Engine, mut rx: mpsc::Receiver<Message>) {
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
        tokio::select! {
            msg = rx.recv() => match msg {
                Some(f) => f(&mut engine),
                None => break,
            },
            _ = tick.tick() => engine.tick(Instant::now()),
            _ = window => {}
        }
        wake = engine.pump();
    }
}
