//! A hostile tenant against a shared server: every request here once crashed, stalled or
//! leaked across keys on an earlier build. Each must now be refused (4xx with a JSON body)
//! or contained, and the server must go on serving every key.

mod common;

use common::http::*;
use serde_json::{json, Value};

fn data(seed: i64) -> Vec<Value> {
    let toks: Vec<i64> = (0..10).map(|i| (seed * 31 + i * 7) % 250 + 3).collect();
    vec![ce_datum(&toks[..9], &toks[1..])]
}

fn datum_with_targets(targets: Value) -> Value {
    json!({
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": [5]}]},
        "loss_fn_inputs": {"target_tokens": targets}
    })
}

/// The server still answers every key: health, a listing, a training step.
fn assert_alive(c: &Client, t: &mut Trainer) {
    assert_eq!(c.get("/api/v1/healthz").0, 200);
    let (status, v) = c.get("/api/v1/training_runs");
    assert_eq!(status, 200, "{v}");
    assert!(t.step(data(1), 1e-3).is_finite());
}

fn assert_refused(status: u16, body: &Value, needle: &str) {
    assert_eq!(status, 400, "{body}");
    let detail = body["detail"].as_str().unwrap_or_default();
    assert!(detail.contains(needle), "{needle:?} not in {detail:?}");
}

