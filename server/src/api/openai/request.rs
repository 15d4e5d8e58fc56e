//! OpenAI requests to Lathe sampling jobs. Each prompt becomes one typed
//! [`SampleRequest`] checked by [`validate::sample_job`], so these endpoints have exactly
//! the limits and checks of `asample`; what OpenAI's API has and Lathe cannot honour is
//! refused by name, never ignored.

use lathe_sdk::types::openai::{
    ChatCompletionRequest, ChatMessageIn, CompletionPrompt, CompletionRequest, ContentPart,
    MessageContent, OpenAiSampling,
};
use lathe_sdk::types::{ModelInput, SampleRequest, SamplingParams, StopCondition};

use super::super::{validate, ApiError, AppState};
use super::TextModel;
use crate::engine::SamplerRef;
use crate::model::ChatMessage;
use crate::sample::SampleJob;

/// OpenAI's default `max_tokens` for `/v1/completions`.
pub const COMPLETIONS_DEFAULT_MAX_TOKENS: usize = 16;

/// Most alternatives per position `logprobs` may ask for on `/v1/completions`: OpenAI's
/// own limit. Each prompt position's alternatives are decoded to text and rendered into
/// the answer (for every choice with `echo`), so the bound keeps an answer's size a small
/// multiple of its tokens.
pub const MAX_COMPLETION_LOGPROBS: usize = 5;

/// Most choices one request may ask for (prompts times `n`), as `asample`'s
/// `num_samples` bound.
pub const MAX_CHOICES: usize = validate::MAX_NUM_SAMPLES;

/// What a request asks for, ready to submit.
pub struct Plan {
    /// The sampler every prompt uses.
    pub sampler: SamplerRef,
    /// One job per prompt, with its prompt tokens.
    pub jobs: Vec<SampleJob>,
    /// Choices per prompt.
    pub n: usize,
    /// Where choices' text ends.
    pub stops: Vec<String>,
    /// The request asked for no new tokens (completions with `echo`): one is sampled,
    /// because a sampling job needs one, and dropped.
    pub drop_generated: bool,
}

fn bad(message: impl Into<String>) -> ApiError {
    ApiError::bad_request(message)
}

/// The sampler `model` names: the base model, or a checkpoint (whose access the engine
/// checks when the job is queued).
pub fn sampler(s: &AppState, model: &str) -> Result<SamplerRef, ApiError> {
    if s.model.matches(model) {
        Ok(SamplerRef::BaseModel)
    } else if model.starts_with("tinker://") {
        Ok(SamplerRef::Path(super::super::training::parse_uri(model)?))
    } else {
        Err(ApiError::not_found(format!(
            "unknown model {model:?}: this server serves {:?} and the tinker:// paths of \
             checkpoints your key may read (GET /v1/models lists yours)",
            s.model.name
        )))
    }
}

/// Refuses the shared sampling fields Lathe cannot honour.
fn check_sampling(p: &OpenAiSampling, logprobs: bool) -> Result<(), ApiError> {
    for (name, v) in [
        ("presence_penalty", p.presence_penalty),
        ("frequency_penalty", p.frequency_penalty),
    ] {
        if v.is_some_and(|v| v != 0.0) {
            return Err(bad(format!("{name} is not supported (only 0)")));
        }
    }
    if p.logit_bias.as_ref().is_some_and(|b| !b.is_empty()) {
        return Err(bad("logit_bias is not supported"));
    }
    if p.stream && logprobs {
        return Err(bad(
            "logprobs are not streamed: ask for them without stream, or stream without them",
        ));
    }
    Ok(())
}

/// The typed `asample` body for one prompt, then checked as `asample` checks it.
fn job(
    s: &AppState,
    prompt: Vec<u32>,
    p: &OpenAiSampling,
    max_tokens: Option<usize>,
    prompt_logprobs: bool,
    topk_prompt_logprobs: usize,
) -> Result<SampleJob, ApiError> {
    let params = SamplingParams {
        max_tokens,
        seed: p.seed,
        stop: p.stop.clone().map(|s| StopCondition::Texts(s.into_vec())),
        temperature: p.temperature.unwrap_or(1.0),
        top_k: -1,
        top_p: p.top_p.unwrap_or(1.0),
    };
    let prompt = ModelInput::from_ints(prompt.into_iter().map(i64::from).collect());
    let req = SampleRequest {
        prompt_logprobs,
        topk_prompt_logprobs,
        ..SampleRequest::new(prompt, params, p.n.unwrap_or(1))
    };
    validate::sample_job(&s.model, &req, &s.limits)
}

