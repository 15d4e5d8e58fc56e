use lathe_sdk::types::{CustomLossGraph, CustomLossInput};
use serde::Deserialize;
use serde_json::{json, Value};

use super::*;

#[derive(Deserialize)]
struct Tensor {
    shape: Vec<usize>,
    data: Vec<f64>,
    #[serde(default)]
    int: bool,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    inputs: Vec<CustomLossInput>,
    graph: CustomLossGraph,
    logprobs: Tensor,
    values: Vec<Tensor>,
    loss: f64,
    grad: Vec<f64>,
    metrics: std::collections::BTreeMap<String, f64>,
}

fn cases() -> Vec<Case> {
    serde_json::from_str(include_str!(
        "../../../tests/data/custom_loss_reference.json"
    ))
    .unwrap()
}

fn array(t: &Tensor) -> Array {
    let kind = if t.int { Kind::Int } else { Kind::Float };
    Array::new(t.shape.clone(), t.data.clone(), kind)
}

fn run(loss: &CustomLoss, lp: &[f64], shape: &[usize], values: &[Tensor]) -> Evaluated {
    let lp = Array::new(shape.to_vec(), lp.to_vec(), Kind::Float);
    loss.evaluate(lp, values.iter().map(array).collect())
        .unwrap()
}

/// Close in absolute terms for small values and relative terms for large ones. The
/// reference casts some values to float32 (`.float()`), so agreement is to about 1e-7.
fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-6 * (1.0 + b.abs())
}

/// scripts/reference/custom_loss_reference.py's losses, traced by the tinker SDK and
/// run by PyTorch autograd: every allowed function, with the gradient conventions at
/// ties and kinks torch uses.
#[test]
fn custom_losses_match_pytorch() {
    for case in cases() {
        let loss = CustomLoss::compile(&case.name, &case.inputs, &case.graph)
            .unwrap_or_else(|e| panic!("{}: {e}", case.name));
        let out = run(
            &loss,
            &case.logprobs.data,
            &case.logprobs.shape,
            &case.values,
        );
        assert!(
            close(out.loss, case.loss),
            "{}: loss {} vs {}",
            case.name,
            out.loss,
            case.loss
        );
        for (i, (g, want)) in out.grad.iter().zip(&case.grad).enumerate() {
            assert!(close(*g, *want), "{}: grad[{i}] {g} vs {want}", case.name);
        }
        let keys: Vec<&str> = loss.metric_keys().collect();
        assert_eq!(keys.len(), case.metrics.len(), "{}", case.name);
        for (key, v) in keys.iter().zip(&out.metrics) {
            assert!(close(*v, case.metrics[*key]), "{}: {key} {v}", case.name);
        }
    }
}

/// The gradient is the derivative of the value: central differences of the
/// interpreter's own loss, for the reference losses that are smooth at their inputs and
/// do not detach (a detached term is in the value but, by design, not the gradient).
#[test]
fn gradients_match_finite_differences() {
    for case in cases() {
        if !["ppo", "bounds", "reductions", "shapes", "sequence"].contains(&case.name.as_str()) {
            continue;
        }
        let loss = CustomLoss::compile(&case.name, &case.inputs, &case.graph).unwrap();
        let shape = &case.logprobs.shape;
        let lp = &case.logprobs.data;
        let grad = run(&loss, lp, shape, &case.values).grad;
        let h = 1e-6;
        for i in 0..lp.len() {
            let at = |d: f64| {
                let mut x = lp.clone();
                x[i] += d;
                run(&loss, &x, shape, &case.values).loss
            };
            let fd = (at(h) - at(-h)) / (2.0 * h);
            assert!(
                (fd - grad[i]).abs() <= 1e-5 * (1.0 + fd.abs()),
                "{}: d/dlp[{i}]: finite difference {fd}, gradient {}",
                case.name,
                grad[i]
            );
        }
    }
}

fn node(op: &str, name: &str, target: &str, args: Value) -> Value {
    json!({"op": op, "name": name, "target": target, "args": args, "kwargs": {}})
}

fn placeholder(name: &str) -> Value {
    node("placeholder", name, name, json!([]))
}

fn output(loss: &str) -> Value {
    node(
        "output",
        "output",
        "output",
        json!([{"tuple": [{"ref": loss}, {"dict": {}}]}]),
    )
}

fn graph(nodes: Vec<Value>) -> CustomLossGraph {
    serde_json::from_value(json!({ "nodes": nodes })).unwrap()
}

