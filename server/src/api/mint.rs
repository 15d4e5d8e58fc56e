//! MinT's extension endpoints (`mindlab-toolkit`'s `mintx`).

use axum::extract::State;
use axum::{Extension, Json};
use lathe_sdk::types::mint::{
    ForwardBackwardReverseKlRequest, InterpolateCheckpointsRequest, ReverseKlDatum,
};
use lathe_sdk::types::UntypedApiFuture;

use super::body::LargeJson;
use super::training::{ordered, parse_uri};
use super::validate::{self, dense_values, floats, to_token_ids};
use super::{ApiError, ApiJson, AppState, Owner};
use crate::engine::{KeyLimits, ModelInfo, MAX_SOURCES};
use crate::train::reverse_kl::KlDatum;

/// Reverse-KL temperatures accepted: beyond these, `logits / T` or `T^2` leave the
/// range where the loss and its gradient stay finite.
const MIN_TEMPERATURE: f64 = 1e-3;
const MAX_TEMPERATURE: f64 = 1e3;

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
    // Each interpolation reads and writes whole adapters off the async threads: at most
    // one per core at once, like body decoding.
    let slot = s.cpu_slot(&owner.0).await?;
    let fut = s
        .engine
        .interpolate(owner.0, sources, req.coefficients, name, slot)
        .await?;
    Ok(Json(fut))
}

/// `forward_backward_reverse_kl`: the run's gradient gains that of the reverse KL to the
/// reference over the whole vocabulary (see [`crate::train::reverse_kl`]). Without a
/// `seq_id` (MinT's default) the step takes no number in the run's order and runs at
/// its next turn.
pub async fn forward_backward_reverse_kl(
    State(s): State<AppState>,
    Extension(owner): Extension<Owner>,
    LargeJson(req): LargeJson<ForwardBackwardReverseKlRequest>,
) -> Result<Json<UntypedApiFuture>, ApiError> {
    let order = (s.clone(), owner.clone(), req.model_id.clone(), req.seq_id);
    ordered(order, reverse_kl_inner(s, owner, req).await).await
}

async fn reverse_kl_inner(
    s: AppState,
    owner: Owner,
    req: ForwardBackwardReverseKlRequest,
) -> Result<Json<UntypedApiFuture>, ApiError> {
    let reference = if s.model.matches(&req.reference_model_path) {
        None
    } else {
        Some(parse_uri(&req.reference_model_path)?)
    };
    if !(MIN_TEMPERATURE..=MAX_TEMPERATURE).contains(&req.temperature) {
        return Err(ApiError::bad_request(format!(
            "temperature must be between {MIN_TEMPERATURE} and {MAX_TEMPERATURE}, got {}",
            req.temperature
        )));
    }
    let data = kl_data(&s.model, &req.data, &s.limits)?;
    let request_id = s
        .engine
        .reverse_kl(
            owner.0,
            req.model_id.clone(),
            req.seq_id,
            reference,
            data,
            req.temperature,
        )
        .await??;
    Ok(Json(UntypedApiFuture {
        request_id,
        model_id: Some(req.model_id),
        sample_sequence_ids: None,
    }))
}

/// The datums, checked against the model and the per-request token limit before any
/// tensor is expanded.
fn kl_data(
    model: &ModelInfo,
    data: &[ReverseKlDatum],
    limits: &KeyLimits,
) -> Result<Vec<KlDatum>, ApiError> {
    if data.is_empty() {
        return Err(ApiError::bad_request(
            "data is empty: send at least one datum",
        ));
    }
    let declared = data
        .iter()
        .map(|d| {
            d.student_input
                .length()
                .saturating_add(d.reference_input.length())
                .saturating_add(d.target_tokens.num_elements().unwrap_or(usize::MAX))
        })
        .fold(0usize, usize::saturating_add);
    if declared > limits.tokens_per_request {
        return Err(ApiError::bad_request(format!(
            "this request declares {declared} tokens; the limit is {} per request \
             (--max-tokens-per-request): split it into several requests",
            limits.tokens_per_request
        )));
    }
    data.iter()
        .enumerate()
        .map(|(i, d)| {
            let student = validate::tokens(
                model,
                &d.student_input,
                &format!("datum {i}: student_input"),
            )?;
            let reference = validate::tokens(
                model,
                &d.reference_input,
                &format!("datum {i}: reference_input"),
            )?;
            let n = d.target_tokens.num_elements().unwrap_or(usize::MAX);
            let completion = to_token_ids(
                model,
                dense_values(&d.target_tokens, "target_tokens", n, i)?.into_iter(),
                &format!("datum {i}: target_tokens"),
            )?;
            if completion.is_empty() {
                return Err(ApiError::bad_request(format!(
                    "datum {i}: target_tokens is empty"
                )));
            }
            let weights = floats(&d.weights, "weights", n, i)?;
            Ok(KlDatum {
                student,
                reference,
                completion,
                weights,
            })
        })
        .collect()
}