fn choices(prompts: usize, n: Option<usize>) -> Result<usize, ApiError> {
    let n = n.unwrap_or(1);
    if n == 0 {
        return Err(bad("n must be at least 1"));
    }
    match prompts.checked_mul(n) {
        Some(c) if c <= MAX_CHOICES => Ok(n),
        _ => Err(bad(format!(
            "{prompts} prompt(s) x n={n} choices is more than {MAX_CHOICES}"
        ))),
    }
}

/// Bytes of text per token of context that a prompt may have before it is encoded:
/// tokenizers average about four bytes a token, so a longer text could not fit the
/// context, and encoding it first (its cost and memory grow with the text) is refused.
const TEXT_BYTES_PER_TOKEN: usize = 32;

/// Refuses text that could not fit `s`'s context, before anything encodes it.
fn check_text_len(s: &AppState, what: &str, bytes: usize) -> Result<(), ApiError> {
    let max = s.model.max_seq_len.saturating_mul(TEXT_BYTES_PER_TOKEN);
    if bytes > max {
        return Err(bad(format!(
            "{what} has {bytes} bytes of text, more than the context of {} tokens could \
             hold ({max} bytes)",
            s.model.max_seq_len
        )));
    }
    Ok(())
}

/// Plans `/v1/completions`.
pub async fn completion(
    s: &AppState,
    owner: &str,
    req: &CompletionRequest,
) -> Result<Plan, ApiError> {
    let sampler = sampler(s, &req.model)?;
    check_sampling(&req.sampling, req.logprobs.is_some())?;
    if req.echo && req.sampling.stream {
        return Err(bad("echo is not streamed: ask for it without stream"));
    }
    if req.suffix.is_some() {
        return Err(bad("suffix is not supported"));
    }
    if let Some(k) = req.logprobs.filter(|&k| k > MAX_COMPLETION_LOGPROBS) {
        return Err(bad(format!(
            "logprobs must be at most {MAX_COMPLETION_LOGPROBS}, got {k}"
        )));
    }
    let n = req.sampling.n.unwrap_or(1);
    if req.best_of.is_some_and(|b| b != n) {
        return Err(bad("best_of is not supported (only equal to n)"));
    }
    // Counts and sizes first: encoding is the expensive part.
    let texts: &[String] = match &req.prompt {
        CompletionPrompt::Text(t) => std::slice::from_ref(t),
        CompletionPrompt::Texts(t) => t,
        _ => &[],
    };
    if !texts.is_empty() {
        choices(texts.len(), req.sampling.n)?;
    }
    for t in texts {
        check_text_len(s, "a prompt", t.len())?;
    }
    let prompts = match &req.prompt {
        CompletionPrompt::Text(t) => encode_texts(s, owner, vec![t.clone()]).await?,
        CompletionPrompt::Texts(t) => encode_texts(s, owner, t.clone()).await?,
        CompletionPrompt::Tokens(t) => vec![t.clone()],
        CompletionPrompt::TokenLists(t) => t.clone(),
    };
    if prompts.is_empty() {
        return Err(bad("prompt is empty"));
    }
    let n = choices(prompts.len(), req.sampling.n)?;
    let max_tokens = req.max_tokens.unwrap_or(COMPLETIONS_DEFAULT_MAX_TOKENS);
    let drop_generated = max_tokens == 0;
    if drop_generated && !req.echo {
        return Err(bad("max_tokens 0 asks for nothing (unless echo is set)"));
    }
    if !req.echo && req.logprobs.is_some_and(|k| k > 0) {
        return Err(bad(
            "logprobs above 0 asks for alternatives of sampled tokens, which Lathe does not \
             compute: use logprobs 0 (each sampled token's own log-probability), or echo to \
             score the prompt with alternatives",
        ));
    }
    let scored = req.echo && req.logprobs.is_some();
    let topk = if req.echo {
        req.logprobs.unwrap_or(0)
    } else {
        0
    };
    let jobs = prompts
        .into_iter()
        .map(|p| job(s, p, &req.sampling, Some(max_tokens.max(1)), scored, topk))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Plan {
        sampler,
        jobs,
        n,
        stops: stops(&req.sampling),
        drop_generated,
    })
}

