//! Request and response bodies of the Tinker endpoints (`tinker-wire.md` §2–§4).
//!
//! Requests carry the `type` discriminator the Python SDK always sends; the server
//! ignores it (absent or not), so these structs keep it as an optional string.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use super::data::{
    AdamParams, Datum, LoraConfig, ModelInput, SampledSequence, SamplingParams, TensorData,
};

/// The answer to every submission: a handle to poll with `retrieve_future`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UntypedApiFuture {
    /// Opaque id for `retrieve_future`.
    pub request_id: String,
    /// The model the request concerns.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_id: Option<String>,
    /// One id per requested sample (`asample` only; asserted by SDK 0.26+).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sample_sequence_ids: Option<Vec<String>>,
}

/// `POST /api/v1/create_model`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CreateModelRequest {
    /// The owning session.
    pub session_id: String,
    /// The client's counter of models in this session; the run id derives from it.
    pub model_seq_id: u64,
    /// The base model name.
    pub base_model: String,
    /// Rank and targets.
    pub lora_config: LoraConfig,
    /// Free-form metadata kept with the run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_metadata: Option<BTreeMap<String, String>>,
}

/// `create_model` result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CreateModelResponse {
    /// The training run id (`<session>:train:<n>`).
    pub model_id: String,
}

/// `unload_model` result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UnloadModelResponse {
    /// The training run unloaded.
    pub model_id: String,
}

/// A request naming one model (`get_info`, `unload_model`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelIdRequest {
    /// The training run.
    pub model_id: String,
}

/// `model_data` inside [`GetInfoResponse`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelData {
    /// Architecture family (`llama`, `qwen2`, `qwen3`).
    pub arch: String,
    /// The base model name.
    pub model_name: String,
    /// Hugging Face tokenizer id, if the client should load one itself.
    #[serde(default)]
    pub tokenizer_id: Option<String>,
}

/// `POST /api/v1/get_info` answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GetInfoResponse {
    /// The training run.
    pub model_id: String,
    /// Always true: Lathe trains LoRA adapters.
    pub is_lora: bool,
    /// Adapter rank.
    pub lora_rank: usize,
    /// The base model name.
    pub model_name: String,
    /// Details about the base model.
    pub model_data: ModelData,
}

/// The batch and loss of a `forward` or `forward_backward`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ForwardBackwardInput {
    /// The datums.
    pub data: Vec<Datum>,
    /// Loss name (`cross_entropy`, `importance_sampling`, `ppo`, `cispo`, `dro`); kept as a
    /// string so an unknown name gets a clear error rather than a decode failure.
    pub loss_fn: String,
    /// Loss settings: numbers (`clip_low_threshold`, `clip_high_threshold`, `beta`) and,
    /// for `loss_fn: "custom"`, the text `loss_id`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_fn_config: Option<BTreeMap<String, LossConfigValue>>,
}

/// One loss setting: a number, or text (tinker 0.38's `loss_id` of a custom loss).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum LossConfigValue {
    /// A numeric setting.
    Number(f64),
    /// A text setting.
    Text(String),
}

impl From<f64> for LossConfigValue {
    fn from(v: f64) -> Self {
        LossConfigValue::Number(v)
    }
}

/// `POST /api/v1/forward_backward`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ForwardBackwardRequest {
    /// Batch and loss.
    pub forward_backward_input: ForwardBackwardInput,
    /// The training run.
    pub model_id: String,
    /// Position in the run's operation order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq_id: Option<u64>,
}

/// `POST /api/v1/forward` (no gradient).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ForwardRequest {
    /// Batch and loss.
    pub forward_input: ForwardBackwardInput,
    /// The training run.
    pub model_id: String,
    /// Position in the run's operation order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq_id: Option<u64>,
}

/// Result of `forward` / `forward_backward`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ForwardBackwardOutput {
    /// Always `TorchLossReturn` (the SDK keeps the text after the last `:`).
    pub loss_fn_output_type: String,
    /// One map per datum: `logprobs` and `elementwise_loss`.
    pub loss_fn_outputs: Vec<BTreeMap<String, TensorData>>,
    /// `name:reduction` keys, e.g. `loss:sum`.
    pub metrics: BTreeMap<String, f64>,
}

impl ForwardBackwardOutput {
    /// `loss:sum`, the batch's total loss.
    pub fn loss(&self) -> Option<f64> {
        self.metrics.get("loss:sum").copied()
    }

    /// Target log-probabilities of datum `i`, flattened.
    pub fn logprobs(&self, i: usize) -> Option<Vec<f32>> {
        self.tensor(i, "logprobs")
    }

