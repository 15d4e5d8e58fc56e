//! Finished operations' results as the wire types, in the encoding the client asks for.
//! The results of `forward_backward` and `sample` travel as protobuf whenever the
//! request's `Accept` names `application/x-protobuf` (SDK 0.25 and later accept nothing
//! else for them; 0.22 offers both); everything else, and every other client, gets JSON.

use std::collections::BTreeMap;

use axum::http::header::{ACCEPT, CONTENT_TYPE};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use lathe_sdk::proto;
use lathe_sdk::types::mint::{
    ForwardBackwardReverseKlResponse, InterpolateCheckpointsResponse, ReverseKlItemOutput,
};
use lathe_sdk::types::{
    CheckpointKind, CreateCustomLossResponse, CreateModelResponse, ForwardBackwardOutput,
    LoadWeightsResponse, OptimStepResponse, SampleResponse, SampledSequence,
    SaveWeightsForSamplerResponse, SaveWeightsResponse, StopReason, TensorData,
    UnloadModelResponse,
};

use super::session::with_type;
use super::ApiError;
use crate::sample::{SampleOutput, Stop};
use crate::train::adamw::StepReport;
use crate::train::reverse_kl::KlResult;
use crate::worker::{DatumOutput, ForwardResult, Reply};

/// How a result body is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    /// `application/json`.
    Json,
    /// `application/x-protobuf`, for the results that have a protobuf message.
    Protobuf,
}

impl Encoding {
    /// Protobuf when the request's `Accept` lists `application/x-protobuf`.
    pub fn accepted(headers: &HeaderMap) -> Self {
        // A media range with `q=0` means "not this one".
        let accepts = |range: &str| {
            let mut parts = range.split(';').map(str::trim);
            parts.next() == Some(proto::CONTENT_TYPE)
                && !parts.any(|p| {
                    p.strip_prefix("q=")
                        .and_then(|q| q.parse::<f32>().ok())
                        .is_some_and(|q| q <= 0.0)
                })
        };
        let wants_proto = headers
            .get_all(ACCEPT)
            .iter()
            .any(|v| v.to_str().is_ok_and(|v| v.split(',').any(accepts)));
        if wants_proto {
            Encoding::Protobuf
        } else {
            Encoding::Json
        }
    }
}

/// The HTTP response for a finished operation.
pub fn respond(reply: &Reply, encoding: Encoding) -> Result<Response, ApiError> {
    let proto = encoding == Encoding::Protobuf;
    let encoded = match reply {
        Reply::Forward(f) if proto => proto::encode_forward_backward_output(&forward_output(f)),
        Reply::Sample(s) if proto => proto::encode_sample_response(&sample_response(s)),
        _ => return Ok(json(reply)),
    };
    let body = encoded.map_err(|e| ApiError::internal(format!("encoding the result: {e}")))?;
    Ok(([(CONTENT_TYPE, proto::CONTENT_TYPE)], body).into_response())
}

/// A result as its JSON wire type, serialised straight from the typed struct.
fn json(reply: &Reply) -> Response {
    match reply {
        Reply::ModelCreated { model_id } => Json(CreateModelResponse {
            model_id: model_id.clone(),
        })
        .into_response(),
        Reply::WeightsLoaded { path } => Json(LoadWeightsResponse {
            path: Some(path.clone()),
        })
        .into_response(),
        Reply::Optimized(report) => Json(optim_response(report)).into_response(),
        Reply::Saved {
            kind: CheckpointKind::Training,
            path,
        } => Json(SaveWeightsResponse { path: path.clone() }).into_response(),
        Reply::Saved {
            kind: CheckpointKind::Sampler,
            path,
        } => Json(SaveWeightsForSamplerResponse {
            path: Some(path.clone()),
            sampling_session_id: None,
        })
        .into_response(),
        Reply::SamplerSnapshot {
            sampling_session_id,
        } => Json(SaveWeightsForSamplerResponse {
            path: None,
            sampling_session_id: Some(sampling_session_id.clone()),
        })
        .into_response(),
        Reply::Unloaded { model_id } => Json(UnloadModelResponse {
            model_id: model_id.clone(),
        })
        .into_response(),
        Reply::Forward(f) => Json(forward_output(f)).into_response(),
        Reply::CustomLossCreated { loss_id } => Json(with_type(
            CreateCustomLossResponse {
                loss_id: loss_id.clone(),
            },
            "create_custom_loss",
        ))
        .into_response(),
        Reply::Sample(s) => Json(sample_response(s)).into_response(),
        Reply::ReverseKl(results) => Json(reverse_kl_response(results)).into_response(),
        Reply::Interpolated {
            path,
            source_paths,
            coefficients,
        } => Json(InterpolateCheckpointsResponse {
            path: path.clone(),
            checkpoint_type: "sampler".into(),
            source_paths: source_paths.clone(),
            coefficients: coefficients.clone(),
            has_rank_shards: false,
            kind: "mint_interpolate_checkpoints".into(),
        })
        .into_response(),
    }
}

