//! Checkpoints and metadata. `peft` reads and writes adapters and optimizer state in the
//! PEFT layout; `checkpoints` places them atomically under the data dir; `db` is the
//! SQLite index of runs and checkpoints.

pub mod checkpoints;
pub mod db;
mod error;
pub mod peft;

pub use error::StoreError;