    /// Per-token loss terms of datum `i`, flattened.
    pub fn elementwise_loss(&self, i: usize) -> Option<Vec<f32>> {
        self.tensor(i, "elementwise_loss")
    }

    fn tensor(&self, i: usize, name: &str) -> Option<Vec<f32>> {
        let t = self.loss_fn_outputs.get(i)?.get(name)?;
        Some(t.to_dense().ok()?.into_iter().map(|v| v as f32).collect())
    }
}

/// `POST /api/v1/optim_step`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OptimStepRequest {
    /// AdamW hyper-parameters for this step.
    pub adam_params: AdamParams,
    /// The training run.
    pub model_id: String,
    /// Position in the run's operation order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq_id: Option<u64>,
}

/// `optim_step` result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OptimStepResponse {
    /// `grad_norm:mean` (before clipping) and friends.
    #[serde(default)]
    pub metrics: Option<BTreeMap<String, f64>>,
}

/// `POST /api/v1/save_weights` (training state: adapter and optimizer).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SaveWeightsRequest {
    /// The training run.
    pub model_id: String,
    /// The checkpoint name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// Position in the run's operation order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq_id: Option<u64>,
    /// Replace an existing checkpoint of the same name.
    #[serde(default)]
    pub overwrite: bool,
    /// Delete the checkpoint after this many seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_seconds: Option<u64>,
}

impl OptimStepResponse {
    /// The gradient norm before clipping, if the server reported it.
    pub fn grad_norm(&self) -> Option<f64> {
        self.metrics.as_ref()?.get("grad_norm:mean").copied()
    }
}

/// `save_weights` result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SaveWeightsResponse {
    /// `tinker://<run>/weights/<name>`.
    pub path: String,
}

/// `POST /api/v1/load_weights`: into an existing run (`model_id`), or, for SDK 0.38's
/// create-via-load, into a new run named from `session_id` and `model_seq_id`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoadWeightsRequest {
    /// The run to load into.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_id: Option<String>,
    /// `tinker://<run>/weights/<name>`.
    pub path: String,
    /// Also restore the optimizer state.
    #[serde(default)]
    pub optimizer: bool,
    /// Position in the run's operation order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq_id: Option<u64>,
    /// Create-via-load: the owning session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
    /// Create-via-load: the client's model counter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_seq_id: Option<u64>,
}

/// `load_weights` result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoadWeightsResponse {
    /// The URI loaded.
    #[serde(default)]
    pub path: Option<String>,
}

/// `POST /api/v1/save_weights_for_sampler`: with `path`, a named sampler checkpoint;
/// without, an in-memory snapshot and a sampling session on it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SaveWeightsForSamplerRequest {
    /// The training run.
    pub model_id: String,
    /// The checkpoint name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// Position in the run's operation order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq_id: Option<u64>,
    /// The client's sampling-session counter (snapshot form).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sampling_session_seq_id: Option<u64>,
    /// Delete the checkpoint after this many seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_seconds: Option<u64>,
}

/// `save_weights_for_sampler` result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SaveWeightsForSamplerResponse {
    /// `tinker://<run>/sampler_weights/<name>` for a named checkpoint.
    #[serde(default)]
    pub path: Option<String>,
    /// The sampling session on the snapshot, when no name was given.
    #[serde(default)]
    pub sampling_session_id: Option<String>,
}

/// `POST /api/v1/create_sampling_session`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CreateSamplingSessionRequest {
    /// The owning session.
    pub session_id: String,
    /// The client's sampling-session counter.
    pub sampling_session_seq_id: u64,
    /// Sample the base model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_model: Option<String>,
    /// Sample a saved adapter (`tinker://...`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_path: Option<String>,
}

/// `create_sampling_session` answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CreateSamplingSessionResponse {
    /// `<session>:sample:<n>`.
    pub sampling_session_id: String,
}

/// `POST /api/v1/asample`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SampleRequest {
    /// How many independent samples.
    #[serde(default = "one_sample")]
    pub num_samples: usize,
    /// The prompt.
    pub prompt: ModelInput,
    /// How to sample.
    #[serde(default)]
    pub sampling_params: SamplingParams,
    /// The sampling session (or give `base_model` / `model_path` directly).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sampling_session_id: Option<String>,
    /// Sample the base model without a session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_model: Option<String>,
    /// Sample a saved adapter without a session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_path: Option<String>,
    /// The client's request counter (sampling needs no ordering).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq_id: Option<u64>,
    /// Also return the log-probability of every prompt token.
    #[serde(default)]
    pub prompt_logprobs: bool,
    /// Top-k alternatives per prompt position.
    #[serde(default)]
    pub topk_prompt_logprobs: usize,
    /// SDK 0.38: top-k alternatives per sampled position (Lathe refuses a non-zero value).
    #[serde(default)]
    pub topk_sample_logprobs: usize,
    /// SDK 0.38: `k` draws per prompt position (Lathe refuses a non-zero value).
    #[serde(default)]
    pub prompt_alt_tokens_k: usize,
    /// SDK 0.38: log-probabilities of given tokens at prompt positions (Lathe refuses it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_prompt_logprobs: Option<TensorData>,
    /// SDK 0.38: score only the last `n` prompt tokens (Lathe refuses it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs_last_n: Option<u64>,
    /// SDK 0.38: record what StableReinforce training needs (Lathe refuses `true`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub record_stability_info: Option<bool>,
}

