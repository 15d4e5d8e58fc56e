//! `retrieve_future`: long-polls a submitted request.

use axum::extract::State;
use axum::{Extension, Json};
use lathe_sdk::types::{RequestFailedResponse, RetrieveFutureRequest, TryAgainResponse};
use serde_json::Value;

use super::{ApiError, ApiJson, AppState, Owner};

/// Holds the request up to `poll_timeout` (the SDK re-polls at once and times out at
/// 45 s), then answers `try_again`; a finished request answers its result, a failed one
/// `{"error", "category"}` — all with HTTP 200, as the SDK expects.
pub async fn retrieve_future(
    State(s): State<AppState>,
    Extension(owner): Extension<Owner>,
    ApiJson(req): ApiJson<RetrieveFutureRequest>,
) -> Result<Json<Value>, ApiError> {
    let result = s
        .engine
        .retrieve(owner.0, req.request_id.clone(), s.poll_timeout)
        .await?;
    Ok(Json(match result {
        None => serde_json::to_value(TryAgainResponse {
            kind: "try_again".into(),
            request_id: req.request_id,
            queue_state: "active".into(),
        })
        .expect("serialises"),
        Some(r) => match r.as_ref() {
            Ok(body) => body.clone(),
            Err(f) => serde_json::to_value(RequestFailedResponse {
                error: f.message.clone(),
                category: f.category().into(),
            })
            .expect("serialises"),
        },
    }))
}
