//! OpenAI-compatible endpoints, so that trained adapters can be evaluated and served
//! with standard OpenAI clients and evaluation harnesses: `/v1/completions`,
//! `/v1/chat/completions` (both whole or streamed as server-sent events) and
//! `/v1/models`. `model` is the base model or any `tinker://` checkpoint the key may
//! read. Requests go through the same key check, validation, per-key limits and
//! sampling queue as `asample` (each prompt is one sampling request); errors keep their
//! status from [`ApiError`]'s table and take OpenAI's body shape.

mod answer;
mod request;
mod stream;
mod text;

use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use lathe_sdk::types::openai::{
    ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, OpenAiErrorBody,
    OpenAiErrorDetail, OpenAiSampling,
};
use lathe_sdk::types::{CheckpointKind, CheckpointUri};
use serde::de::DeserializeOwned;
use tokio::sync::watch;

use super::{ApiError, AppState, Owner};
use crate::engine::{EngineError, EngineHandle};
use crate::model::{ChatTemplate, TextTokenizer};
use crate::sample::progress::Tokens;
use crate::sample::{SampleOutput, TokenProgress};
use crate::worker::Reply;

/// What these endpoints need of the model besides [`crate::engine::ModelInfo`]: text in
/// and out.
pub struct TextModel {
    /// The model's tokenizer.
    pub tokenizer: TextTokenizer,
    /// Its chat template, if it has one (`/v1/chat/completions` needs it).
    pub chat_template: Option<ChatTemplate>,
}

/// An [`ApiError`] answered in OpenAI's shape, `{"error": {"message", "type", "code"}}`.
#[derive(Debug)]
pub struct OpenAiError(pub ApiError);

impl From<ApiError> for OpenAiError {
    fn from(e: ApiError) -> Self {
        Self(e)
    }
}

impl From<EngineError> for OpenAiError {
    fn from(e: EngineError) -> Self {
        Self(e.into())
    }
}

impl IntoResponse for OpenAiError {
    fn into_response(self) -> Response {
        let e = self.0;
        let body = Json(OpenAiErrorBody {
            error: OpenAiErrorDetail {
                message: e.message,
                kind: e.code.into(),
                param: None,
                code: Some(e.code.into()),
            },
        });
        match e.limit {
            None => (e.status, body).into_response(),
            Some((_, retry_after)) => {
                let retry = [(axum::http::header::RETRY_AFTER, retry_after.to_string())];
                (e.status, retry, body).into_response()
            }
        }
    }
}

/// Parses a JSON body (off the async threads, in one of the key's CPU slots: a prompt
/// of token ids can be tens of MB); a bad one is a 400 in OpenAI's shape.
async fn parse<T: DeserializeOwned + Send + 'static>(
    s: &AppState,
    owner: &Owner,
    body: Bytes,
) -> Result<T, OpenAiError> {
    super::body::decode_json(s, &owner.0, body)
        .await
        .map_err(OpenAiError)
}

/// Unix seconds now.
fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// `POST /v1/completions`.
pub async fn completions(
    State(s): State<AppState>,
    Extension(owner): Extension<Owner>,
    body: Bytes,
) -> Result<Response, OpenAiError> {
    let req: CompletionRequest = parse(&s, &owner, body).await?;
    let plan = request::completion(&s, &owner.0, &req).await?;
    let kind = stream::Kind::Completion;
    let (model, sampling) = (req.model.clone(), req.sampling.clone());
    serve(
        s,
        owner,
        plan,
        kind,
        &model,
        &sampling,
        move |text, id, plan, outputs| {
            Ok(Json(answer::completion(text, id, plan, &req, outputs)?).into_response())
        },
    )
    .await
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(
    State(s): State<AppState>,
    Extension(owner): Extension<Owner>,
    body: Bytes,
) -> Result<Response, OpenAiError> {
    let req: ChatCompletionRequest = parse(&s, &owner, body).await?;
    let plan = request::chat(&s, &owner.0, &req).await?;
    let kind = stream::Kind::Chat;
    let (model, sampling) = (req.model.clone(), req.sampling.clone());
    serve(
        s,
        owner,
        plan,
        kind,
        &model,
        &sampling,
        move |text, id, plan, outputs| {
            Ok(Json(answer::chat(text, id, plan, &req, outputs)?).into_response())
        },
    )
    .await
}

/// Submits a planned request and answers it: streamed when asked, else whole, written
/// by `whole` from every prompt's result, off the async threads under one of the
/// owner's CPU slots (decoding every choice's text, and with `echo` every prompt
/// position's alternatives, takes real CPU time for a large request).
async fn serve(
    s: AppState,
    owner: Owner,
    plan: request::Plan,
    kind: stream::Kind,
    model: &str,
    sampling: &OpenAiSampling,
    whole: impl FnOnce(&TextModel, &str, &request::Plan, Vec<SampleOutput>) -> Result<Response, ApiError>
        + Send
        + 'static,
) -> Result<Response, OpenAiError> {
    let sent = Submitted::submit(&s, &owner, &plan, sampling.stream).await?;
    if sampling.stream {
        let usage = sampling
            .stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage);
        return Ok(stream::start(s, plan, sent, kind, model.to_string(), usage));
    }
    let id = sent.id().to_string();
    let outputs = sent.outputs().await?;
    let _slot = s.cpu_slot(&owner.0).await?;
    let text = s.text.clone();
    let answer = tokio::task::spawn_blocking(move || whole(&text, &id, &plan, outputs))
        .await
        .map_err(|e| ApiError::internal(format!("answer task failed: {e}")))??;
    Ok(answer)
}

