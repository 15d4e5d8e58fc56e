//! Lathe: train LoRA adapters on a shared base model, step by step, over the Tinker
//! HTTP protocol.
//!
//! This crate is a facade over [`lathe_sdk`], so recipe code writes `use lathe::...`.
//! The wire types live in [`types`]; see the repository README for the server.

pub use lathe_sdk::*;
