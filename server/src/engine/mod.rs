//! The engine: owns all session state (sessions, training runs with their `seq_id`
//! reorder buffers, sampling sessions, futures, the index) as a single actor, and feeds
//! the worker thread batches chosen by a pure scheduler.

#[cfg(test)]
mod access_tests;
mod actor;
mod archive;
#[cfg(test)]
mod batching_tests;
mod catalog;
mod command;
mod completions;
mod custom_loss;
mod dispatch;
mod ended;
mod error;
mod futures;
mod info;
mod interpolate;
mod limits;
pub mod rest;
mod run_queue;
mod runs;
mod sampling;
#[cfg(test)]
mod sampling_adapter_tests;
pub mod scheduler;
#[cfg(test)]
mod settings_tests;
mod state;
#[cfg(test)]
mod test_engine;
mod ttl;

pub use actor::{channel, run, EngineHandle};
pub use archive::{ARCHIVE_STREAMS, ARCHIVE_STREAMS_PER_KEY};
pub use command::Command;
pub use completions::{Completion, CompletionPoll};
pub use custom_loss::MAX_CUSTOM_LOSSES_PER_SESSION;
pub use error::EngineError;
pub use futures::FutureResult;
pub use info::{LoraWidths, ModelInfo};
pub use interpolate::{InterpolatePlan, MAX_SOURCES};
pub use limits::{KeyLimits, LimitExceeded};
pub use rest::{parse_checkpoint_id, MAX_PAGE};
pub use run_queue::MAX_SEQ_AHEAD;
pub use runs::{NewRun, SaveRequest, MAX_SNAPSHOTS_PER_RUN};
pub use sampling::SamplerRef;
pub use state::{now_unix, Engine, EngineConfig, StoreWork, WorkerLink};
pub use ttl::{Ttl, MAX_TTL_SECONDS};
