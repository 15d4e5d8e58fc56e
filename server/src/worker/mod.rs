//! The worker thread: one OS thread owns the base model and every adapter and runs all
//! model work, one [`Batch`] at a time, for the engine.

mod adapter_cache;
mod jobs;
mod reply;
mod runner;
mod thread;

pub use adapter_cache::{ByteLru, CACHE_SHARE as SAMPLER_CACHE_SHARE};
pub use jobs::{
    panic_message, Batch, BatchReport, Blame, Done, Failure, Outcome, Pass, RunOp, RunWork,
    SampleWork, SamplerSource,
};
pub use reply::{CustomTotals, DatumOutput, ForwardResult, Reply};
pub use runner::{Worker, CANCELLED, CHECKPOINT_GONE};
pub use thread::{spawn, WorkerHandle};