fn logprobs(rank: u8) -> Vec<CustomLossInput> {
    vec![CustomLossInput {
        name: "logprobs".into(),
        rank,
    }]
}

fn compile_error(nodes: Vec<Value>) -> String {
    CustomLoss::compile("bad", &logprobs(1), &graph(nodes))
        .unwrap_err()
        .to_string()
}

#[test]
fn graphs_outside_the_allow_list_are_refused_by_name() {
    let call = |target: &str| {
        compile_error(vec![
            placeholder("logprobs"),
            node("call_function", "x", target, json!([{"ref": "logprobs"}])),
            output("x"),
        ])
    };
    for target in [
        "builtins.eval",
        "os.system",
        "torch.load",
        "torch.save",
        "math.exp",
    ] {
        let err = call(target);
        assert!(
            err.contains(target) && err.contains("not one this server allows"),
            "{err}"
        );
    }
    let err = compile_error(vec![
        placeholder("logprobs"),
        node("call_method", "x", "add_", json!([{"ref": "logprobs"}, 1])),
        output("x"),
    ]);
    assert!(
        err.contains("\"add_\""),
        "in-place methods are refused: {err}"
    );
    for (op, needle) in [("call_module", "modules"), ("get_attr", "captured")] {
        let err = compile_error(vec![
            placeholder("logprobs"),
            node(op, "x", "w", json!([])),
            output("x"),
        ]);
        assert!(err.contains(needle), "{err}");
    }
    let err = compile_error(vec![
        placeholder("logprobs"),
        node(
            "call_function",
            "x",
            "getattr",
            json!([{"ref": "logprobs"}, "grad_fn"]),
        ),
        output("x"),
    ]);
    assert!(err.contains("shape or ndim"), "{err}");
}

#[test]
fn malformed_graphs_are_refused_with_the_reason() {
    let cases: Vec<(Vec<Value>, &str)> = vec![
        (vec![placeholder("logprobs")], "no output"),
        (
            vec![placeholder("advantages"), output("advantages")],
            "does not match",
        ),
        (
            vec![
                placeholder("logprobs"),
                node("call_function", "x", "torch.exp", json!([{"ref": "later"}])),
                output("x"),
            ],
            "not an earlier node",
        ),
        (
            vec![
                placeholder("logprobs"),
                node(
                    "call_function",
                    "logprobs",
                    "torch.exp",
                    json!([{"ref": "logprobs"}]),
                ),
                output("logprobs"),
            ],
            "two nodes",
        ),
        (
            vec![
                placeholder("logprobs"),
                node(
                    "call_function",
                    "x",
                    "torch.sum",
                    json!([{"ref": "logprobs"}]),
                ),
                node(
                    "output",
                    "output",
                    "output",
                    json!([{"tuple": [{"ref": "x"}, {"dict": {"loss:sum": {"ref": "x"}}}]}]),
                ),
            ],
            "custom/<name>",
        ),
        (
            vec![
                placeholder("logprobs"),
                node(
                    "call_function",
                    "x",
                    "torch.sum",
                    json!([{"ref": "logprobs"}]),
                ),
                output("x"),
                node("call_function", "y", "torch.exp", json!([{"ref": "x"}])),
            ],
            "follow the output",
        ),
        (
            vec![
                placeholder("logprobs"),
                node(
                    "call_function",
                    "x",
                    "torch.sum",
                    json!([{"ref": "logprobs"}, 0, true, null, 5]),
                ),
                output("x"),
            ],
            "at most",
        ),
        (
            vec![
                placeholder("logprobs"),
                json!({"op": "call_function", "name": "x", "target": "torch.sum",
                       "args": [{"ref": "logprobs"}], "kwargs": {"out": {"ref": "logprobs"}}}),
                output("x"),
            ],
            "keyword argument \"out\"",
        ),
    ];
    for (nodes, needle) in cases {
        let err = compile_error(nodes);
        assert!(err.contains(needle), "{needle}: {err}");
    }
    let mut deep = json!(1);
    for _ in 0..20 {
        deep = json!([deep]);
    }
    let err = compile_error(vec![
        placeholder("logprobs"),
        node(
            "call_function",
            "x",
            "operator.getitem",
            json!([{"ref": "logprobs"}, deep]),
        ),
        output("x"),
    ]);
    assert!(err.contains("nest"), "{err}");
    let many: Vec<Value> = std::iter::once(placeholder("logprobs"))
        .chain((0..MAX_NODES).map(|i| {
            node(
                "call_function",
                &format!("n{i}"),
                "torch.exp",
                json!([{"ref": "logprobs"}]),
            )
        }))
        .collect();
    assert!(compile_error(many).contains("limit"));
    let bad_inputs = CustomLoss::compile(
        "x",
        &[CustomLossInput {
            name: "logprobs".into(),
            rank: 0,
        }],
        &graph(vec![placeholder("logprobs"), output("logprobs")]),
    );
    assert!(bad_inputs.unwrap_err().to_string().contains("rank 1"));
}

