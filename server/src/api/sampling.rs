//! Sampling endpoints.

use axum::extract::{Path, State};
use axum::{Extension, Json};
use std::time::Duration;

use lathe_sdk::types::{
    CreateSamplingSessionRequest, CreateSamplingSessionResponse, FutureCompletion,
    FuturesRetrieveRequest, FuturesRetrieveResponse, GetSamplerResponse,
    JoinSamplingSessionRequest, JoinSamplingSessionResponse, SampleRequest, UntypedApiFuture,
};
use serde_json::Value;

use super::body::LargeJson;
use super::session::with_type;
use super::training::parse_uri;
use super::{validate, ApiError, ApiJson, AppState, Owner};
use crate::engine::SamplerRef;

pub async fn create_sampling_session(
    State(s): State<AppState>,
    Extension(owner): Extension<Owner>,
    ApiJson(req): ApiJson<CreateSamplingSessionRequest>,
) -> Result<Json<Value>, ApiError> {
    let uri = match (&req.model_path, &req.base_model) {
        (Some(p), _) => Some(parse_uri(p)?),
        (None, Some(name)) => {
            validate::base_model(&s.model, name)?;
            None
        }
        (None, None) => {
            return Err(ApiError::bad_request(
                "create_sampling_session needs model_path or base_model",
            ))
        }
    };
    let id = s
        .engine
        .create_sampling_session(owner.0, req.session_id, req.sampling_session_seq_id, uri)
        .await??;
    let resp = CreateSamplingSessionResponse {
        sampling_session_id: id,
    };
    Ok(Json(with_type(resp, "create_sampling_session")))
}

pub async fn asample(
    State(s): State<AppState>,
    Extension(owner): Extension<Owner>,
    LargeJson(req): LargeJson<SampleRequest>,
) -> Result<Json<UntypedApiFuture>, ApiError> {
    let job = validate::sample_job(&s.model, &req, &s.limits)?;
    let sampler = match (req.sampling_session_id, req.model_path, req.base_model) {
        (Some(id), _, _) => SamplerRef::Session(id),
        (None, Some(p), _) => SamplerRef::Path(parse_uri(&p)?),
        (None, None, Some(name)) => {
            validate::base_model(&s.model, &name)?;
            SamplerRef::BaseModel
        }
        (None, None, None) => {
            return Err(ApiError::bad_request(
                "asample needs sampling_session_id, model_path or base_model",
            ))
        }
    };
    // tinker 0.38 numbers a copied client's requests from `clone * 10^9`.
    let clone = req.seq_id.unwrap_or(0) / CLONE_BLOCK;
    Ok(Json(
        s.engine
            .sample_streamed(owner.0, sampler, job, None, Some(clone))
            .await??,
    ))
}

/// Sampling request numbers per client copy (tinker 0.38's `seq_id // 1_000_000_000`).
const CLONE_BLOCK: u64 = 1_000_000_000;

/// `retrieve_futures`: the sampling session's requests finished since the client's last
/// poll, waiting up to the request's `timeout` (at most the server's poll timeout) for
/// the first.
pub async fn retrieve_futures(
    State(s): State<AppState>,
    Extension(owner): Extension<Owner>,
    ApiJson(req): ApiJson<FuturesRetrieveRequest>,
) -> Result<Json<FuturesRetrieveResponse>, ApiError> {
    let wait = match req.timeout {
        Some(t) if t.is_finite() && t >= 0.0 => {
            Duration::from_secs_f64(t.min(s.poll_timeout.as_secs_f64()))
        }
        _ => s.poll_timeout,
    };
    let (events, cursor) = s
        .engine
        .retrieve_futures(
            owner.0,
            req.target.sampling_session_id,
            req.target.cloned_sampler_id,
            req.prev_cursor,
            wait,
        )
        .await?;
    let completions = events
        .into_iter()
        .map(|c| match c.failed {
            false => FutureCompletion::Finished {
                request_id: c.request_id,
                response_payload_uncompressed_size: None,
            },
            true => FutureCompletion::Failed {
                request_id: c.request_id,
            },
        })
        .collect();
    Ok(Json(FuturesRetrieveResponse {
        completions,
        cursor,
    }))
}

/// `join_sampling_session`: an id for a copy of a sampling client, so that copies never
/// number their requests alike.
pub async fn join_sampling_session(
    State(s): State<AppState>,
    Extension(owner): Extension<Owner>,
    ApiJson(req): ApiJson<JoinSamplingSessionRequest>,
) -> Result<Json<JoinSamplingSessionResponse>, ApiError> {
    let client_counter = s
        .engine
        .join_sampling_session(owner.0, req.sampling_session_id)
        .await??;
    Ok(Json(JoinSamplingSessionResponse { client_counter }))
}

pub async fn get_sampler(
    State(s): State<AppState>,
    Extension(owner): Extension<Owner>,
    Path(id): Path<String>,
) -> Result<Json<GetSamplerResponse>, ApiError> {
    Ok(Json(s.engine.get_sampler(owner.0, id).await??))
}
