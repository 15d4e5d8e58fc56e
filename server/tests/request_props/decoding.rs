//! The served model, and each body kind decoded and validated as the server does.

use super::*;

// ---------------------------------------------------------------- the served model

pub(crate) const VOCAB: usize = 256;
pub(crate) const MAX_SEQ: usize = 256;

pub(crate) fn model() -> ModelInfo {
    ModelInfo {
        name: "base".into(),
        aliases: vec!["default".into()],
        arch: "llama".into(),
        vocab_size: VOCAB,
        max_seq_len: MAX_SEQ,
        tokenizer_json: "{}".into(),
        chat_template: None,
        eos_token: None,
        bos_token: None,
        lora_widths: Default::default(),
    }
}

pub(crate) fn cases(n: u32) -> ProptestConfig {
    // No persistence: a regression file would land beside this test in the source tree.
    ProptestConfig {
        failure_persistence: None,
        ..ProptestConfig::with_cases(n)
    }
}

// ---------------------------------------------------------------- decode and validate

/// Every body type the server reads, with the checks its handler runs before the engine.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Kind {
    ForwardBackward,
    Forward,
    Sample,
    CreateModel,
    OptimStep,
    SaveWeights,
    SaveForSampler,
    LoadWeights,
    SetTtl,
    CreateSampling,
    CreateSession,
    Heartbeat,
    ModelId,
    RetrieveFuture,
    WeightsInfo,
    CreateCustomLoss,
    Completion,
    ChatCompletion,
}

pub(crate) const KINDS: [Kind; 18] = [
    Kind::ForwardBackward,
    Kind::Forward,
    Kind::Sample,
    Kind::CreateModel,
    Kind::OptimStep,
    Kind::SaveWeights,
    Kind::SaveForSampler,
    Kind::LoadWeights,
    Kind::SetTtl,
    Kind::CreateSampling,
    Kind::CreateSession,
    Kind::Heartbeat,
    Kind::ModelId,
    Kind::RetrieveFuture,
    Kind::WeightsInfo,
    Kind::CreateCustomLoss,
    Kind::Completion,
    Kind::ChatCompletion,
];

pub(crate) fn uri(s: &str) -> bool {
    s.parse::<CheckpointUri>().is_ok()
}

pub(crate) fn name(path: Option<&str>) -> bool {
    path.is_some_and(|p| validate_checkpoint_name(p).is_ok())
}

/// Checks what every accepted TTL must satisfy.
pub(crate) fn ttl(seconds: Option<u64>) -> bool {
    match Ttl::from_wire(seconds) {
        Ok(Some(t)) => {
            assert!(t.seconds() <= MAX_TTL_SECONDS && seconds == Some(t.seconds()));
            true
        }
        Ok(None) => {
            assert!(seconds.is_none());
            true
        }
        Err(_) => {
            assert!(seconds.is_some_and(|s| s > MAX_TTL_SECONDS));
            false
        }
    }
}

