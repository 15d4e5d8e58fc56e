//! Property tests of every request body the server decodes, against an untrusted tenant:
//! for random and adversarial bodies, decoding and validation never panic, and never
//! allocate more than a small multiple of the body's own size (plus a fixed slack). Where
//! it is cheap, what validation accepts is also checked against what was sent.
//!
//! Allocation is measured by a counting `#[global_allocator]`, per thread, so proptest's
//! machinery and the other tests running beside these do not count. A `realloc` counts
//! both blocks at its peak, as a moving `realloc` holds both. The bound is
//! [`ALLOC_FACTOR`] per byte of body, [`BUFFERED_FACTOR`] per byte of the fields serde
//! buffers as a value tree, plus [`ALLOC_SLACK`]; the constants say where they come from.
//! One allowance is not proportional to the body: a sparse loss input expands to its
//! declared size, [`EXPANDED_FACTOR`] bytes per declared value of each input the loss
//! reads. What a request may declare is bounded by `--max-tokens-per-request` (checked
//! from the shapes before anything is expanded), so that term is bounded by the operator.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

use lathe_sdk::types::{
    validate_checkpoint_name, CheckpointUri, CreateModelRequest, CreateSamplingSessionRequest,
    ForwardBackwardRequest, ForwardRequest, LoadWeightsRequest, ModelIdRequest, OptimStepRequest,
    RetrieveFutureRequest, SampleRequest, SaveWeightsForSamplerRequest, SaveWeightsRequest,
    SessionHeartbeatRequest, SetTtlRequest, TensorData, TensorDtype, WeightsInfoRequest,
};
use lathe_server::api::validate;
use lathe_server::engine::{KeyLimits, ModelInfo, Ttl, MAX_TTL_SECONDS};
use lathe_server::train::adamw;
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::Index;
use serde_json::{json, Value};

// ---------------------------------------------------------------- allocation counting

struct Counting;

thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

/// Records `alloc` new bytes held alongside the current ones, then `free` bytes released.
fn note(alloc: usize, free: usize) {
    let _ = LIVE.try_with(|live| {
        let high = live.get() + alloc as isize;
        let _ = PEAK.try_with(|p| p.set(p.get().max(high)));
        live.set(high - free as isize);
    });
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            note(layout.size(), 0);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(layout);
        if !p.is_null() {
            note(layout.size(), 0);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        note(0, layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = System.realloc(ptr, layout, new_size);
        if !p.is_null() {
            note(new_size, layout.size());
        }
        p
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Runs `f` and returns its result with the most bytes this thread held at once during
/// it, above what it held before (what `f` returns still counts: it is held at the end).
fn peak_alloc_during<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let start = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(start));
    let r = f();
    let peak = PEAK.with(Cell::get);
    (r, (peak - start).max(0) as usize)
}

/// Bytes decoding plus validation may hold per byte of body. Arrays of one-digit numbers
/// (`0,`: two bytes each) become `i64`s or `f64`s (8 bytes, 16 after `Vec` doubling, 24
/// while it reallocates) and then a copy or two for the engine's types: about 12 at
/// worst. The tightest typed path is a batch of minimal datums: each datum's
/// `loss_fn_inputs` map allocates a whole B-tree leaf (11 slots of `String` and
/// `TensorData`, about 1.4 KiB) for as little as 80 bytes of text, about 20 in all.
const ALLOC_FACTOR: usize = 24;
/// Bytes per byte of the fields serde buffers as a value tree (its private `Content`, or
/// `serde_json::Value`) before typing them: `ModelInputChunk` (internally tagged),
/// `StopCondition` (untagged) and `CreateSessionRequest::user_metadata`. A node is 32
/// bytes for as little as two bytes of text (`0,`), three times that while its `Vec`
/// doubles; a one-element list (`[0],`) allocates the minimum capacity of four nodes:
/// 128 bytes for four bytes of text, plus its own slot, about 56 in all. See
/// [`buffered_bytes`].
const BUFFERED_FACTOR: usize = 64;
/// Fixed slack: error messages, the serde_json scratch buffer, small maps.
const ALLOC_SLACK: usize = 64 * 1024;
/// Bytes per declared value of a loss input the loss reads: the `f64` of `to_dense`,
/// the `f32` or `u32` kept, and the vector's growth.
const EXPANDED_FACTOR: usize = 24;
/// The per-request limit these tests run under (the server's default).
fn limits() -> KeyLimits {
    KeyLimits::default()
}

/// The largest `peak / body` seen for bodies of at least 2 KiB, times 100, for bodies
/// mostly typed and for bodies mostly buffered (`REQUEST_PROPS_REPORT=1` prints each
/// new record).
static WORST_TYPED_X100: AtomicUsize = AtomicUsize::new(0);
static WORST_BUFFERED_X100: AtomicUsize = AtomicUsize::new(0);

fn check_alloc(
    what: &str,
    body_len: usize,
    buffered: usize,
    expanded: usize,
    peak: usize,
) -> Result<(), TestCaseError> {
    let worst = if 2 * buffered < body_len {
        &WORST_TYPED_X100
    } else {
        &WORST_BUFFERED_X100
    };
    if body_len >= 2048 {
        let ratio = peak * 100 / body_len;
        let old = worst.fetch_max(ratio, Ordering::Relaxed);
        if ratio > old && std::env::var_os("REQUEST_PROPS_REPORT").is_some() {
            eprintln!(
                "{what}: new worst ratio {:.2} ({peak} bytes for {body_len}, {buffered} buffered)",
                ratio as f64 / 100.0
            );
        }
    }
    let limit = ALLOC_FACTOR * body_len
        + (BUFFERED_FACTOR - ALLOC_FACTOR) * buffered
        + EXPANDED_FACTOR * expanded
        + ALLOC_SLACK;
    prop_assert!(
        peak <= limit,
        "{what}: held {peak} bytes for a {body_len}-byte body, {buffered} of it buffered \
         and {expanded} declared values to expand (limit {limit})"
    );
    Ok(())
}

// ---------------------------------------------------------------- the served model

const VOCAB: usize = 256;
const MAX_SEQ: usize = 256;

fn model() -> ModelInfo {
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
    }
}

