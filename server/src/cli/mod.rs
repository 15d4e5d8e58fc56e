//! Subcommands of the `lathe` binary.

pub mod bench;
pub mod bench_serve;
pub mod bench_wire;
pub mod generate;
pub mod serve;

use lathe_server::model::{LoadedModel, Precision};

/// Loads `spec`, fetching the default model first if it is missing.
pub fn load_model(spec: &str) -> anyhow::Result<LoadedModel> {
    Ok(lathe_server::embedded::load_model(spec)?)
}

/// [`load_model`] in `precision` (see [`lathe_server::embedded::load_model_in`]).
pub fn load_model_in(spec: &str, precision: Precision) -> anyhow::Result<LoadedModel> {
    Ok(lathe_server::embedded::load_model_in(spec, precision)?)
}
