//! Loading the model a command names (fetching the default one on first use) and
//! starting a whole server in-process: what `lathe serve`, the SDK examples and the
//! recipes share.

use std::path::{Path, PathBuf};
use std::process::Command;

use candle_core::Device;

use crate::model::{default_model_path, LoadedModel, ModelError, Precision, DEFAULT_MODEL_NAME};
use crate::server::{self, RunningServer, ServeError, ServerConfig};

/// Errors of [`load_model`] and [`start`].
#[derive(Debug, thiserror::Error)]
pub enum EmbedError {
    /// The default model is missing and could not be fetched.
    #[error("fetching the default model: {0}")]
    Fetch(String),
    /// The model failed to load.
    #[error("loading model {spec:?}: {source}")]
    Model {
        /// What was asked for.
        spec: String,
        /// Why it failed.
        source: ModelError,
    },
    /// The server failed to start.
    #[error(transparent)]
    Serve(#[from] ServeError),
}

fn fetch_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/fetch-model")
}

/// Loads `spec` (`default`, a `.gguf` file or a Hugging Face directory), running
/// `scripts/fetch-model` first when the default model is missing and this build comes
/// from a source checkout.
pub fn load_model(spec: &str) -> Result<LoadedModel, EmbedError> {
    if (spec == "default" || spec == DEFAULT_MODEL_NAME) && !default_model_path().exists() {
        let script = fetch_script();
        if !script.exists() {
            return Err(EmbedError::Fetch(format!(
                "the default model is missing at {} and scripts/fetch-model is not available; \
                 pass a model path",
                default_model_path().display()
            )));
        }
        tracing::info!("default model not found; running scripts/fetch-model");
        let status = Command::new(&script)
            .status()
            .map_err(|e| EmbedError::Fetch(format!("running {}: {e}", script.display())))?;
        if !status.success() {
            return Err(EmbedError::Fetch(format!(
                "scripts/fetch-model failed ({status})"
            )));
        }
    }
    let started = std::time::Instant::now();
    let model = LoadedModel::load(spec, &Device::Cpu).map_err(|source| EmbedError::Model {
        spec: spec.to_string(),
        source,
    })?;
    tracing::info!(
        model = %model.name,
        params = model.transformer.weights.num_params(),
        seconds = format!("{:.2}", started.elapsed().as_secs_f64()),
        "model loaded"
    );
    Ok(model)
}

/// [`load_model`], then sets the element type of its products ([`Precision`]). A CPU
/// without a bf16 kernel keeps f32, with a warning in the log.
pub fn load_model_in(spec: &str, precision: Precision) -> Result<LoadedModel, EmbedError> {
    let mut model = load_model(spec)?;
    let got = model
        .transformer
        .set_precision(precision)
        .map_err(|source| EmbedError::Model {
            spec: spec.to_string(),
            source,
        })?;
    if got != precision {
        tracing::warn!("precision {precision} is not available on this CPU; using {got}");
    }
    Ok(model)
}

/// Starts a server in this process on a free loopback port, on the default model, with
/// its data (and generated API key) in `data_dir`. Use `api_keys[0]` of the result to
/// connect.
pub async fn start(data_dir: &Path) -> Result<RunningServer, EmbedError> {
    let model = tokio::task::spawn_blocking(|| load_model("default"))
        .await
        .map_err(|e| EmbedError::Fetch(e.to_string()))??;
    let config = ServerConfig {
        port: 0,
        data_dir: data_dir.to_path_buf(),
        ..Default::default()
    };
    Ok(server::start(model, config).await?)
}
