//! Checkpoints and metadata. `peft` reads and writes adapters and optimizer state in the
//! PEFT layout; `checkpoints` writes them as immutable versions under the data dir; `db`
//! is the SQLite index of runs and checkpoints; `data_dir` holds the two together under
//! an exclusive lock, with the crash-safe save and delete sequences.

pub mod checkpoints;
pub mod data_dir;
pub mod db;
mod error;
pub mod interpolate;
pub mod peft;

pub use data_dir::{ExpiredDelete, OpenReport, Store};
pub use error::StoreError;
