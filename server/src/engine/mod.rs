//! The engine: owns all session state (sessions, training runs with their `seq_id`
//! reorder buffers, sampling sessions, futures, the index) as a single actor, and feeds
//! the worker thread batches chosen by a pure scheduler.

mod actor;
#[cfg(test)]
mod batching_tests;
mod error;
mod futures;
mod info;
mod rest;
mod runs;
mod sampling;
pub mod scheduler;
mod state;

pub use actor::{channel, run, EngineHandle};
pub use error::EngineError;
pub use futures::FutureResult;
pub use info::ModelInfo;
pub use rest::{parse_checkpoint_id, MAX_PAGE};
pub use runs::{NewRun, SaveRequest, MAX_SNAPSHOTS_PER_RUN};
pub use sampling::SamplerRef;
pub use state::{now_unix, Engine, EngineConfig, WorkerLink};
