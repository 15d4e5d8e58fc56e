//! Wire types of the OpenAI-compatible endpoints (`/v1/completions`,
//! `/v1/chat/completions`, `/v1/models`), the subset Lathe serves. Field names and
//! shapes follow OpenAI's API reference, so the official `openai` client and evaluation
//! harnesses read them unchanged. Fields a client may send that Lathe cannot honour are
//! declared here too, so that the server can refuse them by name instead of silently
//! ignoring them; unknown fields are ignored.

use std::collections::BTreeMap;

use serde::de::{self, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};

/// A prompt of `/v1/completions`: text, several texts, token ids, or several token-id
/// lists (one choice set per prompt).
///
/// Decoded in one streaming pass by a visitor of its own: serde's `untagged` would
/// first buffer the whole value as a tree of 32-byte nodes, many times the bytes of a
/// list of token ids, before typing it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum CompletionPrompt {
    /// One text.
    Text(String),
    /// Several texts.
    Texts(Vec<String>),
    /// One prompt as token ids.
    Tokens(Vec<u32>),
    /// Several prompts as token ids.
    TokenLists(Vec<Vec<u32>>),
}

impl<'de> Deserialize<'de> for CompletionPrompt {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(PromptVisitor)
    }
}

struct PromptVisitor;

impl<'de> Visitor<'de> for PromptVisitor {
    type Value = CompletionPrompt;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a string, a list of strings, a list of token ids or a list of such lists")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<CompletionPrompt, E> {
        Ok(CompletionPrompt::Text(v.to_string()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<CompletionPrompt, E> {
        Ok(CompletionPrompt::Text(v))
    }

    /// The first element decides the list's form; the others must share it. An empty
    /// list is no texts.
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<CompletionPrompt, A::Error> {
        let mixed = || de::Error::custom("a prompt list mixes texts, token ids and token-id lists");
        let mut prompt = match seq.next_element::<PromptItem>()? {
            None => return Ok(CompletionPrompt::Texts(Vec::new())),
            Some(PromptItem::Text(t)) => CompletionPrompt::Texts(vec![t]),
            Some(PromptItem::Token(t)) => CompletionPrompt::Tokens(vec![t]),
            Some(PromptItem::Tokens(t)) => CompletionPrompt::TokenLists(vec![t]),
        };
        match &mut prompt {
            CompletionPrompt::Texts(texts) => {
                while let Some(item) = seq.next_element::<PromptItem>()? {
                    let PromptItem::Text(t) = item else {
                        return Err(mixed());
                    };
                    texts.push(t);
                }
            }
            CompletionPrompt::Tokens(tokens) => {
                while let Some(item) = seq.next_element::<PromptItem>()? {
                    let PromptItem::Token(t) = item else {
                        return Err(mixed());
                    };
                    tokens.push(t);
                }
            }
            CompletionPrompt::TokenLists(lists) => {
                while let Some(item) = seq.next_element::<PromptItem>()? {
                    let PromptItem::Tokens(t) = item else {
                        return Err(mixed());
                    };
                    lists.push(t);
                }
            }
            CompletionPrompt::Text(_) => unreachable!("a list is never one text"),
        }
        Ok(prompt)
    }
}

/// One element of a prompt list.
enum PromptItem {
    Text(String),
    Token(u32),
    Tokens(Vec<u32>),
}

impl<'de> Deserialize<'de> for PromptItem {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(PromptItemVisitor)
    }
}

struct PromptItemVisitor;

impl<'de> Visitor<'de> for PromptItemVisitor {
    type Value = PromptItem;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a string, a token id or a list of token ids")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<PromptItem, E> {
        Ok(PromptItem::Text(v.to_string()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<PromptItem, E> {
        Ok(PromptItem::Text(v))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<PromptItem, E> {
        u32::try_from(v)
            .map(PromptItem::Token)
            .map_err(|_| E::custom(format!("token id {v} is out of range")))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<PromptItem, E> {
        u32::try_from(v)
            .map(PromptItem::Token)
            .map_err(|_| E::custom(format!("token id {v} is out of range")))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<PromptItem, A::Error> {
        // Not `size_hint`-sized: the hint comes from the wire.
        let mut tokens = Vec::new();
        while let Some(t) = seq.next_element::<u32>()? {
            tokens.push(t);
        }
        Ok(PromptItem::Tokens(tokens))
    }
}

/// `stop`: one string or several.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum StopSequences {
    /// One stop string.
    One(String),
    /// Several stop strings.
    Many(Vec<String>),
}

impl StopSequences {
    /// The stop strings as a list.
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StopSequences::One(s) => vec![s],
            StopSequences::Many(v) => v,
        }
    }
}

/// `stream_options`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk carrying the request's token usage.
    #[serde(default)]
    pub include_usage: bool,
}

/// The sampling fields the two endpoints share.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct OpenAiSampling {
    /// Softmax temperature (default 1; 0 is greedy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    /// Nucleus mass (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f64>,
    /// Choices per prompt (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n: Option<usize>,
    /// Stop strings; the returned text ends before the first one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<StopSequences>,
    /// Seed for reproducible sampling; choice `i` uses `seed + i`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// Answer with server-sent events, one chunk per new text.
    #[serde(default)]
    pub stream: bool,
    /// Streaming options.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_options: Option<StreamOptions>,
    /// Not supported unless 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub presence_penalty: Option<f64>,
    /// Not supported unless 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frequency_penalty: Option<f64>,
    /// Not supported unless empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logit_bias: Option<BTreeMap<String, f64>>,
    /// The caller's end-user id (accepted, unused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionRequest {
    /// The base model's name, or a `tinker://` checkpoint path the key may read.
    pub model: String,
    /// The prompt(s).
    pub prompt: CompletionPrompt,
    /// Most new tokens per choice (default 16, as OpenAI's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<usize>,
    /// Return the prompt before the completion (and its log-probabilities).
    #[serde(default)]
    pub echo: bool,
    /// Return log-probabilities; `k > 0` also asks for the `k` most likely tokens at each
    /// position, which Lathe has for echoed prompt positions only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<usize>,
    /// Not supported unless equal to `n`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub best_of: Option<usize>,
    /// Not supported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suffix: Option<String>,
    /// Sampling settings.
    #[serde(flatten)]
    pub sampling: OpenAiSampling,
}

/// One part of a multi-part message content.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContentPart {
    /// `text` is the only kind Lathe serves.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
}