fn one_sample() -> usize {
    1
}

impl SampleRequest {
    /// A request for `num_samples` samples of `prompt`, with no sampler named yet and
    /// none of the optional extras.
    pub fn new(prompt: ModelInput, sampling_params: SamplingParams, num_samples: usize) -> Self {
        Self {
            num_samples,
            prompt,
            sampling_params,
            sampling_session_id: None,
            base_model: None,
            model_path: None,
            seq_id: None,
            prompt_logprobs: false,
            topk_prompt_logprobs: 0,
            topk_sample_logprobs: 0,
            prompt_alt_tokens_k: 0,
            target_prompt_logprobs: None,
            prompt_logprobs_last_n: None,
            record_stability_info: None,
        }
    }
}

/// One `(token id, logprob)` alternative of a prompt position.
pub type TopkEntry = (i64, f64);

/// `asample` result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SampleResponse {
    /// `num_samples` sequences.
    pub sequences: Vec<SampledSequence>,
    /// Per prompt token (first `None`), when requested.
    #[serde(default)]
    pub prompt_logprobs: Option<Vec<Option<f64>>>,
    /// Per prompt position (first `None`), the requested number of most likely tokens,
    /// when `topk_prompt_logprobs` > 0.
    #[serde(default)]
    pub topk_prompt_logprobs: Option<Vec<Option<Vec<TopkEntry>>>>,
}

/// `POST /api/v1/retrieve_future`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RetrieveFutureRequest {
    /// From the submission.
    pub request_id: String,
    /// The SDK may accept a metadata-only answer (Lathe always sends the result).
    #[serde(default)]
    pub allow_metadata_only: bool,
}

/// `POST /api/v1/cancel_future` (SDK 0.38, when `sample_cancel_enabled`): the client gave
/// up on a sampling request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CancelFutureRequest {
    /// From the submission.
    pub request_id: String,
}

/// `retrieve_future` answer while the work is still queued or running.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TryAgainResponse {
    /// Always `try_again`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The request polled.
    pub request_id: String,
    /// `active`, `paused_capacity` or `paused_rate_limit`.
    pub queue_state: String,
}

/// `retrieve_future` answer for a request that failed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestFailedResponse {
    /// What went wrong.
    pub error: String,
    /// `user` (bad input), `server` or `unknown`.
    pub category: String,
}

/// `POST /api/v1/weights_info`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WeightsInfoRequest {
    /// `tinker://...`.
    pub tinker_path: String,
}

/// `weights_info` answer: what a checkpoint was trained as.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WeightsInfoResponse {
    /// Its base model.
    pub base_model: String,
    /// Always true.
    pub is_lora: bool,
    /// Adapter rank.
    pub lora_rank: usize,
    /// Whether lm_head is adapted.
    pub train_unembed: bool,
    /// Whether the MLP is adapted.
    pub train_mlp: bool,
    /// Whether attention is adapted.
    pub train_attn: bool,
}

/// `GET /api/v1/samplers/{id}` answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GetSamplerResponse {
    /// The sampling session id.
    pub sampler_id: String,
    /// Its base model.
    pub base_model: String,
    /// The checkpoint it samples, if any.
    #[serde(default)]
    pub model_path: Option<String>,
}

/// A checkpoint in REST listings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Checkpoint {
    /// `weights/<name>` or `sampler_weights/<name>`.
    pub checkpoint_id: String,
    /// `training` or `sampler`.
    pub checkpoint_type: String,
    /// When it was saved (RFC 3339).
    pub time: String,
    /// Its URI.
    pub tinker_path: String,
    /// Bytes on disk.
    #[serde(default)]
    pub size_bytes: Option<u64>,
    /// Readable by every key.
    #[serde(default)]
    pub public: bool,
    /// When it will be deleted (RFC 3339), if it has a TTL.
    #[serde(default)]
    pub expires_at: Option<String>,
}