/// `GET /v1/models`: the base model, then the key's sampler checkpoints (newest first,
/// up to a page).
pub async fn models(
    State(s): State<AppState>,
    Extension(owner): Extension<Owner>,
) -> Result<Json<ModelList>, OpenAiError> {
    const PAGE: usize = 1000;
    let created = now();
    let mut data = vec![ModelCard {
        id: s.model.name.clone(),
        object: "model".into(),
        created,
        owned_by: "lathe".into(),
    }];
    let page = s.engine.list_user_checkpoints(owner.0, 0, PAGE).await?;
    for c in page.checkpoints {
        match c.tinker_path.parse::<CheckpointUri>() {
            Ok(uri) if uri.kind == CheckpointKind::Sampler => data.push(ModelCard {
                id: c.tinker_path,
                object: "model".into(),
                created,
                owned_by: uri.run_id,
            }),
            _ => {}
        }
    }
    Ok(Json(ModelList {
        object: "list".into(),
        data,
    }))
}

/// A request's sampling jobs, queued in the engine. Dropped before their results are
/// taken (the client went away), the jobs still queued or decoding are cancelled, so a
/// client that gives up never leaves work running for nobody.
pub struct Submitted {
    engine: EngineHandle,
    owner: String,
    poll: std::time::Duration,
    /// One request id per prompt.
    ids: Vec<String>,
    /// Per prompt, its tokens as they are picked (streaming only).
    watches: Vec<Option<watch::Receiver<Tokens>>>,
    /// Requests whose result has not been taken.
    pending: Vec<String>,
}

impl Submitted {
    /// Queues one sampling request per prompt of `plan`.
    async fn submit(
        s: &AppState,
        owner: &Owner,
        plan: &request::Plan,
        stream: bool,
    ) -> Result<Self, ApiError> {
        let mut sent = Self {
            engine: s.engine.clone(),
            owner: owner.0.clone(),
            poll: s.poll_timeout,
            ids: Vec::new(),
            watches: Vec::new(),
            pending: Vec::new(),
        };
        for job in &plan.jobs {
            let (progress, watch) = if stream {
                let (p, w) = TokenProgress::new(job.num_samples);
                (Some(p), Some(w))
            } else {
                (None, None)
            };
            // On an error here, dropping `sent` cancels the prompts already queued.
            let fut = s
                .engine
                .sample_streamed(
                    owner.0.clone(),
                    plan.sampler.clone(),
                    job.clone(),
                    progress,
                    None,
                )
                .await??;
            sent.pending.push(fut.request_id.clone());
            sent.ids.push(fut.request_id);
            sent.watches.push(watch);
        }
        Ok(sent)
    }

    /// The id answers carry: the first request's.
    fn id(&self) -> &str {
        self.ids.first().map_or("", String::as_str)
    }

    /// Waits for prompt `i`'s result.
    async fn output(&mut self, i: usize) -> Result<SampleOutput, ApiError> {
        let id = self.ids[i].clone();
        let result = loop {
            if let Some(r) = self
                .engine
                .retrieve(self.owner.clone(), id.clone(), self.poll)
                .await?
            {
                break r;
            }
        };
        self.pending.retain(|p| *p != id);
        match result.as_ref() {
            Ok(Reply::Sample(out)) => Ok(out.clone()),
            Ok(_) => Err(ApiError::internal(
                "a sampling request answered a non-sample",
            )),
            Err(f) => Err(match f.blame {
                crate::worker::Blame::User => ApiError::bad_request(f.message.clone()),
                crate::worker::Blame::Server => ApiError::internal(f.message.clone()),
            }),
        }
    }

    /// Every prompt's result, in order.
    async fn outputs(mut self) -> Result<Vec<SampleOutput>, ApiError> {
        let mut all = Vec::with_capacity(self.ids.len());
        for i in 0..self.ids.len() {
            all.push(self.output(i).await?);
        }
        Ok(all)
    }
}

impl Drop for Submitted {
    fn drop(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (engine, owner) = (self.engine.clone(), self.owner.clone());
        let pending = std::mem::take(&mut self.pending);
        rt.spawn(async move {
            for id in pending {
                if let Err(e) = engine
                    .cancel_future(owner.clone(), id)
                    .await
                    .and_then(|r| r)
                {
                    tracing::debug!("cancelling an abandoned OpenAI request: {e}");
                }
            }
        });
    }
}