/// A message's content: text, or parts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    /// Plain text.
    Text(String),
    /// Parts (text only).
    Parts(Vec<ContentPart>),
}

/// One message of a chat request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessageIn {
    /// `system`, `developer`, `user` or `assistant`.
    pub role: String,
    /// The text (absent only on assistant messages with tool calls, which Lathe refuses).
    #[serde(default)]
    pub content: Option<MessageContent>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletionRequest {
    /// The base model's name, or a `tinker://` checkpoint path the key may read.
    pub model: String,
    /// The conversation, rendered with the model's chat template.
    pub messages: Vec<ChatMessageIn>,
    /// Most new tokens per choice (default: as many as the context allows, up to the
    /// server's default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<usize>,
    /// The newer name of `max_tokens`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_completion_tokens: Option<usize>,
    /// Return each new token's log-probability.
    #[serde(default)]
    pub logprobs: bool,
    /// Most likely alternatives per token: not available (only 0 is accepted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_logprobs: Option<usize>,
    /// Not supported (tool calling).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<serde_json::Value>,
    /// Not supported (structured output); `{"type": "text"}` is accepted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_format: Option<serde_json::Value>,
    /// Sampling settings.
    #[serde(flatten)]
    pub sampling: OpenAiSampling,
}

/// Token counts of a request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Prompt tokens (summed over prompts).
    pub prompt_tokens: usize,
    /// Generated tokens (summed over choices).
    pub completion_tokens: usize,
    /// Their sum.
    pub total_tokens: usize,
}

