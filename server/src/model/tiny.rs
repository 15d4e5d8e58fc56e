//! Tiny random models, built in code, so the default test command needs no download.
//!
//! [`tiny_model`] gives a random Llama or Qwen3 decoder with a byte-level tokenizer and a
//! ChatML template; [`write_hf_dir`] writes one as a Hugging Face directory, which
//! exercises the same loader real models use.

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use rand::{rngs::StdRng, Rng, SeedableRng};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

use super::chat_template::ChatTemplate;
use super::config::{Arch, ModelConfig};
use super::tokenizer::TextTokenizer;
use super::weights::{BaseWeights, FrozenLinear, LayerWeights};
use super::{LoadedModel, ModelError, Transformer};

/// ChatML, the format SmolLM2 and Qwen use.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// Special tokens of the tiny tokenizer, after the 256 byte tokens.
pub const TINY_SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// The config of a tiny model of the given family (259 tokens: bytes + 3 specials).
pub fn tiny_config(arch: Arch) -> ModelConfig {
    ModelConfig {
        arch,
        vocab_size: 256 + TINY_SPECIALS.len(),
        hidden_size: 32,
        intermediate_size: 48,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 8,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        max_position_embeddings: 256,
        tie_word_embeddings: arch == Arch::Llama,
    }
}

/// Random weights for `cfg` (normal, std 0.2; norms near 1), deterministic in `seed`.
pub fn random_weights(
    cfg: &ModelConfig,
    seed: u64,
    device: &Device,
) -> Result<BaseWeights, ModelError> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut mat = |rows: usize, cols: usize, std: f32| -> Result<Tensor, ModelError> {
        let v: Vec<f32> = (0..rows * cols)
            .map(|_| {
                // Box-Muller keeps this free of extra distribution crates.
                let (u1, u2): (f32, f32) = (rng.random_range(1e-7..1.0), rng.random());
                std * (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
            })
            .collect();
        Ok(Tensor::from_vec(v, (rows, cols), device)?)
    };
    let norm = |m: Tensor| -> Result<Tensor, ModelError> { Ok((m.squeeze(0)? + 1.0)?) };
    let (d, f, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
    let mut layers = Vec::new();
    for _ in 0..cfg.num_hidden_layers {
        let bias = |m: &mut dyn FnMut(usize, usize, f32) -> Result<Tensor, ModelError>,
                    n: usize| {
            if cfg.qkv_bias() {
                m(1, n, 0.1).and_then(|t| Ok(t.squeeze(0)?)).map(Some)
            } else {
                Ok(None)
            }
        };
        let q_proj = FrozenLinear {
            weight: mat(cfg.q_dim(), d, 0.2)?,
            bias: bias(&mut mat, cfg.q_dim())?,
        };
        let k_proj = FrozenLinear {
            weight: mat(cfg.kv_dim(), d, 0.2)?,
            bias: bias(&mut mat, cfg.kv_dim())?,
        };
        let v_proj = FrozenLinear {
            weight: mat(cfg.kv_dim(), d, 0.2)?,
            bias: bias(&mut mat, cfg.kv_dim())?,
        };
        let lin = |t: Tensor| FrozenLinear {
            weight: t,
            bias: None,
        };
        let (q_norm, k_norm) = if cfg.qk_norm() {
            (
                Some(norm(mat(1, cfg.head_dim, 0.1)?)?),
                Some(norm(mat(1, cfg.head_dim, 0.1)?)?),
            )
        } else {
            (None, None)
        };
        layers.push(LayerWeights {
            input_layernorm: norm(mat(1, d, 0.1)?)?,
            q_proj,
            k_proj,
            v_proj,
            o_proj: lin(mat(d, cfg.q_dim(), 0.2)?),
            q_norm,
            k_norm,
            post_attention_layernorm: norm(mat(1, d, 0.1)?)?,
            gate_proj: lin(mat(f, d, 0.2)?),
            up_proj: lin(mat(f, d, 0.2)?),
            down_proj: lin(mat(d, f, 0.2)?),
        });
    }
    Ok(BaseWeights {
        embed_tokens: mat(v, d, 1.0)?,
        layers,
        norm: norm(mat(1, d, 0.1)?)?,
        lm_head: if cfg.tie_word_embeddings {
            None
        } else {
            Some(mat(v, d, 0.2)?)
        },
    })
}

/// A byte-level tokenizer with no merges: one token per byte, plus ChatML specials.
pub fn tiny_tokenizer() -> Result<TextTokenizer, ModelError> {
    let mut alphabet: Vec<char> = ByteLevel::alphabet().into_iter().collect();
    // Order by the byte each char stands for, as GPT-2's bytes_to_unicode does.
    alphabet.sort_by_key(|c| byte_of(*c));
    let mut vocab: Vocab = alphabet
        .iter()
        .enumerate()
        .map(|(i, c)| (c.to_string(), i as u32))
        .collect();
    for (i, s) in TINY_SPECIALS.iter().enumerate() {
        vocab.insert(s.to_string(), (256 + i) as u32);
    }
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, vec![])
        .build()
        .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
    let mut tok = Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    tok.with_decoder(Some(ByteLevelDecoder::default()));
    tok.add_special_tokens(TINY_SPECIALS.iter().map(|s| AddedToken::from(*s, true)))
        .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
    Ok(TextTokenizer::new(tok, None, Some("<|im_end|>".into())))
}

