//! Parse, don't validate: wire requests become the engine's checked types here, and every
//! way a request can be wrong becomes a 400 with a message naming the field.

use std::collections::BTreeMap;

use lathe_sdk::types::{
    Datum, ForwardBackwardInput, LoraConfig, LossConfigValue, ModelInput, SampleRequest,
    StopCondition, TensorData,
};

use super::custom_loss;
use super::error::ApiError;
use crate::engine::{KeyLimits, ModelInfo};
use crate::model::lora::MAX_RANK;
use crate::model::LoraSpec;
use crate::sample::{Picker, SampleJob, DEFAULT_MAX_TOKENS};
use crate::train::loss::{
    DEFAULT_CISPO_CLIP_HIGH, DEFAULT_CISPO_CLIP_LOW, DEFAULT_CLIP_HIGH, DEFAULT_CLIP_LOW,
    DEFAULT_DRO_BETA, DEFAULT_GSPO_CLIP_HIGH, DEFAULT_GSPO_CLIP_LOW,
};
use crate::train::{DatumJob, Loss, TokenInputs};

/// Most samples one `asample` may ask for.
pub const MAX_NUM_SAMPLES: usize = 64;
/// Most alternatives per prompt position `topk_prompt_logprobs` may ask for.
pub const MAX_TOPK_PROMPT_LOGPROBS: usize = 64;
/// Most targets per position a `[n, k]` `target_tokens` may carry (distillation sends a
/// teacher's top-k): bounds what a sparse target expands to.
pub const MAX_TARGETS_PER_POSITION: usize = 64;

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError::bad_request(msg)
}

/// The LoRA spec of a `create_model`.
pub fn lora_spec(cfg: &LoraConfig) -> Result<LoraSpec, ApiError> {
    let spec = LoraSpec {
        rank: cfg.rank,
        train_attn: cfg.train_attn,
        train_mlp: cfg.train_mlp,
        train_unembed: cfg.train_unembed,
    };
    if spec.rank == 0 || spec.rank > MAX_RANK {
        return Err(bad(format!(
            "lora_config.rank must be between 1 and {MAX_RANK}, got {}",
            spec.rank
        )));
    }
    spec.validate().map_err(|e| bad(e.to_string()))?;
    Ok(spec)
}

/// Most entries of a run's `user_metadata`, which is stored with the run.
pub const MAX_METADATA_ENTRIES: usize = 64;
/// Most bytes (keys and values) of a run's `user_metadata`.
pub const MAX_METADATA_BYTES: usize = 16 * 1024;

/// A run's `user_metadata`, bounded: it is kept in the index for as long as the run is.
pub fn run_metadata(
    meta: Option<BTreeMap<String, String>>,
) -> Result<BTreeMap<String, String>, ApiError> {
    let meta = meta.unwrap_or_default();
    let bytes: usize = meta.iter().map(|(k, v)| k.len() + v.len()).sum();
    if meta.len() > MAX_METADATA_ENTRIES || bytes > MAX_METADATA_BYTES {
        return Err(bad(format!(
            "user_metadata has {} entries and {bytes} bytes; the limits are \
             {MAX_METADATA_ENTRIES} entries and {MAX_METADATA_BYTES} bytes",
            meta.len()
        )));
    }
    Ok(meta)
}

/// Checks that `name` is the served base model.
pub fn base_model(model: &ModelInfo, name: &str) -> Result<(), ApiError> {
    if model.matches(name) {
        Ok(())
    } else {
        Err(bad(format!(
            "unknown base_model {name:?}; this server serves {:?}",
            model.name
        )))
    }
}

