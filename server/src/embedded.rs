//! Loading the model a command names (fetching the default one on first use) and
//! starting a whole server in-process: what `lathe serve`, the SDK examples and the
//! recipes share.

use std::path::{Path, PathBuf};
use std::process::Command;

use candle_core::Device;

use crate::model::{
    default_model_path, Backend, DeviceError, DeviceSpec, LoadedModel, ModelError, PrecisionChoice,
    DEFAULT_MODEL_NAME,
};
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
    /// The device asked for cannot be used.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// The server failed to start.
    #[error(transparent)]
    Serve(#[from] ServeError),
}

/// How to load the base model: the device it runs on and the element type of its
/// frozen products. The default is the CPU with `auto` precision (bf16 where the CPU has
/// AMX tiles, f32 otherwise: [`PrecisionChoice::resolve`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ModelOptions {
    /// Where the weights live and the operations run: the CPU (with its fast paths) or
    /// a CUDA device (candle's ops, see [`crate::model::backend`]).
    pub device: DeviceSpec,
    /// f32, or bf16 for the frozen weights' products (on the CPU, packed for the bf16
    /// kernels; on another device, the weights themselves stored in bf16), or `auto`.
    pub precision: PrecisionChoice,
}

fn fetch_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/fetch-model")
}

/// Loads `spec` (`default`, a `.gguf` file or a Hugging Face directory) on the CPU with
/// the default [`ModelOptions`], running `scripts/fetch-model` first when the default model is missing and this
/// build comes from a source checkout.
pub fn load_model(spec: &str) -> Result<LoadedModel, EmbedError> {
    load_model_with(spec, ModelOptions::default())
}

/// [`load_model`] on `options.device` with `options.precision`. The device is opened
/// first, so a device that is not there fails at once, naming it. The weights are read
/// on the host; for another device they are narrowed there (bf16) and then moved, so
/// the device never holds more than the weights it keeps. On the CPU, bf16 on a CPU
/// without a bf16 kernel keeps f32, with a warning in the log.
pub fn load_model_with(spec: &str, options: ModelOptions) -> Result<LoadedModel, EmbedError> {
    let device = options.device.open()?;
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
    let model_error = |source| EmbedError::Model {
        spec: spec.to_string(),
        source,
    };
    let mut model = LoadedModel::load(spec, &Device::Cpu).map_err(model_error)?;
    let backend = if device.is_cpu() {
        Backend::Cpu
    } else {
        Backend::Device
    };
    let precision = options.precision.resolve(backend);
    let t = &mut model.transformer;
    let got = if device.is_cpu() {
        t.set_precision(precision).map_err(model_error)?
    } else {
        t.set_backend(Backend::Device).map_err(model_error)?;
        let got = t.set_precision(precision).map_err(model_error)?;
        *t = t.to_device(&device).map_err(model_error)?;
        got
    };
    if got != precision {
        tracing::warn!("precision {precision} is not available on this CPU; using {got}");
    }
    tracing::info!(
        model = %model.name,
        params = model.transformer.weights.num_params(),
        device = %options.device,
        backend = ?model.transformer.backend(),
        precision = %got,
        seconds = format!("{:.2}", started.elapsed().as_secs_f64()),
        "model loaded"
    );
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
