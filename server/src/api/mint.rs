//! MinT's extension endpoints (`mindlab-toolkit`'s `mintx`).

use axum::extract::State;
use axum::{Extension, Json};
use lathe_sdk::types::mint::InterpolateCheckpointsRequest;
use lathe_sdk::types::UntypedApiFuture;

use super::training::parse_uri;
use super::{ApiError, ApiJson, AppState, Owner};
use crate::engine::MAX_SOURCES;

/// `checkpoints/interpolate`: a sampler checkpoint holding the weighted sum of the
/// sources' LoRA deltas, saved under the first source's run.
pub async fn interpolate(
    State(s): State<AppState>,
    Extension(owner): Extension<Owner>,
    ApiJson(req): ApiJson<InterpolateCheckpointsRequest>,
) -> Result<Json<UntypedApiFuture>, ApiError> {
    if req.output_checkpoint_type != "sampler" {
        return Err(ApiError::bad_request(format!(
            "output_checkpoint_type must be \"sampler\", got {:?}",
            req.output_checkpoint_type
        )));
    }
    if req.source_paths.len() > MAX_SOURCES {
        return Err(ApiError::bad_request(format!(
            "at most {MAX_SOURCES} source_paths, got {}",
            req.source_paths.len()
        )));
    }
    let sources = req
        .source_paths
        .iter()
        .map(|p| parse_uri(p))
        .collect::<Result<Vec<_>, _>>()?;
    let name = match req.output_path {
        Some(name) => {
            lathe_sdk::types::validate_checkpoint_name(&name).map_err(ApiError::bad_request)?;
            name
        }
        None => format!("mintx-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]),
    };
    let fut = s
        .engine
        .interpolate(owner.0, sources, req.coefficients, name)
        .await?;
    Ok(Json(fut))
}