fn optim_response(r: &StepReport) -> OptimStepResponse {
    let metrics = BTreeMap::from([
        ("grad_norm:mean".to_string(), r.grad_norm),
        (
            "clipped:mean".to_string(),
            if r.clipped { 1.0 } else { 0.0 },
        ),
        ("step:max".to_string(), r.step as f64),
    ]);
    OptimStepResponse {
        metrics: Some(metrics),
    }
}

/// `[n]` for one target per position, `[n, k]` for `k`.
fn float_tensor(values: &[f32], k: usize) -> TensorData {
    let mut t = TensorData::float32(values.to_vec());
    t.shape = Some(if k <= 1 {
        vec![values.len()]
    } else {
        vec![values.len() / k, k]
    });
    t
}

fn forward_output(f: &ForwardResult) -> ForwardBackwardOutput {
    let datum = |d: &DatumOutput| {
        BTreeMap::from([
            ("logprobs".to_string(), float_tensor(&d.logprobs, d.k)),
            (
                "elementwise_loss".to_string(),
                float_tensor(&d.elementwise_loss, d.k),
            ),
        ])
    };
    let mut metrics = BTreeMap::from([("loss:sum".to_string(), f.loss)]);
    if let Some(custom) = &f.custom {
        // As tinker's client-side custom losses report them: `:mean` metrics are means
        // over the datums, and the linearised loss is `surrogate_loss:sum`.
        let datums = f.datums.len().max(1) as f64;
        for (key, sum) in custom.keys.iter().zip(&custom.sums) {
            let value = if key.ends_with(":mean") {
                sum / datums
            } else {
                *sum
            };
            metrics.insert(key.clone(), value);
        }
        metrics.insert("surrogate_loss:sum".into(), custom.surrogate);
    }
    ForwardBackwardOutput {
        loss_fn_output_type: "TorchLossReturn".into(),
        loss_fn_outputs: f.datums.iter().map(datum).collect(),
        metrics,
    }
}

fn sample_response(s: &SampleOutput) -> SampleResponse {
    SampleResponse {
        sequences: s
            .sequences
            .iter()
            .map(|g| SampledSequence {
                stop_reason: match g.stop {
                    Stop::Stop => StopReason::Stop,
                    Stop::Length => StopReason::Length,
                },
                tokens: g.tokens.iter().map(|&t| i64::from(t)).collect(),
                logprobs: Some(g.logprobs.iter().map(|&l| f64::from(l)).collect()),
            })
            .collect(),
        prompt_logprobs: s
            .prompt_logprobs
            .as_ref()
            .map(|p| p.iter().map(|l| l.map(f64::from)).collect()),
        topk_prompt_logprobs: s.topk_prompt_logprobs.as_ref().map(|rows| {
            rows.iter()
                .map(|row| {
                    row.as_ref().map(|alts| {
                        alts.iter()
                            .map(|&(t, l)| (i64::from(t), f64::from(l)))
                            .collect()
                    })
                })
                .collect()
        }),
    }
}

/// MinT's reverse-KL result: each datum's loss, and the batch's metrics (`loss:mean` over
/// datums, `reverse_kl:mean` per unit of weight, without the temperature factor).
fn reverse_kl_response(results: &[KlResult]) -> ForwardBackwardReverseKlResponse {
    let n = results.len().max(1) as f64;
    let weight: f64 = results.iter().map(|r| r.weight).sum();
    let kl: f64 = results.iter().map(|r| r.weighted_kl).sum();
    let metrics = [
        ("loss:mean", results.iter().map(|r| r.loss).sum::<f64>() / n),
        (
            "reverse_kl:mean",
            if weight != 0.0 { kl / weight } else { 0.0 },
        ),
        ("num_samples:sum", results.len() as f64),
        (
            "num_tokens:sum",
            results.iter().map(|r| r.tokens as f64).sum(),
        ),
    ];
    ForwardBackwardReverseKlResponse {
        outputs: results
            .iter()
            .map(|r| ReverseKlItemOutput {
                loss: TensorData::float32(vec![r.loss as f32]),
            })
            .collect(),
        metrics: metrics
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect(),
        kind: "mint_forward_backward_reverse_kl".into(),
    }
}