/// A training run in REST listings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainingRun {
    /// `<session>:train:<n>`.
    pub training_run_id: String,
    /// Its base model.
    pub base_model: String,
    /// Who created it.
    pub model_owner: String,
    /// Always true.
    pub is_lora: bool,
    /// Never set by Lathe.
    #[serde(default)]
    pub corrupted: bool,
    /// Adapter rank.
    #[serde(default)]
    pub lora_rank: Option<usize>,
    /// Last time an operation touched it (RFC 3339).
    pub last_request_time: String,
    /// Its newest training checkpoint.
    #[serde(default)]
    pub last_checkpoint: Option<Checkpoint>,
    /// Its newest sampler checkpoint.
    #[serde(default)]
    pub last_sampler_checkpoint: Option<Checkpoint>,
    /// Metadata given at creation.
    #[serde(default)]
    pub user_metadata: Option<BTreeMap<String, String>>,
}

/// Pagination of a listing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Cursor {
    /// Index of the first item returned.
    pub offset: usize,
    /// Most items returned.
    pub limit: usize,
    /// Items in the whole listing.
    pub total_count: usize,
}

/// `GET /api/v1/training_runs` answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainingRunsResponse {
    /// This page.
    pub training_runs: Vec<TrainingRun>,
    /// Where it sits in the whole listing.
    pub cursor: Cursor,
}

/// Checkpoint listing answer (per run: no cursor; per user: with cursor).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointsListResponse {
    /// This page.
    pub checkpoints: Vec<Checkpoint>,
    /// Where it sits in the whole listing.
    #[serde(default)]
    pub cursor: Option<Cursor>,
}

/// `PUT .../checkpoints/{id}/ttl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SetTtlRequest {
    /// Seconds from now; `None` keeps the checkpoint forever.
    #[serde(default)]
    pub ttl_seconds: Option<u64>,
}

/// `GET /api/v1/lathe/tokenizer` answer (a Lathe extension): enough to encode prompts
/// and render chats without a model hub.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenizerResponse {
    /// The base model.
    pub base_model: String,
    /// Hugging Face `tokenizer.json`, as a JSON value.
    pub tokenizer: serde_json::Value,
    /// The model's chat template (Jinja), if it has one.
    #[serde(default)]
    pub chat_template: Option<String>,
    /// The end-of-sequence token, as text.
    #[serde(default)]
    pub eos_token: Option<String>,
    /// The beginning-of-sequence token, as text.
    #[serde(default)]
    pub bos_token: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A metric reads back as the very f64 the server wrote: JSON numbers parse correctly
    /// rounded (serde_json's `float_roundtrip`; its default parser can land one ulp off,
    /// as it did on this loss).
    #[test]
    fn metrics_parse_to_the_bits_the_server_wrote() {
        let loss = f64::from_bits(0x4079_778c_2200_0000);
        let body = serde_json::json!({
            "loss_fn_output_type": "TorchLossReturn",
            "loss_fn_outputs": [],
            "metrics": {"loss:sum": loss},
        });
        let text = serde_json::to_string(&body).unwrap();
        assert!(text.contains("407.47171211242676"), "{text}");
        let back: ForwardBackwardOutput = serde_json::from_str(&text).unwrap();
        assert_eq!(back.loss().map(f64::to_bits), Some(loss.to_bits()));
    }

    #[test]
    fn forward_backward_request_parses_the_observed_body() {
        let body = r#"{"forward_backward_input": {
            "data": [{"loss_fn_inputs": {
                "target_tokens": {"data": [3974, 13876], "dtype": "int64", "shape": [2]},
                "weights": {"data": [1.0, 1.0], "dtype": "float32", "shape": [2]}},
              "model_input": {"chunks": [{"tokens": [785, 3974], "type": "encoded_text"}]}}],
            "loss_fn": "cross_entropy"},
          "model_id": "sess-1:train:0", "seq_id": 1, "some_future_field": 3}"#;
        let req: ForwardBackwardRequest = serde_json::from_str(body).unwrap();
        assert_eq!(req.seq_id, Some(1));
        assert_eq!(req.forward_backward_input.loss_fn, "cross_entropy");
        assert_eq!(req.forward_backward_input.data.len(), 1);
    }

    #[test]
    fn sample_request_defaults_like_the_python_sdk() {
        let req: SampleRequest =
            serde_json::from_str(r#"{"prompt": {"chunks": []}, "sampling_session_id": "s"}"#)
                .unwrap();
        assert_eq!(req.num_samples, 1);
        assert_eq!(req.sampling_params.temperature, 1.0);
        assert!(!req.prompt_logprobs);
    }
}
