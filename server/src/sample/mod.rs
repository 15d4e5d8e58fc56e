//! Sampling: token choice (temperature, top-k, top-p) and batched KV-cache decoding
//! across adapters.

pub mod jobs;
pub mod logits;
mod prefill;
pub mod progress;
mod rescore;
pub mod running;

pub use jobs::{
    sample, sample_timed, DecodeMode, Generated, SampleJob, SampleOutput, SampleTimings, Stop,
    DEFAULT_MAX_TOKENS,
};
pub use logits::Picker;
pub use progress::TokenProgress;
pub use running::{Admission, Finished, RunningDecode};