/// Decodes `body` as `kind` and runs the handler's validation. `Some(accepted)` when it
/// decoded. Assertions here are the semantic properties of accepted requests.
pub(crate) fn decode_and_validate(kind: Kind, body: &[u8]) -> Option<bool> {
    let m = model();
    fn de<T: serde::de::DeserializeOwned>(body: &[u8]) -> Option<T> {
        serde_json::from_slice(body).ok()
    }
    Some(match kind {
        Kind::ForwardBackward => {
            let r: ForwardBackwardRequest = de(body)?;
            forward_ok(&m, &r.forward_backward_input)
        }
        Kind::Forward => {
            let r: ForwardRequest = de(body)?;
            forward_ok(&m, &r.forward_input)
        }
        Kind::Sample => {
            let r: SampleRequest = de(body)?;
            sample_ok(&m, &r) && r.model_path.as_deref().is_none_or(uri)
        }
        Kind::CreateModel => {
            let r: CreateModelRequest = de(body)?;
            let spec = validate::lora_spec(&r.lora_config);
            if let Ok(s) = &spec {
                assert!((1..=lathe_server::model::lora::MAX_RANK).contains(&s.rank));
                assert_eq!(s.rank, r.lora_config.rank);
            }
            validate::base_model(&m, &r.base_model).is_ok() && spec.is_ok()
        }
        Kind::OptimStep => {
            let r: OptimStepRequest = de(body)?;
            let ok = adamw::validate(&r.adam_params).is_ok();
            if ok {
                let p = r.adam_params;
                assert!(p.learning_rate.is_finite() && p.beta1 < 1.0 && p.beta2 < 1.0);
            }
            ok
        }
        Kind::SaveWeights => {
            let r: SaveWeightsRequest = de(body)?;
            name(r.path.as_deref()) && ttl(r.ttl_seconds)
        }
        Kind::SaveForSampler => {
            let r: SaveWeightsForSamplerRequest = de(body)?;
            match r.path.as_deref() {
                Some(p) => name(Some(p)) && ttl(r.ttl_seconds),
                None => true,
            }
        }
        Kind::LoadWeights => uri(&de::<LoadWeightsRequest>(body)?.path),
        Kind::SetTtl => ttl(de::<SetTtlRequest>(body)?.ttl_seconds),
        Kind::CreateSampling => {
            let r: CreateSamplingSessionRequest = de(body)?;
            match (&r.model_path, &r.base_model) {
                (Some(p), _) => uri(p),
                (None, Some(b)) => validate::base_model(&m, b).is_ok(),
                (None, None) => false,
            }
        }
        // The handler skims the body (it keeps none of it), as this does.
        Kind::CreateSession => de::<serde::de::IgnoredAny>(body).is_some(),
        Kind::Heartbeat => de::<SessionHeartbeatRequest>(body).is_some(),
        Kind::ModelId => de::<ModelIdRequest>(body).is_some(),
        Kind::RetrieveFuture => de::<RetrieveFutureRequest>(body).is_some(),
        Kind::WeightsInfo => uri(&de::<WeightsInfoRequest>(body)?.tinker_path),
        Kind::CreateCustomLoss => {
            let r: lathe_sdk::types::CreateCustomLossRequest = de(body)?;
            lathe_server::train::custom::CustomLoss::compile(&r.name, &r.inputs, &r.graph).is_ok()
        }
        // What the handlers check next needs the served tokenizer: decoding is the
        // part a body alone can make costly.
        Kind::Completion => de::<lathe_sdk::types::openai::CompletionRequest>(body).is_some(),
        Kind::ChatCompletion => {
            de::<lathe_sdk::types::openai::ChatCompletionRequest>(body).is_some()
        }
    })
}

/// Runs `forward_input`; an accepted batch must be exactly what was sent.
pub(crate) fn forward_ok(m: &ModelInfo, input: &lathe_sdk::types::ForwardBackwardInput) -> bool {
    // A custom loss would be looked up in the engine, which has none here: refused.
    let Ok(validate::LossChoice::Builtin(loss)) =
        validate::loss(&input.loss_fn, input.loss_fn_config.as_ref())
    else {
        return false;
    };
    let Ok(jobs) = validate::forward_input(m, input, &limits(), loss) else {
        return false;
    };
    assert_eq!(jobs.len(), input.data.len());
    for (job, d) in jobs.iter().zip(&input.data) {
        let toks = d.model_input.to_ints().expect("accepted inputs are text");
        assert!(!toks.is_empty() && toks.len() <= m.max_seq_len);
        assert_eq!(job.tokens.len(), toks.len());
        assert!(job.tokens.iter().zip(&toks).all(|(&a, &b)| a as i64 == b));
        let n = job.tokens.len() * job.k;
        assert_eq!(job.targets.len(), n, "targets expand to tokens * k");
        assert!(job.targets.iter().all(|&t| (t as usize) < m.vocab_size));
        // Accepted, so its declared size is bounded: expanding it here is safe.
        let sent = d.loss_fn_inputs["target_tokens"].to_dense().unwrap();
        assert_eq!(sent.len(), n);
        assert!(job.targets.iter().zip(&sent).all(|(&a, &b)| a as f64 == b));
        for v in [&job.inputs.weights, &job.inputs.advantages] {
            assert!(v.is_empty() || v.len() == n);
        }
    }
    true
}

/// Runs `sample_job`; an accepted job must fit the context and keep the prompt.
pub(crate) fn sample_ok(m: &ModelInfo, r: &SampleRequest) -> bool {
    let limits = KeyLimits::default();
    let Ok(job) = validate::sample_job(m, r, &limits) else {
        return false;
    };
    assert!(job.stop_strings.len().max(job.stop_tokens.len()) <= limits.stop_strings);
    assert!(job
        .stop_strings
        .iter()
        .all(|s| s.len() <= limits.stop_string_bytes));
    let prompt = r.prompt.to_ints().unwrap();
    assert!(job.prompt.iter().zip(&prompt).all(|(&a, &b)| a as i64 == b));
    assert_eq!(job.prompt.len(), prompt.len());
    assert!(job.max_tokens >= 1 && job.prompt.len() + job.max_tokens <= m.max_seq_len);
    assert!((1..=validate::MAX_NUM_SAMPLES).contains(&job.num_samples));
    assert!(job.stop_tokens.iter().all(|&t| (t as usize) < m.vocab_size));
    assert!(job.picker.top_p > 0.0 && job.picker.top_p <= 1.0);
    true
}

