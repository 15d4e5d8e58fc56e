//! [`TrainingClient`]: one LoRA adapter being trained.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use reqwest::Method;
use serde::Serialize;
use serde_json::Value;

use super::error::{Error, Result};
use super::future::{decode, poll, single, ApiFuture};
use super::http::Payload;
use super::sampling::SamplingClient;
use super::service::ServiceClient;
use super::tokenizer::Tokenizer;
use crate::types::{
    validate_checkpoint_name, AdamParams, CheckpointUri, Datum, ForwardBackwardInput,
    ForwardBackwardOutput, ForwardBackwardRequest, ForwardRequest, GetInfoResponse,
    LoadWeightsRequest, LossConfigValue, LossFn, ModelIdRequest, OptimStepRequest,
    OptimStepResponse, SaveWeightsForSamplerRequest, SaveWeightsRequest, UntypedApiFuture,
};

/// Loss settings: `clip_low_threshold`, `clip_high_threshold` (ppo, cispo), `beta` (dro).
pub type LossFnConfig = BTreeMap<String, f64>;

/// Most datums per request (as the Python SDK).
pub const MAX_CHUNK_DATUMS: usize = 1024;
/// Most estimated JSON bytes per request (as the Python SDK).
pub const MAX_CHUNK_BYTES: usize = 5_000_000;

/// A LoRA adapter on the server. Cheap to clone; clones share the operation counter, so
/// operations from every clone run in the order they were submitted.
#[derive(Clone, Debug)]
pub struct TrainingClient {
    pub(crate) service: ServiceClient,
    model_id: String,
    seq: Arc<AtomicU64>,
}

/// Checks datums before sending: what the server would reject anyway, caught early with
/// the datum's index.
pub fn validate_data(data: &[Datum]) -> Result<()> {
    if data.is_empty() {
        return Err(Error::InvalidInput("data is empty".into()));
    }
    for (i, d) in data.iter().enumerate() {
        let n = d.model_input.length();
        if n == 0 {
            return Err(Error::InvalidInput(format!("datum {i}: empty model_input")));
        }
        let targets = d.loss_fn_inputs.get("target_tokens").ok_or_else(|| {
            Error::InvalidInput(format!(
                "datum {i}: loss_fn_inputs.target_tokens is missing"
            ))
        })?;
        let dims = targets.dims();
        if dims.first() != Some(&n) {
            return Err(Error::InvalidInput(format!(
                "datum {i}: target_tokens has shape {dims:?} but model_input has {n} tokens"
            )));
        }
        let count: usize = dims.iter().product();
        for (name, t) in &d.loss_fn_inputs {
            let values = t
                .to_dense()
                .map_err(|e| Error::InvalidInput(format!("datum {i}: {name}: {e}")))?;
            if name != "target_tokens" && values.len() != count && values.len() != n {
                return Err(Error::InvalidInput(format!(
                    "datum {i}: {name} has {} values but target_tokens has {count}",
                    values.len()
                )));
            }
            if let Some(v) = values.iter().find(|v| !v.is_finite()) {
                return Err(Error::InvalidInput(format!(
                    "datum {i}: {name} contains a non-finite value ({v})"
                )));
            }
        }
    }
    Ok(())
}

/// Splits data into chunks of at most [`MAX_CHUNK_DATUMS`] datums and about
/// [`MAX_CHUNK_BYTES`] bytes.
fn chunks(data: &[Datum]) -> Vec<&[Datum]> {
    let size = |d: &Datum| -> usize {
        d.model_input.length().saturating_mul(8)
            + d.loss_fn_inputs
                .values()
                .map(|t| t.data.len() * 12)
                .sum::<usize>()
    };
    let mut out = Vec::new();
    let mut start = 0;
    let mut bytes = 0;
    for (i, d) in data.iter().enumerate() {
        let s = size(d);
        if i > start && (i - start >= MAX_CHUNK_DATUMS || bytes + s > MAX_CHUNK_BYTES) {
            out.push(&data[start..i]);
            start = i;
            bytes = 0;
        }
        bytes += s;
    }
    out.push(&data[start..]);
    out
}

