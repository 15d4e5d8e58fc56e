//! [`Tokenizer`]: text to token ids and chat rendering, from the server's tokenizer
//! extension, so recipes need no model hub.

use minijinja::{context, Environment};
use serde::{Deserialize, Serialize};

use super::error::{Error, Result};
use crate::types::{ModelInput, TokenizerResponse};

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The text.
    pub content: String,
}

impl Message {
    /// A message with the given role.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A base model's tokenizer and chat template.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    template: Option<Environment<'static>>,
    bos: Option<String>,
    eos: Option<String>,
    eos_id: Option<u32>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.inner.get_vocab_size(true))
            .field("has_chat_template", &self.template.is_some())
            .finish()
    }
}

impl Tokenizer {
    pub(crate) fn from_response(resp: TokenizerResponse) -> Result<Self> {
        let json = serde_json::to_string(&resp.tokenizer).expect("value serialises");
        let inner = tokenizers::Tokenizer::from_bytes(json.as_bytes())
            .map_err(|e| Error::decode(format!("tokenizer.json: {e}"), ""))?;
        let template = match resp.chat_template {
            Some(src) => {
                let mut env = Environment::new();
                minijinja_contrib::add_to_environment(&mut env);
                env.set_unknown_method_callback(
                    minijinja_contrib::pycompat::unknown_method_callback,
                );
                env.add_template_owned("chat", src)
                    .map_err(|e| Error::decode(format!("chat template: {e}"), ""))?;
                Some(env)
            }
            None => None,
        };
        let eos_id = resp.eos_token.as_deref().and_then(|t| inner.token_to_id(t));
        Ok(Self {
            inner,
            template,
            bos: resp.bos_token,
            eos: resp.eos_token,
            eos_id,
        })
    }

    /// Token ids of `text` (no special tokens added).
    pub fn encode(&self, text: &str) -> Result<Vec<i64>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| Error::InvalidInput(format!("tokenizing: {e}")))?;
        Ok(enc.get_ids().iter().map(|&i| i64::from(i)).collect())
    }

    /// Text of token ids (special tokens skipped).
    pub fn decode(&self, ids: &[i64]) -> Result<String> {
        let ids: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
        self.inner
            .decode(&ids, true)
            .map_err(|e| Error::InvalidInput(format!("detokenizing: {e}")))
    }

    /// The end-of-sequence token id.
    pub fn eos_token_id(&self) -> Option<i64> {
        self.eos_id.map(i64::from)
    }

    /// Renders a chat with the model's own template; with `add_generation_prompt`, ends
    /// with the assistant turn's opening so the model answers.
    pub fn apply_chat_template(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let env = self
            .template
            .as_ref()
            .ok_or_else(|| Error::InvalidInput("this model has no chat template".into()))?;
        let tpl = env.get_template("chat").expect("added at construction");
        tpl.render(context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos.clone().unwrap_or_default(),
            eos_token => self.eos.clone().unwrap_or_default(),
        })
        .map_err(|e| Error::InvalidInput(format!("rendering the chat template: {e}")))
    }

    /// A chat rendered and tokenized, ready to sample from.
    pub fn chat_prompt(&self, messages: &[Message]) -> Result<ModelInput> {
        Ok(ModelInput::from_ints(
            self.encode(&self.apply_chat_template(messages, true)?)?,
        ))
    }
}