/// A loss of `logprobs` alone, with its body as the given nodes (the last is the loss).
fn loss_of(nodes: Vec<Value>) -> CustomLoss {
    let last = nodes.last().unwrap()["name"].as_str().unwrap().to_string();
    let mut all = vec![placeholder("logprobs")];
    all.extend(nodes);
    all.push(output(&last));
    CustomLoss::compile("t", &logprobs(1), &graph(all)).unwrap()
}

fn eval_error(loss: &CustomLoss, n: usize) -> String {
    let lp = Array::new(vec![n], vec![-0.5; n], Kind::Float);
    loss.evaluate(lp, Vec::new()).unwrap_err().to_string()
}

#[test]
fn run_time_failures_are_errors_naming_the_node_never_panics() {
    // The loss must be a 0-d tensor.
    let not_scalar = loss_of(vec![node(
        "call_function",
        "x",
        "torch.exp",
        json!([{"ref": "logprobs"}]),
    )]);
    assert!(eval_error(&not_scalar, 3).contains("0-d"));
    // log of a negative number: the loss is NaN, refused before it reaches the adapter.
    let nan = loss_of(vec![
        node(
            "call_function",
            "x",
            "torch.log",
            json!([{"ref": "logprobs"}]),
        ),
        node("call_method", "s", "sum", json!([{"ref": "x"}])),
    ]);
    assert!(eval_error(&nan, 3).contains("not a finite number"));
    // An outer product of a long sequence passes the per-tensor limit.
    let outer = loss_of(vec![
        node(
            "call_function",
            "col",
            "operator.getitem",
            json!([{"ref": "logprobs"}, {"tuple": [{"slice": [null, null, null]}, null]}]),
        ),
        node(
            "call_function",
            "x",
            "operator.mul",
            json!([{"ref": "col"}, {"ref": "logprobs"}]),
        ),
        node("call_method", "s", "sum", json!([{"ref": "x"}])),
    ]);
    let err = eval_error(&outer, 4096);
    assert!(err.contains("\"x\"") && err.contains("limit"), "{err}");
    // The same loss on a short sequence runs.
    let lp = Array::new(vec![3], vec![-1.0, -2.0, -3.0], Kind::Float);
    let out = outer.evaluate(lp, Vec::new()).unwrap();
    assert_eq!(out.loss, 36.0);
    assert_eq!(out.grad, vec![-12.0; 3]);
    // Indexing with a tensor, and a dimension that is not there.
    let advanced = loss_of(vec![
        node(
            "call_function",
            "i",
            "operator.gt",
            json!([{"ref": "logprobs"}, -1.0]),
        ),
        node(
            "call_function",
            "x",
            "operator.getitem",
            json!([{"ref": "logprobs"}, {"ref": "i"}]),
        ),
        node("call_method", "s", "sum", json!([{"ref": "x"}])),
    ]);
    assert!(eval_error(&advanced, 3).contains("advanced indexing"));
    let bad_dim = loss_of(vec![node(
        "call_method",
        "s",
        "sum",
        json!([{"ref": "logprobs"}, 3]),
    )]);
    assert!(eval_error(&bad_dim, 3).contains("out of range"));
    // A declared rank the datum does not have.
    let lp = Array::new(vec![1, 3], vec![-1.0; 3], Kind::Float);
    assert!(bad_dim
        .evaluate(lp, Vec::new())
        .unwrap_err()
        .to_string()
        .contains("rank"));
}