/// GPT-2's byte-to-unicode map, inverted: printable bytes map to themselves, the rest to
/// 256 + their rank among the non-printable ones.
fn byte_of(c: char) -> u32 {
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let cp = c as u32;
    if cp < 256 && printable(cp) {
        return cp;
    }
    let mut n = 256;
    for b in 0..256u32 {
        if !printable(b) {
            if n == cp {
                return b;
            }
            n += 1;
        }
    }
    cp
}

/// A complete tiny model (weights, tokenizer, ChatML template).
pub fn tiny_model(arch: Arch, seed: u64, device: &Device) -> Result<LoadedModel, ModelError> {
    let cfg = tiny_config(arch);
    let weights = random_weights(&cfg, seed, device)?;
    let tokenizer = tiny_tokenizer()?;
    let tokenizer_json = tokenizer.to_json().map_err(ModelError::Tokenizer)?;
    Ok(LoadedModel {
        name: format!("tiny-{arch:?}").to_lowercase(),
        transformer: Transformer::new(cfg, weights)?,
        chat_template: Some(ChatTemplate::new(
            CHATML_TEMPLATE.into(),
            None,
            tokenizer.eos_token(),
        )?),
        tokenizer,
        tokenizer_json,
    })
}

/// [`tiny_model`] with every matrix whose width is a multiple of 32 passed through GGML's
/// Q4_1 quantizer and back, as a Q4_1 GGUF file gives them (the default model's case:
/// its decode weights reproduce them exactly).
pub fn tiny_model_q4_1(arch: Arch, seed: u64) -> Result<LoadedModel, ModelError> {
    let mut model = tiny_model(arch, seed, &Device::Cpu)?;
    let q4 = |w: &Tensor| -> Result<Tensor, ModelError> {
        if !w.dims()[1].is_multiple_of(32) {
            return Ok(w.clone());
        }
        // A fresh buffer first: `QTensor::quantize` reads the whole storage under a view
        // (the trainer's weights are views of its stacked buffers), not the view.
        let own = Tensor::from_vec(w.flatten_all()?.to_vec1::<f32>()?, w.dims(), w.device())?;
        let q = QTensor::quantize(&own, GgmlDType::Q4_1)?;
        Ok(q.dequantize(&Device::Cpu)?)
    };
    let mut w = model.transformer.weights.clone();
    w.embed_tokens = q4(&w.embed_tokens)?;
    w.lm_head = w.lm_head.as_ref().map(q4).transpose()?;
    for l in &mut w.layers {
        for p in [
            &mut l.q_proj,
            &mut l.k_proj,
            &mut l.v_proj,
            &mut l.o_proj,
            &mut l.gate_proj,
            &mut l.up_proj,
            &mut l.down_proj,
        ] {
            p.weight = q4(&p.weight)?;
        }
    }
    model.transformer = Transformer::new(model.transformer.config.clone(), w)?;
    Ok(model)
}

