//! Architecture hyper-parameters, read from a Hugging Face `config.json` or GGUF metadata.

use serde::Deserialize;

use super::ModelError;

/// The decoder families Lathe runs. They share one implementation; these flags are the
/// only differences that matter to the forward and backward passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Llama and SmolLM.
    Llama,
    /// Qwen2: biases on the q, k and v projections.
    Qwen2,
    /// Qwen3: RMSNorm over each head of q and k before RoPE.
    Qwen3,
}

/// Hyper-parameters of a decoder-only transformer, with Hugging Face field names.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Which family the weights come from.
    pub arch: Arch,
    /// Number of token ids.
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the MLP.
    pub intermediate_size: usize,
    /// Number of decoder blocks.
    pub num_hidden_layers: usize,
    /// Number of query heads.
    pub num_attention_heads: usize,
    /// Number of key/value heads (grouped-query attention).
    pub num_key_value_heads: usize,
    /// Width of one attention head.
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base frequency.
    pub rope_theta: f64,
    /// Longest sequence the model was trained for.
    pub max_position_embeddings: usize,
    /// Whether the output projection reuses the token embedding.
    pub tie_word_embeddings: bool,
}

impl ModelConfig {
    /// Query heads that share one key/value head.
    pub fn group_size(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }

    /// Width of the concatenated query heads.
    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }

    /// Width of the concatenated key (or value) heads.
    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }

    /// Whether q, k and v carry biases.
    pub fn qkv_bias(&self) -> bool {
        self.arch == Arch::Qwen2
    }

    /// Whether q and k get a per-head RMSNorm.
    pub fn qk_norm(&self) -> bool {
        self.arch == Arch::Qwen3
    }

    /// Checks the invariants the kernels rely on.
    pub fn validate(&self) -> Result<(), ModelError> {
        let bad = |m: String| Err(ModelError::Config(m));
        if self.num_attention_heads == 0 || self.num_key_value_heads == 0 {
            return bad("head counts must be positive".into());
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return bad(format!(
                "{} query heads are not a multiple of {} key/value heads",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return bad(format!(
                "head_dim {} must be even and positive",
                self.head_dim
            ));
        }
        if self.vocab_size == 0 || self.hidden_size == 0 || self.num_hidden_layers == 0 {
            return bad("vocab, hidden size and layer count must be positive".into());
        }
        Ok(())
    }

    /// Parses a Hugging Face `config.json`.
    pub fn from_hf_json(text: &str) -> Result<Self, ModelError> {
        let raw: HfConfig = serde_json::from_str(text)
            .map_err(|e| ModelError::Config(format!("config.json: {e}")))?;
        let model_type = raw.model_type.as_deref().unwrap_or("llama");
        let arch = match model_type {
            "llama" | "mistral" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            other => {
                return Err(ModelError::Config(format!(
                    "unsupported model_type {other:?}; Lathe runs llama, qwen2 and qwen3"
                )))
            }
        };
        if let Some(scaling) = raw.rope_scaling.as_ref().filter(|v| !v.is_null()) {
            return Err(ModelError::Config(format!(
                "rope_scaling {scaling} is not supported yet"
            )));
        }
        let heads = raw.num_attention_heads;
        let cfg = Self {
            arch,
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_hidden_layers: raw.num_hidden_layers,
            num_attention_heads: heads,
            num_key_value_heads: raw.num_key_value_heads.unwrap_or(heads),
            head_dim: raw.head_dim.unwrap_or(raw.hidden_size / heads.max(1)),
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6),
            rope_theta: raw.rope_theta.unwrap_or(10_000.0),
            max_position_embeddings: raw.max_position_embeddings.unwrap_or(2048),
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

#[derive(Deserialize)]
struct HfConfig {
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    rope_scaling: Option<serde_json::Value>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_qwen3_config_with_explicit_head_dim() {
        let cfg = ModelConfig::from_hf_json(
            r#"{"model_type":"qwen3","vocab_size":100,"hidden_size":64,"intermediate_size":96,
            "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":32,
            "rms_norm_eps":1e-6,"rope_theta":1000000.0,"tie_word_embeddings":true,
            "rope_scaling":null,"torch_dtype":"bfloat16"}"#,
        )
        .unwrap();
        assert_eq!(cfg.arch, Arch::Qwen3);
        assert_eq!(cfg.head_dim, 32);
        assert_eq!(cfg.group_size(), 2);
        assert!(cfg.qk_norm() && !cfg.qkv_bias());
    }

    #[test]
    fn rejects_unknown_architectures_and_bad_heads() {
        let err = ModelConfig::from_hf_json(
            r#"{"model_type":"gpt2","vocab_size":1,"hidden_size":1,"intermediate_size":1,
            "num_hidden_layers":1,"num_attention_heads":1}"#,
        )
        .unwrap_err();
        assert!(err.to_string().contains("gpt2"));
        let err = ModelConfig::from_hf_json(
            r#"{"vocab_size":10,"hidden_size":12,"intermediate_size":8,
            "num_hidden_layers":1,"num_attention_heads":3,"num_key_value_heads":2}"#,
        )
        .unwrap_err();
        assert!(err.to_string().contains("multiple"));
    }
}