/// Merges the outputs of a split request as the Python SDK does: outputs concatenated;
/// metrics reduced by their suffix (`sum`, `mean` weighted by datums, `min`, `max`);
/// other suffixes dropped.
pub fn merge_outputs(parts: Vec<ForwardBackwardOutput>) -> ForwardBackwardOutput {
    if parts.len() == 1 {
        return parts.into_iter().next().expect("one part");
    }
    let total: usize = parts.iter().map(|p| p.loss_fn_outputs.len()).sum();
    let mut metrics: BTreeMap<String, f64> = BTreeMap::new();
    for p in &parts {
        let weight = p.loss_fn_outputs.len() as f64 / total.max(1) as f64;
        for (k, &v) in &p.metrics {
            let reduction = k.rsplit(':').next().unwrap_or("");
            let entry = metrics.entry(k.clone());
            match reduction {
                "sum" => *entry.or_insert(0.0) += v,
                "mean" => *entry.or_insert(0.0) += v * weight,
                "min" => {
                    let e = entry.or_insert(f64::INFINITY);
                    *e = e.min(v);
                }
                "max" => {
                    let e = entry.or_insert(f64::NEG_INFINITY);
                    *e = e.max(v);
                }
                _ => {}
            }
        }
    }
    let loss_fn_output_type = parts[0].loss_fn_output_type.clone();
    ForwardBackwardOutput {
        loss_fn_output_type,
        loss_fn_outputs: parts.into_iter().flat_map(|p| p.loss_fn_outputs).collect(),
        metrics,
    }
}

impl TrainingClient {
    pub(crate) fn new(service: ServiceClient, model_id: String) -> Self {
        Self {
            service,
            model_id,
            seq: Arc::new(AtomicU64::new(0)),
        }
    }

    /// The training run id (`<session>:train:<n>`).
    pub fn model_id(&self) -> &str {
        &self.model_id
    }

