//! Strategies: wild JSON, edits of valid bodies, and near-valid bodies with what they must become.

use super::*;

// ---------------------------------------------------------------- JSON generators

/// Numbers and near-numbers a hostile client sends where a count or id is expected.
pub(crate) fn wild_scalar() -> BoxedStrategy<Value> {
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
pub(crate) const RAW: [&str; 6] = [
    "1e400",
    "-1e400",
    "18446744073709551616",
    "-9223372036854775809",
    "1e-400",
    "0.000000000000000000000000000000000000000000000000001e400",
];

pub(crate) fn raw(i: usize) -> String {
    format!("@@RAW{i}@@")
}

pub(crate) fn to_body(v: &Value) -> Vec<u8> {
    let mut s = serde_json::to_string(v).unwrap();
    for (i, r) in RAW.iter().enumerate() {
        s = s.replace(&format!("\"{}\"", raw(i)), r);
    }
    s.into_bytes()
}

/// Field names of the wire types, so generated objects hit real fields.
pub(crate) const FIELDS: &str =
    "data dtype shape sparse_crow_indices sparse_col_indices model_input chunks \
    type tokens loss_fn_inputs target_tokens weights advantages logprobs clip_low_threshold \
    clip_high_threshold loss_fn loss_fn_config beta forward_backward_input forward_input \
    model_id seq_id prompt num_samples sampling_params max_tokens temperature top_p top_k stop \
    seed topk_prompt_logprobs prompt_logprobs sampling_session_id base_model model_path \
    session_id model_seq_id lora_config rank train_mlp adam_params learning_rate beta1 path \
    ttl_seconds overwrite request_id tinker_path user_metadata tags expected_tokens";

/// Strings with a meaning somewhere in the protocol.
pub(crate) const WORDS: &str =
    "encoded_text image image_asset_pointer int64 float32 cross_entropy ppo \
    cispo dro importance_sampling base default tinker://s:train:0/weights/a \
    tinker://r/sampler_weights/x tinker:////// .. a/b ok";

pub(crate) fn field() -> impl Strategy<Value = &'static str> {
    prop::sample::select(FIELDS.split_whitespace().collect::<Vec<_>>())
}

pub(crate) fn wild_string() -> BoxedStrategy<Value> {
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
pub(crate) fn deep() -> BoxedStrategy<Value> {
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

pub(crate) fn any_json() -> BoxedStrategy<Value> {
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
pub(crate) enum Edit {
    Replace(Index, Value),
    Remove(Index),
    Append(Index, Value),
    Truncate(Index, Index),
    Wrap(Index),
}

pub(crate) fn edit() -> BoxedStrategy<Edit> {
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

pub(crate) fn pointers(v: &Value, at: String, out: &mut Vec<String>) {
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

pub(crate) fn apply(v: &mut Value, e: &Edit) {
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
pub(crate) enum Form {
    /// Flat data, no shape (1-D only).
    Bare,
    /// Flat data with its shape.
    Dense,
    /// CSR, zeros left out.
    Sparse,
}

/// Writes `values` (`rows * cols`, row-major) as a wire tensor. Integral values are
/// written without a fraction, which is the most compact (and most amplifying) text.
pub(crate) fn tensor(
    values: &[f64],
    rows: usize,
    cols: usize,
    two_d: bool,
    form: Form,
    int: bool,
) -> Value {
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
pub(crate) struct Plan {
    pub(crate) tokens: Vec<i64>,
    pub(crate) k: usize,
    pub(crate) targets: Vec<i64>,
    pub(crate) weights: Vec<f64>,
    pub(crate) form: Form,
    pub(crate) two_d: bool,
    pub(crate) chunks: usize,
}

pub(crate) fn form() -> impl Strategy<Value = Form> {
    prop_oneof![Just(Form::Bare), Just(Form::Dense), Just(Form::Sparse)]
}

pub(crate) fn plan(rl: bool) -> BoxedStrategy<Plan> {
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

pub(crate) const LOSSES: [&str; 5] = [
    "cross_entropy",
    "importance_sampling",
    "ppo",
    "cispo",
    "dro",
];

/// A valid forward/backward body and its plans.
pub(crate) fn batch() -> BoxedStrategy<(Value, Vec<Plan>)> {
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
pub(crate) fn sample_body() -> BoxedStrategy<Value> {
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
pub(crate) fn compact_batch(
    n: usize,
    k: usize,
    datums: usize,
    inputs: usize,
    form: Form,
) -> Vec<u8> {
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
pub(crate) fn tree_elem() -> impl Strategy<Value = Value> {
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
pub(crate) fn other_bodies() -> Vec<(Kind, Value)> {
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
        (
            Kind::CreateCustomLoss,
            json!({"session_id": "s", "custom_loss_seq_id": 0, "name": "l",
                   "inputs": [{"name": "logprobs", "rank": 1}, {"name": "w", "rank": 1}],
                   "graph": {"format": 1, "nodes": [
                {"op": "placeholder", "name": "logprobs", "target": "logprobs"},
                {"op": "placeholder", "name": "w", "target": "w"},
                {"op": "call_function", "name": "mul", "target": "operator.mul",
                 "args": [{"ref": "logprobs"}, {"ref": "w"}]},
                {"op": "call_method", "name": "s", "target": "sum", "args": [{"ref": "mul"}]},
                {"op": "call_function", "name": "neg", "target": "operator.neg",
                 "args": [{"ref": "s"}]},
                {"op": "output", "name": "output", "target": "output",
                 "args": [{"tuple": [{"ref": "neg"}, {"dict": {"custom/l:sum": {"ref": "neg"}}}]}]}]}}),
        ),
        (
            Kind::Completion,
            json!({"model": "base", "prompt": [[1, 2], [3]], "max_tokens": 4,
                   "temperature": 0.5, "stop": ["x"], "n": 2, "logprobs": 1}),
        ),
        (
            Kind::ChatCompletion,
            json!({"model": "base", "messages": [{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": [{"type": "text", "text": "yo"}]}],
                   "max_tokens": 4, "top_p": 0.9, "response_format": {"type": "text"}}),
        ),
    ]
}
