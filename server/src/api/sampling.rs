//! Sampling endpoints.

use axum::extract::{Path, State};
use axum::{Extension, Json};
use lathe_sdk::types::{
    CreateSamplingSessionRequest, CreateSamplingSessionResponse, GetSamplerResponse, SampleRequest,
    UntypedApiFuture,
};
use serde_json::Value;

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
    ApiJson(req): ApiJson<SampleRequest>,
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
    Ok(Json(s.engine.sample(owner.0, sampler, job).await??))
}

pub async fn get_sampler(
    State(s): State<AppState>,
    Extension(owner): Extension<Owner>,
    Path(id): Path<String>,
) -> Result<Json<GetSamplerResponse>, ApiError> {
    Ok(Json(s.engine.get_sampler(owner.0, id).await??))
}
