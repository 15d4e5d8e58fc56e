//! The frozen base model: loading (GGUF, Hugging Face directories), the tokenizer and
//! chat template, the decoder with its hand-written backward, and the LoRA seam.

pub mod adapted;
pub mod backend;
pub mod batch;
pub mod chat_template;
pub mod config;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod gguf;
pub mod hf;
pub mod kv;
pub mod lora;
pub mod lora_stack;
pub mod ops;
pub mod tiny;
pub mod tokenizer;
pub mod transformer;
pub mod weights;

#[cfg(test)]
mod test_util;

use std::path::{Path, PathBuf};

use candle_core::Device;

pub use backend::{Backend, DeviceError, DeviceSpec};
pub use chat_template::{ChatMessage, ChatTemplate};
pub use config::{Arch, ModelConfig};
pub use cpu::bf16::{Precision, PrecisionChoice};
pub use kv::KvCache;
pub use lora::{Adapter, AdapterGrads, LoraSpec, Proj, Target};
pub use tokenizer::TextTokenizer;
pub use transformer::{PackedBatch, Tape, Transformer};

/// The name clients use for the default model.
pub const DEFAULT_MODEL_NAME: &str = "HuggingFaceTB/SmolLM2-135M-Instruct";

/// The file `scripts/fetch-model` puts under `models/`.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// Errors of loading and running the model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A tensor operation failed.
    #[error("tensor error: {0}")]
    Candle(#[from] candle_core::Error),
    /// A file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The model's configuration is unusable.
    #[error("model config: {0}")]
    Config(String),
    /// A weight is missing or has the wrong shape.
    #[error("model weights: {0}")]
    Shape(String),
    /// The tokenizer could not be built or used.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The chat template failed to parse or render.
    #[error("chat template: {0}")]
    Template(String),
    /// Invalid LoRA settings or adapter files.
    #[error("lora: {0}")]
    Lora(String),
    /// Bad input to the model (token ids, lengths).
    #[error("invalid input: {0}")]
    Input(String),
    /// The default model has not been fetched.
    #[error("default model not found at {0}; run scripts/fetch-model")]
    DefaultModelMissing(PathBuf),
}

/// A loaded base model: decoder, tokenizer and chat template.
pub struct LoadedModel {
    /// Display name (the Hugging Face id for the default model).
    pub name: String,
    /// The decoder.
    pub transformer: Transformer,
    /// Text <-> token ids.
    pub tokenizer: TextTokenizer,
    /// The model's own chat template.
    pub chat_template: Option<ChatTemplate>,
    /// The tokenizer in Hugging Face `tokenizer.json` form, served to clients.
    pub tokenizer_json: String,
}

impl LoadedModel {
    /// Loads a model given on the command line: `default` (or the default model's name),
    /// a `.gguf` file, or a Hugging Face directory.
    pub fn load(spec: &str, device: &Device) -> Result<Self, ModelError> {
        let path = resolve_model_path(spec)?;
        let name = if path.ends_with(DEFAULT_MODEL_FILE) {
            DEFAULT_MODEL_NAME.to_string()
        } else {
            spec.to_string()
        };
        let mut model = if path.is_dir() {
            hf::load_dir(&path, device)?
        } else {
            gguf::load_file(&path, device)?
        };
        model.name = name;
        Ok(model)
    }
}

/// Where the default model lives: `$LATHE_MODELS_DIR` or `models/` at the workspace root.
pub fn default_model_path() -> PathBuf {
    let dir = std::env::var_os("LATHE_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("..")
                .join("models")
        });
    dir.join(DEFAULT_MODEL_FILE)
}

/// Resolves `default` / the default model name to its file; anything else is a path.
pub fn resolve_model_path(spec: &str) -> Result<PathBuf, ModelError> {
    if spec == "default" || spec == DEFAULT_MODEL_NAME {
        let path = default_model_path();
        if !path.exists() {
            return Err(ModelError::DefaultModelMissing(path));
        }
        return Ok(path);
    }
    let path = PathBuf::from(spec);
    if !path.exists() {
        return Err(ModelError::Io {
            path,
            source: std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "no such model file or directory",
            ),
        });
    }
    Ok(path)
}