    fn next_seq(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// Submits the typed request `build` makes from this run's id and its next
    /// `seq_id`; answers the request id.
    async fn submit<R: Serialize>(
        &self,
        path: &str,
        kind: &'static str,
        build: impl FnOnce(String, Option<u64>) -> R,
    ) -> Result<String> {
        let request = build(self.model_id.clone(), Some(self.next_seq()));
        let fut: UntypedApiFuture = self
            .service
            .transport()
            .send(Method::POST, path, &request, Some(kind))
            .await
            .and_then(decode)?;
        Ok(fut.request_id)
    }

    /// A built-in loss's name and numeric settings as the wire has them.
    fn builtin(
        loss_fn: LossFn,
        config: Option<LossFnConfig>,
    ) -> (&'static str, Option<BTreeMap<String, LossConfigValue>>) {
        let config = config.map(|c| {
            c.into_iter()
                .map(|(k, v)| (k, LossConfigValue::Number(v)))
                .collect()
        });
        (loss_fn.as_str(), config)
    }

    pub(crate) async fn forward_like(
        &self,
        with_grad: bool,
        data: &[Datum],
        loss_fn: &str,
        config: Option<BTreeMap<String, LossConfigValue>>,
    ) -> Result<ApiFuture<ForwardBackwardOutput>> {
        validate_data(data)?;
        let mut ids = Vec::new();
        for chunk in chunks(data) {
            let input = ForwardBackwardInput {
                data: chunk.to_vec(),
                loss_fn: loss_fn.to_string(),
                loss_fn_config: config.clone(),
            };
            ids.push(self.submit_forward(input, with_grad).await?);
        }
        Ok(ApiFuture::with_protobuf(
            self.service.transport().clone(),
            ids,
            |bodies| {
                let parts = bodies
                    .into_iter()
                    .map(|b| b.forward_output())
                    .collect::<Result<Vec<_>>>()?;
                Ok(merge_outputs(parts))
            },
        ))
    }

    /// Submits one chunk: as protobuf (what tinker 0.25+ sends; far smaller and cheaper
    /// than JSON float arrays), or as JSON to a server that answers protobuf with 415.
    async fn submit_forward(&self, input: ForwardBackwardInput, with_grad: bool) -> Result<String> {
        let transport = self.service.transport();
        let seq_id = Some(self.next_seq());
        let request = ForwardBackwardRequest {
            forward_backward_input: input,
            model_id: self.model_id.clone(),
            seq_id,
        };
        // A request protobuf cannot carry (image chunks, ids past int32) goes as JSON with
        // the same seq_id, so the server still hears of it and the run does not wait.
        let encoded = transport
            .protobuf
            .load(Ordering::Relaxed)
            .then(|| crate::proto::encode_forward_backward(&request, !with_grad).ok())
            .flatten();
        if let Some(encoded) = encoded {
            let payload = Payload::Bytes {
                content_type: crate::proto::CONTENT_TYPE,
                data: encoded.into(),
            };
            let timeout = transport.config.request_timeout;
            match transport
                .execute_raw(
                    Method::POST,
                    "/api/v1/forward_backward",
                    &payload,
                    None,
                    timeout,
                )
                .await
            {
                Err(Error::Api { status: 415, .. }) => {
                    tracing::info!("the server does not take protobuf; sending JSON from now on");
                    transport.protobuf.store(false, Ordering::Relaxed);
                }
                other => return Ok(other?.json::<UntypedApiFuture>()?.request_id),
            }
        }
        // The JSON wire: the same typed request (the seq_id was not consumed by a 415).
        let (path, body) = if with_grad {
            ("/api/v1/forward_backward", serde_json::to_value(&request))
        } else {
            let ForwardBackwardRequest {
                forward_backward_input,
                model_id,
                seq_id,
            } = request;
            let forward = ForwardRequest {
                forward_input: forward_backward_input,
                model_id,
                seq_id,
            };
            ("/api/v1/forward", serde_json::to_value(&forward))
        };
        // Only an int64 tensor holding a fraction fails to serialise.
        let body = body.map_err(|e| Error::InvalidInput(e.to_string()))?;
        let fut: UntypedApiFuture = transport
            .execute(Method::POST, path, Some(&body))
            .await
            .and_then(decode)?;
        Ok(fut.request_id)
    }

    /// Losses and per-token log-probabilities, without a gradient.
    pub async fn forward(
        &self,
        data: &[Datum],
        loss_fn: LossFn,
        config: Option<LossFnConfig>,
    ) -> Result<ApiFuture<ForwardBackwardOutput>> {
        let (loss_fn, config) = Self::builtin(loss_fn, config);
        self.forward_like(false, data, loss_fn, config).await
    }

    /// Losses and log-probabilities, and the gradient added to the adapter's accumulated
    /// gradient (applied by the next [`optim_step`](Self::optim_step)). Losses are sums
    /// over tokens, as in Tinker. Batches over the server's limits are split and merged.
    pub async fn forward_backward(
        &self,
        data: &[Datum],
        loss_fn: LossFn,
        config: Option<LossFnConfig>,
    ) -> Result<ApiFuture<ForwardBackwardOutput>> {
        let (loss_fn, config) = Self::builtin(loss_fn, config);
        self.forward_like(true, data, loss_fn, config).await
    }

    /// One AdamW step on the accumulated gradient, which is then cleared.
    pub async fn optim_step(&self, params: AdamParams) -> Result<ApiFuture<OptimStepResponse>> {
        let all = [
            params.learning_rate,
            params.beta1,
            params.beta2,
            params.eps,
            params.weight_decay,
            params.grad_clip_norm,
        ];
        if all.iter().any(|v| !v.is_finite() || *v < 0.0) {
            return Err(Error::InvalidInput(format!(
                "AdamParams must be finite and non-negative: {params:?}"
            )));
        }
        let id = self
            .submit("/api/v1/optim_step", "optim_step", |model_id, seq_id| {
                OptimStepRequest {
                    adam_params: params,
                    model_id,
                    seq_id,
                }
            })
            .await?;
        Ok(ApiFuture::new(
            self.service.transport().clone(),
            vec![id],
            single,
        ))
    }

    fn uri_future(&self, id: String) -> ApiFuture<CheckpointUri> {
        ApiFuture::new(self.service.transport().clone(), vec![id], |values| {
            let v = values.into_iter().next().unwrap_or(Value::Null);
            let path = v["path"]
                .as_str()
                .ok_or_else(|| Error::decode("no path", &v.to_string()))?;
            path.parse()
                .map_err(|e: String| Error::decode(e, &v.to_string()))
        })
    }

    /// Saves adapter and optimizer state as `tinker://<run>/weights/<name>`.
    pub async fn save_state(&self, name: &str) -> Result<ApiFuture<CheckpointUri>> {
        validate_checkpoint_name(name).map_err(Error::InvalidInput)?;
        let id = self
            .submit(
                "/api/v1/save_weights",
                "save_weights",
                |model_id, seq_id| SaveWeightsRequest {
                    model_id,
                    path: Some(name.to_string()),
                    seq_id,
                    overwrite: false,
                    ttl_seconds: None,
                },
            )
            .await?;
        Ok(self.uri_future(id))
    }

    /// Saves the adapter for sampling as `tinker://<run>/sampler_weights/<name>`.
    pub async fn save_weights_for_sampler(&self, name: &str) -> Result<ApiFuture<CheckpointUri>> {
        validate_checkpoint_name(name).map_err(Error::InvalidInput)?;
        let id = self
            .submit(
                "/api/v1/save_weights_for_sampler",
                "save_weights_for_sampler",
                |model_id, seq_id| SaveWeightsForSamplerRequest {
                    model_id,
                    path: Some(name.to_string()),
                    seq_id,
                    sampling_session_seq_id: None,
                    ttl_seconds: None,
                },
            )
            .await?;
        Ok(self.uri_future(id))
    }

    async fn load(&self, uri: &CheckpointUri, optimizer: bool) -> Result<ApiFuture<()>> {
        let id = self
            .submit(
                "/api/v1/load_weights",
                "load_weights",
                |model_id, seq_id| LoadWeightsRequest {
                    model_id: Some(model_id),
                    path: uri.to_string(),
                    optimizer,
                    seq_id,
                    session_id: None,
                    model_seq_id: None,
                },
            )
            .await?;
        Ok(ApiFuture::new(
            self.service.transport().clone(),
            vec![id],
            |_| Ok(()),
        ))
    }

    /// Replaces the adapter's weights with a checkpoint's (optimizer state reset).
    pub async fn load_state(&self, uri: &CheckpointUri) -> Result<ApiFuture<()>> {
        self.load(uri, false).await
    }

    /// Replaces weights and optimizer state with a checkpoint's.
    pub async fn load_state_with_optimizer(&self, uri: &CheckpointUri) -> Result<ApiFuture<()>> {
        self.load(uri, true).await
    }

    /// Snapshots the current weights in server memory (no disk write, no copy of the base
    /// model) and returns a sampling client on them.
    pub async fn save_weights_and_get_sampling_client(&self) -> Result<SamplingClient> {
        let seq = self.service.next_sampling_seq();
        let id = self
            .submit(
                "/api/v1/save_weights_for_sampler",
                "save_weights_for_sampler",
                |model_id, seq_id| SaveWeightsForSamplerRequest {
                    model_id,
                    path: None,
                    seq_id,
                    sampling_session_seq_id: Some(seq),
                    ttl_seconds: None,
                },
            )
            .await?;
        let v = poll(self.service.transport(), &id).await?;
        let sampler = v["sampling_session_id"]
            .as_str()
            .ok_or_else(|| Error::decode("no sampling_session_id", &v.to_string()))?;
        Ok(SamplingClient::new(
            self.service.clone(),
            sampler.to_string(),
            None,
        ))
    }

    /// Rank and base model of this run.
    pub async fn get_info(&self) -> Result<GetInfoResponse> {
        self.service
            .transport()
            .send(
                Method::POST,
                "/api/v1/get_info",
                &ModelIdRequest {
                    model_id: self.model_id.clone(),
                },
                Some("get_info"),
            )
            .await
            .and_then(decode)
    }

    /// The base model's tokenizer and chat template.
    pub async fn get_tokenizer(&self) -> Result<Tokenizer> {
        let info = self.get_info().await?;
        self.service.get_tokenizer(&info.model_name).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{ModelInput, TensorData};

    #[test]
    fn client_side_checks_catch_bad_datums() {
        let ok = Datum::cross_entropy(
            ModelInput::from_ints(vec![1, 2]),
            vec![2, 3],
            vec![1.0, 1.0],
        );
        assert!(validate_data(std::slice::from_ref(&ok)).is_ok());
        assert!(validate_data(&[]).is_err());
        let mut short = ok.clone();
        short
            .loss_fn_inputs
            .insert("target_tokens".into(), TensorData::int64(vec![2]));
        assert!(validate_data(&[short]).is_err());
        let mut nan = ok.clone();
        nan.loss_fn_inputs
            .insert("weights".into(), TensorData::float32(vec![1.0, f32::NAN]));
        assert!(
            matches!(validate_data(&[nan]), Err(Error::InvalidInput(m)) if m.contains("non-finite"))
        );
    }

    #[test]
    fn big_batches_split_and_merge_like_the_python_sdk() {
        let d = Datum::cross_entropy(
            ModelInput::from_ints(vec![1, 2]),
            vec![2, 3],
            vec![1.0, 1.0],
        );
        let data = vec![d; 2500];
        let parts = chunks(&data);
        assert_eq!(
            parts.iter().map(|p| p.len()).collect::<Vec<_>>(),
            [1024, 1024, 452]
        );
        let out = |n: usize, loss: f64, mean: f64| ForwardBackwardOutput {
            loss_fn_output_type: "TorchLossReturn".into(),
            loss_fn_outputs: vec![BTreeMap::new(); n],
            metrics: [
                ("loss:sum".to_string(), loss),
                ("x:mean".to_string(), mean),
                ("y:max".to_string(), loss),
                ("z:weird".to_string(), 1.0),
            ]
            .into(),
        };
        let merged = merge_outputs(vec![out(1, 2.0, 1.0), out(3, 5.0, 3.0)]);
        assert_eq!(merged.loss_fn_outputs.len(), 4);
        assert_eq!(merged.metrics["loss:sum"], 7.0);
        assert_eq!(merged.metrics["x:mean"], 2.5);
        assert_eq!(merged.metrics["y:max"], 5.0);
        assert!(!merged.metrics.contains_key("z:weird"));
    }
}