#[test]
fn declared_tensor_shapes_are_checked_before_anything_is_allocated() {
    let dir = temp_dir("hostile-shapes");
    let server = TestServer::start(&dir, |_| {});
    let a = server.client(KEY_A);
    let session = a.session();
    let mut t = Trainer::new(&a, &session, 0, 1);
    let cases = [
        // The ~600-byte request that aborted the process: 2^50 sparse targets, no data.
        (
            json!({"data": [], "dtype": "int64", "shape": [1, 1_125_899_906_842_624_u64],
                   "sparse_crow_indices": [0, 0], "sparse_col_indices": []}),
            "targets per position",
        ),
        // [n, k] with k beyond any use.
        (
            json!({"data": [], "dtype": "int64", "shape": [1, 100_000],
                   "sparse_crow_indices": [0, 0], "sparse_col_indices": []}),
            "targets per position",
        ),
        // A dense tensor whose shape disagrees with its data.
        (
            json!({"data": [3, 4], "dtype": "int64", "shape": [1, 3]}),
            "holds 3 values but 2 were sent",
        ),
        (
            json!({"data": [3], "dtype": "int64", "shape": [1, 0]}),
            "shape",
        ),
    ];
    for (targets, needle) in cases {
        let body = json!({"forward_backward_input": {"data": [datum_with_targets(targets)],
                           "loss_fn": "cross_entropy"}, "model_id": t.model_id});
        let (status, v) = a.post("/api/v1/forward_backward", &body);
        assert_refused(status, &v, needle);
    }
    // Other loss inputs: a sparse weight of a huge or overflowing shape.
    for shape in [json!([1, 1u64 << 50]), json!([1u64 << 40, 1u64 << 40])] {
        let d = json!({
            "model_input": {"chunks": [{"type": "encoded_text", "tokens": [5]}]},
            "loss_fn_inputs": {
                "target_tokens": {"data": [6], "dtype": "int64"},
                "weights": {"data": [], "dtype": "float32", "shape": shape,
                            "sparse_crow_indices": [0, 0], "sparse_col_indices": []}
            }
        });
        let body = json!({"forward_backward_input": {"data": [d], "loss_fn": "cross_entropy"},
                          "model_id": t.model_id});
        let (status, v) = a.post("/api/v1/forward_backward", &body);
        assert_refused(status, &v, "weights");
    }
    // Rejected without a model id too: validation never allocates first.
    let body = json!({"forward_backward_input": {"data": [datum_with_targets(
        json!({"data": [], "dtype": "int64", "shape": [1, 1u64 << 50],
               "sparse_crow_indices": [0, 0], "sparse_col_indices": []}))],
        "loss_fn": "cross_entropy"}, "model_id": "no-such-run"});
    let (status, v) = a.post("/api/v1/forward_backward", &body);
    assert_eq!(status, 400, "{v}");
    assert_alive(&server.client(KEY_B), &mut t);
    server.stop();
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn absurd_ttls_are_refused_and_a_stored_one_cannot_stop_the_engine() {
    let dir = temp_dir("hostile-ttl");
    let server = TestServer::start(&dir, |_| {});
    let a = server.client(KEY_A);
    let session = a.session();
    let mut t = Trainer::new(&a, &session, 0, 1);
    let uri = t.save_state("keep");
    let run = t.model_id.clone();
    let ttl_path = format!("/api/v1/training_runs/{run}/checkpoints/weights/keep/ttl");
    for ttl in [json!(1_000_000_000_000u64), json!(u64::MAX)] {
        let (status, v) = a.put(&ttl_path, &json!({ "ttl_seconds": ttl }));
        assert_refused(status, &v, "ttl_seconds");
    }
    // A save whose TTL once wrapped negative (and deleted the checkpoint within a second).
    t.seq += 1;
    let (status, v) = a.post(
        "/api/v1/save_weights",
        &json!({"model_id": run, "path": "wrapped", "seq_id": t.seq, "ttl_seconds": u64::MAX}),
    );
    assert_refused(status, &v, "ttl_seconds");
    // The refused save's seq_id is skipped: the run goes on at once.
    assert!(t.step(data(2), 1e-3).is_finite());
    // The longest allowed TTL lists fine.
    let (status, v) = a.put(
        &ttl_path,
        &json!({"ttl_seconds": lathe_server::engine::MAX_TTL_SECONDS}),
    );
    assert_eq!(status, 200, "{v}");
    let (status, v) = a.get("/api/v1/checkpoints");
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["checkpoints"][0]["tinker_path"], json!(uri));
    server.stop();

    // An expiry far beyond what any TTL gives (an older server's row, a hand-edited index)
    // must not stop the engine after a restart either.
    let db = rusqlite::Connection::open(dir.join("lathe.db")).unwrap();
    db.execute("UPDATE checkpoints SET expires_at = ?1", [i64::MAX / 2])
        .unwrap();
    drop(db);
    let server = TestServer::start(&dir, |_| {});
    let a = server.client(KEY_A);
    for _ in 0..2 {
        let (status, v) = a.get("/api/v1/checkpoints");
        assert_eq!(status, 200, "{v}");
        assert_eq!(
            v["checkpoints"][0]["expires_at"],
            json!("9999-12-31T23:59:59Z")
        );
        std::thread::sleep(std::time::Duration::from_millis(600));
    }
    assert_eq!(a.post("/api/v1/create_session", &json!({})).0, 200);
    server.stop();
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn seq_ids_far_ahead_are_refused_and_the_run_goes_on() {
    let dir = temp_dir("hostile-seq");
    let server = TestServer::start(&dir, |_| {});
    let a = server.client(KEY_A);
    let session = a.session();
    let mut t = Trainer::new(&a, &session, 0, 1);
    for seq in [u64::MAX, u64::MAX - 1, 1 << 40, t.seq + 2 + 1024] {
        let (status, v) = a.post(
            "/api/v1/forward_backward",
            &fb_body(&t.model_id, seq, data(3)),
        );
        assert_refused(status, &v, "ahead");
    }
    assert_alive(&a, &mut t);
    server.stop();
    let _ = std::fs::remove_dir_all(dir);
}

fn sample_status(c: &Client, sampler: &str) -> u16 {
    let (status, v) = c.post(
        "/api/v1/asample",
        &json!({"prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
                "sampling_params": {"max_tokens": 2, "seed": 1}, "num_samples": 1,
                "sampling_session_id": sampler}),
    );
    if status == 200 {
        c.wait(v["request_id"].as_str().unwrap())
            .unwrap_or_else(|e| panic!("sampling failed: {e}"));
    }
    status
}

#[test]
fn access_to_a_published_checkpoint_is_checked_at_every_use() {
    let dir = temp_dir("hostile-access");
    let server = TestServer::start(&dir, |_| {});
    let (a, b) = (server.client(KEY_A), server.client(KEY_B));
    let session = a.session();
    let mut t = Trainer::new(&a, &session, 0, 1);
    let uri = t.save_sampler("shared");
    let ckpt = format!(
        "/api/v1/training_runs/{}/checkpoints/sampler_weights/shared",
        t.model_id
    );
    assert_eq!(a.post(&format!("{ckpt}/publish"), &json!({})).0, 200);
    let b_session = b.session();
    let (status, v) = b.post(
        "/api/v1/create_sampling_session",
        &json!({"session_id": b_session, "sampling_session_seq_id": 0, "model_path": uri}),
    );
    assert_eq!(status, 200, "{v}");
    let sampler = v["sampling_session_id"].as_str().unwrap().to_string();
    assert_eq!(sample_status(&b, &sampler), 200);
    // Unpublished: B's open session loses access at once.
    assert_eq!(a.delete(&format!("{ckpt}/publish")).0, 200);
    assert_eq!(sample_status(&b, &sampler), 404);
    // Published again, the same version: access comes back.
    assert_eq!(a.post(&format!("{ckpt}/publish"), &json!({})).0, 200);
    assert_eq!(sample_status(&b, &sampler), 200);
    // Deleted and saved again, private, under the same name: B never sees the new one.
    assert_eq!(a.delete(&ckpt).0, 200);
    assert_eq!(sample_status(&b, &sampler), 404);
    t.step(data(4), 1e-2);
    assert_eq!(t.save_sampler("shared"), uri);
    assert_eq!(sample_status(&b, &sampler), 404);
    // Nor if A publishes the new one: B's session was opened on the old version.
    assert_eq!(a.post(&format!("{ckpt}/publish"), &json!({})).0, 200);
    assert_eq!(sample_status(&b, &sampler), 404);
    // A's own sessions follow the same rule, and A can open a new one.
    let (status, v) = a.post(
        "/api/v1/create_sampling_session",
        &json!({"session_id": session, "sampling_session_seq_id": 5, "model_path": uri}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        sample_status(&a, v["sampling_session_id"].as_str().unwrap()),
        200
    );
    server.stop();
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_second_server_on_the_same_data_dir_is_refused_and_the_first_keeps_its_checkpoints() {
    let dir = temp_dir("hostile-lock");
    let server = TestServer::start(&dir, |_| {});
    let a = server.client(KEY_A);
    let session = a.session();
    let mut t = Trainer::new(&a, &session, 0, 1);
    let uri = t.save_state("mine");
    let second = server.runtime.block_on(lathe_server::server::start(
        lathe_server::model::tiny::tiny_model(
            lathe_server::model::Arch::Llama,
            7,
            &candle_core::Device::Cpu,
        )
        .unwrap(),
        lathe_server::server::ServerConfig {
            port: 0,
            data_dir: dir.clone(),
            ..Default::default()
        },
    ));
    let err = second
        .err()
        .expect("a second server on the same dir must fail");
    assert!(err.to_string().contains("another lathe server"), "{err}");
    t.load_state(&uri, true);
    assert!(t.step(data(5), 1e-3).is_finite());
    server.stop();
    let _ = std::fs::remove_dir_all(dir);
}

fn assert_limited(status: u16, body: &Value, limit: &str) {
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["limit"], json!(limit), "{body}");
    assert_eq!(body["code"], json!("rate_limited"), "{body}");
}

#[test]
fn each_key_has_its_own_limits_and_one_at_a_limit_slows_no_one_else() {
    let dir = temp_dir("hostile-limits");
    let server = TestServer::start(&dir, |c| {
        c.engine.limits.queued_operations = 2;
        c.engine.limits.live_runs = 1;
        c.engine.limits.tokens_per_request = 50;
        c.engine.limits.sampling_tokens = 40;
        c.engine.limits.checkpoints = 1;
    });
    let (a, b) = (server.client(KEY_A), server.client(KEY_B));
    let session = a.session();
    let t = Trainer::new(&a, &session, 0, 1);
    // A second live run for the same key: 429 naming the limit, with Retry-After.
    let (status, v) = a.post(
        "/api/v1/create_model",
        &json!({"session_id": session, "model_seq_id": 1, "base_model": a.base_model(),
                "lora_config": {"rank": 4}}),
    );
    assert_limited(status, &v, "max_live_runs");
    // Operations queued behind a missing seq_id fill A's queue.
    let mut queued = Vec::new();
    for seq in [5, 6] {
        let (status, v) = a.post("/api/v1/forward", &forward_body(&t.model_id, seq, data(1)));
        assert_eq!(status, 200, "{v}");
        queued.push(v["request_id"].as_str().unwrap().to_string());
    }
    let resp = reqwest::blocking::Client::new()
        .post(format!("{}/api/v1/forward", server.url))
        .header("X-API-Key", KEY_A)
        .json(&forward_body(&t.model_id, 7, data(1)))
        .send()
        .unwrap();
    assert_eq!(resp.status().as_u16(), 429);
    assert_eq!(resp.headers()["retry-after"], "1");
    assert_limited(429, &resp.json().unwrap(), "max_queued_operations");
    // The operations the run waits for are admitted at the limit, the queue drains, and
    // the refused seq_id 7, sent again as the SDK does after Retry-After, runs.
    for seq in 1..=4 {
        a.call("/api/v1/forward", &forward_body(&t.model_id, seq, data(1)))
            .unwrap();
    }
    for id in &queued {
        a.wait(id).unwrap();
    }
    a.call("/api/v1/forward", &forward_body(&t.model_id, 7, data(1)))
        .unwrap();
    // Another key is not affected by A's queue.
    let b_session = b.session();
    let mut u = Trainer::new(&b, &b_session, 0, 2);
    assert!(u.step(data(2), 1e-3).is_finite());
    // Requests over a per-request limit are 400: retrying cannot help.
    let long: Vec<i64> = (0..60).map(|i| i % 50 + 3).collect();
    let (status, v) = b.post(
        "/api/v1/forward",
        &forward_body(
            &u.model_id,
            u.seq + 1,
            vec![ce_datum(&long[..59], &long[1..])],
        ),
    );
    assert_refused(status, &v, "--max-tokens-per-request");
    u.seq += 1; // the refused seq_id is used up, as the SDKs count it
    let sample = |c: &Client, n: usize| {
        c.post(
            "/api/v1/asample",
            &json!({"prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
                    "sampling_params": {"max_tokens": 8}, "num_samples": n,
                    "base_model": c.base_model()}),
        )
    };
    let (status, v) = sample(&b, 5);
    assert_refused(status, &v, "--max-sampling-tokens");
    let (status, v) = sample(&b, 2);
    assert_eq!(status, 200, "{v}");
    b.wait(v["request_id"].as_str().unwrap()).unwrap();
    // Checkpoints: one name fits; overwriting it is fine; a second name is refused.
    u.save_state("one");
    u.seq += 1;
    let (status, v) = b.post(
        "/api/v1/save_weights",
        &json!({"model_id": u.model_id, "path": "one", "seq_id": u.seq, "overwrite": true}),
    );
    assert_eq!(status, 200, "{v}");
    b.wait(v["request_id"].as_str().unwrap()).unwrap();
    u.seq += 1;
    let (status, v) = b.post(
        "/api/v1/save_weights",
        &json!({"model_id": u.model_id, "path": "two", "seq_id": u.seq}),
    );
    assert_limited(status, &v, "max_checkpoints");
    // A 429 keeps its seq_id open: once the key deletes a checkpoint, the same request
    // sent again (as the SDKs retry) saves, and the run goes on in order.
    let one = format!(
        "/api/v1/training_runs/{}/checkpoints/weights/one",
        u.model_id
    );
    assert_eq!(b.delete(&one).0, 200);
    b.call(
        "/api/v1/save_weights",
        &json!({"model_id": u.model_id, "path": "two", "seq_id": u.seq}),
    )
    .unwrap();
    assert!(u.step(data(3), 1e-3).is_finite());
    server.stop();
    let _ = std::fs::remove_dir_all(dir);
}

/// Sampling sessions close only with their session, so each key may hold a bounded
/// number open; past it the key gets a 429 naming the limit and other keys carry on.
#[test]
fn a_key_at_its_sampling_session_limit_is_refused_and_no_one_else() {
    let dir = temp_dir("hostile-samplers");
    let server = TestServer::start(&dir, |c| c.engine.limits.samplers = 2);
    let (a, b) = (server.client(KEY_A), server.client(KEY_B));
    let open = |c: &Client, session: &str, seq: u64| {
        c.post(
            "/api/v1/create_sampling_session",
            &json!({"session_id": session, "sampling_session_seq_id": seq,
                    "base_model": c.base_model()}),
        )
    };
    let session = a.session();
    for seq in 0..2 {
        let (status, v) = open(&a, &session, seq);
        assert_eq!(status, 200, "{v}");
    }
    let (status, v) = open(&a, &session, 2);
    assert_limited(status, &v, "max_samplers");
    // Another key is not limited by A's sessions.
    let other = b.session();
    let (status, v) = open(&b, &other, 0);
    assert_eq!(status, 200, "{v}");
    server.stop();
    let _ = std::fs::remove_dir_all(dir);
}

/// What axum's extractors reject before any handler runs (a malformed query string or
/// path segment, a missing query parameter) is answered in JSON too, in the API's shape.
#[test]
fn rejections_before_a_handler_are_json() {
    let dir = temp_dir("hostile-json-errors");
    let server = TestServer::start(&dir, |c| c.max_request_bytes = 4096);
    let a = server.client(KEY_A);
    for path in [
        "/api/v1/training_runs?limit=-1",
        "/api/v1/sessions/%FF",
        "/api/v1/lathe/archive",
    ] {
        let (status, v) = a.get(path);
        assert_eq!(status, 400, "{path}: {v}");
        assert!(
            v["detail"].as_str().is_some_and(|d| !d.is_empty()),
            "{path}: {v}"
        );
        assert_eq!(v["code"], "invalid_request", "{path}: {v}");
    }
    // A route that takes another method: 405 in JSON, its `Allow` header kept.
    let resp = reqwest::blocking::Client::new()
        .get(format!("{}/api/v1/forward_backward", server.url))
        .header("X-API-Key", KEY_A)
        .send()
        .unwrap();
    assert_eq!(resp.status().as_u16(), 405);
    assert!(resp.headers().contains_key("allow"));
    let v: Value = resp.json().unwrap();
    assert_eq!(v["code"], "method_not_allowed", "{v}");
    // Under /v1/, OpenAI's shape: an unknown path, a body over --max-request-bytes.
    let (status, v) = a.get("/v1/no-such-thing");
    assert_eq!(status, 404, "{v}");
    assert!(v["error"]["message"].is_string(), "{v}");
    let base = a.base_model();
    let (status, v) = a.post(
        "/v1/completions",
        &json!({"model": base, "prompt": "x".repeat(5000)}),
    );
    assert_eq!(status, 413, "{v}");
    assert_eq!(v["error"]["code"], "payload_too_large", "{v}");
    server.stop();
    let _ = std::fs::remove_dir_all(dir);
}

/// Only the requests that carry tokens take bodies up to `--max-request-bytes`; control
/// calls (decoded on the async threads, `create_session`'s metadata as a JSON tree) take
/// at most 1 MiB.
#[test]
fn control_calls_take_small_bodies_and_token_calls_large_ones() {
    let dir = temp_dir("hostile-body-limits");
    let server = TestServer::start(&dir, |c| c.max_request_bytes = 8 << 20);
    let a = server.client(KEY_A);
    let big = vec![0; 600_000];
    // Each refused body on a connection of its own: the server answers before reading
    // the body, then closes the connection.
    let (status, v) = server.client(KEY_A).post(
        "/api/v1/create_session",
        &json!({"tags": [], "user_metadata": {"x": big}, "sdk_version": "0.38.0"}),
    );
    assert_eq!(status, 413, "{v}");
    assert_eq!(v["code"], "payload_too_large", "{v}");
    let session = a.session();
    let (status, v) = server.client(KEY_A).post(
        "/api/v1/save_weights",
        &json!({"model_id": "x", "path": "a".repeat(2 << 20)}),
    );
    assert_eq!(status, 413, "{v}");
    // A forward_backward of the same size is read and judged on its content.
    let model_id = a.create_model(&session, 0, 4, 1);
    let (status, v) = a.post(
        "/api/v1/forward_backward",
        &json!({"model_id": model_id, "seq_id": 1, "forward_backward_input": {
            "loss_fn": "cross_entropy", "data": [{"model_input": {"chunks": [
                {"type": "encoded_text", "tokens": big}]}, "loss_fn_inputs": {}}]}}),
    );
    assert_eq!(status, 400, "{v}");
    assert_ne!(v["code"], "payload_too_large", "{v}");
    server.stop();
    let _ = std::fs::remove_dir_all(dir);
}

/// Adapter state held in memory is bounded per key (`--max-adapter-bytes`) and in all
/// (`--max-total-adapter-bytes`): a run (four times its adapter: weights, gradient, two
/// AdamW moments) or a sampler snapshot (one copy) that would pass either limit is
/// refused with a 429 naming it, and the refused key's other work goes on.
#[test]
fn adapter_state_in_memory_is_bounded_per_key_and_in_all() {
    use lathe_server::engine::LoraWidths;
    use lathe_server::model::{tiny::tiny_config, Arch};
    let w = LoraWidths::of(&tiny_config(Arch::Llama));
    // The rank-4 adapter on every part that `Trainer` creates.
    let unit = ((w.attn + w.mlp + w.unembed) * 4 * 4) as u64;
    let dir = temp_dir("hostile-adapter-bytes");
    let server = TestServer::start(&dir, |c| {
        c.engine.limits.adapter_bytes = 5 * unit;
        // An eighth is kept for the worker's cache of checkpoint adapters: 9.6 units
        // are left for runs and snapshots.
        c.engine.max_adapter_bytes = 11 * unit;
    });
    let (a, b) = (server.client(KEY_A), server.client(KEY_B));
    let snapshot = |c: &Client, model_id: &str, seq: u64| {
        c.post(
            "/api/v1/save_weights_for_sampler",
            &json!({"model_id": model_id, "seq_id": seq}),
        )
    };
    let session = a.session();
    let mut t = Trainer::new(&a, &session, 0, 1);
    let (status, v) = snapshot(&a, &t.model_id, 1);
    assert_eq!(status, 200, "a run and one snapshot: {v}");
    a.wait(v["request_id"].as_str().unwrap()).unwrap();
    let (status, v) = snapshot(&a, &t.model_id, 2);
    assert_limited(status, &v, "max_adapter_bytes");
    let (status, v) = a.post(
        "/api/v1/create_model",
        &json!({"session_id": session, "model_seq_id": 1, "base_model": a.base_model(),
                "lora_config": {"rank": 4}}),
    );
    assert_limited(status, &v, "max_adapter_bytes");
    // The refused snapshot kept its seq_id; the run goes on past it.
    t.seq = 1;
    assert!(t.step(data(2), 1e-3).is_finite());
    // B's run fits in the server's limit; its snapshot would pass it.
    let b_session = b.session();
    let u = Trainer::new(&b, &b_session, 0, 2);
    let (status, v) = snapshot(&b, &u.model_id, 1);
    assert_limited(status, &v, "max_total_adapter_bytes");
    server.stop();
    let _ = std::fs::remove_dir_all(dir);
}
