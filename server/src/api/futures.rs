//! `retrieve_future`: long-polls a submitted request.

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use lathe_sdk::types::{
    CancelFutureRequest, RequestFailedResponse, RetrieveFutureRequest, TryAgainResponse,
};

use super::reply::{respond, Encoding};
use super::{ApiError, ApiJson, AppState, Owner};

/// Holds the request up to `poll_timeout` (the SDK re-polls at once and times out at
/// 45 s), then answers `try_again`; a finished request answers its result (protobuf for
/// `forward_backward` and `sample` results when `Accept` asks for it), a failed one
/// `{"error", "category"}` — all with HTTP 200, as the SDK expects. `try_again` and
/// failures are JSON whatever the `Accept`, as the SDK reads them.
///
/// A result's answer holds its bytes of the key's `--max-answer-bytes` until its client
/// has taken it ([`super::answer_budget`]). A key whose clients already have that much to
/// read gets 429 before anything is taken from the table, and a result whose answer would
/// pass the budget is refused with 429 (checked on its estimated size before it is
/// written, and on its size after). A result counts as retrieved (and goes a minute
/// later) only once its answer is ready to send, so none is lost to the budget or to a
/// client that gave up waiting. Results are written off the async threads in one of the
/// key's CPU slots, each holding its estimate of the budget meanwhile.
pub async fn retrieve_future(
    State(s): State<AppState>,
    Extension(owner): Extension<Owner>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<RetrieveFutureRequest>,
) -> Result<Response, ApiError> {
    s.answer_budget.admit(&owner.0)?;
    let result = s
        .engine
        .retrieve_marking(
            owner.0.clone(),
            req.request_id.clone(),
            s.poll_timeout,
            false,
        )
        .await?;
    let Some(result) = result else {
        return Ok(Json(TryAgainResponse {
            kind: "try_again".into(),
            request_id: req.request_id,
            queue_state: "active".into(),
        })
        .into_response());
    };
    let answer = match result.as_ref() {
        Err(f) => Json(RequestFailedResponse {
            error: f.message.clone(),
            category: f.category().into(),
        })
        .into_response(),
        Ok(reply) => {
            // The estimate first, so that copies being written count; then the size.
            let reserved = s.answer_budget.reserve(&owner.0, reply.approx_bytes())?;
            let resp = written(&s, &owner.0, result.clone(), Encoding::accepted(&headers)).await?;
            s.answer_budget.hold_reserved(resp, reserved)?
        }
    };
    // The answer is ready: losing the mark (the engine stopping) only keeps the result
    // until its TTL, so the answer goes out anyway.
    if let Err(e) = s.engine.mark_retrieved(owner.0, req.request_id).await {
        tracing::debug!("marking a result retrieved: {e}");
    }
    Ok(answer)
}

/// A finished result's answer, written off the async threads in one of `owner`'s CPU
/// slots (tens of MB of JSON for a large `forward_backward`).
async fn written(
    s: &AppState,
    owner: &str,
    result: crate::engine::FutureResult,
    encoding: Encoding,
) -> Result<Response, ApiError> {
    let slot = s.cpu_slot(owner).await?;
    tokio::task::spawn_blocking(move || {
        let _slot = slot;
        match result.as_ref() {
            Ok(reply) => respond(reply, encoding),
            Err(_) => Err(ApiError::internal("a failed result has no answer to write")),
        }
    })
    .await
    .map_err(|e| ApiError::internal(format!("writing the result: {e}")))?
}

/// Cancels a sampling request the client gave up on (queued: fails at once; decoding:
/// its sequences stop at the next step). A finished request is left as it is; a
/// training operation is refused (400), since its run's later operations depend on it.
pub async fn cancel_future(
    State(s): State<AppState>,
    Extension(owner): Extension<Owner>,
    ApiJson(req): ApiJson<CancelFutureRequest>,
) -> Result<Json<serde_json::Value>, ApiError> {
    s.engine.cancel_future(owner.0, req.request_id).await??;
    Ok(Json(serde_json::Value::Object(Default::default())))
}
