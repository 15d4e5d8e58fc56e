//! Server-side custom losses: `create_custom_loss`, the `loss_fn: "custom"` of a
//! forward/backward request, and the inputs a custom loss reads from each datum.

use std::sync::Arc;

use axum::extract::State;
use axum::{Extension, Json};
use lathe_sdk::types::{CreateCustomLossRequest, Datum, TensorDtype, UntypedApiFuture};

use super::validate::LossChoice;
use super::{ApiError, ApiJson, AppState, Owner};
use crate::engine::KeyLimits;
use crate::train::custom::{checked_shape, Array, CustomLoss, Kind};
use crate::train::{CustomInputs, CustomLossRef, Loss};

/// Values a custom loss's inputs may hold per target a request may declare
/// (`--max-tokens-per-request`): bounds what a request's sparse inputs expand to.
const VALUES_PER_TARGET: usize = 4;

/// The largest `create_custom_loss` body: more than a graph at the compiler's node and
/// argument limits needs, and the body is decoded on the async threads.
pub const MAX_BODY_BYTES: usize = 1 << 20;

/// `POST /api/v1/create_custom_loss`: rebuilds the traced graph from the allow-list
/// (refusing it with a 400 naming the node otherwise) and registers it in the session.
pub async fn create_custom_loss(
    State(s): State<AppState>,
    Extension(owner): Extension<Owner>,
    ApiJson(req): ApiJson<CreateCustomLossRequest>,
) -> Result<Json<UntypedApiFuture>, ApiError> {
    let loss = CustomLoss::compile(&req.name, &req.inputs, &req.graph)
        .map_err(|e| ApiError::bad_request(format!("create_custom_loss {:?}: {e}", req.name)))?;
    let future = s
        .engine
        .create_custom_loss(
            owner.0,
            req.session_id,
            req.custom_loss_seq_id,
            Arc::new(loss),
        )
        .await??;
    Ok(Json(future))
}

/// The loss a request names, with a custom loss looked up in the run's session.
pub async fn resolve(
    s: &AppState,
    owner: &Owner,
    model_id: &str,
    choice: LossChoice,
) -> Result<Loss, ApiError> {
    Ok(match choice {
        LossChoice::Builtin(loss) => loss,
        LossChoice::Custom(loss_id) => {
            let loss = s
                .engine
                .custom_loss(owner.0.clone(), model_id.to_string(), loss_id)
                .await??;
            Loss::Custom(CustomLossRef(loss))
        }
    })
}

/// How many input values a request's custom-loss inputs may hold in all.
pub fn values_per_request(limits: &KeyLimits) -> usize {
    limits.tokens_per_request.saturating_mul(VALUES_PER_TARGET)
}

/// Datum `i`'s inputs of `loss`: `logprobs` takes the shape of `target_tokens`
/// (`target_dims`), which must have the declared rank, and every other declared input
/// must be in `loss_fn_inputs` with its declared rank. Each input's declared size is
/// taken from `budget` before it is expanded.
pub fn inputs(
    loss: &CustomLoss,
    d: &Datum,
    target_dims: &[usize],
    i: usize,
    budget: &mut usize,
) -> Result<CustomInputs, ApiError> {
    let bad = |msg: String| ApiError::bad_request(format!("datum {i}: {msg}"));
    let declared = loss.inputs();
    if target_dims.len() != usize::from(declared[0].rank) {
        return Err(bad(format!(
            "target_tokens has rank {}, but custom loss {:?} declared logprobs with rank {}",
            target_dims.len(),
            loss.name(),
            declared[0].rank
        )));
    }
    let mut arrays = Vec::with_capacity(declared.len() - 1);
    for input in &declared[1..] {
        let name = &input.name;
        let t = d.loss_fn_inputs.get(name).ok_or_else(|| {
            bad(format!(
                "loss_fn_inputs[{name:?}] is missing; custom loss {:?} reads it",
                loss.name()
            ))
        })?;
        // Protobuf cannot tell an empty shape from none, so a one-value tensor without
        // a shape is the scalar a rank-0 input declares.
        let dims = match (&t.shape, input.rank) {
            (None, 0) if t.data.len() == 1 => Vec::new(),
            _ => t.dims(),
        };
        if dims.len() != usize::from(input.rank) {
            return Err(bad(format!(
                "loss_fn_inputs[{name:?}] has rank {}, but custom loss {:?} declared rank {}",
                dims.len(),
                loss.name(),
                input.rank
            )));
        }
        checked_shape(&dims).map_err(|e| bad(format!("loss_fn_inputs[{name:?}]: {e}")))?;
        let size = t.num_elements().ok_or_else(|| {
            bad(format!(
                "loss_fn_inputs[{name:?}] has shape {dims:?}, whose size overflows"
            ))
        })?;
        *budget = budget.checked_sub(size).ok_or_else(|| {
            bad(format!(
                "the custom loss's inputs in this request hold more values than the limit \
                 ({VALUES_PER_TARGET} per target of --max-tokens-per-request); split the \
                 request"
            ))
        })?;
        let values = t
            .to_dense()
            .map_err(|e| bad(format!("loss_fn_inputs[{name:?}]: {e}")))?;
        if let Some(v) = values.iter().find(|v| !v.is_finite()) {
            return Err(bad(format!(
                "loss_fn_inputs[{name:?}] contains a non-finite value ({v})"
            )));
        }
        let kind = match t.dtype {
            TensorDtype::Int64 => Kind::Int,
            TensorDtype::Float32 => Kind::Float,
        };
        arrays.push(Array::new(dims, values, kind));
    }
    Ok(CustomInputs {
        logprobs_shape: target_dims.to_vec(),
        inputs: arrays,
    })
}