/// Token ids of a model input, checked against the vocabulary and context length.
pub fn tokens(model: &ModelInfo, input: &ModelInput, what: &str) -> Result<Vec<u32>, ApiError> {
    let ids = input.to_ints().ok_or_else(|| {
        bad(format!(
            "{what}: only encoded_text chunks are supported (this base model reads no images)"
        ))
    })?;
    if ids.is_empty() {
        return Err(bad(format!("{what} is empty")));
    }
    if ids.len() > model.max_seq_len {
        return Err(bad(format!(
            "{what} has {} tokens; the context limit is {}",
            ids.len(),
            model.max_seq_len
        )));
    }
    to_token_ids(model, ids.into_iter().map(|t| t as f64), what)
}

pub(super) fn to_token_ids(
    model: &ModelInfo,
    values: impl Iterator<Item = f64>,
    what: &str,
) -> Result<Vec<u32>, ApiError> {
    values
        .map(|v| {
            if v.fract() != 0.0 || v < 0.0 || v >= model.vocab_size as f64 {
                Err(bad(format!(
                    "{what}: token id {v} is out of range [0, {})",
                    model.vocab_size
                )))
            } else {
                Ok(v as u32)
            }
        })
        .collect()
}

/// The loss a forward/backward request names: a built-in one, or the id of a custom loss
/// (which the engine resolves, since a custom loss belongs to a session).
#[derive(Debug, Clone, PartialEq)]
pub enum LossChoice {
    /// A built-in loss with its settings.
    Builtin(Loss),
    /// `loss_fn: "custom"` with this `loss_id`.
    Custom(String),
}

/// The loss of a forward/backward request.
pub fn loss(
    name: &str,
    config: Option<&BTreeMap<String, LossConfigValue>>,
) -> Result<LossChoice, ApiError> {
    let empty = BTreeMap::new();
    let config = config.unwrap_or(&empty);
    if name == "custom" {
        return match (config.len(), config.get("loss_id")) {
            (1, Some(LossConfigValue::Text(id))) => Ok(LossChoice::Custom(id.clone())),
            _ => Err(bad(
                "loss_fn \"custom\" takes exactly one setting, the text loss_id that \
                 create_custom_loss answered",
            )),
        };
    }
    let allowed: &[&str] = match name {
        "cross_entropy" | "importance_sampling" => &[],
        "ppo" | "cispo" | "gspo" => &["clip_low_threshold", "clip_high_threshold"],
        "dro" => &["beta"],
        "stable_reinforce" => {
            return Err(bad(
                "stable_reinforce is not supported by this server: it trains on what Tinker's \
                 sampler records per sequence (record_stability_info), which Tinker has not \
                 published; use importance_sampling, ppo, cispo or gspo",
            ))
        }
        other => {
            return Err(bad(format!(
                "unknown loss_fn {other:?}; expected cross_entropy, importance_sampling, ppo, \
                 cispo, gspo, dro or custom"
            )))
        }
    };
    let mut numbers = BTreeMap::new();
    for (k, v) in config {
        if !allowed.contains(&k.as_str()) {
            return Err(bad(format!(
                "loss_fn_config key {k:?} does not apply to {name}"
            )));
        }
        let LossConfigValue::Number(v) = v else {
            return Err(bad(format!("loss_fn_config.{k} must be a number")));
        };
        if !v.is_finite() {
            return Err(bad(format!("loss_fn_config.{k} must be finite, got {v}")));
        }
        numbers.insert(k.as_str(), *v);
    }
    let get = |k: &str, d: f64| numbers.get(k).copied().unwrap_or(d);
    let clip = |(low, high): (f64, f64)| -> Result<(f64, f64), ApiError> {
        let (lo, hi) = (
            get("clip_low_threshold", low),
            get("clip_high_threshold", high),
        );
        if lo < 0.0 || hi < lo {
            return Err(bad(format!(
                "clip thresholds must satisfy 0 <= clip_low_threshold <= clip_high_threshold, got {lo} and {hi}"
            )));
        }
        Ok((lo, hi))
    };
    Ok(LossChoice::Builtin(match name {
        "cross_entropy" => Loss::CrossEntropy,
        "importance_sampling" => Loss::ImportanceSampling,
        "ppo" => {
            let (clip_low, clip_high) = clip((DEFAULT_CLIP_LOW, DEFAULT_CLIP_HIGH))?;
            Loss::Ppo {
                clip_low,
                clip_high,
            }
        }
        "cispo" => {
            let (clip_low, clip_high) = clip((DEFAULT_CISPO_CLIP_LOW, DEFAULT_CISPO_CLIP_HIGH))?;
            Loss::Cispo {
                clip_low,
                clip_high,
            }
        }
        "gspo" => {
            let (clip_low, clip_high) = clip((DEFAULT_GSPO_CLIP_LOW, DEFAULT_GSPO_CLIP_HIGH))?;
            Loss::Gspo {
                clip_low,
                clip_high,
            }
        }
        _ => Loss::Dro {
            beta: get("beta", DEFAULT_DRO_BETA),
        },
    }))
}

