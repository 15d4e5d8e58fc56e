//! What the api layer needs to know about the served model, as plain data.

use crate::model::{Arch, LoadedModel, LoraSpec, ModelConfig};

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
    /// LoRA parameters per unit of rank, over every layer: what an adapter of rank `r`
    /// holds is `r` times the sum of the parts its spec trains.
    pub lora_widths: LoraWidths,
}

/// `in + out` summed over the adapted matrices of each part of a spec, all layers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoraWidths {
    /// q, k, v and o.
    pub attn: usize,
    /// gate, up and down.
    pub mlp: usize,
    /// The output head.
    pub unembed: usize,
}

impl LoraWidths {
    /// The widths of `cfg`'s adapted matrices.
    pub fn of(cfg: &ModelConfig) -> Self {
        let sum = |spec: LoraSpec| -> usize {
            spec.targets(cfg)
                .into_iter()
                .map(|t| {
                    let (out, inp) = t.dims(cfg);
                    out + inp
                })
                .sum()
        };
        let only = |train_attn, train_mlp, train_unembed| LoraSpec {
            rank: 1,
            train_attn,
            train_mlp,
            train_unembed,
        };
        Self {
            attn: sum(only(true, false, false)),
            mlp: sum(only(false, true, false)),
            unembed: sum(only(false, false, true)),
        }
    }

    /// Bytes of a checkpoint of an f32 adapter of `spec`: the adapter, and with
    /// `optimizer` Adam's two moments beside it (a training checkpoint).
    pub fn checkpoint_bytes(&self, spec: &LoraSpec, optimizer: bool) -> u64 {
        self.adapter_bytes(spec)
            .saturating_mul(if optimizer { 3 } else { 1 })
    }

    /// Bytes of an f32 adapter of `spec`.
    pub fn adapter_bytes(&self, spec: &LoraSpec) -> u64 {
        let width = usize::from(spec.train_attn) * self.attn
            + usize::from(spec.train_mlp) * self.mlp
            + usize::from(spec.train_unembed) * self.unembed;
        (width as u64)
            .saturating_mul(spec.rank as u64)
            .saturating_mul(4)
    }
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
            lora_widths: LoraWidths::of(cfg),
        }
    }

    /// Whether `name` refers to this model.
    pub fn matches(&self, name: &str) -> bool {
        name == self.name || self.aliases.iter().any(|a| a == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tiny::tiny_config;
    use crate::model::Adapter;

    /// The estimate is the parameter count of the adapter a run of that spec makes.
    #[test]
    fn adapter_bytes_are_those_of_a_real_adapter() {
        for arch in [Arch::Llama, Arch::Qwen2, Arch::Qwen3] {
            let cfg = tiny_config(arch);
            let widths = LoraWidths::of(&cfg);
            for (attn, mlp, unembed) in [
                (true, true, false),
                (true, false, true),
                (false, true, true),
            ] {
                let spec = LoraSpec {
                    rank: 3,
                    train_attn: attn,
                    train_mlp: mlp,
                    train_unembed: unembed,
                };
                let a = Adapter::new(
                    &cfg,
                    spec,
                    1,
                    candle_core::DType::F32,
                    &candle_core::Device::Cpu,
                )
                .unwrap();
                assert_eq!(widths.adapter_bytes(&spec), 4 * a.num_params() as u64);
            }
        }
    }
}
