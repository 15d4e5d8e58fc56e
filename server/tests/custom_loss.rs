//! Server-side custom losses over HTTP (tinker 0.38's `create_custom_loss`): the
//! interpreter's numerics are tested in `train::custom` against PyTorch; here, the
//! endpoint's contract, training with a loss by its `loss_id`, and the rules on who may
//! use which loss.

mod common;

use common::http::*;
use serde_json::{json, Value};

/// `def loss(logprobs, <input>): l = -(logprobs * <input>).sum(); return l, {metric: l}`
/// as the SDK encodes its traced graph.
fn linear_loss(input: &str, rank: u8, metric: &str) -> Value {
    json!({
        "name": format!("times_{input}"),
        "inputs": [{"name": "logprobs", "rank": 1}, {"name": input, "rank": rank}],
        "graph": {"format": 1, "nodes": [
            {"op": "placeholder", "name": "logprobs", "target": "logprobs", "args": [], "kwargs": {}},
            {"op": "placeholder", "name": input, "target": input, "args": [], "kwargs": {}},
            {"op": "call_function", "name": "mul", "target": "operator.mul",
             "args": [{"ref": "logprobs"}, {"ref": input}], "kwargs": {}},
            {"op": "call_method", "name": "sum_1", "target": "sum", "args": [{"ref": "mul"}], "kwargs": {}},
            {"op": "call_function", "name": "neg", "target": "operator.neg", "args": [{"ref": "sum_1"}], "kwargs": {}},
            {"op": "output", "name": "output", "target": "output",
             "args": [{"tuple": [{"ref": "neg"}, {"dict": {metric: {"ref": "neg"}}}]}], "kwargs": {}}
        ]}
    })
}

/// `create_custom_loss` in `session` as number `seq`; returns the loss id.
fn create(c: &Client, session: &str, seq: u64, mut body: Value) -> Result<String, Value> {
    body["session_id"] = json!(session);
    body["custom_loss_seq_id"] = json!(seq);
    let (status, v) = c.post("/api/v1/create_custom_loss", &body);
    if status != 200 {
        return Err(v);
    }
    let r = c.wait(v["request_id"].as_str().unwrap())?;
    assert_eq!(r["type"], "create_custom_loss");
    Ok(r["loss_id"].as_str().unwrap().to_string())
}

fn custom_body(model_id: &str, seq: u64, data: Vec<Value>, loss_id: &str) -> Value {
    json!({"forward_backward_input": {"data": data, "loss_fn": "custom",
                                      "loss_fn_config": {"loss_id": loss_id}},
           "model_id": model_id, "seq_id": seq})
}

fn with_input(mut datum: Value, name: &str, tensor: Value) -> Value {
    datum["loss_fn_inputs"][name] = tensor;
    datum
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-5 * (1.0 + b.abs())
}

#[test]
fn a_custom_loss_trains_exactly_as_the_built_in_loss_it_spells_out() {
    let dir = temp_dir("custom-loss");
    let server = TestServer::start(&dir, |_| {});
    let alice = server.client(KEY_A);
    let session = alice.session();
    let neg_ll = create(
        &alice,
        &session,
        0,
        linear_loss("weights", 1, "custom/neg_ll:sum"),
    )
    .unwrap();
    let scaled = create(&alice, &session, 1, linear_loss("c", 0, "custom/c:mean")).unwrap();
    // Sending the same loss again under the same number (a client's retry) gives the
    // same id; another loss under that number is refused.
    let again = create(
        &alice,
        &session,
        0,
        linear_loss("weights", 1, "custom/neg_ll:sum"),
    );
    assert_eq!(again.unwrap(), neg_ll);
    // Repeats answer with the first creation's future while it lasts: a client sending
    // one creation over and over holds one future, not one per request.
    let mut body = linear_loss("weights", 1, "custom/neg_ll:sum");
    body["session_id"] = json!(session);
    body["custom_loss_seq_id"] = json!(0);
    let ids: Vec<Value> = (0..3)
        .map(|_| alice.post("/api/v1/create_custom_loss", &body).1["request_id"].clone())
        .collect();
    assert!(
        ids.iter().all(|id| id == &ids[0] && id.is_string()),
        "{ids:?}"
    );
    let clash = create(&alice, &session, 0, linear_loss("c", 0, "custom/c:mean")).unwrap_err();
    assert!(clash.to_string().contains("already names"), "{clash}");

    let data = vec![
        ce_datum(&[1, 2, 3, 4, 5], &[2, 3, 4, 5, 6]),
        ce_datum(&[7, 8, 9], &[8, 9, 10]),
    ];
    let mut builtin = Trainer::new(&alice, &session, 0, 7);
    let custom = Trainer::new(&alice, &session, 1, 7);
    let mut seq = 0;
    for step in 0..3 {
        let want = builtin.step(data.clone(), 5e-2);
        seq += 1;
        let got = alice
            .call(
                "/api/v1/forward_backward",
                &custom_body(&custom.model_id, seq, data.clone(), &neg_ll),
            )
            .unwrap();
        let m = &got["metrics"];
        let loss = m["loss:sum"].as_f64().unwrap();
        assert!(close(loss, want), "step {step}: {loss} vs {want}");
        assert!(close(m["custom/neg_ll:sum"].as_f64().unwrap(), want), "{m}");
        // A linear loss is its own linearisation.
        assert!(
            close(m["surrogate_loss:sum"].as_f64().unwrap(), want),
            "{m}"
        );
        let outputs = got["loss_fn_outputs"].as_array().unwrap();
        assert_eq!(outputs.len(), 2);
        assert_eq!(outputs[0]["logprobs"]["shape"], json!([5]));
        seq += 1;
        alice
            .call(
                "/api/v1/optim_step",
                &optim_body(&custom.model_id, seq, 5e-2),
            )
            .unwrap();
    }

    // A rank-0 input: c = 2 doubles the loss; a `:mean` metric is averaged over datums.
    let two = json!({"data": [2.0], "dtype": "float32", "shape": []});
    let doubled: Vec<Value> = data
        .iter()
        .map(|d| with_input(d.clone(), "c", two.clone()))
        .collect();
    let plain = builtin.forward_loss(data.clone());
    seq += 1;
    let mut forward = custom_body(&custom.model_id, seq, doubled, &scaled);
    forward["forward_input"] = forward
        .as_object_mut()
        .unwrap()
        .remove("forward_backward_input")
        .unwrap();
    let r = alice.call("/api/v1/forward", &forward).unwrap();
    let loss = r["metrics"]["loss:sum"].as_f64().unwrap();
    assert!(close(loss, 2.0 * plain), "{loss} vs 2 x {plain}");
    assert!(
        close(r["metrics"]["custom/c:mean"].as_f64().unwrap(), loss / 2.0),
        "{r}"
    );
    server.stop();
}