/// The dense values of a loss input that must hold exactly `n` values. The declared
/// shape is checked before anything is expanded, so a sparse tensor that claims a huge
/// shape costs nothing.
pub(super) fn dense_values(
    t: &TensorData,
    name: &str,
    n: usize,
    i: usize,
) -> Result<Vec<f64>, ApiError> {
    match t.num_elements() {
        Some(size) if size == n => {}
        Some(size) => {
            return Err(bad(format!(
                "datum {i}: {name} has shape {:?} ({size} values) but target_tokens has {n}",
                t.dims()
            )))
        }
        None => {
            return Err(bad(format!(
                "datum {i}: {name} has shape {:?}, whose size overflows",
                t.dims()
            )))
        }
    }
    t.to_dense()
        .map_err(|e| bad(format!("datum {i}: {name}: {e}")))
}

pub(super) fn floats(t: &TensorData, name: &str, n: usize, i: usize) -> Result<Vec<f32>, ApiError> {
    let dense = dense_values(t, name, n, i)?;
    if let Some(v) = dense.iter().find(|v| !v.is_finite()) {
        return Err(bad(format!(
            "datum {i}: {name} contains a non-finite value ({v})"
        )));
    }
    Ok(dense.into_iter().map(|v| v as f32).collect())
}

/// One datum as a training job (adapter index filled in by the worker).
fn datum(
    model: &ModelInfo,
    d: &Datum,
    i: usize,
    loss: Loss,
    custom_budget: &mut usize,
) -> Result<DatumJob, ApiError> {
    let toks = tokens(model, &d.model_input, &format!("datum {i}: model_input"))?;
    let n = toks.len();
    let targets = d.loss_fn_inputs.get("target_tokens").ok_or_else(|| {
        bad(format!(
            "datum {i}: loss_fn_inputs.target_tokens is required"
        ))
    })?;
    let dims = targets.dims();
    let k = match dims[..] {
        [len] if len == n => 1,
        [len, k] if len == n && (1..=MAX_TARGETS_PER_POSITION).contains(&k) => k,
        [len, k] if len == n && k > MAX_TARGETS_PER_POSITION => {
            return Err(bad(format!(
                "datum {i}: target_tokens has {k} targets per position; the limit is \
                 {MAX_TARGETS_PER_POSITION}"
            )))
        }
        _ => {
            return Err(bad(format!(
                "datum {i}: target_tokens has shape {dims:?} but model_input has {n} tokens"
            )))
        }
    };
    // n <= max_seq_len and k <= MAX_TARGETS_PER_POSITION, so this cannot overflow.
    let m = n * k;
    let dense = dense_values(targets, "target_tokens", m, i)?;
    let target_ids = to_token_ids(
        model,
        dense.into_iter(),
        &format!("datum {i}: target_tokens"),
    )?;
    // Only the inputs the loss reads are expanded (a sparse input costs its declared
    // size, not its bytes); others are ignored, as unknown keys are.
    let get = |name: &str, read: bool| -> Result<Vec<f32>, ApiError> {
        match d.loss_fn_inputs.get(name) {
            Some(t) if read => floats(t, name, m, i),
            _ => Ok(Vec::new()),
        }
    };
    let (rl, clipped) = (
        loss.is_rl(),
        matches!(
            loss,
            Loss::Ppo { .. } | Loss::Cispo { .. } | Loss::Gspo { .. }
        ),
    );
    // A custom loss reads only the inputs it declares.
    let builtin = !matches!(loss, Loss::Custom(_));
    let inputs = TokenInputs {
        weights: get("weights", builtin && !rl)?,
        advantages: get("advantages", rl)?,
        sampler_logprobs: get("logprobs", rl)?,
        clip_low: Some(get("clip_low_threshold", clipped)?).filter(|v| !v.is_empty()),
        clip_high: Some(get("clip_high_threshold", clipped)?).filter(|v| !v.is_empty()),
        sequence_ratio_mask: Some(get(
            "sequence_ratio_mask",
            matches!(loss, Loss::Gspo { .. }),
        )?)
        .filter(|v| !v.is_empty()),
        custom: match &loss {
            Loss::Custom(custom) => {
                Some(custom_loss::inputs(&custom.0, d, &dims, i, custom_budget)?)
            }
            _ => None,
        },
    };
    if loss.is_rl() && k != 1 {
        return Err(bad(format!(
            "datum {i}: RL losses take one target per position, got shape {dims:?}"
        )));
    }
    inputs
        .validate(&loss, m)
        .map_err(|e| bad(format!("datum {i}: {e}")))?;
    Ok(DatumJob {
        tokens: toks,
        targets: target_ids,
        k,
        adapter: 0,
        loss,
        inputs,
    })
}