/// Serialized bytes of the parts of `body` that `kind` decodes through a value tree
/// (see [`BUFFERED_FACTOR`]); 0 when the body is not JSON.
pub(crate) fn buffered_bytes(kind: Kind, body: &[u8]) -> usize {
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return 0;
    };
    let size = |x: Option<&Value>| x.map_or(0, |x| serde_json::to_vec(x).unwrap().len());
    match kind {
        Kind::Sample => size(v.pointer("/sampling_params/stop")),
        Kind::CreateSession => size(v.get("user_metadata")),
        // Graph arguments are a tree of 32-byte nodes of their own.
        Kind::CreateCustomLoss => size(v.get("graph")),
        // The sampling settings are flattened: serde buffers every field the request
        // does not name itself (the prompt is typed as it streams).
        Kind::Completion | Kind::ChatCompletion => match &v {
            Value::Object(fields) => fields
                .iter()
                .filter(|(k, _)| !matches!(k.as_str(), "prompt" | "messages"))
                .map(|(k, x)| k.len() + size(Some(x)))
                .sum(),
            _ => 0,
        },
        _ => 0,
    }
}

/// Values the loss inputs of a forward body declare that validation may expand: for
/// each datum, tokens x targets per position for each input its loss reads; 0 when the
/// request declares more than the per-request limit (refused before expanding).
pub(crate) fn expanded_values(kind: Kind, body: &[u8]) -> usize {
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return 0;
    };
    let input = match kind {
        Kind::ForwardBackward => v.get("forward_backward_input"),
        Kind::Forward => v.get("forward_input"),
        _ => None,
    };
    let Some(input) = input else { return 0 };
    let read: &[&str] = match input.get("loss_fn").and_then(Value::as_str) {
        Some("cross_entropy") => &["target_tokens", "weights"],
        Some("ppo" | "cispo") => &[
            "target_tokens",
            "advantages",
            "logprobs",
            "clip_low_threshold",
            "clip_high_threshold",
        ],
        _ => &["target_tokens", "advantages", "logprobs"],
    };
    let Some(Value::Array(data)) = input.get("data") else {
        return 0;
    };
    let (mut declared, mut expanded) = (0usize, 0usize);
    for d in data {
        let n: usize = d
            .pointer("/model_input/chunks")
            .and_then(Value::as_array)
            .map_or(0, |chunks| {
                chunks
                    .iter()
                    .filter_map(|c| c.get("tokens").and_then(Value::as_array))
                    .map(Vec::len)
                    .sum()
            });
        let inputs = d.get("loss_fn_inputs");
        let k = inputs
            .and_then(|i| i.pointer("/target_tokens/shape"))
            .and_then(Value::as_array)
            .filter(|s| s.len() == 2)
            .and_then(|s| s[1].as_u64())
            .map_or(1, |k| k.min(usize::MAX as u64) as usize);
        let m = n.saturating_mul(k);
        declared = declared.saturating_add(m);
        let present = read
            .iter()
            .filter(|name| inputs.and_then(|i| i.get(**name)).is_some())
            .count();
        expanded = expanded.saturating_add(m.saturating_mul(present));
    }
    if declared > limits().tokens_per_request {
        0
    } else {
        expanded
    }
}

/// Decodes and validates `body` as `kind` under the allocation bound.
pub(crate) fn run_body(kind: Kind, body: &[u8]) -> Result<Option<bool>, TestCaseError> {
    let buffered = buffered_bytes(kind, body);
    let expanded = expanded_values(kind, body);
    let (out, peak) = peak_alloc_during(|| decode_and_validate(kind, body));
    check_alloc(&format!("{kind:?}"), body.len(), buffered, expanded, peak)?;
    Ok(out)
}

pub(crate) fn run_all(body: &[u8]) -> Result<(), TestCaseError> {
    for kind in KINDS {
        run_body(kind, body)?;
    }
    Ok(())
}