#[test]
fn custom_losses_belong_to_their_session_and_bad_ones_are_refused() {
    let dir = temp_dir("custom-loss-rules");
    let server = TestServer::start(&dir, |_| {});
    let alice = server.client(KEY_A);
    let bob = server.client(KEY_B);
    let session = alice.session();
    let other_session = alice.session();
    let loss = create(
        &alice,
        &session,
        0,
        linear_loss("weights", 1, "custom/l:sum"),
    )
    .unwrap();
    let data = vec![ce_datum(&[1, 2, 3], &[2, 3, 4])];

    // Only the runs of the session that created the loss may use it.
    let mine = alice.create_model(&session, 0, 4, 1);
    let elsewhere = alice.create_model(&other_session, 0, 4, 1);
    let bobs = bob.create_model(&bob.session(), 0, 4, 1);
    for (c, run) in [(&alice, &elsewhere), (&bob, &bobs)] {
        let (status, v) = c.post(
            "/api/v1/forward_backward",
            &custom_body(run, 1, data.clone(), &loss),
        );
        assert_eq!(status, 400, "{v}");
        assert!(v.to_string().contains("unknown custom loss"), "{v}");
    }
    // Bob cannot create a loss in Alice's session either.
    let err = create(&bob, &session, 5, linear_loss("weights", 1, "custom/l:sum")).unwrap_err();
    assert!(err.to_string().contains("unknown session"), "{err}");

    // Graphs outside the allow-list and malformed declarations: 400 naming the problem.
    let mut evil = linear_loss("weights", 1, "custom/l:sum");
    evil["graph"]["nodes"][2]["target"] = json!("torch.load");
    let err = create(&alice, &session, 1, evil).unwrap_err();
    assert!(err.to_string().contains("torch.load"), "{err}");
    let mut misdeclared = linear_loss("weights", 1, "custom/l:sum");
    misdeclared["inputs"][0]["name"] = json!("weights");
    let err = create(&alice, &session, 2, misdeclared).unwrap_err();
    assert!(err.to_string().contains("logprobs"), "{err}");
    // A graph body past any graph the compiler takes (1 MiB; --max-request-bytes is
    // larger): refused before it is decoded (on a connection of its own, which the
    // server closes after answering without reading the body).
    let mut huge = linear_loss("weights", 1, "custom/l:sum");
    huge["graph"]["nodes"][2]["args"] = json!([vec![0; 600_000]]);
    let err = create(&server.client(KEY_A), &session, 6, huge).unwrap_err();
    assert_eq!(err["code"], "payload_too_large", "{err}");

    // Datums that do not fit the loss, and a custom loss without its id.
    let no_weights = vec![json!({
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
        "loss_fn_inputs": {"target_tokens": {"data": [2, 3], "dtype": "int64", "shape": [2]}}
    })];
    let wrong_rank = vec![with_input(
        data[0].clone(),
        "weights",
        json!({"data": [1.0], "dtype": "float32", "shape": []}),
    )];
    let cases = [
        (
            custom_body(&mine, 1, no_weights, &loss),
            "is missing; custom loss",
        ),
        (custom_body(&mine, 1, wrong_rank, &loss), "rank 0"),
        (
            json!({"forward_backward_input": {"data": data, "loss_fn": "custom"},
                   "model_id": mine, "seq_id": 1}),
            "loss_id",
        ),
    ];
    for (body, needle) in cases {
        let (status, v) = alice.post("/api/v1/forward_backward", &body);
        assert_eq!(status, 400, "{v}");
        assert!(v.to_string().contains(needle), "{needle}: {v}");
    }

    // A loss that fails on a datum (log of a log-probability is NaN) fails its own
    // request with the reason; the run goes on.
    let mut nan = linear_loss("weights", 1, "custom/l:sum");
    nan["graph"]["nodes"][2] = json!({"op": "call_function", "name": "mul", "target": "torch.log",
                                      "args": [{"ref": "logprobs"}], "kwargs": {}});
    let nan_id = create(&alice, &session, 3, nan).unwrap();
    let err = alice
        .call(
            "/api/v1/forward_backward",
            &custom_body(&mine, 2, data.clone(), &nan_id),
        )
        .unwrap_err();
    assert!(err.to_string().contains("not a finite number"), "{err}");
    alice
        .call(
            "/api/v1/forward_backward",
            &custom_body(&mine, 3, data.clone(), &loss),
        )
        .unwrap();
    server.stop();
}
