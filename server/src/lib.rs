//! Lathe server library: one frozen base model, many LoRA training sessions.
//!
//! Layers, one way only: `model` (decoder, LoRA seam, loaders), `train` (losses, AdamW,
//! multi-adapter forward/backward), `sample` (KV-cache decoding), `store` (checkpoint
//! files). See ARCHITECTURE.md.

pub mod api;
pub mod embedded;
pub mod engine;
pub mod memory;
pub mod model;
pub mod panics;
pub mod sample;
pub mod server;
pub mod store;
pub mod train;
pub mod worker;
