//! Hugging Face model directories: `config.json`, `model.safetensors` (or a sharded
//! `model.safetensors.index.json`), `tokenizer.json` and `tokenizer_config.json`.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};

use super::chat_template::ChatTemplate;
use super::config::ModelConfig;
use super::tokenizer::TextTokenizer;
use super::weights::{BaseWeights, FrozenLinear, LayerWeights};
use super::{LoadedModel, ModelError, Transformer};

fn read(path: &Path) -> Result<String, ModelError> {
    std::fs::read_to_string(path).map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// Loads a Llama / Qwen2 / Qwen3 directory with f32 weights on `device`.
pub fn load_dir(dir: &Path, device: &Device) -> Result<LoadedModel, ModelError> {
    let config = ModelConfig::from_hf_json(&read(&dir.join("config.json"))?)?;
    let mut tensors = load_safetensors(dir, device)?;
    let weights = assemble(&config, &mut tensors)?;

    let tokenizer_json = read(&dir.join("tokenizer.json"))?;
    let tcfg: serde_json::Value = match std::fs::read_to_string(dir.join("tokenizer_config.json")) {
        Ok(text) => serde_json::from_str(&text)
            .map_err(|e| ModelError::Tokenizer(format!("tokenizer_config.json: {e}")))?,
        Err(_) => serde_json::Value::Null,
    };
    let token_str = |key: &str| match &tcfg[key] {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content").and_then(|c| c.as_str()).map(String::from),
        _ => None,
    };
    let (bos, eos) = (token_str("bos_token"), token_str("eos_token"));
    let tokenizer = TextTokenizer::from_json(&tokenizer_json, bos.clone(), eos.clone())?;
    let template = match &tcfg["chat_template"] {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(list) => list
            .iter()
            .find(|t| t["name"] == "default")
            .and_then(|t| t["template"].as_str())
            .map(String::from),
        _ => std::fs::read_to_string(dir.join("chat_template.jinja")).ok(),
    };
    let chat_template = template
        .map(|t| ChatTemplate::new(t, bos, eos))
        .transpose()?;
    Ok(LoadedModel {
        name: dir.display().to_string(),
        transformer: Transformer::new(config, weights)?,
        tokenizer,
        chat_template,
        tokenizer_json,
    })
}

fn load_safetensors(dir: &Path, device: &Device) -> Result<HashMap<String, Tensor>, ModelError> {
    let single = dir.join("model.safetensors");
    let files = if single.exists() {
        vec![single]
    } else {
        let index_path = dir.join("model.safetensors.index.json");
        let index: serde_json::Value = serde_json::from_str(&read(&index_path)?)
            .map_err(|e| ModelError::Config(format!("{}: {e}", index_path.display())))?;
        let mut shards: Vec<String> = index["weight_map"]
            .as_object()
            .ok_or_else(|| ModelError::Config("safetensors index has no weight_map".into()))?
            .values()
            .filter_map(|v| v.as_str().map(String::from))
            .collect();
        shards.sort();
        shards.dedup();
        shards.into_iter().map(|s| dir.join(s)).collect()
    };
    let mut all = HashMap::new();
    for f in files {
        let part = candle_core::safetensors::load(&f, device)
            .map_err(|e| ModelError::Config(format!("{}: {e}", f.display())))?;
        all.extend(part);
    }
    Ok(all)
}

/// Builds [`BaseWeights`] from Hugging Face tensor names, converting to f32.
pub fn assemble(
    cfg: &ModelConfig,
    t: &mut HashMap<String, Tensor>,
) -> Result<BaseWeights, ModelError> {
    let mut take = |name: &str| -> Result<Tensor, ModelError> {
        let x = t
            .remove(name)
            .ok_or_else(|| ModelError::Shape(format!("tensor {name} missing")))?;
        Ok(x.to_dtype(DType::F32)?)
    };
    let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
    for i in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{i}");
        let mut lin = |name: &str, bias: bool| -> Result<FrozenLinear, ModelError> {
            Ok(FrozenLinear {
                weight: take(&format!("{p}.{name}.weight"))?,
                bias: if bias {
                    Some(take(&format!("{p}.{name}.bias"))?)
                } else {
                    None
                },
            })
        };
        let b = cfg.qkv_bias();
        let q_proj = lin("self_attn.q_proj", b)?;
        let k_proj = lin("self_attn.k_proj", b)?;
        let v_proj = lin("self_attn.v_proj", b)?;
        let o_proj = lin("self_attn.o_proj", false)?;
        let gate_proj = lin("mlp.gate_proj", false)?;
        let up_proj = lin("mlp.up_proj", false)?;
        let down_proj = lin("mlp.down_proj", false)?;
        let (q_norm, k_norm) = if cfg.qk_norm() {
            (
                Some(take(&format!("{p}.self_attn.q_norm.weight"))?),
                Some(take(&format!("{p}.self_attn.k_norm.weight"))?),
            )
        } else {
            (None, None)
        };
        layers.push(LayerWeights {
            input_layernorm: take(&format!("{p}.input_layernorm.weight"))?,
            q_proj,
            k_proj,
            v_proj,
            o_proj,
            q_norm,
            k_norm,
            post_attention_layernorm: take(&format!("{p}.post_attention_layernorm.weight"))?,
            gate_proj,
            up_proj,
            down_proj,
        });
    }
    let embed_tokens = take("model.embed_tokens.weight")?;
    let norm = take("model.norm.weight")?;
    let lm_head = if cfg.tie_word_embeddings {
        None
    } else {
        Some(take("lm_head.weight")?)
    };
    Ok(BaseWeights {
        embed_tokens,
        layers,
        norm,
        lm_head,
    })
}