/// The targets a datum declares (`tokens x k`), read from its lengths and shapes
/// without expanding anything.
fn declared_targets(d: &Datum) -> usize {
    let n: usize = d
        .model_input
        .chunks
        .iter()
        .map(|c| match c {
            lathe_sdk::types::ModelInputChunk::EncodedText { tokens } => tokens.len(),
            _ => 0,
        })
        .fold(0, usize::saturating_add);
    let k = match d.loss_fn_inputs.get("target_tokens").map(|t| t.dims()) {
        Some(dims) if dims.len() == 2 => dims[1],
        _ => 1,
    };
    n.saturating_mul(k)
}

/// The datums of a forward/backward request. `limits.tokens_per_request` bounds its
/// declared targets (`tokens x k` over all datums) before any tensor is expanded, so
/// what a request may make the server allocate is bounded by the operator, whatever
/// its sparse tensors declare.
pub fn forward_input(
    model: &ModelInfo,
    input: &ForwardBackwardInput,
    limits: &KeyLimits,
    loss: Loss,
) -> Result<Vec<DatumJob>, ApiError> {
    if input.data.is_empty() {
        return Err(bad("data is empty: send at least one datum"));
    }
    let declared = input
        .data
        .iter()
        .map(declared_targets)
        .fold(0, usize::saturating_add);
    if declared > limits.tokens_per_request {
        return Err(bad(format!(
            "this request declares {declared} targets (tokens x targets per position); the \
             limit is {} per request (--max-tokens-per-request): split it into several requests",
            limits.tokens_per_request
        )));
    }
    let mut custom_budget = custom_loss::values_per_request(limits);
    input
        .data
        .iter()
        .enumerate()
        .map(|(i, d)| datum(model, d, i, loss.clone(), &mut custom_budget))
        .collect()
}