/// Writes a tiny model as a Hugging Face directory (config, safetensors, tokenizer).
pub fn write_hf_dir(dir: &Path, arch: Arch, seed: u64) -> Result<(), ModelError> {
    let model = tiny_model(arch, seed, &Device::Cpu)?;
    let cfg = &model.transformer.config;
    let io = |source| ModelError::Io {
        path: dir.to_path_buf(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(io)?;
    let model_type = match arch {
        Arch::Llama => "llama",
        Arch::Qwen2 => "qwen2",
        Arch::Qwen3 => "qwen3",
    };
    let config = serde_json::json!({
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
    });
    std::fs::write(dir.join("config.json"), config.to_string()).map_err(io)?;
    let w = &model.transformer.weights;
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    tensors.insert("model.embed_tokens.weight".into(), w.embed_tokens.clone());
    tensors.insert("model.norm.weight".into(), w.norm.clone());
    if let Some(h) = &w.lm_head {
        tensors.insert("lm_head.weight".into(), h.clone());
    }
    for (i, l) in w.layers.iter().enumerate() {
        let p = format!("model.layers.{i}");
        let mut put = |name: &str, lin: &FrozenLinear| {
            tensors.insert(format!("{p}.{name}.weight"), lin.weight.clone());
            if let Some(b) = &lin.bias {
                tensors.insert(format!("{p}.{name}.bias"), b.clone());
            }
        };
        put("self_attn.q_proj", &l.q_proj);
        put("self_attn.k_proj", &l.k_proj);
        put("self_attn.v_proj", &l.v_proj);
        put("self_attn.o_proj", &l.o_proj);
        put("mlp.gate_proj", &l.gate_proj);
        put("mlp.up_proj", &l.up_proj);
        put("mlp.down_proj", &l.down_proj);
        tensors.insert(
            format!("{p}.input_layernorm.weight"),
            l.input_layernorm.clone(),
        );
        tensors.insert(
            format!("{p}.post_attention_layernorm.weight"),
            l.post_attention_layernorm.clone(),
        );
        if let (Some(q), Some(k)) = (&l.q_norm, &l.k_norm) {
            tensors.insert(format!("{p}.self_attn.q_norm.weight"), q.clone());
            tensors.insert(format!("{p}.self_attn.k_norm.weight"), k.clone());
        }
    }
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors"))?;
    std::fs::write(dir.join("tokenizer.json"), &model.tokenizer_json).map_err(io)?;
    let tcfg = serde_json::json!({
        "chat_template": CHATML_TEMPLATE,
        "eos_token": "<|im_end|>",
        "bos_token": null,
    });
    std::fs::write(dir.join("tokenizer_config.json"), tcfg.to_string()).map_err(io)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiny_tokenizer_round_trips_text_and_specials() {
        let t = tiny_tokenizer().unwrap();
        let ids = t.encode("<|im_start|>user\nhé 12<|im_end|>").unwrap();
        assert_eq!(ids[0], 257);
        assert_eq!(*ids.last().unwrap(), 258);
        assert_eq!(ids[1], u32::from(b'u'));
        assert_eq!(t.decode(&ids).unwrap(), "<|im_start|>user\nhé 12<|im_end|>");
        assert_eq!(t.eos_ids(), &[258]);
    }

    #[test]
    fn hf_dir_round_trips_through_the_loader() {
        let dir = std::env::temp_dir().join(format!("lathe-tiny-{}", std::process::id()));
        for arch in [Arch::Llama, Arch::Qwen2, Arch::Qwen3] {
            write_hf_dir(&dir, arch, 7).unwrap();
            let loaded = super::super::hf::load_dir(&dir, &Device::Cpu).unwrap();
            let orig = tiny_model(arch, 7, &Device::Cpu).unwrap();
            assert_eq!(loaded.transformer.config, orig.transformer.config);
            let a = loaded.transformer.weights.layers[1]
                .q_proj
                .weight
                .to_vec2::<f32>()
                .unwrap();
            let b = orig.transformer.weights.layers[1]
                .q_proj
                .weight
                .to_vec2::<f32>()
                .unwrap();
            assert_eq!(a, b);
            assert!(loaded.chat_template.is_some());
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