/// The triggers a hostile review found: each is an error (or a correct value), never a
/// panic, an abort or a huge allocation.
#[test]
fn hostile_shapes_slices_and_ranks_are_refused_before_anything_is_allocated() {
    // A step far past the dimension: one element, and no overflow computing the length.
    let huge_step = loss_of(vec![
        node(
            "call_function",
            "x",
            "operator.getitem",
            json!([{"ref": "logprobs"}, {"slice": [null, null, i64::MAX]}]),
        ),
        node("call_method", "s", "sum", json!([{"ref": "x"}])),
    ]);
    let lp = Array::new(vec![3], vec![-1.0, -2.0, -3.0], Kind::Float);
    let out = huge_step.evaluate(lp, Vec::new()).unwrap();
    assert_eq!((out.loss, out.grad), (-1.0, vec![1.0, 0.0, 0.0]));
    // An empty tensor reshaped to (0, 2^40), then reduced over its empty dimension: the
    // result would hold 2^40 elements.
    let empty_giant = loss_of(vec![
        node(
            "call_function",
            "e",
            "operator.getitem",
            json!([{"ref": "logprobs"}, {"slice": [0, 0, null]}]),
        ),
        node(
            "call_method",
            "r",
            "reshape",
            json!([{"ref": "e"}, 0, 1_i64 << 40]),
        ),
        node(
            "call_function",
            "l",
            "torch.logsumexp",
            json!([{"ref": "r"}, 0]),
        ),
        node("call_method", "s", "sum", json!([{"ref": "l"}])),
    ]);
    let err = eval_error(&empty_giant, 3);
    assert!(err.contains("\"r\"") && err.contains("limit"), "{err}");
    // Rank grown by indexing with None, one node at a time.
    let nones: Vec<Value> = vec![Value::Null; MAX_RANK + 1];
    let deep = loss_of(vec![
        node(
            "call_function",
            "x",
            "operator.getitem",
            json!([{"ref": "logprobs"}, {"tuple": nones}]),
        ),
        node("call_method", "s", "sum", json!([{"ref": "x"}])),
    ]);
    assert!(eval_error(&deep, 3).contains("dimensions"));
    let mut grow = vec![node(
        "call_method",
        "u0",
        "unsqueeze",
        json!([{"ref": "logprobs"}, 0]),
    )];
    for i in 1..=MAX_RANK {
        grow.push(node(
            "call_method",
            &format!("u{i}"),
            "unsqueeze",
            json!([{"ref": format!("u{}", i - 1)}, 0]),
        ));
    }
    grow.push(node(
        "call_method",
        "s",
        "sum",
        json!([{"ref": format!("u{MAX_RANK}")}]),
    ));
    assert!(eval_error(&loss_of(grow), 3).contains("dimensions"));
    assert!(checked_shape(&[0, 1 << 40]).is_err());
    assert!(checked_shape(&[usize::MAX, usize::MAX]).is_err());
    assert!(checked_shape(&[0, 5, 7]).is_ok());
}

#[test]
fn a_graph_holding_too_many_constants_or_sizes_is_refused_at_compile_time() {
    // reshape's sizes as separate positional arguments.
    let sizes: Vec<Value> = std::iter::once(json!({"ref": "logprobs"}))
        .chain((0..100).map(|_| json!(1)))
        .collect();
    let err = compile_error(vec![
        placeholder("logprobs"),
        node("call_method", "r", "reshape", Value::Array(sizes)),
        output("r"),
    ]);
    assert!(err.contains("limit"), "{err}");
    // Nested constant lists past the per-graph budget: 64 x 64 x 8 = 32K constants.
    let row: Vec<Value> = (0..64).map(|_| json!(1)).collect();
    let block: Vec<Value> = (0..64).map(|_| Value::Array(row.clone())).collect();
    let mut nodes = vec![placeholder("logprobs")];
    for i in 0..8 {
        nodes.push(node(
            "call_function",
            &format!("c{i}"),
            "torch.clamp",
            json!([{"ref": "logprobs"}, Value::Array(block.clone())]),
        ));
    }
    nodes.push(output("c7"));
    let err = compile_error(nodes);
    assert!(err.contains(&MAX_ARGS.to_string()), "{err}");
}

#[test]
fn a_retried_graph_with_a_nan_constant_equals_itself() {
    let nodes = || {
        vec![
            placeholder("logprobs"),
            node(
                "call_function",
                "m",
                "operator.gt",
                json!([{"ref": "logprobs"}, 0.0]),
            ),
            node(
                "call_method",
                "f",
                "masked_fill",
                json!([{"ref": "logprobs"}, {"ref": "m"}, {"float": "nan"}]),
            ),
            node("call_method", "s", "sum", json!([{"ref": "f"}])),
            output("s"),
        ]
    };
    let a = CustomLoss::compile("t", &logprobs(1), &graph(nodes())).unwrap();
    let b = CustomLoss::compile("t", &logprobs(1), &graph(nodes())).unwrap();
    assert_eq!(a, b);
    let other = CustomLoss::compile("u", &logprobs(1), &graph(nodes())).unwrap();
    assert_ne!(a, other, "a different name is a different loss");
}
