//! What the api layer needs to know about the served model, as plain data.

use crate::model::{Arch, LoadedModel};

/// The served base model.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// The name clients pass as `base_model`.
    pub name: String,
    /// Other names accepted for it (e.g. `default`).
    pub aliases: Vec<String>,
    /// `llama`, `qwen2` or `qwen3`.
    pub arch: String,
    /// Vocabulary size: token ids must be below it.
    pub vocab_size: usize,
    /// Longest sequence in tokens.
    pub max_seq_len: usize,
    /// Hugging Face `tokenizer.json`.
    pub tokenizer_json: String,
    /// Jinja chat template.
    pub chat_template: Option<String>,
    /// EOS token text.
    pub eos_token: Option<String>,
    /// BOS token text.
    pub bos_token: Option<String>,
}

impl ModelInfo {
    /// Describes a loaded model.
    pub fn of(model: &LoadedModel) -> Self {
        let cfg = &model.transformer.config;
        Self {
            name: model.name.clone(),
            aliases: vec!["default".into()],
            arch: match cfg.arch {
                Arch::Llama => "llama",
                Arch::Qwen2 => "qwen2",
                Arch::Qwen3 => "qwen3",
            }
            .into(),
            vocab_size: cfg.vocab_size,
            max_seq_len: model.transformer.max_seq_len(),
            tokenizer_json: model.tokenizer_json.clone(),
            chat_template: model.chat_template.as_ref().map(|t| t.source().to_string()),
            eos_token: model.tokenizer.eos_token(),
            bos_token: model.tokenizer.bos_token(),
        }
    }

    /// Whether `name` refers to this model.
    pub fn matches(&self, name: &str) -> bool {
        name == self.name || self.aliases.iter().any(|a| a == name)
    }
}
