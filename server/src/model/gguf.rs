//! GGUF files (llama architecture): metadata, dequantised f32 weights in the Hugging Face
//! layout, and the tokenizer and chat template stored in the metadata.

use std::collections::HashMap;
use std::fs::File;
use std::io::BufReader;
use std::path::Path;

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::{DType, Device, Tensor};

use super::chat_template::ChatTemplate;
use super::config::{Arch, ModelConfig};
use super::tokenizer::GgufVocab;
use super::weights::{BaseWeights, FrozenLinear, LayerWeights};
use super::{LoadedModel, ModelError};

/// Loads a GGUF model: f32 weights on `device`, tokenizer, chat template.
pub fn load_file(path: &Path, device: &Device) -> Result<LoadedModel, ModelError> {
    let io = |source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut reader = BufReader::new(File::open(path).map_err(io)?);
    let content = Content::read(&mut reader).map_err(|e| {
        ModelError::Config(format!("{}: not a readable GGUF file: {e}", path.display()))
    })?;
    let md = &content.metadata;
    let arch_name = get_str(md, "general.architecture")?;
    let arch = match arch_name.as_str() {
        "llama" => Arch::Llama,
        "qwen2" => Arch::Qwen2,
        "qwen3" => Arch::Qwen3,
        other => {
            return Err(ModelError::Config(format!(
                "unsupported GGUF architecture {other:?}"
            )))
        }
    };
    let key = |k: &str| format!("{arch_name}.{k}");
    let heads = get_u(md, &key("attention.head_count"))?;
    let hidden = get_u(md, &key("embedding_length"))?;
    let vocab = GgufVocab::from_metadata(md)?;
    let config = ModelConfig {
        arch,
        vocab_size: vocab.tokens.len(),
        hidden_size: hidden,
        intermediate_size: get_u(md, &key("feed_forward_length"))?,
        num_hidden_layers: get_u(md, &key("block_count"))?,
        num_attention_heads: heads,
        num_key_value_heads: get_u(md, &key("attention.head_count_kv")).unwrap_or(heads),
        head_dim: get_u(md, &key("rope.dimension_count"))
            .or_else(|_| get_u(md, &key("attention.key_length")))
            .unwrap_or(hidden / heads.max(1)),
        rms_norm_eps: get_f(md, &key("attention.layer_norm_rms_epsilon")).unwrap_or(1e-5),
        rope_theta: get_f(md, &key("rope.freq_base")).unwrap_or(10_000.0),
        max_position_embeddings: get_u(md, &key("context_length")).unwrap_or(2048),
        tie_word_embeddings: !content.tensor_infos.contains_key("output.weight"),
    };
    config.validate()?;

    let mut load = |name: &str| -> Result<Tensor, ModelError> {
        if !content.tensor_infos.contains_key(name) {
            return Err(ModelError::Shape(format!(
                "tensor {name} missing from GGUF"
            )));
        }
        let q = content.tensor(&mut reader, name, &Device::Cpu)?;
        Ok(q.dequantize(&Device::Cpu)?.to_dtype(DType::F32)?)
    };
    let linear = |t: Tensor| FrozenLinear {
        weight: t,
        bias: None,
    };
    let mut layers = Vec::with_capacity(config.num_hidden_layers);
    for i in 0..config.num_hidden_layers {
        let n = |s: &str| format!("blk.{i}.{s}");
        // llama.cpp permutes q/k rows only for llama (interleaved RoPE); qwen2/qwen3
        // GGUFs keep the Hugging Face (NeoX, rotate-half) order.
        let permuted = config.arch == Arch::Llama;
        let fix = |t: Tensor, heads: usize| {
            if permuted {
                unpermute_rows(&t, heads)
            } else {
                Ok(t)
            }
        };
        let q = fix(load(&n("attn_q.weight"))?, config.num_attention_heads)?;
        let k = fix(load(&n("attn_k.weight"))?, config.num_key_value_heads)?;
        let bias = |name: &str, load: &mut dyn FnMut(&str) -> Result<Tensor, ModelError>| {
            if config.qkv_bias() {
                load(&n(name)).map(Some)
            } else {
                Ok(None)
            }
        };
        let q_bias = bias("attn_q.bias", &mut load)?;
        let k_bias = bias("attn_k.bias", &mut load)?;
        let v_bias = bias("attn_v.bias", &mut load)?;
        let (q_norm, k_norm) = if config.qk_norm() {
            (
                Some(load(&n("attn_q_norm.weight"))?),
                Some(load(&n("attn_k_norm.weight"))?),
            )
        } else {
            (None, None)
        };
        layers.push(LayerWeights {
            input_layernorm: load(&n("attn_norm.weight"))?,
            q_proj: FrozenLinear {
                weight: q,
                bias: q_bias,
            },
            k_proj: FrozenLinear {
                weight: k,
                bias: k_bias,
            },
            v_proj: FrozenLinear {
                weight: load(&n("attn_v.weight"))?,
                bias: v_bias,
            },
            o_proj: linear(load(&n("attn_output.weight"))?),
            q_norm,
            k_norm,
            post_attention_layernorm: load(&n("ffn_norm.weight"))?,
            gate_proj: linear(load(&n("ffn_gate.weight"))?),
            up_proj: linear(load(&n("ffn_up.weight"))?),
            down_proj: linear(load(&n("ffn_down.weight"))?),
        });
    }
    let weights = BaseWeights {
        embed_tokens: load("token_embd.weight")?,
        layers,
        norm: load("output_norm.weight")?,
        lm_head: if config.tie_word_embeddings {
            None
        } else {
            Some(load("output.weight")?)
        },
    };
    let weights = if device.is_cpu() {
        weights
    } else {
        weights.to_device(device)?
    };
    let tokenizer = vocab.build_tokenizer()?;
    let tokenizer_json = tokenizer
        .to_json()
        .map_err(|e| ModelError::Tokenizer(format!("serialising tokenizer.json: {e}")))?;
    let chat_template = match md.get("tokenizer.chat_template") {
        Some(v) => Some(ChatTemplate::new(
            v.to_string()?.clone(),
            tokenizer.bos_token(),
            tokenizer.eos_token(),
        )?),
        None => None,
    };
    Ok(LoadedModel {
        name: path.display().to_string(),
        transformer: super::Transformer::new(config, weights)?,
        tokenizer,
        chat_template,
        tokenizer_json,
    })
}

