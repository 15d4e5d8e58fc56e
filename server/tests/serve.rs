//! The server end to end over loopback HTTP, on a tiny model: every protocol flow,
//! ordering, isolation, limits, restart.

mod common;

use std::time::Duration;

use common::http::*;
use serde_json::{json, Value};

fn data(seed: i64) -> Vec<Value> {
    let toks: Vec<i64> = (0..12).map(|i| (seed * 37 + i * 11) % 250 + 3).collect();
    vec![ce_datum(&toks[..11], &toks[1..])]
}

#[test]
fn whole_flow_over_http() {
    let dir = temp_dir("flow");
    let srv = TestServer::start(&dir, |_| {});
    let c = srv.client(KEY_A);
    let session = c.session();
    let mut t = Trainer::new(&c, &session, 0, 1);
    let info = c.ok(
        "/api/v1/get_info",
        &json!({"model_id": t.model_id, "type": "get_info"}),
    );
    assert_eq!(info["lora_rank"], 4);
    assert_eq!(info["model_data"]["arch"], "llama");

    let s = 1;
    t.seq = 1;
    let fb = c
        .call(
            "/api/v1/forward_backward",
            &fb_body(&t.model_id, s, data(1)),
        )
        .unwrap();
    let lp = fb["loss_fn_outputs"][0]["logprobs"]["data"]
        .as_array()
        .unwrap();
    assert_eq!(lp.len(), 11);
    assert!(fb["metrics"]
        .as_object()
        .unwrap()
        .keys()
        .all(|k| k.matches(':').count() == 1));
    let first = loss_of(&fb);
    t.seq += 1;
    let opt = c
        .call("/api/v1/optim_step", &optim_body(&t.model_id, t.seq, 1e-2))
        .unwrap();
    assert!(opt["metrics"]["grad_norm:mean"].as_f64().unwrap() > 0.0);
    assert!(t.forward_loss(data(1)) < first, "one step lowers the loss");

    let state = t.save_state("s1");
    assert!(state.ends_with("/weights/s1") && state.starts_with("tinker://"));
    let sampler_path = t.save_sampler("p1");
    assert!(sampler_path.ends_with("/sampler_weights/p1"));

    // Snapshot sampler (save_weights_and_get_sampling_client).
    t.seq += 1;
    let snap = c
        .call(
            "/api/v1/save_weights_for_sampler",
            &json!({"model_id": t.model_id, "seq_id": t.seq, "sampling_session_seq_id": 0}),
        )
        .unwrap();
    let sampler = snap["sampling_session_id"].as_str().unwrap().to_string();
    assert_eq!(sampler, format!("{session}:sample:0"));
    let sub = c.ok(
        "/api/v1/asample",
        &json!({"num_samples": 2, "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
                "sampling_params": {"max_tokens": 5, "seed": 3, "temperature": 1.0},
                "sampling_session_id": sampler, "prompt_logprobs": true}),
    );
    assert_eq!(sub["sample_sequence_ids"].as_array().unwrap().len(), 2);
    let res = c.wait(sub["request_id"].as_str().unwrap()).unwrap();
    assert_eq!(res["sequences"].as_array().unwrap().len(), 2);
    let plp = res["prompt_logprobs"].as_array().unwrap();
    assert_eq!(plp.len(), 3);
    assert!(plp[0].is_null() && plp[1].as_f64().unwrap() < 0.0);
    let (status, got) = c.get(&format!("/api/v1/samplers/{sampler}"));
    assert_eq!(
        (status, got["sampler_id"].as_str()),
        (200, Some(sampler.as_str()))
    );

    // A sampling session on the saved sampler weights.
    let s2 = c.ok(
        "/api/v1/create_sampling_session",
        &json!({"session_id": session, "sampling_session_seq_id": 1, "model_path": sampler_path}),
    );
    let s2 = s2["sampling_session_id"].as_str().unwrap();
    let r2 = c
        .call(
            "/api/v1/asample",
            &json!({"prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
                    "sampling_params": {"max_tokens": 4, "temperature": 0.0},
                    "sampling_session_id": s2}),
        )
        .unwrap();
    assert_eq!(r2["sequences"][0]["tokens"].as_array().unwrap().len(), 4);

    // weights_info and REST listings.
    let wi = c.ok("/api/v1/weights_info", &json!({"tinker_path": state}));
    assert_eq!(
        (wi["lora_rank"].as_u64(), wi["train_mlp"].as_bool()),
        (Some(4), Some(true))
    );
    let (_, runs) = c.get("/api/v1/training_runs?limit=20&offset=0");
    assert_eq!(
        runs["training_runs"][0]["training_run_id"],
        t.model_id.as_str()
    );
    assert_eq!(runs["cursor"]["total_count"], 1);
    let (_, ck) = c.get(&format!("/api/v1/training_runs/{}/checkpoints", t.model_id));
    let mut kinds: Vec<&str> = ck["checkpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["checkpoint_type"].as_str().unwrap())
        .collect();
    kinds.sort();
    assert_eq!(kinds, ["sampler", "training"]);

    // Archive: a 302 to a signed link serving a tar with the PEFT files.
    let (status, _) = c.get(&format!(
        "/api/v1/training_runs/{}/checkpoints/weights/s1/archive",
        t.model_id
    ));
    assert_eq!(status, 302);
    let http = reqwest::blocking::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let resp = http
        .get(format!(
            "{}/api/v1/training_runs/{}/checkpoints/weights/s1/archive",
            srv.url, t.model_id
        ))
        .header("X-API-Key", KEY_A)
        .send()
        .unwrap();
    let location = resp.headers()["location"].to_str().unwrap().to_string();
    assert!(resp.headers().contains_key("expires"));
    let resp = http.get(location).send().unwrap();
    let length: Option<u64> = resp
        .headers()
        .get("content-length")
        .map(|v| v.to_str().unwrap().parse().unwrap());
    let tar = resp.bytes().unwrap();
    assert_eq!(
        length,
        Some(tar.len() as u64),
        "the tar's length is announced"
    );
    let mut names: Vec<String> = tar::Archive::new(tar.as_ref())
        .entries()
        .unwrap()
        .map(|e| e.unwrap().path().unwrap().display().to_string())
        .collect();
    names.sort();
    assert!(
        names.contains(&"adapter_model.safetensors".to_string()),
        "{names:?}"
    );
    assert!(names.contains(&"checkpoint_complete".to_string()));

    // TTL, delete.
    let (status, _) = c.put(
        &format!(
            "/api/v1/training_runs/{}/checkpoints/sampler_weights/p1/ttl",
            t.model_id
        ),
        &json!({"ttl_seconds": 3600}),
    );
    assert_eq!(status, 200);
    let (_, ck) = c.get("/api/v1/checkpoints?limit=100&offset=0");
    assert!(ck["checkpoints"]
        .as_array()
        .unwrap()
        .iter()
        .any(|c| !c["expires_at"].is_null()));
    let (status, _) = c.delete(&format!(
        "/api/v1/training_runs/{}/checkpoints/sampler_weights/p1",
        t.model_id
    ));
    assert_eq!(status, 200);
    let (_, ck) = c.get(&format!("/api/v1/training_runs/{}/checkpoints", t.model_id));
    assert_eq!(ck["checkpoints"].as_array().unwrap().len(), 1);

    // The tokenizer extension.
    let (status, tok) = c.get("/api/v1/lathe/tokenizer");
    assert_eq!(status, 200);
    assert!(tok["tokenizer"]["model"].is_object());
    assert!(tok["base_model"].is_string(), "{}", tok["base_model"]);
    // The next caller gets the same answer.
    assert_eq!(c.get("/api/v1/lathe/tokenizer"), (200, tok));
    srv.stop();
}

#[test]
fn least_recently_used_snapshots_are_freed_and_work_keeps_a_session_alive() {
    let dir = temp_dir("snap");
    let srv = TestServer::start(&dir, |cfg| {
        cfg.engine.session_timeout = Duration::from_secs(2)
    });
    let c = srv.client(KEY_A);
    let session = c.session();
    let mut t = Trainer::new(&c, &session, 0, 1);
    let sample = |id: &str| {
        c.post(
            "/api/v1/asample",
            &json!({"prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
                    "sampling_params": {"max_tokens": 2}, "sampling_session_id": id}),
        )
        .0
    };
    let mut samplers = Vec::new();
    for i in 0..=lathe_server::engine::MAX_SNAPSHOTS_PER_RUN {
        // Training without heartbeats for longer than the timeout keeps the session.
        std::thread::sleep(Duration::from_millis(600));
        t.step(data(i as i64), 1e-2);
        t.seq += 1;
        let v = c
            .call(
                "/api/v1/save_weights_for_sampler",
                &json!({"model_id": t.model_id, "seq_id": t.seq, "sampling_session_seq_id": i}),
            )
            .unwrap();
        samplers.push(v["sampling_session_id"].as_str().unwrap().to_string());
        // The first snapshot stays in use, as a recipe's long-lived sampler does.
        assert_eq!(sample(&samplers[0]), 200);
    }
    assert_eq!(sample(&samplers[0]), 200, "a snapshot in use is kept");
    assert_eq!(
        sample(&samplers[1]),
        404,
        "the least recently used snapshot was freed"
    );
    assert_eq!(sample(samplers.last().unwrap()), 200);
    srv.stop();
}

#[test]
fn seq_ids_are_reordered_and_repeats_deduplicated() {
    let dir = temp_dir("seq");
    let srv = TestServer::start(&dir, |_| {});
    let c = srv.client(KEY_A);
    let session = c.session();
    let run = c.create_model(&session, 0, 4, 1);
    // optim_step (seq 2) arrives before the forward_backward (seq 1) it depends on.
    let opt = c.ok("/api/v1/optim_step", &optim_body(&run, 2, 1e-2));
    let fb = c.ok("/api/v1/forward_backward", &fb_body(&run, 1, data(2)));
    let again = c.ok("/api/v1/forward_backward", &fb_body(&run, 1, data(2)));
    assert_eq!(
        fb["request_id"], again["request_id"],
        "a repeated seq_id is the same request"
    );
    c.wait(fb["request_id"].as_str().unwrap()).unwrap();
    let o = c.wait(opt["request_id"].as_str().unwrap()).unwrap();
    assert!(
        o["metrics"]["grad_norm:mean"].as_f64().unwrap() > 0.0,
        "optim ran after fb"
    );
    // An optimizer step with no gradient is a user error.
    let err = c
        .call("/api/v1/optim_step", &optim_body(&run, 3, 1e-2))
        .unwrap_err();
    assert_eq!(err["category"], "user");
    srv.stop();
}

/// Runs `steps` training steps for two runs, either concurrently (two threads, two keys,
/// one server) or one run per fresh server; returns each run's losses.
fn two_runs(concurrent: bool) -> Vec<Vec<f64>> {
    let steps = 4;
    let job = |c: Client, seed: i64| {
        move || {
            let session = c.session();
            let mut t = Trainer::new(&c, &session, 0, seed as u64);
            let mut losses: Vec<f64> = (0..steps).map(|_| t.step(data(seed), 1e-2)).collect();
            losses.push(t.forward_loss(data(seed)));
            losses
        }
    };
    if concurrent {
        let srv = TestServer::start(&temp_dir("two"), |_| {});
        let a = std::thread::spawn(job(srv.client(KEY_A), 1));
        let b = std::thread::spawn(job(srv.client(KEY_B), 2));
        let out = vec![a.join().unwrap(), b.join().unwrap()];
        srv.stop();
        out
    } else {
        [(KEY_A, 1), (KEY_B, 2)]
            .into_iter()
            .map(|(key, seed)| {
                let srv = TestServer::start(&temp_dir("solo"), |_| {});
                let out = job(srv.client(key), seed)();
                srv.stop();
                out
            })
            .collect()
    }
}

#[test]
fn two_concurrent_sessions_stay_independent() {
    let together = two_runs(true);
    let alone = two_runs(false);
    for (t, a) in together.iter().zip(&alone) {
        for (x, y) in t.iter().zip(a) {
            assert!((x - y).abs() <= 1e-4 * y.abs().max(1.0), "{t:?} vs {a:?}");
        }
    }
    assert!(
        (together[0][0] - together[1][0]).abs() > 1e-3,
        "different data, different losses"
    );
}

#[test]
fn keys_own_their_runs_and_published_checkpoints_are_shared() {
    let dir = temp_dir("auth");
    let srv = TestServer::start(&dir, |_| {});
    let a = srv.client(KEY_A);
    let b = srv.client(KEY_B);
    assert_eq!(
        srv.client("").post("/api/v1/create_session", &json!({})).0,
        401
    );
    assert_eq!(
        srv.client("tml-wrong")
            .post("/api/v1/create_session", &json!({}))
            .0,
        401
    );
    // JWT exchange: the token works in place of the key.
    let jwt = a.ok("/api/v1/auth/token", &json!({}))["jwt"]
        .as_str()
        .unwrap()
        .to_string();
    let a_jwt = srv.client(&jwt);
    let session = a_jwt.session();
    let mut t = Trainer::new(&a_jwt, &session, 0, 1);
    t.step(data(1), 1e-2);
    let uri = t.save_state("shared");
    // Bob sees none of it.
    assert_eq!(
        b.post("/api/v1/get_info", &json!({"model_id": t.model_id}))
            .0,
        404
    );
    assert_eq!(
        b.get(&format!("/api/v1/training_runs/{}", t.model_id)).0,
        404
    );
    let (_, runs) = b.get("/api/v1/training_runs");
    assert_eq!(runs["training_runs"].as_array().unwrap().len(), 0);
    assert_eq!(
        b.post("/api/v1/weights_info", &json!({"tinker_path": uri}))
            .0,
        404
    );
    assert_eq!(
        b.post(
            "/api/v1/forward_backward",
            &fb_body(&t.model_id, 9, data(1))
        )
        .0,
        404
    );
    // Until Alice publishes it.
    let ckpt = format!(
        "/api/v1/training_runs/{}/checkpoints/weights/shared",
        t.model_id
    );
    assert_eq!(
        b.post(&format!("{ckpt}/publish"), &json!({})).0,
        404,
        "only the owner publishes"
    );
    assert_eq!(a.post(&format!("{ckpt}/publish"), &json!({})).0, 200);
    assert_eq!(
        b.post("/api/v1/weights_info", &json!({"tinker_path": uri}))
            .0,
        200
    );
    let bs = b.session();
    let mut bt = Trainer::new(&b, &bs, 0, 5);
    bt.load_state(&uri, true);
    assert_eq!(a.delete(&format!("{ckpt}/publish")).0, 200);
    assert_eq!(
        b.post("/api/v1/weights_info", &json!({"tinker_path": uri}))
            .0,
        404
    );
    srv.stop();
}

#[test]
fn restart_lists_checkpoints_and_resumes_exactly() {
    let dir = temp_dir("restart");
    let srv = TestServer::start(&dir, |_| {});
    let c = srv.client(KEY_A);
    let session = c.session();
    let mut t = Trainer::new(&c, &session, 0, 1);
    t.step(data(1), 1e-2);
    let state = t.save_state("s1");
    let sampler = t.save_sampler("p1");
    t.step(data(3), 1e-2);
    let expected = t.forward_loss(data(3));
    let sample = |c: &Client, session: &str, seq: u64| -> Value {
        let s = c.ok(
            "/api/v1/create_sampling_session",
            &json!({"session_id": session, "sampling_session_seq_id": seq, "model_path": sampler}),
        );
        c.call(
            "/api/v1/asample",
            &json!({"prompt": {"chunks": [{"type": "encoded_text", "tokens": [9, 8, 7]}]},
                    "sampling_params": {"max_tokens": 6, "seed": 11, "temperature": 1.0},
                    "sampling_session_id": s["sampling_session_id"], "num_samples": 2}),
        )
        .unwrap()["sequences"]
            .clone()
    };
    let before = sample(&c, &session, 1);
    srv.stop();

    let srv = TestServer::start(&dir, |_| {});
    let c = srv.client(KEY_A);
    let (_, ck) = c.get(&format!("/api/v1/training_runs/{}/checkpoints", t.model_id));
    assert_eq!(ck["checkpoints"].as_array().unwrap().len(), 2);
    // The old run is listed but no longer loaded.
    let (status, err) = c.post("/api/v1/forward", &forward_body(&t.model_id, 99, data(1)));
    assert_eq!(status, 404);
    assert!(
        err["detail"].as_str().unwrap().contains("no longer loaded"),
        "{err}"
    );
    let session = c.session();
    let mut r = Trainer::new(&c, &session, 0, 77);
    r.load_state(&state, true);
    r.step(data(3), 1e-2);
    assert_eq!(
        r.forward_loss(data(3)),
        expected,
        "identical optimizer state after restart"
    );
    assert_eq!(
        sample(&c, &session, 1),
        before,
        "the sampler samples what it did before"
    );
    srv.stop();
}

#[test]
fn limits_are_enforced_with_clear_errors() {
    let dir = temp_dir("limits");
    let srv = TestServer::start(&dir, |cfg| {
        cfg.engine.max_sessions = 1;
        cfg.max_request_bytes = 64 * 1024;
        cfg.engine.session_timeout = Duration::from_secs(1);
    });
    let c = srv.client(KEY_A);
    let session = c.session();
    c.create_model(&session, 0, 4, 1);
    let (status, err) = c.post(
        "/api/v1/create_model",
        &json!({"session_id": session, "model_seq_id": 1, "base_model": c.base_model(),
                "lora_config": {"rank": 4}}),
    );
    assert_eq!(
        (status, err["code"].as_str()),
        (400, Some("capacity")),
        "{err}"
    );
    let big = vec![b' '; 100 * 1024];
    let (status, err) = c.post_raw("/api/v1/create_session", big);
    assert_eq!(status, 413, "{err}");
    assert!(err["detail"].is_string());
    // No heartbeat for longer than the timeout: the session expires, its run is unloaded.
    std::thread::sleep(Duration::from_millis(2500));
    let (status, _) = c.post("/api/v1/session_heartbeat", &json!({"session_id": session}));
    assert_eq!(status, 410);
    let (_, runs) = c.get("/api/v1/training_runs");
    assert_eq!(
        runs["training_runs"].as_array().unwrap().len(),
        1,
        "the run stays listed"
    );
    srv.stop();
}

#[test]
fn a_finished_session_answers_gone_and_finishing_again_is_harmless() {
    let dir = temp_dir("finish");
    let srv = TestServer::start(&dir, |_| {});
    let c = srv.client(KEY_A);
    let session = c.session();
    let t = Trainer::new(&c, &session, 0, 1);
    let finish = |client: &Client, status: &str| {
        client.post(
            &format!("/api/v1/sessions/{session}/finish"),
            &json!({"reason": {"type": status}, "detail": null}),
        )
    };
    let (status, v) = finish(&srv.client(KEY_B), "success");
    assert_eq!(status, 404, "another key cannot finish it: {v}");
    let (status, _) = c.post(
        &format!("/api/v1/sessions/{session}/finish"),
        &json!({"reason": {"type": 5}}),
    );
    assert_eq!(status, 400, "a status that is not a string");
    assert_eq!(finish(&c, "errored"), (200, json!({})));
    let (status, v) = c.post(
        "/api/v1/session_heartbeat",
        &json!({"session_id": session, "type": "session_heartbeat"}),
    );
    assert_eq!(status, 410, "{v}");
    assert!(v["detail"].as_str().unwrap().contains("errored"), "{v}");
    // The first reason stays; the run is gone; the session takes no new runs.
    assert_eq!(finish(&c, "success").0, 200);
    let (_, v) = c.post("/api/v1/session_heartbeat", &json!({"session_id": session}));
    assert!(v["detail"].as_str().unwrap().contains("errored"));
    let (status, _) = c.post("/api/v1/get_info", &json!({"model_id": t.model_id}));
    assert_eq!(status, 404);
    let (status, _) = c.post(
        "/api/v1/create_model",
        &json!({"session_id": session, "model_seq_id": 1, "base_model": c.base_model(),
                "lora_config": {"rank": 4}}),
    );
    assert_eq!(status, 410);
    srv.stop();
}

#[test]
fn retrieve_futures_reports_each_sampling_clients_completions_once() {
    let dir = temp_dir("retrieve-futures");
    let server = TestServer::start(&dir, |_| {});
    let c = server.client(KEY_A);
    let session = c.session();
    let sampler = c.ok(
        "/api/v1/create_sampling_session",
        &json!({"session_id": session, "sampling_session_seq_id": 0,
                "base_model": c.base_model()}),
    )["sampling_session_id"]
        .as_str()
        .unwrap()
        .to_string();
    let sample = |seq: u64| {
        c.ok(
            "/api/v1/asample",
            &json!({"sampling_session_id": sampler, "seq_id": seq, "num_samples": 1,
                    "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
                    "sampling_params": {"max_tokens": 3}}),
        )["request_id"]
            .as_str()
            .unwrap()
            .to_string()
    };
    // A copy of the client first joins the session for its id (the SDK's order).
    let joined = c.ok(
        "/api/v1/join_sampling_session",
        &json!({"sampling_session_id": sampler, "type": "join_sampling_session"}),
    );
    assert_eq!(joined["client_counter"], 1);
    let (mine, copys) = (sample(1), sample(1_000_000_001));
    let poll = |clone: u64, cursor: u64| {
        c.ok(
            "/api/v1/retrieve_futures",
            &json!({"target": {"type": "sampling_session", "sampling_session_id": sampler,
                               "cloned_sampler_id": clone},
                    "prev_cursor": cursor, "timeout": 5.0}),
        )
    };
    let first = poll(0, 0);
    assert_eq!(
        first["completions"][0]["request_id"],
        mine.as_str(),
        "{first}"
    );
    assert_eq!(first["completions"][0]["state"], "finished");
    assert_eq!(first["completions"].as_array().unwrap().len(), 1, "{first}");
    let cursor = first["cursor"].as_u64().unwrap();
    let t0 = std::time::Instant::now();
    let again = c.ok(
        "/api/v1/retrieve_futures",
        &json!({"target": {"sampling_session_id": sampler}, "prev_cursor": cursor,
                "timeout": 0.3}),
    );
    assert!(
        again["completions"].as_array().unwrap().is_empty(),
        "{again}"
    );
    assert_eq!(again["cursor"].as_u64().unwrap(), cursor);
    assert!(
        t0.elapsed() >= Duration::from_millis(250),
        "it waited for news"
    );
    let copy = poll(1, 0);
    assert_eq!(
        copy["completions"][0]["request_id"],
        copys.as_str(),
        "{copy}"
    );
    // Copies get their own ids; another key sees nothing of the session.
    for want in [2, 3] {
        let j = c.ok(
            "/api/v1/join_sampling_session",
            &json!({"sampling_session_id": sampler, "type": "join_sampling_session"}),
        );
        assert_eq!(j["client_counter"], want);
    }
    // A copy the session never handed out has no queue.
    let (status, v) = c.post(
        "/api/v1/retrieve_futures",
        &json!({"target": {"sampling_session_id": sampler, "cloned_sampler_id": 99},
                "prev_cursor": 0, "timeout": 0}),
    );
    assert_eq!(status, 400, "{v}");
    let other = server.client(KEY_B);
    let (status, _) = other.post(
        "/api/v1/retrieve_futures",
        &json!({"target": {"sampling_session_id": sampler}, "prev_cursor": 0, "timeout": 0}),
    );
    assert_eq!(status, 404);
    server.stop();
}
