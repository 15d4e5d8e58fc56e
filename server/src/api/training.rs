//! Training endpoints. Submissions validate, queue and return a future at once; the
//! model work happens in the worker.

use axum::extract::State;
use axum::{Extension, Json};
use lathe_sdk::types::{
    validate_checkpoint_name, CheckpointKind, CheckpointUri, CreateModelRequest,
    ForwardBackwardRequest, ForwardRequest, LoadWeightsRequest, ModelIdRequest, OptimStepRequest,
    SaveWeightsForSamplerRequest, SaveWeightsRequest, UntypedApiFuture, WeightsInfoRequest,
};
use serde_json::Value;

use super::body::{ForwardBackwardBody, LargeJson};
use super::custom_loss;
use super::session::with_type;
use super::{validate, ApiError, ApiJson, AppState, Owner};
use crate::engine::{NewRun, SaveRequest, Ttl};
use crate::train::adamw;
use crate::worker::{Pass, RunOp};

fn future(request_id: String, model_id: &str) -> Json<UntypedApiFuture> {
    Json(UntypedApiFuture {
        request_id,
        model_id: Some(model_id.to_string()),
        sample_sequence_ids: None,
    })
}

/// Passes an ordered submission's result through; when it was refused for good, tells
/// the engine that its `seq_id` will never come, so the run's later operations do not
/// wait for it. A 429 is not for good: the SDK sends the same `seq_id` again once the
/// key's queue has drained, so that number stays open.
pub(super) async fn ordered<T>(
    (s, owner, model_id, seq): (AppState, Owner, String, Option<u64>),
    result: Result<T, ApiError>,
) -> Result<T, ApiError> {
    let for_good =
        matches!(&result, Err(e) if e.status != axum::http::StatusCode::TOO_MANY_REQUESTS);
    if let (true, Some(seq)) = (for_good, seq) {
        let _ = s.engine.skip_seq(owner.0, model_id, seq).await;
    }
    result
}

pub fn parse_uri(path: &str) -> Result<CheckpointUri, ApiError> {
    path.parse::<CheckpointUri>().map_err(ApiError::bad_request)
}

pub async fn create_model(
    State(s): State<AppState>,
    Extension(owner): Extension<Owner>,
    ApiJson(req): ApiJson<CreateModelRequest>,
) -> Result<Json<UntypedApiFuture>, ApiError> {
    validate::base_model(&s.model, &req.base_model)?;
    let spec = validate::lora_spec(&req.lora_config)?;
    let new = NewRun {
        session_id: req.session_id,
        model_seq_id: req.model_seq_id,
        spec,
        seed: req.lora_config.seed.unwrap_or_else(rand::random),
        user_metadata: validate::run_metadata(req.user_metadata)?,
    };
    Ok(Json(s.engine.create_model(owner.0, new).await??))
}

pub async fn get_info(
    State(s): State<AppState>,
    Extension(owner): Extension<Owner>,
    ApiJson(req): ApiJson<ModelIdRequest>,
) -> Result<Json<Value>, ApiError> {
    let info = s.engine.get_info(owner.0, req.model_id).await??;
    Ok(Json(with_type(info, "get_info")))
}

async fn submit_forward(
    s: AppState,
    owner: Owner,
    model_id: String,
    seq_id: Option<u64>,
    data: Vec<crate::train::DatumJob>,
    with_grad: bool,
) -> Result<Json<UntypedApiFuture>, ApiError> {
    let op = RunOp::Forward {
        data,
        with_grad,
        pass: Pass::WHOLE,
    };
    let request_id = s
        .engine
        .submit(owner.0, model_id.clone(), seq_id, op)
        .await??;
    Ok(future(request_id, &model_id))
}

/// `forward_backward` as JSON or protobuf; a protobuf `forward_only` request is a
/// `forward`.
pub async fn forward_backward(
    State(s): State<AppState>,
    Extension(owner): Extension<Owner>,
    body: ForwardBackwardBody,
) -> Result<Json<UntypedApiFuture>, ApiError> {
    let req = body.request;
    let order = (s.clone(), owner.clone(), req.model_id.clone(), req.seq_id);
    let with_grad = !body.forward_only;
    ordered(
        order,
        forward_backward_inner(s, owner, req, with_grad).await,
    )
    .await
}

async fn forward_backward_inner(
    s: AppState,
    owner: Owner,
    req: ForwardBackwardRequest,
    with_grad: bool,
) -> Result<Json<UntypedApiFuture>, ApiError> {
    let input = &req.forward_backward_input;
    let choice = validate::loss(&input.loss_fn, input.loss_fn_config.as_ref())?;
    let loss = custom_loss::resolve(&s, &owner, &req.model_id, choice).await?;
    let data = validate::forward_input(&s.model, input, &s.limits, loss)?;
    submit_forward(s, owner, req.model_id, req.seq_id, data, with_grad).await
}

pub async fn forward(
    State(s): State<AppState>,
    Extension(owner): Extension<Owner>,
    LargeJson(req): LargeJson<ForwardRequest>,
) -> Result<Json<UntypedApiFuture>, ApiError> {
    let order = (s.clone(), owner.clone(), req.model_id.clone(), req.seq_id);
    ordered(order, forward_inner(s, owner, req).await).await
}

async fn forward_inner(
    s: AppState,
    owner: Owner,
    req: ForwardRequest,
) -> Result<Json<UntypedApiFuture>, ApiError> {
    let input = &req.forward_input;
    let choice = validate::loss(&input.loss_fn, input.loss_fn_config.as_ref())?;
    let loss = custom_loss::resolve(&s, &owner, &req.model_id, choice).await?;
    let data = validate::forward_input(&s.model, input, &s.limits, loss)?;
    submit_forward(s, owner, req.model_id, req.seq_id, data, false).await
}