/// Log-probabilities of a completion choice (the legacy completions shape).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CompletionLogprobs {
    /// Each token's text.
    pub tokens: Vec<String>,
    /// Each token's log-probability (`null` for the first prompt token).
    pub token_logprobs: Vec<Option<f32>>,
    /// The most likely tokens at each position, where known (`null` elsewhere).
    pub top_logprobs: Vec<Option<BTreeMap<String, f32>>>,
    /// Each token's character offset in the choice's text.
    pub text_offset: Vec<usize>,
}

/// One choice of `/v1/completions` (also a streamed chunk's choice).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionChoice {
    /// Its index among the request's choices.
    pub index: usize,
    /// The text (in a chunk: the new text).
    pub text: String,
    /// Log-probabilities, when asked for.
    #[serde(default)]
    pub logprobs: Option<CompletionLogprobs>,
    /// `stop` or `length`; `null` in a chunk before the last.
    #[serde(default)]
    pub finish_reason: Option<String>,
}

/// The answer of `/v1/completions`, and each streamed chunk (`usage` only in the last
/// one, when asked for).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionResponse {
    /// `cmpl-...`.
    pub id: String,
    /// `text_completion`.
    pub object: String,
    /// Unix seconds.
    pub created: u64,
    /// The `model` asked for.
    pub model: String,
    /// The choices.
    pub choices: Vec<CompletionChoice>,
    /// Token counts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// One token's log-probability in a chat choice.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatTokenLogprob {
    /// The token's text.
    pub token: String,
    /// Its log-probability.
    pub logprob: f32,
    /// The text's UTF-8 bytes.
    pub bytes: Vec<u8>,
    /// Alternatives (always empty: Lathe does not compute them for sampled tokens).
    pub top_logprobs: Vec<serde_json::Value>,
}

/// Log-probabilities of a chat choice.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatLogprobs {
    /// One entry per token of the content.
    pub content: Vec<ChatTokenLogprob>,
}

/// The assistant's message (in a chunk: its delta).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessageOut {
    /// `assistant` (in chunks, only in the first).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    /// The text (in a chunk: the new text).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

/// One choice of `/v1/chat/completions`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatChoice {
    /// Its index among the request's choices.
    pub index: usize,
    /// The whole message (absent in chunks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<ChatMessageOut>,
    /// The new part of the message (chunks only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delta: Option<ChatMessageOut>,
    /// Log-probabilities, when asked for.
    #[serde(default)]
    pub logprobs: Option<ChatLogprobs>,
    /// `stop` or `length`; `null` in a chunk before the last.
    #[serde(default)]
    pub finish_reason: Option<String>,
}

/// The answer of `/v1/chat/completions` (`object` `chat.completion`), and each streamed
/// chunk (`chat.completion.chunk`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletionResponse {
    /// `chatcmpl-...`.
    pub id: String,
    /// `chat.completion` or `chat.completion.chunk`.
    pub object: String,
    /// Unix seconds.
    pub created: u64,
    /// The `model` asked for.
    pub model: String,
    /// The choices.
    pub choices: Vec<ChatChoice>,
    /// Token counts (in a stream: only the last chunk, when asked for).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// One entry of `/v1/models`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelCard {
    /// What to pass as `model`.
    pub id: String,
    /// `model`.
    pub object: String,
    /// Unix seconds.
    pub created: u64,
    /// Who owns it: `lathe` for the base model, the run for a checkpoint.
    pub owned_by: String,
}

/// `GET /v1/models`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelList {
    /// `list`.
    pub object: String,
    /// The base model, then the key's sampler checkpoints.
    pub data: Vec<ModelCard>,
}

/// An error, in OpenAI's shape: `{"error": {...}}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpenAiErrorBody {
    /// The error.
    pub error: OpenAiErrorDetail,
}

/// What went wrong.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpenAiErrorDetail {
    /// Human-readable message.
    pub message: String,
    /// The error class (Lathe's error code).
    #[serde(rename = "type")]
    pub kind: String,
    /// The request field at fault, when one is.
    #[serde(default)]
    pub param: Option<String>,
    /// Lathe's stable error code.
    #[serde(default)]
    pub code: Option<String>,
}
