//! Subcommands of the `lathe` binary.

pub mod bench;
pub mod bench_serve;
pub mod bench_wire;
pub mod generate;
pub mod serve;

use clap::Args;
use lathe_server::embedded::ModelOptions;
use lathe_server::model::{DeviceSpec, LoadedModel, PrecisionChoice};

/// The `--device` flag of the commands that load the model.
#[derive(Args, Clone, Copy, Debug)]
pub struct DeviceArg {
    /// Where the base model runs: `cpu`, or `cuda` / `cuda:N` (a build with `--features
    /// cuda`).
    #[arg(long, default_value = "cpu")]
    pub device: DeviceSpec,
}

/// Loads `spec` on `device` in `precision`, fetching the default model first if it is
/// missing (see [`lathe_server::embedded::load_model_with`]).
pub fn load_model(
    spec: &str,
    device: DeviceArg,
    precision: PrecisionChoice,
) -> anyhow::Result<LoadedModel> {
    let options = ModelOptions {
        device: device.device,
        precision,
    };
    Ok(lathe_server::embedded::load_model_with(spec, options)?)
}