pub async fn optim_step(
    State(s): State<AppState>,
    Extension(owner): Extension<Owner>,
    ApiJson(req): ApiJson<OptimStepRequest>,
) -> Result<Json<UntypedApiFuture>, ApiError> {
    let order = (s.clone(), owner.clone(), req.model_id.clone(), req.seq_id);
    ordered(order, optim_step_inner(s, owner, req).await).await
}

async fn optim_step_inner(
    s: AppState,
    owner: Owner,
    req: OptimStepRequest,
) -> Result<Json<UntypedApiFuture>, ApiError> {
    adamw::validate(&req.adam_params)
        .map_err(|e| ApiError::bad_request(format!("adam_params: {e}")))?;
    let op = RunOp::OptimStep(req.adam_params);
    let request_id = s
        .engine
        .submit(owner.0, req.model_id.clone(), req.seq_id, op)
        .await??;
    Ok(future(request_id, &req.model_id))
}

fn checkpoint_name(path: Option<&str>) -> Result<String, ApiError> {
    let name =
        path.ok_or_else(|| ApiError::bad_request("path (the checkpoint name) is required"))?;
    validate_checkpoint_name(name).map_err(ApiError::bad_request)?;
    Ok(name.to_string())
}

pub async fn save_weights(
    State(s): State<AppState>,
    Extension(owner): Extension<Owner>,
    ApiJson(req): ApiJson<SaveWeightsRequest>,
) -> Result<Json<UntypedApiFuture>, ApiError> {
    let order = (s.clone(), owner.clone(), req.model_id.clone(), req.seq_id);
    ordered(order, save_weights_inner(s, owner, req).await).await
}

async fn save_weights_inner(
    s: AppState,
    owner: Owner,
    req: SaveWeightsRequest,
) -> Result<Json<UntypedApiFuture>, ApiError> {
    let save = SaveRequest {
        kind: CheckpointKind::Training,
        name: checkpoint_name(req.path.as_deref())?,
        overwrite: req.overwrite,
        ttl: Ttl::from_wire(req.ttl_seconds)?,
    };
    let request_id = s
        .engine
        .save(owner.0, req.model_id.clone(), req.seq_id, save)
        .await??;
    Ok(future(request_id, &req.model_id))
}

pub async fn save_weights_for_sampler(
    State(s): State<AppState>,
    Extension(owner): Extension<Owner>,
    ApiJson(req): ApiJson<SaveWeightsForSamplerRequest>,
) -> Result<Json<UntypedApiFuture>, ApiError> {
    let order = (s.clone(), owner.clone(), req.model_id.clone(), req.seq_id);
    ordered(order, save_weights_for_sampler_inner(s, owner, req).await).await
}

async fn save_weights_for_sampler_inner(
    s: AppState,
    owner: Owner,
    req: SaveWeightsForSamplerRequest,
) -> Result<Json<UntypedApiFuture>, ApiError> {
    let id = req.model_id.clone();
    let request_id = match req.path.as_deref() {
        Some(name) => {
            let save = SaveRequest {
                kind: CheckpointKind::Sampler,
                name: checkpoint_name(Some(name))?,
                overwrite: true,
                ttl: Ttl::from_wire(req.ttl_seconds)?,
            };
            s.engine.save(owner.0, id, req.seq_id, save).await??
        }
        None => {
            let seq = req.sampling_session_seq_id;
            s.engine
                .snapshot_for_sampler(owner.0, id, req.seq_id, seq)
                .await??
        }
    };
    Ok(future(request_id, &req.model_id))
}

pub async fn load_weights(
    State(s): State<AppState>,
    Extension(owner): Extension<Owner>,
    ApiJson(req): ApiJson<LoadWeightsRequest>,
) -> Result<Json<UntypedApiFuture>, ApiError> {
    let order = (
        s.clone(),
        owner.clone(),
        req.model_id.clone().unwrap_or_default(),
        req.seq_id,
    );
    ordered(order, load_weights_inner(s, owner, req).await).await
}

async fn load_weights_inner(
    s: AppState,
    owner: Owner,
    req: LoadWeightsRequest,
) -> Result<Json<UntypedApiFuture>, ApiError> {
    let uri = parse_uri(&req.path)?;
    match (req.model_id, req.session_id, req.model_seq_id) {
        (Some(model_id), _, _) => {
            let request_id = s
                .engine
                .load(owner.0, model_id.clone(), req.seq_id, uri, req.optimizer)
                .await??;
            Ok(future(request_id, &model_id))
        }
        (None, Some(session), Some(seq)) => Ok(Json(
            s.engine
                .create_from_checkpoint(owner.0, session, seq, uri, req.optimizer)
                .await??,
        )),
        _ => Err(ApiError::bad_request(
            "load_weights needs model_id, or session_id and model_seq_id to create a run",
        )),
    }
}

pub async fn unload_model(
    State(s): State<AppState>,
    Extension(owner): Extension<Owner>,
    ApiJson(req): ApiJson<ModelIdRequest>,
) -> Result<Json<UntypedApiFuture>, ApiError> {
    let request_id = s
        .engine
        .submit(owner.0, req.model_id.clone(), None, RunOp::Unload)
        .await??;
    Ok(future(request_id, &req.model_id))
}

pub async fn weights_info(
    State(s): State<AppState>,
    Extension(owner): Extension<Owner>,
    ApiJson(req): ApiJson<WeightsInfoRequest>,
) -> Result<Json<Value>, ApiError> {
    let uri = parse_uri(&req.tinker_path)?;
    let info = s.engine.weights_info(owner.0, uri).await??;
    Ok(Json(serde_json::to_value(info).expect("serialises")))
}