fn cases(n: u32) -> ProptestConfig {
    // No persistence: a regression file would land beside this test in the source tree.
    ProptestConfig {
        failure_persistence: None,
        ..ProptestConfig::with_cases(n)
    }
}

// ---------------------------------------------------------------- decode and validate

/// Every body type the server reads, with the checks its handler runs before the engine.
#[derive(Debug, Clone, Copy)]
enum Kind {
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
}

const KINDS: [Kind; 15] = [
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
];

fn uri(s: &str) -> bool {
    s.parse::<CheckpointUri>().is_ok()
}

fn name(path: Option<&str>) -> bool {
    path.is_some_and(|p| validate_checkpoint_name(p).is_ok())
}

/// Checks what every accepted TTL must satisfy.
fn ttl(seconds: Option<u64>) -> bool {
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
fn decode_and_validate(kind: Kind, body: &[u8]) -> Option<bool> {
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
    })
}

/// Runs `forward_input`; an accepted batch must be exactly what was sent.
fn forward_ok(m: &ModelInfo, input: &lathe_sdk::types::ForwardBackwardInput) -> bool {
    let Ok(jobs) = validate::forward_input(m, input, &limits()) else {
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
fn sample_ok(m: &ModelInfo, r: &SampleRequest) -> bool {
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
fn buffered_bytes(kind: Kind, body: &[u8]) -> usize {
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return 0;
    };
    let size = |x: Option<&Value>| x.map_or(0, |x| serde_json::to_vec(x).unwrap().len());
    let chunks = |input: &str| match v.pointer(input).and_then(|d| d.get("data")) {
        Some(Value::Array(data)) => data
            .iter()
            .map(|d| size(d.pointer("/model_input/chunks")))
            .sum(),
        _ => 0,
    };
    match kind {
        Kind::ForwardBackward => chunks("/forward_backward_input"),
        Kind::Forward => chunks("/forward_input"),
        Kind::Sample => {
            size(v.pointer("/prompt/chunks")) + size(v.pointer("/sampling_params/stop"))
        }
        Kind::CreateSession => size(v.get("user_metadata")),
        _ => 0,
    }
}

/// Values the loss inputs of a forward body declare that validation may expand: for
/// each datum, tokens x targets per position for each input its loss reads; 0 when the
/// request declares more than the per-request limit (refused before expanding).
fn expanded_values(kind: Kind, body: &[u8]) -> usize {
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
fn run_body(kind: Kind, body: &[u8]) -> Result<Option<bool>, TestCaseError> {
    let buffered = buffered_bytes(kind, body);
    let expanded = expanded_values(kind, body);
    let (out, peak) = peak_alloc_during(|| decode_and_validate(kind, body));
    check_alloc(&format!("{kind:?}"), body.len(), buffered, expanded, peak)?;
    Ok(out)
}

fn run_all(body: &[u8]) -> Result<(), TestCaseError> {
    for kind in KINDS {
        run_body(kind, body)?;
    }
    Ok(())
}

// ---------------------------------------------------------------- JSON generators

/// Numbers and near-numbers a hostile client sends where a count or id is expected.
fn wild_scalar() -> BoxedStrategy<Value> {
    prop_oneof![
        6 => (0u64..300).prop_map(Value::from),
        1 => prop::sample::select(vec![
            json!(-1), json!(i64::MIN), json!(i64::MAX), json!(u64::MAX), json!(1u64 << 50),
            json!(1u64 << 63), json!(1u64 << 32), json!(u32::MAX), json!(0.5), json!(-0.0),
            json!(1e300), json!(-1e300), json!(5e-324), json!(1.0), json!(256), json!(255),
            json!(64), json!(65), json!(MAX_TTL_SECONDS), json!(MAX_TTL_SECONDS + 1),
            json!(null), json!(true), json!(""), json!("NaN"), json!("Infinity"), json!("-inf"),
            json!("1"), json!([]), json!({}), json!(raw(0)), json!(raw(1)), json!(raw(2)),
            json!(raw(3)), json!(raw(4)), json!(raw(5)),
        ]),
        1 => any::<i64>().prop_map(Value::from),
        1 => any::<f64>().prop_map(Value::from),
    ]
    .boxed()
}

/// Number texts no `serde_json::Value` holds, spliced in by [`to_body`].
const RAW: [&str; 6] = [
    "1e400",
    "-1e400",
    "18446744073709551616",
    "-9223372036854775809",
    "1e-400",
    "0.000000000000000000000000000000000000000000000000001e400",
];

fn raw(i: usize) -> String {
    format!("@@RAW{i}@@")
}

fn to_body(v: &Value) -> Vec<u8> {
    let mut s = serde_json::to_string(v).unwrap();
    for (i, r) in RAW.iter().enumerate() {
        s = s.replace(&format!("\"{}\"", raw(i)), r);
    }
    s.into_bytes()
}

/// Field names of the wire types, so generated objects hit real fields.
const FIELDS: &str = "data dtype shape sparse_crow_indices sparse_col_indices model_input chunks \
    type tokens loss_fn_inputs target_tokens weights advantages logprobs clip_low_threshold \
    clip_high_threshold loss_fn loss_fn_config beta forward_backward_input forward_input \
    model_id seq_id prompt num_samples sampling_params max_tokens temperature top_p top_k stop \
    seed topk_prompt_logprobs prompt_logprobs sampling_session_id base_model model_path \
    session_id model_seq_id lora_config rank train_mlp adam_params learning_rate beta1 path \
    ttl_seconds overwrite request_id tinker_path user_metadata tags expected_tokens";

/// Strings with a meaning somewhere in the protocol.
const WORDS: &str = "encoded_text image image_asset_pointer int64 float32 cross_entropy ppo \
    cispo dro importance_sampling base default tinker://s:train:0/weights/a \
    tinker://r/sampler_weights/x tinker:////// .. a/b ok";

fn field() -> impl Strategy<Value = &'static str> {
    prop::sample::select(FIELDS.split_whitespace().collect::<Vec<_>>())
}

fn wild_string() -> BoxedStrategy<Value> {
    let words: Vec<&str> = WORDS
        .split_whitespace()
        .chain(["", "\u{0}", "\u{301}"])
        .collect();
    prop_oneof![
        field().prop_map(Value::from),
        prop::sample::select(words).prop_map(Value::from),
        "[ -~\u{80}-\u{10FFFF}]{0,12}".prop_map(Value::from),
    ]
    .boxed()
}

/// Nesting a little past serde_json's recursion limit (128).
fn deep() -> BoxedStrategy<Value> {
    (100usize..140, any::<bool>())
        .prop_map(|(depth, arrays)| {
            (0..depth).fold(json!(0), |v, _| {
                if arrays {
                    json!([v])
                } else {
                    json!({ "chunks": v })
                }
            })
        })
        .boxed()
}

fn any_json() -> BoxedStrategy<Value> {
    let leaf = prop_oneof![3 => wild_scalar(), 2 => wild_string(), 1 => Just(Value::Null)];
    leaf.prop_recursive(5, 96, 8, |inner| {
        prop_oneof![
            vec(inner.clone(), 0..8).prop_map(Value::Array),
            vec((field(), inner), 0..8).prop_map(|kv| {
                Value::Object(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
            }),
        ]
    })
    .boxed()
}

/// One edit of a body: the target node is chosen by index among all nodes.
#[derive(Debug, Clone)]
enum Edit {
    Replace(Index, Value),
    Remove(Index),
    Append(Index, Value),
    Truncate(Index, Index),
    Wrap(Index),
}

fn edit() -> BoxedStrategy<Edit> {
    let i = any::<Index>;
    let v = || prop_oneof![4 => wild_scalar(), 2 => any_json(), 1 => deep()];
    prop_oneof![
        4 => (i(), v()).prop_map(|(a, b)| Edit::Replace(a, b)),
        2 => i().prop_map(Edit::Remove),
        2 => (i(), v()).prop_map(|(a, b)| Edit::Append(a, b)),
        1 => (i(), i()).prop_map(|(a, b)| Edit::Truncate(a, b)),
        1 => i().prop_map(Edit::Wrap),
    ]
    .boxed()
}

fn pointers(v: &Value, at: String, out: &mut Vec<String>) {
    match v {
        Value::Array(a) => a
            .iter()
            .enumerate()
            .for_each(|(i, x)| pointers(x, format!("{at}/{i}"), out)),
        Value::Object(o) => o.iter().for_each(|(k, x)| {
            let k = k.replace('~', "~0").replace('/', "~1");
            pointers(x, format!("{at}/{k}"), out)
        }),
        _ => {}
    }
    out.push(at);
}

fn apply(v: &mut Value, e: &Edit) {
    let mut all = Vec::new();
    pointers(v, String::new(), &mut all);
    let pick = |i: &Index| all[i.index(all.len())].clone();
    match e {
        Edit::Replace(i, x) => *v.pointer_mut(&pick(i)).unwrap() = x.clone(),
        Edit::Remove(i) => {
            let p = pick(i);
            if let Some((parent, last)) = p.rsplit_once('/') {
                match v.pointer_mut(parent).unwrap() {
                    Value::Object(o) => drop(o.remove(&last.replace("~1", "/").replace("~0", "~"))),
                    Value::Array(a) => drop(a.remove(last.parse::<usize>().unwrap())),
                    _ => unreachable!(),
                }
            }
        }
        Edit::Append(i, x) => match v.pointer_mut(&pick(i)).unwrap() {
            Value::Array(a) => a.push(x.clone()),
            Value::Object(o) => drop(o.insert("extra".into(), x.clone())),
            other => *other = x.clone(),
        },
        Edit::Truncate(i, len) => {
            if let Value::Array(a) = v.pointer_mut(&pick(i)).unwrap() {
                let keep = len.index(a.len() + 1);
                a.truncate(keep);
            }
        }
        Edit::Wrap(i) => {
            let node = v.pointer_mut(&pick(i)).unwrap();
            *node = json!([node.take()]);
        }
    }
}

// ---------------------------------------------------------------- near-valid bodies

/// How a `[n]` or `[n, k]` loss input is written on the wire.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Form {
    /// Flat data, no shape (1-D only).
    Bare,
    /// Flat data with its shape.
    Dense,
    /// CSR, zeros left out.
    Sparse,
}

/// Writes `values` (`rows * cols`, row-major) as a wire tensor. Integral values are
/// written without a fraction, which is the most compact (and most amplifying) text.
fn tensor(values: &[f64], rows: usize, cols: usize, two_d: bool, form: Form, int: bool) -> Value {
    let num = |x: f64| {
        if x.fract() == 0.0 && x.abs() < 1e15 {
            json!(x as i64)
        } else {
            json!(x)
        }
    };
    let dtype = if int { "int64" } else { "float32" };
    let shape = if two_d {
        json!([rows, cols])
    } else {
        json!([rows])
    };
    match form {
        Form::Bare => {
            json!({"data": values.iter().map(|&x| num(x)).collect::<Vec<_>>(), "dtype": dtype})
        }
        Form::Dense => json!({
            "data": values.iter().map(|&x| num(x)).collect::<Vec<_>>(),
            "dtype": dtype,
            "shape": shape,
        }),
        Form::Sparse => {
            let (mut crow, mut col, mut data) = (vec![0usize], vec![], vec![]);
            for r in 0..rows {
                for c in 0..cols {
                    let x = values[r * cols + c];
                    if x != 0.0 {
                        col.push(c);
                        data.push(num(x));
                    }
                }
                crow.push(col.len());
            }
            json!({
                "data": data, "dtype": dtype, "shape": [rows, cols],
                "sparse_crow_indices": crow, "sparse_col_indices": col,
            })
        }
    }
}

/// A datum the server must accept, with what it must turn into.
#[derive(Debug, Clone)]
struct Plan {
    tokens: Vec<i64>,
    k: usize,
    targets: Vec<i64>,
    weights: Vec<f64>,
    form: Form,
    two_d: bool,
    chunks: usize,
}

fn form() -> impl Strategy<Value = Form> {
    prop_oneof![Just(Form::Bare), Just(Form::Dense), Just(Form::Sparse)]
}

fn plan(rl: bool) -> BoxedStrategy<Plan> {
    let n = prop_oneof![4 => 1usize..16, 1 => 1usize..=MAX_SEQ];
    let k = if rl {
        Just(1usize).boxed()
    } else {
        prop_oneof![4 => Just(1usize), 2 => 2usize..5, 1 => 60usize..=64].boxed()
    };
    // Zeros are common so sparse tensors really are sparse.
    let id = prop_oneof![1 => Just(0i64), 2 => 0..VOCAB as i64].boxed();
    (n, k, form(), any::<bool>(), 1usize..4)
        .prop_flat_map(move |(n, k, form, flat, chunks)| {
            // Keep generation cheap: the compact-body property covers the largest sizes.
            let k = k.min((4096 / n).max(1));
            let m = n * k;
            (
                vec(id.clone(), n),
                vec(id.clone(), m),
                // Eighths: exact in f32, so the text round trip is exact too.
                vec((-16i32..16).prop_map(|x| f64::from(x) / 8.0), m),
                Just((k, form, flat, chunks)),
            )
        })
        .prop_map(|(tokens, targets, weights, (k, form, flat, chunks))| Plan {
            tokens,
            k,
            targets,
            weights,
            form: if k > 1 && form == Form::Bare {
                Form::Dense
            } else {
                form
            },
            // A k = 1 target may be written [n] or [n, 1]; CSR needs two dimensions.
            two_d: k > 1 || form == Form::Sparse || flat,
            chunks,
        })
        .boxed()
}

impl Plan {
    fn datum(&self, rl: bool) -> Value {
        let n = self.tokens.len();
        let per = n.div_ceil(self.chunks);
        let chunks: Vec<Value> = self
            .tokens
            .chunks(per)
            .map(|c| json!({"type": "encoded_text", "tokens": c}))
            .collect();
        let t: Vec<f64> = self.targets.iter().map(|&x| x as f64).collect();
        let t = |f| tensor(&t, n, self.k, self.two_d, f, true);
        let w = |f| tensor(&self.weights, n, self.k, self.two_d, f, false);
        let mut inputs = json!({"target_tokens": t(self.form), "weights": w(self.form)});
        if rl {
            inputs["advantages"] = w(Form::Dense);
            inputs["logprobs"] = w(Form::Bare);
        }
        json!({"model_input": {"chunks": chunks}, "loss_fn_inputs": inputs})
    }
}

const LOSSES: [&str; 5] = [
    "cross_entropy",
    "importance_sampling",
    "ppo",
    "cispo",
    "dro",
];

/// A valid forward/backward body and its plans.
fn batch() -> BoxedStrategy<(Value, Vec<Plan>)> {
    (0usize..5, any::<bool>())
        .prop_flat_map(|(loss, with_config)| {
            let rl = loss != 0;
            (vec(plan(rl), 1..4), Just((loss, with_config)))
        })
        .prop_map(|(plans, (loss, with_config))| {
            let rl = loss != 0;
            let data: Vec<Value> = plans.iter().map(|p| p.datum(rl)).collect();
            let mut input = json!({"data": data, "loss_fn": LOSSES[loss]});
            if with_config && (loss == 2 || loss == 3) {
                input["loss_fn_config"] =
                    json!({"clip_low_threshold": 0.8, "clip_high_threshold": 1.2});
            }
            let body =
                json!({"forward_backward_input": input, "model_id": "s:train:0", "seq_id": 3});
            (body, plans)
        })
        .boxed()
}

/// A valid sampling body.
fn sample_body() -> BoxedStrategy<Value> {
    (
        1usize..MAX_SEQ,
        1usize..=64,
        0usize..=64,
        any::<u64>(),
        0u32..4,
    )
        .prop_flat_map(|(n, num, topk, seed, stop)| {
            let room = MAX_SEQ - n;
            (
                vec(0..VOCAB as i64, n),
                prop::option::of(1..=room),
                (
                    0.0f64..2.0,
                    0.01f64..=1.0,
                    prop_oneof![Just(-1i64), 1i64..300],
                ),
                Just((num, topk, seed, stop)),
            )
        })
        .prop_map(
            |(prompt, max, (temp, top_p, top_k), (num, topk, seed, stop))| {
                let stop = match stop {
                    0 => Value::Null,
                    1 => json!("\n"),
                    2 => json!(["a", "bc"]),
                    _ => json!([0, 1, 255]),
                };
                json!({
                    "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
                    "num_samples": num, "topk_prompt_logprobs": topk,
                    "sampling_params": {"max_tokens": max, "temperature": temp, "top_p": top_p,
                                        "top_k": top_k, "seed": seed, "stop": stop},
                    "sampling_session_id": "s:sample:0",
                })
            },
        )
        .boxed()
}

/// A batch of `datums` identical datums of `n` zero tokens, with zero `[n, k]` targets
/// and `inputs` zero float inputs (cross-entropy reads `weights` and checks the others),
/// all written as `form`: the fewest bytes per declared value.
fn compact_batch(n: usize, k: usize, datums: usize, inputs: usize, form: Form) -> Vec<u8> {
    let zeros = vec![0.0; n * k];
    let mut loss_inputs = json!({"target_tokens": tensor(&zeros, n, k, true, form, true)});
    let names = [
        "weights",
        "advantages",
        "logprobs",
        "clip_low_threshold",
        "clip_high_threshold",
    ];
    for name in &names[..inputs] {
        loss_inputs[name] = tensor(&zeros, n, k, true, form, false);
    }
    let datum = json!({
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": vec![0; n]}]},
        "loss_fn_inputs": loss_inputs,
    });
    to_body(&json!({
        "forward_backward_input": {"data": vec![datum; datums], "loss_fn": "cross_entropy"},
        "model_id": "m",
    }))
}

/// Elements of a value tree that cost the most per byte of text.
fn tree_elem() -> impl Strategy<Value = Value> {
    prop::sample::select(vec![
        json!(0),
        json!(""),
        json!(null),
        json!([]),
        json!({}),
        json!([0]),
        json!([[0]]),
        json!({"": 0}),
        json!({"": {"": 0}}),
    ])
}

/// One valid body of every other kind.
fn other_bodies() -> Vec<(Kind, Value)> {
    vec![
        (
            Kind::CreateModel,
            json!({"session_id": "s", "model_seq_id": 0, "base_model": "base",
                   "lora_config": {"rank": 8, "seed": 1, "train_unembed": true},
                   "user_metadata": {"a": "b"}}),
        ),
        (
            Kind::OptimStep,
            json!({"adam_params": {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95,
                   "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 1.0},
                   "model_id": "s:train:0", "seq_id": 4}),
        ),
        (
            Kind::SaveWeights,
            json!({"model_id": "s:train:0", "path": "step-1", "seq_id": 5, "overwrite": true,
                   "ttl_seconds": 3600}),
        ),
        (
            Kind::SaveForSampler,
            json!({"model_id": "s:train:0", "path": "s1", "seq_id": 6, "ttl_seconds": 60,
                   "sampling_session_seq_id": 0}),
        ),
        (
            Kind::LoadWeights,
            json!({"model_id": "s:train:0", "path": "tinker://s:train:0/weights/step-1",
                   "optimizer": true, "seq_id": 7, "session_id": "s", "model_seq_id": 1}),
        ),
        (Kind::SetTtl, json!({"ttl_seconds": 86400})),
        (
            Kind::CreateSampling,
            json!({"session_id": "s", "sampling_session_seq_id": 0, "base_model": "base",
                   "model_path": "tinker://s:train:0/sampler_weights/s1"}),
        ),
        (
            Kind::CreateSession,
            json!({"tags": ["a"], "user_metadata": {"k": [1, {"x": null}]},
                   "sdk_version": "0.22.0", "project_id": "p"}),
        ),
        (Kind::Heartbeat, json!({"session_id": "s"})),
        (Kind::ModelId, json!({"model_id": "s:train:0"})),
        (
            Kind::RetrieveFuture,
            json!({"request_id": "r", "allow_metadata_only": true}),
        ),
        (
            Kind::WeightsInfo,
            json!({"tinker_path": "tinker://s:train:0/weights/step-1"}),
        ),
    ]
}

// ---------------------------------------------------------------- properties

proptest! {
    #![proptest_config(cases(256))]

    /// Valid batches are accepted and keep every token and target (the semantic checks
    /// live in `forward_ok`), whichever encoding the targets use.
    #[test]
    fn valid_batches_round_trip((body, plans) in batch()) {
        let bytes = to_body(&body);
        let accepted = run_body(Kind::ForwardBackward, &bytes)?;
        prop_assert_eq!(accepted, Some(true), "{}", String::from_utf8_lossy(&bytes));
        let req: ForwardBackwardRequest = serde_json::from_slice(&bytes).unwrap();
        let jobs = validate::forward_input(&model(), &req.forward_backward_input, &limits()).unwrap();
        for (job, p) in jobs.iter().zip(&plans) {
            prop_assert_eq!(job.k, p.k);
            let targets: Vec<i64> = job.targets.iter().map(|&t| t as i64).collect();
            prop_assert_eq!(&targets, &p.targets);
            // Weights are read (and kept) by cross-entropy only; RL losses ignore them.
            let w: Vec<f32> = if req.forward_backward_input.loss_fn == "cross_entropy" {
                p.weights.iter().map(|&x| x as f32).collect()
            } else {
                Vec::new()
            };
            prop_assert_eq!(&job.inputs.weights, &w);
        }
    }

    /// Valid batches with hostile edits anywhere: no panic, bounded memory, and whatever
    /// is still accepted is exactly what was sent.
    #[test]
    fn edited_batches_never_panic(
        (body, _) in batch(),
        edits in vec(edit(), 1..4),
        as_forward in any::<bool>(),
    ) {
        let mut body = body;
        for e in &edits {
            apply(&mut body, e);
        }
        if as_forward {
            if let Some(o) = body.as_object_mut() {
                if let Some(v) = o.remove("forward_backward_input") {
                    o.insert("forward_input".into(), v);
                }
            }
        }
        let kind = if as_forward { Kind::Forward } else { Kind::ForwardBackward };
        run_body(kind, &to_body(&body))?;
    }

    /// A sparse `target_tokens` whose shape disagrees with the tokens is refused, however
    /// self-consistent its own indices are and however large its shape.
    #[test]
    fn sparse_targets_of_the_wrong_shape_are_refused(
        n in 1usize..32,
        rows in prop_oneof![0usize..40, Just(1usize << 20)],
        cols in prop_oneof![
            0usize..70, Just(1usize << 32), Just(1 << 50), Just(1 << 63), Just(usize::MAX)
        ],
        nnz in vec(0usize..3, 0..40),
    ) {
        prop_assume!(!(rows == n && (1..=validate::MAX_TARGETS_PER_POSITION).contains(&cols)));
        // Self-consistent CSR for [rows, cols] (only when rows is small enough to write).
        let rows_written = rows.min(64);
        let mut crow = vec![0usize];
        let mut col = vec![];
        for r in 0..rows_written {
            for c in 0..nnz.get(r).copied().unwrap_or(0).min(cols) {
                col.push(c);
            }
            crow.push(col.len());
        }
        let targets = json!({
            "data": vec![1; col.len()], "dtype": "int64", "shape": [rows, cols],
            "sparse_crow_indices": crow, "sparse_col_indices": col,
        });
        let datum = json!({
            "model_input": {"chunks": [{"type": "encoded_text", "tokens": vec![1; n]}]},
            "loss_fn_inputs": {"target_tokens": targets},
        });
        let body = to_body(&json!({
            "forward_backward_input": {"data": [datum], "loss_fn": "cross_entropy"},
            "model_id": "m",
        }));
        prop_assert_eq!(run_body(Kind::ForwardBackward, &body)?, Some(false));
    }

    /// Valid and edited sampling bodies.
    #[test]
    fn sampling_bodies_never_panic(body in sample_body(), edits in vec(edit(), 0..4)) {
        let accepted = run_body(Kind::Sample, &to_body(&body))?;
        prop_assert_eq!(accepted, Some(true));
        let mut body = body;
        for e in &edits {
            apply(&mut body, e);
        }
        run_body(Kind::Sample, &to_body(&body))?;
    }

    /// Every other body kind, valid and then edited.
    #[test]
    fn other_bodies_never_panic(pick in any::<Index>(), edits in vec(edit(), 0..5)) {
        let all = other_bodies();
        let (kind, mut body) = all[pick.index(all.len())].clone();
        prop_assert_eq!(run_body(kind, &to_body(&body))?, Some(true), "{:?}", kind);
        for e in &edits {
            apply(&mut body, e);
        }
        run_body(kind, &to_body(&body))?;
    }

    /// Arbitrary JSON, read as every kind.
    #[test]
    fn arbitrary_json_never_panics(v in prop_oneof![4 => any_json(), 1 => deep()]) {
        run_all(&to_body(&v))?;
    }

    /// Arbitrary bytes, and valid bodies with their text damaged, read as every kind.
    #[test]
    fn damaged_text_never_panics(
        (body, _) in batch(),
        noise in vec(any::<u8>(), 0..64),
        at in any::<Index>(),
        cut in any::<Index>(),
        mode in 0u8..4,
    ) {
        let mut text = to_body(&body);
        let i = at.index(text.len() + 1);
        match mode {
            0 => text = noise.clone(),
            1 => { text.splice(i..i, noise.iter().copied()); }
            2 => text.truncate(cut.index(text.len() + 1)),
            _ => {
                let len = text.len().max(1);
                for (j, b) in noise.iter().enumerate() {
                    if let Some(x) = text.get_mut((i + j * 7) % len) {
                        *x ^= b;
                    }
                }
            }
        }
        run_all(&text)?;
    }

    /// The tensor helpers alone: `dims` and `num_elements` never panic, `to_dense` (called
    /// only within the documented contract: a bounded `num_elements`) either refuses
    /// before allocating or returns exactly `num_elements` values.
    #[test]
    fn tensors_expand_exactly_or_refuse(
        data in vec(prop_oneof![Just(0.0f64), any::<f64>()], 0..24),
        shape in prop::option::of(vec(prop_oneof![
            8 => 0usize..8, 1 => Just(1usize << 31), 1 => Just(1 << 50), 1 => Just(usize::MAX)
        ], 0..4)),
        crow in prop::option::of(vec(
            prop_oneof![0i64..10, Just(-1), Just(i64::MIN), Just(i64::MAX)], 0..10
        )),
        col in prop::option::of(vec(prop_oneof![0i64..10, Just(-1), Just(i64::MAX)], 0..24)),
        int in any::<bool>(),
    ) {
        let t = TensorData {
            data,
            dtype: if int { TensorDtype::Int64 } else { TensorDtype::Float32 },
            shape,
            sparse_crow_indices: crow,
            sparse_col_indices: col,
        };
        let dims = t.dims();
        let size = t.num_elements();
        let product = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        prop_assert_eq!(size, if t.shape.is_some() { product } else { Some(t.data.len()) });
        // The contract: callers bound `num_elements` before expanding.
        let Some(size) = size.filter(|&s| s <= 1 << 16) else {
            return Ok(());
        };
        let body = serde_json::to_vec(&t).unwrap().len();
        let (out, peak) = peak_alloc_during(|| t.to_dense());
        match out {
            // The dense array itself, and nothing else of note.
            Ok(v) => {
                prop_assert_eq!(v.len(), size);
                prop_assert!(peak <= 8 * size + 1024, "{} bytes for {} values", peak, size);
            }
            // Refused before allocating: only the message.
            Err(_) => check_alloc("to_dense (refused)", body, 0, 0, peak)?,
        }
    }

    /// TTLs: `from_wire` refuses exactly what is above the limit, and the wire forms of a
    /// TTL (numbers of every kind) never panic the three bodies that carry one.
    #[test]
    fn ttls_are_bounded(
        s in prop_oneof![any::<u64>(), 0..=MAX_TTL_SECONDS + 10, Just(u64::MAX)],
        wire in wild_scalar(),
    ) {
        let accepted = ttl(Some(s));
        prop_assert_eq!(accepted, s <= MAX_TTL_SECONDS);
        let save = json!({"model_id": "m", "path": "p", "ttl_seconds": wire.clone()});
        for (kind, body) in [
            (Kind::SetTtl, json!({"ttl_seconds": wire})),
            (Kind::SaveWeights, save.clone()),
            (Kind::SaveForSampler, save),
        ] {
            run_body(kind, &to_body(&body))?;
        }
    }
}

proptest! {
    #![proptest_config(cases(64))]

    /// The tightest dense bodies the format allows (every number one digit), at the
    /// largest sizes validation accepts.
    #[test]
    fn compact_dense_bodies_stay_within_the_bound(
        n in 1usize..=MAX_SEQ,
        k in prop_oneof![Just(1usize), 1usize..=validate::MAX_TARGETS_PER_POSITION],
        datums in 1usize..4,
        inputs in 1usize..=5,
    ) {
        let body = compact_batch(n, k, datums, inputs, Form::Dense);
        prop_assert_eq!(run_body(Kind::ForwardBackward, &body)?, Some(true));
    }

    /// The same bodies with every loss input sparse and all zero: two bytes per row
    /// (`sparse_crow_indices`) however many values a row declares. Only the inputs the
    /// loss reads may be expanded, and only within the declared-size allowance.
    #[test]
    fn compact_sparse_bodies_stay_within_the_bound(
        n in 1usize..=MAX_SEQ,
        k in 1usize..=validate::MAX_TARGETS_PER_POSITION,
        inputs in 1usize..=5,
    ) {
        let body = compact_batch(n, k, 1, inputs, Form::Sparse);
        prop_assert_eq!(run_body(Kind::ForwardBackward, &body)?, Some(true));
    }

    /// Many datums of one token each, valid or not: per-datum overheads (a map node for
    /// `loss_fn_inputs`, the job) against the fewest bytes a datum can take.
    #[test]
    fn many_small_datums_stay_within_the_bound(
        datums in 1usize..3000,
        shape in prop::sample::select(vec![
            json!({"model_input": {"chunks": [{"type": "encoded_text", "tokens": [0]}]},
                   "loss_fn_inputs": {"target_tokens": {"data": [0], "dtype": "int64"},
                                      "weights": {"data": [0], "dtype": "int64"}}}),
            json!({"model_input": {"chunks": []},
                   "loss_fn_inputs": {"": {"data": [], "dtype": "int64"}}}),
            json!({"model_input": {"chunks": []}, "loss_fn_inputs": {}}),
        ]),
    ) {
        let body = json!({
            "forward_input": {"data": vec![shape; datums], "loss_fn": "cross_entropy"},
            "model_id": "m",
        });
        run_body(Kind::Forward, &to_body(&body))?;
    }

    /// Token arrays past the context limit, as a prompt and as a datum, in one chunk or
    /// many: refused, and bounded while being refused.
    #[test]
    fn long_token_arrays_stay_within_the_bound(
        len in MAX_SEQ..40_000,
        chunks in prop_oneof![Just(1usize), 1usize..2000],
    ) {
        let per = len.div_ceil(chunks);
        let chunks: Vec<Value> = vec![0; len]
            .chunks(per)
            .map(|c| json!({"type": "encoded_text", "tokens": c}))
            .collect();
        let input = json!({"chunks": chunks});
        let sample = json!({"prompt": input, "base_model": "base"});
        prop_assert_eq!(run_body(Kind::Sample, &to_body(&sample))?, Some(false));
        let datum = json!({"model_input": input, "loss_fn_inputs": {}});
        let fb = json!({
            "forward_input": {"data": [datum], "loss_fn": "cross_entropy"},
            "model_id": "m",
        });
        prop_assert_eq!(run_body(Kind::Forward, &to_body(&fb))?, Some(false));
    }

    /// Paths (checkpoint URIs) of every shape, as each body that carries one, thousands
    /// of `/` included.
    #[test]
    fn checkpoint_uris_stay_within_the_bound(
        parts in vec(prop_oneof![
            Just(String::new()), Just("weights".to_string()), Just("..".to_string()),
            "[a-z:]{0,6}",
        ], 0..6),
        slashes in 0usize..20_000,
    ) {
        let path = format!("tinker://{}{}", parts.join("/"), "/".repeat(slashes));
        let prompt = json!({"chunks": [{"type": "encoded_text", "tokens": [1]}]});
        for (kind, body) in [
            (Kind::LoadWeights, json!({"model_id": "m", "path": path})),
            (Kind::WeightsInfo, json!({"tinker_path": path})),
            (Kind::CreateSampling, json!({"session_id": "s", "sampling_session_seq_id": 0,
                                          "model_path": path})),
            (Kind::Sample, json!({"prompt": prompt, "model_path": path})),
        ] {
            run_body(kind, &to_body(&body))?;
        }
    }

    /// The fields serde buffers as its `Content` tree (stop conditions, an untagged enum;
    /// model input chunks, internally tagged, unknown fields included): large lists of
    /// every element type, flat and nested.
    #[test]
    fn buffered_fields_stay_within_the_bound(
        len in 0usize..20_000,
        elem in tree_elem(),
        chunk in any::<bool>(),
    ) {
        let list = vec![elem; len];
        let body = if chunk {
            json!({"prompt": {"chunks": [{"type": "encoded_text", "tokens": [1], "x": list}]},
                   "base_model": "base"})
        } else {
            json!({"prompt": {"chunks": [{"type": "encoded_text", "tokens": [1]}]},
                   "sampling_params": {"stop": list}, "base_model": "base"})
        };
        run_body(Kind::Sample, &to_body(&body))?;
    }

    /// `create_session`'s free-form `user_metadata`, which the handler skims without
    /// keeping it: nested one-entry objects, the costliest tree per byte.
    #[test]
    fn session_metadata_stays_within_the_bound(len in 0usize..20_000, elem in tree_elem()) {
        let body = to_body(&json!({"user_metadata": {"k": vec![elem; len]}}));
        run_body(Kind::CreateSession, &body)?;
    }
}