/// SDK 0.38's newer sampling options, which Lathe does not implement: refused when set,
/// never silently dropped (a client relying on one would get wrong results).
fn unsupported_sample_fields(req: &SampleRequest) -> Result<(), ApiError> {
    let set = [
        ("topk_sample_logprobs", req.topk_sample_logprobs != 0),
        ("prompt_alt_tokens_k", req.prompt_alt_tokens_k != 0),
        (
            "target_prompt_logprobs",
            req.target_prompt_logprobs.is_some(),
        ),
        (
            "prompt_logprobs_last_n",
            req.prompt_logprobs_last_n.is_some(),
        ),
        (
            "record_stability_info",
            req.record_stability_info == Some(true),
        ),
    ];
    match set.iter().find(|(_, on)| *on) {
        Some((name, _)) => Err(bad(format!(
            "{name} is not supported by this server; leave it unset (use prompt_logprobs and \
             topk_prompt_logprobs for prompt scores)"
        ))),
        None => Ok(()),
    }
}

/// A sampling request as a decode job; `limits` bounds its stop strings.
pub fn sample_job(
    model: &ModelInfo,
    req: &SampleRequest,
    limits: &KeyLimits,
) -> Result<SampleJob, ApiError> {
    let prompt = tokens(model, &req.prompt, "prompt")?;
    if req.num_samples == 0 || req.num_samples > MAX_NUM_SAMPLES {
        return Err(bad(format!(
            "num_samples must be between 1 and {MAX_NUM_SAMPLES}, got {}",
            req.num_samples
        )));
    }
    if req.topk_prompt_logprobs > MAX_TOPK_PROMPT_LOGPROBS {
        return Err(bad(format!(
            "topk_prompt_logprobs must be at most {MAX_TOPK_PROMPT_LOGPROBS}, got {}",
            req.topk_prompt_logprobs
        )));
    }
    unsupported_sample_fields(req)?;
    let p = &req.sampling_params;
    let room = model.max_seq_len.saturating_sub(prompt.len());
    let max_tokens = match p.max_tokens {
        Some(0) => return Err(bad("sampling_params.max_tokens must be at least 1")),
        Some(m) if m > room => {
            return Err(bad(format!(
                "sampling_params.max_tokens {m} plus the prompt's {} tokens exceeds the context \
                 limit of {}",
                prompt.len(),
                model.max_seq_len
            )))
        }
        Some(m) => m,
        None => DEFAULT_MAX_TOKENS.min(room),
    };
    if max_tokens == 0 {
        return Err(bad(
            "the prompt fills the whole context; nothing can be sampled",
        ));
    }
    if !(p.temperature.is_finite() && p.temperature >= 0.0) {
        return Err(bad(format!(
            "sampling_params.temperature must be finite and >= 0, got {}",
            p.temperature
        )));
    }
    if !(p.top_p > 0.0 && p.top_p <= 1.0) {
        return Err(bad(format!(
            "sampling_params.top_p must be in (0, 1], got {}",
            p.top_p
        )));
    }
    let top_k = match p.top_k {
        -1 | 0 => None,
        k if k > 0 => Some(k as usize),
        k => {
            return Err(bad(format!(
                "sampling_params.top_k must be -1 or positive, got {k}"
            )))
        }
    };
    let (stop_strings, stop_tokens) = match &p.stop {
        None => (Vec::new(), Vec::new()),
        Some(StopCondition::Text(s)) => (vec![s.clone()], Vec::new()),
        Some(StopCondition::Texts(v)) => (v.clone(), Vec::new()),
        Some(StopCondition::Tokens(v)) => (
            Vec::new(),
            to_token_ids(model, v.iter().map(|&t| t as f64), "sampling_params.stop")?,
        ),
    };
    if stop_strings.iter().any(String::is_empty) {
        return Err(bad("sampling_params.stop strings must not be empty"));
    }
    // Every decode step checks every stop condition: their number is bounded too.
    let stops = stop_strings.len().max(stop_tokens.len());
    if stops > limits.stop_strings {
        return Err(bad(format!(
            "sampling_params.stop has {stops} entries; the limit is {} (--max-stop-strings)",
            limits.stop_strings
        )));
    }
    if let Some(long) = stop_strings
        .iter()
        .find(|s| s.len() > limits.stop_string_bytes)
    {
        return Err(bad(format!(
            "a sampling_params.stop string is {} bytes; the limit is {} (--max-stop-string-bytes)",
            long.len(),
            limits.stop_string_bytes
        )));
    }
    Ok(SampleJob {
        prompt,
        adapter: None,
        num_samples: req.num_samples,
        picker: Picker {
            temperature: p.temperature,
            top_k,
            top_p: p.top_p,
        },
        max_tokens,
        stop_strings,
        stop_tokens,
        seed: p.seed,
        prompt_logprobs: req.prompt_logprobs,
        topk_prompt_logprobs: req.topk_prompt_logprobs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> ModelInfo {
        ModelInfo {
            name: "m".into(),
            aliases: vec![],
            arch: "llama".into(),
            vocab_size: 10,
            max_seq_len: 8,
            tokenizer_json: "{}".into(),
            chat_template: None,
            eos_token: None,
            bos_token: None,
            lora_widths: Default::default(),
        }
    }

    /// A request's datums, as the handler parses them (built-in losses).
    fn parse(m: &ModelInfo, input: &ForwardBackwardInput) -> Result<Vec<DatumJob>, ApiError> {
        let LossChoice::Builtin(l) = loss(&input.loss_fn, input.loss_fn_config.as_ref())? else {
            panic!("a built-in loss")
        };
        forward_input(m, input, &KeyLimits::default(), l)
    }

    fn input(data: Vec<Datum>, loss_fn: &str) -> ForwardBackwardInput {
        ForwardBackwardInput {
            data,
            loss_fn: loss_fn.into(),
            loss_fn_config: None,
        }
    }

    #[test]
    fn good_datums_parse_and_bad_ones_name_the_problem() {
        let m = info();
        let ok = Datum::cross_entropy(
            ModelInput::from_ints(vec![1, 2]),
            vec![2, 3],
            vec![1.0, 1.0],
        );
        let jobs = parse(&m, &input(vec![ok.clone()], "cross_entropy")).unwrap();
        assert_eq!(jobs[0].targets, vec![2, 3]);
        let cases: Vec<(Datum, &str, &str)> = vec![
            (
                Datum::cross_entropy(
                    ModelInput::from_ints(vec![1, 20]),
                    vec![2, 3],
                    vec![1.0, 1.0],
                ),
                "cross_entropy",
                "out of range",
            ),
            (
                Datum::cross_entropy(
                    ModelInput::from_ints(vec![1, -1]),
                    vec![2, 3],
                    vec![1.0, 1.0],
                ),
                "cross_entropy",
                "out of range",
            ),
            (
                Datum::cross_entropy(ModelInput::from_ints(vec![1, 2]), vec![2], vec![1.0]),
                "cross_entropy",
                "shape",
            ),
            (
                Datum::cross_entropy(ModelInput::from_ints(vec![1, 2]), vec![2, 3], vec![1.0]),
                "cross_entropy",
                "values",
            ),
            (
                Datum::cross_entropy(
                    ModelInput::from_ints(vec![1, 2]),
                    vec![2, 3],
                    vec![1.0, f32::NAN],
                ),
                "cross_entropy",
                "non-finite",
            ),
            (
                Datum::cross_entropy(ModelInput::from_ints(vec![1; 9]), vec![2; 9], vec![1.0; 9]),
                "cross_entropy",
                "context limit",
            ),
            (ok.clone(), "ppo", "advantages"),
            (ok.clone(), "bogus", "unknown loss_fn"),
        ];
        for (d, loss_fn, needle) in cases {
            let err = parse(&m, &input(vec![d], loss_fn)).unwrap_err();
            assert!(err.message.contains(needle), "{needle}: {}", err.message);
        }
        assert!(parse(&m, &input(vec![], "cross_entropy")).is_err());
    }

    #[test]
    fn sampling_parameters_are_range_checked() {
        let m = info();
        let base: SampleRequest = serde_json::from_value(serde_json::json!({
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
            "sampling_params": {"max_tokens": 3}
        }))
        .unwrap();
        assert_eq!(
            sample_job(&m, &base, &KeyLimits::default())
                .unwrap()
                .max_tokens,
            3
        );
        let mut r = base.clone();
        r.sampling_params.top_p = 0.0;
        assert!(sample_job(&m, &r, &KeyLimits::default()).is_err());
        let mut r = base.clone();
        r.sampling_params.max_tokens = Some(0);
        assert!(sample_job(&m, &r, &KeyLimits::default()).is_err());
        let mut r = base.clone();
        r.sampling_params.max_tokens = Some(7);
        assert!(sample_job(&m, &r, &KeyLimits::default()).is_err());
        let mut r = base.clone();
        r.num_samples = 0;
        assert!(sample_job(&m, &r, &KeyLimits::default()).is_err());
        let mut r = base.clone();
        r.num_samples = MAX_NUM_SAMPLES + 1;
        assert!(sample_job(&m, &r, &KeyLimits::default()).is_err());
        // SDK 0.38's options Lathe lacks are refused by name; their defaults pass.
        let newer = |field: &str, value: serde_json::Value| {
            let mut body = serde_json::to_value(&base).unwrap();
            body[field] = value;
            let r: SampleRequest = serde_json::from_value(body).unwrap();
            sample_job(&m, &r, &KeyLimits::default()).map(|_| ())
        };
        for (field, value) in [
            ("topk_sample_logprobs", serde_json::json!(2)),
            ("prompt_alt_tokens_k", serde_json::json!(1)),
            ("prompt_logprobs_last_n", serde_json::json!(1)),
            ("record_stability_info", serde_json::json!(true)),
            (
                "target_prompt_logprobs",
                serde_json::json!({"data": [1], "dtype": "int64"}),
            ),
        ] {
            let err = newer(field, value).unwrap_err();
            assert!(err.message.contains(field), "{err:?}");
        }
        assert!(newer("topk_sample_logprobs", serde_json::json!(0)).is_ok());
        assert!(newer("record_stability_info", serde_json::json!(false)).is_ok());
    }

    #[test]
    fn stop_conditions_are_bounded_in_count_and_length() {
        let m = info();
        let limits = KeyLimits {
            stop_strings: 2,
            stop_string_bytes: 4,
            ..KeyLimits::default()
        };
        let with_stop = |stop: serde_json::Value| -> SampleRequest {
            serde_json::from_value(serde_json::json!({
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
                "sampling_params": {"max_tokens": 3, "stop": stop}
            }))
            .unwrap()
        };
        assert!(sample_job(&m, &with_stop(serde_json::json!(["ab", "cd"])), &limits).is_ok());
        let err =
            sample_job(&m, &with_stop(serde_json::json!(["a", "b", "c"])), &limits).unwrap_err();
        assert!(
            err.message.contains("--max-stop-strings"),
            "{}",
            err.message
        );
        let err = sample_job(&m, &with_stop(serde_json::json!([1, 2, 3])), &limits).unwrap_err();
        assert!(
            err.message.contains("--max-stop-strings"),
            "{}",
            err.message
        );
        let err = sample_job(&m, &with_stop(serde_json::json!("abcde")), &limits).unwrap_err();
        assert!(
            err.message.contains("--max-stop-string-bytes"),
            "{}",
            err.message
        );
    }

    #[test]
    fn ranks_are_bounded() {
        let mut c = LoraConfig {
            rank: 0,
            ..Default::default()
        };
        assert!(lora_spec(&c).is_err());
        c.rank = MAX_RANK + 1;
        assert!(lora_spec(&c).is_err());
        c.rank = 8;
        assert!(lora_spec(&c).is_ok());
    }
}
