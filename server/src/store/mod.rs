//! Checkpoint files. `peft` reads and writes adapters and optimizer state in the PEFT
//! layout; run and checkpoint metadata (SQLite) joins it with the server.

pub mod peft;

pub use peft::StoreError;