/// Plans `/v1/chat/completions`: the messages rendered with the model's chat template.
pub async fn chat(
    s: &AppState,
    owner: &str,
    req: &ChatCompletionRequest,
) -> Result<Plan, ApiError> {
    let sampler = sampler(s, &req.model)?;
    check_sampling(&req.sampling, req.logprobs)?;
    if req.top_logprobs.is_some_and(|k| k > 0) {
        return Err(bad(
            "top_logprobs is not supported: Lathe computes the log-probability of each \
             sampled token, not of alternatives (use logprobs: true)",
        ));
    }
    if req.tools.as_ref().is_some_and(|t| !t.is_null()) {
        return Err(bad("tools are not supported"));
    }
    if let Some(f) = &req.response_format {
        if f.get("type").and_then(|t| t.as_str()) != Some("text") {
            return Err(bad(
                "response_format is not supported (only {\"type\": \"text\"})",
            ));
        }
    }
    if req.messages.is_empty() {
        return Err(bad("messages is empty"));
    }
    let messages = req
        .messages
        .iter()
        .enumerate()
        .map(|(i, m)| message(i, m))
        .collect::<Result<Vec<_>, _>>()?;
    let bytes = messages.iter().fold(0usize, |n, m| {
        n.saturating_add(m.content.len())
            .saturating_add(m.role.len())
    });
    check_text_len(s, "the conversation", bytes)?;
    let prompt = render_chat(s, owner, messages).await?;
    let n = choices(1, req.sampling.n)?;
    let job = job(
        s,
        prompt,
        &req.sampling,
        req.max_completion_tokens.or(req.max_tokens),
        false,
        0,
    )?;
    Ok(Plan {
        sampler,
        jobs: vec![job],
        n,
        stops: stops(&req.sampling),
        drop_generated: false,
    })
}

fn stops(p: &OpenAiSampling) -> Vec<String> {
    p.stop.clone().map(|s| s.into_vec()).unwrap_or_default()
}

/// One message for the chat template; `developer` is OpenAI's newer name for `system`.
fn message(i: usize, m: &ChatMessageIn) -> Result<ChatMessage, ApiError> {
    let role = match m.role.as_str() {
        "system" | "developer" => "system",
        "user" => "user",
        "assistant" => "assistant",
        other => {
            return Err(bad(format!(
                "messages[{i}]: role {other:?} is not supported (system, developer, user, \
                 assistant)"
            )))
        }
    };
    let content = match &m.content {
        None => return Err(bad(format!("messages[{i}] has no content"))),
        Some(MessageContent::Text(t)) => t.clone(),
        Some(MessageContent::Parts(parts)) => parts
            .iter()
            .map(|p: &ContentPart| match (p.kind.as_str(), &p.text) {
                ("text", Some(t)) => Ok(t.as_str()),
                (kind, _) => Err(bad(format!(
                    "messages[{i}]: content part of type {kind:?} is not supported (text only)"
                ))),
            })
            .collect::<Result<Vec<_>, _>>()?
            .join("\n"),
    };
    Ok(ChatMessage::new(role, content))
}

/// Runs tokenizer work off the async threads, one job per core at most (the slots that
/// bound protobuf decoding): a long prompt takes real CPU time to encode.
async fn on_blocking<R: Send + 'static>(
    s: &AppState,
    owner: &str,
    work: impl FnOnce(&TextModel) -> Result<R, ApiError> + Send + 'static,
) -> Result<R, ApiError> {
    let _slot = s.cpu_slot(owner).await?;
    let text = s.text.clone();
    tokio::task::spawn_blocking(move || work(&text))
        .await
        .map_err(|e| ApiError::internal(format!("tokenizer task failed: {e}")))?
}

/// Encodes text prompts with the model's tokenizer.
async fn encode_texts(
    s: &AppState,
    owner: &str,
    texts: Vec<String>,
) -> Result<Vec<Vec<u32>>, ApiError> {
    on_blocking(s, owner, move |text| {
        texts
            .iter()
            .map(|t| {
                text.tokenizer
                    .encode(t)
                    .map_err(|e| bad(format!("prompt cannot be encoded: {e}")))
            })
            .collect()
    })
    .await
}

/// Renders a conversation with the model's chat template, opening the assistant's turn,
/// and encodes it.
async fn render_chat(
    s: &AppState,
    owner: &str,
    messages: Vec<ChatMessage>,
) -> Result<Vec<u32>, ApiError> {
    on_blocking(s, owner, move |text| {
        let template = text
            .chat_template
            .as_ref()
            .ok_or_else(|| bad("the served model has no chat template: use /v1/completions"))?;
        let prompt = template
            .render(&messages, true)
            .map_err(|e| bad(format!("the chat template refused the messages: {e}")))?;
        text.tokenizer
            .encode(&prompt)
            .map_err(|e| bad(format!("prompt cannot be encoded: {e}")))
    })
    .await
}
