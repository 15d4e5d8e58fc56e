//! Client bootstrap: config, JWT exchange, sessions, heartbeat, telemetry, capabilities,
//! and the Lathe tokenizer extension.

use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use lathe_sdk::types::{
    AuthTokenResponse, ClientConfigResponse, ClientDynamicConfigResponse, CreateSessionResponse,
    FinishSessionRequest, ServerCapabilities, SessionHeartbeatRequest, SupportedModel,
    TokenizerResponse,
};
use serde::Deserialize;
use serde_json::{json, Value};

use super::{validate, ApiError, ApiJson, AppState, Owner};

pub async fn client_config(State(s): State<AppState>) -> Json<ClientConfigResponse> {
    Json(ClientConfigResponse {
        proto_compress_fwdbwd: s.zstd_forward_backward,
        ..ClientConfigResponse::lathe()
    })
}

/// Tells the SDK to cancel the samples it abandons (`cancel_future`).
pub async fn dynamic_config() -> Json<ClientDynamicConfigResponse> {
    Json(ClientDynamicConfigResponse::lathe())
}

pub async fn auth_token(
    State(s): State<AppState>,
    Extension(owner): Extension<Owner>,
) -> Json<AuthTokenResponse> {
    Json(AuthTokenResponse {
        jwt: s.auth.session_token(&owner.0),
    })
}

/// The body (`CreateSessionRequest`: tags, metadata, SDK version) is read for validity
/// only and kept nowhere, so it is skimmed, not built: its free-form metadata would
/// otherwise cost many times its bytes as a JSON tree.
pub async fn create_session(
    State(s): State<AppState>,
    Extension(owner): Extension<Owner>,
    ApiJson(_body): ApiJson<serde::de::IgnoredAny>,
) -> Result<Json<Value>, ApiError> {
    let session_id = s.engine.create_session(owner.0).await??;
    let resp = CreateSessionResponse {
        session_id,
        info_message: None,
        warning_message: None,
        error_message: None,
    };
    Ok(Json(with_type(resp, "create_session")))
}

/// Ends the session: its runs are unloaded (resumable from their checkpoints), its
/// heartbeat then answers 410. Finishing it again is a no-op.
pub async fn finish_session(
    State(s): State<AppState>,
    Extension(owner): Extension<Owner>,
    axum::extract::Path(session_id): axum::extract::Path<String>,
    ApiJson(req): ApiJson<FinishSessionRequest>,
) -> Result<Json<Value>, ApiError> {
    let status = req.reason.kind.as_str().to_string();
    s.engine
        .finish_session(owner.0, session_id, status)
        .await??;
    Ok(Json(json!({})))
}

pub async fn heartbeat(
    State(s): State<AppState>,
    Extension(owner): Extension<Owner>,
    ApiJson(req): ApiJson<SessionHeartbeatRequest>,
) -> Result<Json<Value>, ApiError> {
    s.engine.heartbeat(owner.0, req.session_id).await??;
    Ok(Json(json!({"type": "session_heartbeat"})))
}

pub async fn telemetry() -> Json<Value> {
    Json(json!({"status": "accepted"}))
}

pub async fn capabilities(State(s): State<AppState>) -> Json<ServerCapabilities> {
    Json(ServerCapabilities {
        supported_models: vec![SupportedModel {
            model_name: s.model.name.clone(),
            max_context_length: Some(s.model.max_seq_len),
        }],
    })
}

/// 200 while the engine answers and its worker thread runs; 503 with the reason
/// otherwise, so a load balancer or supervisor sees a server that cannot train.
pub async fn healthz(State(s): State<AppState>) -> (StatusCode, Json<Value>) {
    match s.engine.health(Duration::from_secs(5)).await {
        Ok(()) => (StatusCode::OK, Json(json!({"status": "ok"}))),
        Err(detail) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "unhealthy", "detail": detail})),
        ),
    }
}

#[derive(Deserialize)]
pub struct TokenizerQuery {
    base_model: Option<String>,
}

/// `lathe/tokenizer`: the same answer for every caller, written once (on the first
/// request) and shared: `tokenizer.json` is large, and parsing and writing it again for
/// each request cost memory and the async threads' time.
pub async fn tokenizer(
    State(s): State<AppState>,
    Query(q): Query<TokenizerQuery>,
) -> Result<Response, ApiError> {
    if let Some(name) = &q.base_model {
        validate::base_model(&s.model, name)?;
    }
    let answer = s
        .tokenizer_answer
        .get_or_init(|| tokenizer_answer(&s.model))
        .clone()
        .map_err(ApiError::internal)?;
    Ok(([(header::CONTENT_TYPE, "application/json")], answer).into_response())
}

/// The tokenizer answer of `model`, serialized.
fn tokenizer_answer(model: &crate::engine::ModelInfo) -> Result<Bytes, String> {
    let tokenizer: Value =
        serde_json::from_str(&model.tokenizer_json).map_err(|e| format!("tokenizer.json: {e}"))?;
    let answer = TokenizerResponse {
        base_model: model.name.clone(),
        tokenizer,
        chat_template: model.chat_template.clone(),
        eos_token: model.eos_token.clone(),
        bos_token: model.bos_token.clone(),
    };
    serde_json::to_vec(&answer)
        .map(Bytes::from)
        .map_err(|e| format!("tokenizer answer: {e}"))
}

/// A response object with the `type` discriminator the Python SDK echoes.
pub fn with_type(value: impl serde::Serialize, kind: &str) -> Value {
    let mut v = serde_json::to_value(value).expect("response serialises");
    if let Value::Object(map) = &mut v {
        map.insert("type".into(), Value::String(kind.into()));
    }
    v
}
