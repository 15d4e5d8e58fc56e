//! Running a [`Worker`] on its own OS thread.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc;
use std::thread::JoinHandle;

use super::jobs::{Batch, BatchReport, Failure, Outcome};
use super::runner::Worker;

/// Sends batches to the worker thread.
pub struct WorkerHandle {
    tx: Option<mpsc::Sender<Batch>>,
    thread: Option<JoinHandle<()>>,
}

impl WorkerHandle {
    /// Queues a batch; its outcomes arrive through the `on_done` callback given to
    /// [`spawn`]. Returns false if the worker thread has stopped.
    pub fn send(&self, batch: Batch) -> bool {
        self.tx.as_ref().is_some_and(|tx| tx.send(batch).is_ok())
    }

    /// Whether the thread is still running.
    pub fn is_alive(&self) -> bool {
        self.thread.as_ref().is_some_and(|t| !t.is_finished())
    }

    /// Lets the current batch finish, then stops the thread.
    pub fn shutdown(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for WorkerHandle {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Starts the worker thread. `on_done` receives each batch's report, in the worker
/// thread. A panic inside a batch fails that batch's requests and those being decoded
/// (category `server`), and the worker carries on.
pub fn spawn(mut worker: Worker, on_done: impl Fn(BatchReport) + Send + 'static) -> WorkerHandle {
    let (tx, rx) = mpsc::channel::<Batch>();
    let thread = std::thread::Builder::new()
        .name("lathe-worker".into())
        .spawn(move || {
            if let Err(e) = worker.make_device_current() {
                // Every operation on the device would fail the same way and say so.
                tracing::error!("the worker thread cannot use the model's device: {e}");
            }
            while let Ok(batch) = rx.recv() {
                let ids = batch.request_ids();
                let report = match catch_unwind(AssertUnwindSafe(|| worker.run_batch(batch))) {
                    Ok(report) => report,
                    Err(panic) => {
                        let msg = super::jobs::panic_message(panic.as_ref());
                        tracing::error!("worker panicked: {msg}");
                        let mut failed = worker.abandon_decoding();
                        failed.retain(|id| !ids.contains(id));
                        ids.into_iter()
                            .chain(failed)
                            .map(|request_id| Outcome {
                                request_id,
                                result: Err(Failure::server(format!("internal error: {msg}"))),
                            })
                            .collect::<Vec<_>>()
                            .into()
                    }
                };
                on_done(report);
            }
        })
        .expect("spawning the worker thread");
    WorkerHandle {
        tx: Some(tx),
        thread: Some(thread),
    }
}
