//! Text <-> token ids, from a Hugging Face `tokenizer.json` or from GGUF metadata.

use std::collections::HashMap;

use candle_core::quantized::gguf_file::Value;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, PreTokenizerWrapper, Tokenizer};

use super::gguf::get_str;
use super::ModelError;

/// A tokenizer plus the special tokens generation needs.
#[derive(Debug, Clone)]
pub struct TextTokenizer {
    inner: Tokenizer,
    bos: Option<String>,
    eos: Option<String>,
    eos_ids: Vec<u32>,
}

impl TextTokenizer {
    /// Wraps a `tokenizers` tokenizer; `eos` ends generation.
    pub fn new(inner: Tokenizer, bos: Option<String>, eos: Option<String>) -> Self {
        let eos_ids = eos.iter().filter_map(|t| inner.token_to_id(t)).collect();
        Self {
            inner,
            bos,
            eos,
            eos_ids,
        }
    }

    /// Parses a `tokenizer.json`.
    pub fn from_json(
        json: &str,
        bos: Option<String>,
        eos: Option<String>,
    ) -> Result<Self, ModelError> {
        let inner: Tokenizer = json
            .parse()
            .map_err(|e| ModelError::Tokenizer(format!("tokenizer.json: {e}")))?;
        Ok(Self::new(inner, bos, eos))
    }

    /// Encodes text; special-token strings in the text (e.g. `<|im_start|>`) become their
    /// ids. No BOS is added: chat templates add what the model needs.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, ModelError> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Decodes ids to text, keeping special tokens visible.
    pub fn decode(&self, ids: &[u32]) -> Result<String, ModelError> {
        self.inner
            .decode(ids, false)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))
    }

    /// Ids that end generation.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// The BOS token text, for chat templates.
    pub fn bos_token(&self) -> Option<String> {
        self.bos.clone()
    }

    /// The EOS token text, for chat templates.
    pub fn eos_token(&self) -> Option<String> {
        self.eos.clone()
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The tokenizer as Hugging Face `tokenizer.json` text.
    pub fn to_json(&self) -> Result<String, String> {
        self.inner.to_string(false).map_err(|e| e.to_string())
    }
}

/// The tokenizer fields of GGUF metadata (`tokenizer.ggml.*`).
#[derive(Debug, Clone)]
pub struct GgufVocab {
    /// Token strings by id.
    pub tokens: Vec<String>,
    /// BPE merges, `"a b"`.
    pub merges: Vec<String>,
    /// Token types (3 = control/special).
    pub token_types: Vec<i32>,
    /// Pre-tokenizer name (`smollm`, `qwen2`, `llama-bpe`, ...).
    pub pre: String,
    /// Special token ids.
    pub bos_id: Option<u32>,
    /// End-of-sequence id.
    pub eos_id: Option<u32>,
}

impl GgufVocab {
    /// Reads the vocabulary from GGUF metadata.
    pub fn from_metadata(md: &HashMap<String, Value>) -> Result<Self, ModelError> {
        let model = get_str(md, "tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(ModelError::Tokenizer(format!(
                "GGUF tokenizer model {model:?} is not supported (only byte-level BPE, \"gpt2\")"
            )));
        }
        let strings = |key: &str| -> Result<Vec<String>, ModelError> {
            let v = md
                .get(key)
                .ok_or_else(|| ModelError::Tokenizer(format!("GGUF metadata {key} missing")))?;
            v.to_vec()
                .map_err(|e| ModelError::Tokenizer(format!("{key}: {e}")))?
                .iter()
                .map(|s| {
                    s.to_string()
                        .cloned()
                        .map_err(|e| ModelError::Tokenizer(format!("{key}: {e}")))
                })
                .collect()
        };
        let token_types = match md.get("tokenizer.ggml.token_type") {
            Some(v) => v
                .to_vec()
                .map_err(|e| ModelError::Tokenizer(e.to_string()))?
                .iter()
                .map(|t| t.to_i32().map_err(|e| ModelError::Tokenizer(e.to_string())))
                .collect::<Result<_, _>>()?,
            None => Vec::new(),
        };
        let id = |key: &str| md.get(key).and_then(|v| v.to_u32().ok());
        Ok(Self {
            tokens: strings("tokenizer.ggml.tokens")?,
            merges: strings("tokenizer.ggml.merges")?,
            token_types,
            pre: get_str(md, "tokenizer.ggml.pre").unwrap_or_else(|_| "default".into()),
            bos_id: id("tokenizer.ggml.bos_token_id"),
            eos_id: id("tokenizer.ggml.eos_token_id"),
        })
    }

    /// Builds the byte-level BPE tokenizer Hugging Face would build for this model.
    pub fn build_tokenizer(&self) -> Result<TextTokenizer, ModelError> {
        let vocab: Vocab = self
            .tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let merges = self
            .merges
            .iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| ModelError::Tokenizer(format!("malformed merge {m:?}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        let mut tok = Tokenizer::new(bpe);
        tok.with_pre_tokenizer(Some(pre_tokenizer(&self.pre)?));
        tok.with_decoder(Some(ByteLevelDecoder::default()));
        let specials: Vec<AddedToken> = self
            .token_types
            .iter()
            .enumerate()
            .filter(|(_, &t)| t == 3 || t == 4)
            .map(|(i, _)| AddedToken::from(self.tokens[i].clone(), true))
            .collect();
        tok.add_special_tokens(specials)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        let name = |id: Option<u32>| id.and_then(|i| self.tokens.get(i as usize).cloned());
        Ok(TextTokenizer::new(
            tok,
            name(self.bos_id),
            name(self.eos_id),
        ))
    }
}

/// Maps llama.cpp's pre-tokenizer names to the Hugging Face pre-tokenizer.
fn pre_tokenizer(pre: &str) -> Result<PreTokenizerWrapper, ModelError> {
    let byte_level = ByteLevel::new(false, true, true);
    Ok(match pre {
        // SmolLM and StarCoder: every digit is its own pre-token, then GPT-2 byte level.
        "smollm" | "starcoder" | "refact" => {
            Sequence::new(vec![Digits::new(true).into(), byte_level.into()]).into()
        }
        "gpt-2" | "gpt2" | "default" => byte_level.into(),
        other => {
            return Err(ModelError::Tokenizer(format!(
                "GGUF pre-tokenizer {other:?} is not supported; load the model from a Hugging Face \
                 directory with its tokenizer.json instead"
            )))
        }
    })
}
