//! Subcommands of the `lathe` binary.

pub mod bench;
pub mod bench_serve;
pub mod generate;
pub mod serve;

use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context};
use candle_core::Device;
use lathe_server::model::{default_model_path, LoadedModel, DEFAULT_MODEL_NAME};

/// Loads `spec`, fetching the default model first if it is missing and this binary runs
/// from a source checkout (where `scripts/fetch-model` lives).
pub fn load_model(spec: &str) -> anyhow::Result<LoadedModel> {
    if (spec == "default" || spec == DEFAULT_MODEL_NAME) && !default_model_path().exists() {
        fetch_default_model()?;
    }
    let started = std::time::Instant::now();
    let model =
        LoadedModel::load(spec, &Device::Cpu).with_context(|| format!("loading model {spec:?}"))?;
    tracing::info!(
        model = %model.name,
        params = model.transformer.weights.num_params(),
        seconds = format!("{:.2}", started.elapsed().as_secs_f64()),
        "model loaded"
    );
    Ok(model)
}

fn fetch_default_model() -> anyhow::Result<()> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/fetch-model");
    if !script.exists() {
        bail!(
            "the default model is missing at {} and scripts/fetch-model is not available; \
             pass --model PATH",
            default_model_path().display()
        );
    }
    tracing::info!("default model not found; running scripts/fetch-model");
    let status = Command::new(&script)
        .status()
        .with_context(|| format!("running {}", script.display()))?;
    if !status.success() {
        bail!("scripts/fetch-model failed ({status})");
    }
    Ok(())
}