/// Undoes llama.cpp's per-head row permutation of q and k (`(h, 2, hd/2)` was stored as
/// `(h, hd/2, 2)`), giving the Hugging Face layout that rotate-half RoPE and PEFT use.
pub fn unpermute_rows(w: &Tensor, heads: usize) -> Result<Tensor, ModelError> {
    let (out, inp) = w.dims2()?;
    let hd = out / heads;
    Ok(w.reshape((heads, hd / 2, 2, inp))?
        .transpose(1, 2)?
        .reshape((out, inp))?)
}

pub(crate) fn get_str(md: &HashMap<String, Value>, key: &str) -> Result<String, ModelError> {
    md.get(key)
        .ok_or_else(|| ModelError::Config(format!("GGUF metadata {key} missing")))?
        .to_string()
        .cloned()
        .map_err(|e| ModelError::Config(format!("GGUF metadata {key}: {e}")))
}

pub(crate) fn get_u(md: &HashMap<String, Value>, key: &str) -> Result<usize, ModelError> {
    let v = md
        .get(key)
        .ok_or_else(|| ModelError::Config(format!("GGUF metadata {key} missing")))?;
    let n = match v {
        Value::U8(x) => *x as u64,
        Value::U16(x) => *x as u64,
        Value::U32(x) => *x as u64,
        Value::U64(x) => *x,
        Value::I32(x) if *x >= 0 => *x as u64,
        Value::I64(x) if *x >= 0 => *x as u64,
        other => {
            return Err(ModelError::Config(format!(
                "GGUF metadata {key}: not an unsigned int: {other:?}"
            )))
        }
    };
    Ok(n as usize)
}

fn get_f(md: &HashMap<String, Value>, key: &str) -> Result<f64, ModelError> {
    match md.get(key) {
        Some(Value::F32(x)) => Ok(*x as f64),
        Some(Value::F64(x)) => Ok(*x),
        Some(other) => Err(ModelError::Config(format!(
            "GGUF metadata {key}: not a float: {other:?}"
        ))),
        None => Err(ModelError::Config(format!("GGUF metadata {key} missing"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermute_inverts_llama_cpp_permutation() {
        // llama.cpp: w.reshape(h, 2, hd/2, in).swapaxes(1, 2).reshape(out, in)
        let (heads, hd, inp) = (2, 4, 3);
        let hf = Tensor::arange(0f32, (heads * hd * inp) as f32, &Device::Cpu)
            .unwrap()
            .reshape((heads * hd, inp))
            .unwrap();
        let permuted = hf
            .reshape((heads, 2, hd / 2, inp))
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .reshape((heads * hd, inp))
            .unwrap();
        let back = unpermute_rows(&permuted, heads).unwrap();
        assert_eq!(back.to_vec2::<f32>().unwrap(), hf.to_vec2::<f32>().unwrap());
    }
}
