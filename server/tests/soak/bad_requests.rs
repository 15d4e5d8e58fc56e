//! The soak client's bad requests, on its own resources and on another key's.

use super::*;

impl Agent<'_> {
    // ---- bad requests ----

    pub(super) fn bad(&mut self) {
        let run = self.run.clone();
        let datum_with = |tokens: Value, targets: Value, extra: Value| {
            let mut inputs = json!({ "target_tokens": targets });
            for (k, v) in extra.as_object().expect("an object") {
                inputs[k] = v.clone();
            }
            json!({"model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
                   "loss_fn_inputs": inputs})
        };
        let fb = |data: Vec<Value>, seq: u64| {
            json!({"forward_backward_input": {"data": data, "loss_fn": "cross_entropy"},
                   "model_id": run, "seq_id": seq})
        };
        match self.rng.random_range(0..25) {
            0 => {
                let paths = [
                    "/api/v1/forward_backward",
                    "/api/v1/asample",
                    "/api/v1/save_weights",
                    "/api/v1/load_weights",
                    "/api/v1/retrieve_future",
                    "/api/v1/create_model",
                ];
                let junk: [&[u8]; 6] = [
                    b"{not json",
                    b"[1, 2",
                    b"",
                    b"\xff\xfe\x00",
                    b"{\"model_id\": }",
                    b"{\"a\": 1e999999}",
                ];
                let path = self.pick(&paths).unwrap();
                let body = self.pick(&junk).unwrap();
                let key = self.key;
                self.refused_as(
                    key,
                    "malformed JSON",
                    Method::POST,
                    path,
                    Body::Raw(body),
                    None,
                );
            }
            1 => {
                // Well-formed JSON of the wrong types: no seq_id reaches the server.
                let cases = [
                    (
                        "/api/v1/optim_step",
                        json!({"adam_params": "fast", "model_id": run}),
                    ),
                    (
                        "/api/v1/forward_backward",
                        json!({"forward_backward_input": 7, "model_id": run}),
                    ),
                    (
                        "/api/v1/asample",
                        json!({"prompt": "hello", "num_samples": 1}),
                    ),
                    (
                        "/api/v1/create_model",
                        json!({"session_id": self.session, "model_seq_id": "one"}),
                    ),
                    ("/api/v1/retrieve_future", json!({"request_id": [1, 2]})),
                    ("/api/v1/save_weights", json!([run])),
                ];
                let (path, body) = self.pick(&cases).unwrap();
                self.refused("wrong JSON types", path, &body, None);
            }
            2 => {
                let s = self.next_seq();
                let d = datum_with(
                    json!([1, 2, 3]),
                    json!({"data": [2, 3], "dtype": "int64"}),
                    json!({}),
                );
                self.refused(
                    "target length",
                    "/api/v1/forward_backward",
                    &fb(vec![d], s),
                    None,
                );
            }
            3 => {
                let s = self.next_seq();
                let d = datum_with(
                    json!([1, 2]),
                    json!({"data": [3, 4], "dtype": "int64", "shape": [1, 3]}),
                    json!({}),
                );
                self.refused(
                    "shape disagrees with data",
                    "/api/v1/forward_backward",
                    &fb(vec![d], s),
                    Some(400),
                );
            }
            4 => {
                let s = self.next_seq();
                let bad = [259, 260, 9999, 1 << 31, -4][self.rng.random_range(0..5)];
                let good = self.datum();
                let d = datum_with(
                    json!([1, bad, 3]),
                    json!({"data": [2, 3, 4], "dtype": "int64"}),
                    json!({"weights": {"data": [1.0, 1.0, 1.0], "dtype": "float32"}}),
                );
                self.refused(
                    "token out of range",
                    "/api/v1/forward_backward",
                    &fb(vec![good, d], s),
                    Some(400),
                );
            }
            5 => {
                let target = json!({"sampling_session_id": self.base_sampler});
                let (mut body, _) = self.sample_body(target);
                body["prompt"]["chunks"][0]["tokens"] = json!([5, 100_000, 6]);
                self.refused(
                    "prompt token out of range",
                    "/api/v1/asample",
                    &body,
                    Some(400),
                );
            }
            6 => {
                let s = self.next_seq();
                let huge = [json!(1u64 << 50), json!(100_000), json!(u64::MAX)]
                    [self.rng.random_range(0..3)]
                .clone();
                let d = datum_with(
                    json!([5]),
                    json!({"data": [], "dtype": "int64", "shape": [1, huge],
                           "sparse_crow_indices": [0, 0], "sparse_col_indices": []}),
                    json!({}),
                );
                self.refused(
                    "huge sparse targets",
                    "/api/v1/forward_backward",
                    &fb(vec![d], s),
                    Some(400),
                );
            }
            7 => {
                let s = self.next_seq();
                let shape = [json!([1, 1u64 << 50]), json!([1u64 << 40, 1u64 << 40])]
                    [self.rng.random_range(0..2)]
                .clone();
                let d = datum_with(
                    json!([5]),
                    json!({"data": [6], "dtype": "int64"}),
                    json!({"weights": {"data": [], "dtype": "float32", "shape": shape,
                                       "sparse_crow_indices": [0, 0], "sparse_col_indices": []}}),
                );
                self.refused(
                    "huge sparse weights",
                    "/api/v1/forward_backward",
                    &fb(vec![d], s),
                    Some(400),
                );
            }
            8 => {
                let d = self.datum();
                let body = json!({"forward_backward_input": {"data": [d], "loss_fn": "cross_entropy"},
                                  "model_id": format!("nope-{}:train:0", self.id), "seq_id": 1});
                self.refused("unknown run", "/api/v1/forward_backward", &body, Some(404));
            }
            9 => {
                let (body, _) = self.sample_body(json!({"sampling_session_id": "nope:sample:0"}));
                self.refused("unknown sampler", "/api/v1/asample", &body, Some(404));
                let body = json!({"request_id": uuid::Uuid::new_v4().to_string()});
                self.refused(
                    "unknown future",
                    "/api/v1/retrieve_future",
                    &body,
                    Some(404),
                );
                let body = json!({"session_id": "nope"});
                self.refused(
                    "unknown session",
                    "/api/v1/session_heartbeat",
                    &body,
                    Some(404),
                );
            }
            10 => {
                let s = self.next_seq();
                let uri = self.uri(Kind::Weights, "never-saved");
                let body = json!({"model_id": run, "path": uri, "optimizer": true, "seq_id": s});
                self.refused(
                    "load a missing checkpoint",
                    "/api/v1/load_weights",
                    &body,
                    Some(404),
                );
            }
            11 => {
                let s = self.next_seq();
                let ttl = [json!(u64::MAX), json!(1_000_000_000_000u64)]
                    [self.rng.random_range(0..2)]
                .clone();
                let name = self.new_name(Kind::Weights);
                let body = json!({"model_id": run, "path": name, "seq_id": s, "ttl_seconds": ttl});
                self.refused(
                    "save with an absurd ttl",
                    "/api/v1/save_weights",
                    &body,
                    Some(400),
                );
            }
            12 => {
                let all: Vec<(Kind, String)> = self.ckpts.keys().cloned().collect();
                let (kind, name) = self.pick(&all).expect("keep is live");
                let path = format!("{}/ttl", self.rest_path(kind, &name));
                let ttl = [json!(u64::MAX), json!(1_000_000_000_000u64)]
                    [self.rng.random_range(0..2)]
                .clone();
                let key = self.key;
                self.refused_as(
                    key,
                    "set an absurd ttl",
                    Method::PUT,
                    &path,
                    Body::Json(&json!({ "ttl_seconds": ttl })),
                    Some(400),
                );
            }
            13 => {
                // Not consumed: a seq_id this far ahead is refused before it is noted.
                let ahead = [self.seq + 2 + 1024, 1 << 40, u64::MAX][self.rng.random_range(0..3)];
                let d = self.datum();
                self.refused(
                    "seq_id far ahead",
                    "/api/v1/forward_backward",
                    &fb(vec![d], ahead),
                    Some(400),
                );
            }
            14 => {
                let s = self.next_seq();
                let names = [
                    "a/b".to_string(),
                    ".hidden".to_string(),
                    "x..y".to_string(),
                    "..".to_string(),
                    String::new(),
                    "n".repeat(300),
                    "tab\there".to_string(),
                ];
                let name = self.pick(&names).unwrap();
                let path = ["/api/v1/save_weights", "/api/v1/save_weights_for_sampler"]
                    [self.rng.random_range(0..2)];
                let body = json!({"model_id": run, "path": name, "seq_id": s});
                self.refused("bad checkpoint name", path, &body, Some(400));
            }
            15 => {
                if self.has_grad {
                    return self.train();
                }
                let s = self.next_seq();
                self.fails_as_user(
                    "optim_step without a gradient",
                    "/api/v1/optim_step",
                    &optim_body(&run, s, 1e-3),
                );
            }
            16 => {
                let target = json!({"sampling_session_id": self.base_sampler});
                let (mut body, _) = self.sample_body(target);
                match self.rng.random_range(0..5) {
                    0 => body["sampling_params"]["max_tokens"] = json!(0),
                    1 => body["sampling_params"]["max_tokens"] = json!(100_000),
                    2 => body["sampling_params"]["top_p"] = json!(1.5),
                    3 => body["num_samples"] = json!(0),
                    _ => body["num_samples"] = json!(100_000),
                }
                self.refused("bad sampling params", "/api/v1/asample", &body, Some(400));
            }
            17 => {
                let Some(id) = self.pick(&Vec::from(self.evicted.clone())) else {
                    return self.snapshot();
                };
                let (body, _) = self.sample_body(json!({"sampling_session_id": id}));
                self.refused(
                    "sample an evicted snapshot",
                    "/api/v1/asample",
                    &body,
                    Some(404),
                );
            }
            18 => {
                let s = self.next_seq();
                let uri = self.uri(Kind::Sampler, KEEP_SAMPLER);
                let body = json!({"model_id": run, "path": uri, "optimizer": true, "seq_id": s});
                self.refused(
                    "load sampler weights with the optimizer",
                    "/api/v1/load_weights",
                    &body,
                    Some(400),
                );
            }
            19 => {
                let s = self.next_seq();
                let live = self.live(Kind::Weights);
                let name = self.pick(&live).expect("keep is live");
                let body = json!({"model_id": run, "path": name, "seq_id": s});
                if let Some(v) = self.refused_as(
                    self.key,
                    "save over an existing name",
                    Method::POST,
                    "/api/v1/save_weights",
                    Body::Json(&body),
                    Some(400),
                ) {
                    if !v["detail"]
                        .as_str()
                        .unwrap_or_default()
                        .contains("already exists")
                    {
                        self.fail(
                            "save over an existing name",
                            format!("detail: {}", short(&v)),
                        );
                    }
                }
            }
            20 => {
                let key = self.key;
                let gone = self.pick(&Vec::from(self.deleted.clone()));
                let (kind, name) = gone.unwrap_or((Kind::Weights, "never-saved".into()));
                if self.ckpts.contains_key(&(kind, name.clone())) {
                    return;
                }
                let path = self.rest_path(kind, &name);
                self.refused_as(
                    key,
                    "delete a missing checkpoint",
                    Method::DELETE,
                    &path,
                    Body::Empty,
                    Some(404),
                );
                let path = format!("{path}/publish");
                self.refused_as(
                    key,
                    "publish a missing checkpoint",
                    Method::POST,
                    &path,
                    Body::Json(&json!({})),
                    Some(404),
                );
                let path = format!("/api/v1/training_runs/{run}/checkpoints/bogus/{KEEP}");
                self.refused_as(
                    key,
                    "bad checkpoint kind",
                    Method::DELETE,
                    &path,
                    Body::Empty,
                    None,
                );
            }
            21 | 22 => self.bad_foreign(),
            23 => {
                let key = self.key;
                self.refused_as(
                    key,
                    "unknown endpoint",
                    Method::POST,
                    "/api/v1/nope",
                    Body::Json(&json!({})),
                    Some(404),
                );
                self.refused_as(
                    "sk-nobody",
                    "wrong key",
                    Method::GET,
                    "/api/v1/training_runs",
                    Body::Empty,
                    Some(401),
                );
                self.refused_as(
                    "",
                    "no key",
                    Method::POST,
                    "/api/v1/create_session",
                    Body::Json(&json!({})),
                    Some(401),
                );
            }
            _ => {
                let s = self.next_seq();
                let body = if self.rng.random_bool(0.5) {
                    json!({"forward_backward_input": {"data": [], "loss_fn": "cross_entropy"},
                           "model_id": run, "seq_id": s})
                } else {
                    let d = self.datum();
                    json!({"forward_backward_input": {"data": [d], "loss_fn": "mystery"},
                           "model_id": run, "seq_id": s})
                };
                self.refused(
                    "empty data or unknown loss",
                    "/api/v1/forward_backward",
                    &body,
                    Some(400),
                );
            }
        }
    }

    /// Another key's resources: never visible (404), except what it published, which
    /// may come and go while this runs.
    pub(super) fn bad_foreign(&mut self) {
        let Some(card) = self.foreign() else {
            return self.train();
        };
        let key = self.key;
        let keep = format!("tinker://{}/weights/{KEEP}", card.run);
        let keep_s = format!("tinker://{}/sampler_weights/{KEEP_SAMPLER}", card.run);
        let keep_rest = format!(
            "/api/v1/training_runs/{}/checkpoints/weights/{KEEP}",
            card.run
        );
        match self.rng.random_range(0..13) {
            0 => {
                let d = self.datum();
                let body = fb_body(&card.run, 1, vec![d]);
                self.refused(
                    "train another key's run",
                    "/api/v1/forward_backward",
                    &body,
                    Some(404),
                );
            }
            1 => {
                let (body, _) = self.sample_body(json!({"sampling_session_id": card.base_sampler}));
                self.refused(
                    "sample another key's sampler",
                    "/api/v1/asample",
                    &body,
                    Some(404),
                );
            }
            2 => {
                let body = json!({"request_id": card.request_id});
                self.refused(
                    "poll another key's future",
                    "/api/v1/retrieve_future",
                    &body,
                    Some(404),
                );
            }
            3 => {
                self.refused_as(
                    key,
                    "delete another key's checkpoint",
                    Method::DELETE,
                    &keep_rest,
                    Body::Empty,
                    Some(404),
                );
            }
            4 => {
                let path = format!("{keep_rest}/publish");
                self.refused_as(
                    key,
                    "publish another key's checkpoint",
                    Method::POST,
                    &path,
                    Body::Json(&json!({})),
                    Some(404),
                );
            }
            5 => {
                let s = self.next_seq();
                let body =
                    json!({"model_id": self.run, "path": keep, "optimizer": true, "seq_id": s});
                self.refused(
                    "load another key's checkpoint",
                    "/api/v1/load_weights",
                    &body,
                    Some(404),
                );
            }
            6 => {
                let path = format!("/api/v1/training_runs/{}", card.run);
                self.refused_as(
                    key,
                    "get another key's run",
                    Method::GET,
                    &path,
                    Body::Empty,
                    Some(404),
                );
                let path = format!("/api/v1/samplers/{}", card.base_sampler);
                self.refused_as(
                    key,
                    "get another key's sampler",
                    Method::GET,
                    &path,
                    Body::Empty,
                    Some(404),
                );
            }
            7 => {
                let body = json!({"session_id": card.session});
                self.refused(
                    "heartbeat another key's session",
                    "/api/v1/session_heartbeat",
                    &body,
                    Some(404),
                );
                let path = format!("/api/v1/sessions/{}", card.session);
                self.refused_as(
                    key,
                    "get another key's session",
                    Method::GET,
                    &path,
                    Body::Empty,
                    Some(404),
                );
            }
            8 => {
                let body = json!({"session_id": card.session, "sampling_session_seq_id": 77,
                                  "base_model": self.base_model});
                self.refused(
                    "open a sampler in another key's session",
                    "/api/v1/create_sampling_session",
                    &body,
                    Some(404),
                );
                let body = json!({"tinker_path": keep});
                self.refused(
                    "weights_info of another key's checkpoint",
                    "/api/v1/weights_info",
                    &body,
                    Some(404),
                );
            }
            9 => {
                let (body, _) = self.sample_body(json!({"model_path": keep_s}));
                self.refused(
                    "sample another key's private checkpoint",
                    "/api/v1/asample",
                    &body,
                    Some(404),
                );
            }
            10 => {
                let body = json!({"model_id": card.run, "path": "stolen", "seq_id": 1});
                self.refused(
                    "save another key's run",
                    "/api/v1/save_weights",
                    &body,
                    Some(404),
                );
            }
            _ => {
                // Published by another key: readable while it stays published.
                let published: Vec<String> = self
                    .shared
                    .published
                    .lock()
                    .unwrap()
                    .iter()
                    .filter(|(k, _)| *k != key)
                    .map(|(_, u)| u.clone())
                    .collect();
                let Some(uri) = self.pick(&published) else {
                    return;
                };
                if uri.contains("/sampler_weights/") {
                    let (body, _) = self.sample_body(json!({"model_path": uri}));
                    self.racy(
                        "sample another key's published checkpoint",
                        Method::POST,
                        "/api/v1/asample",
                        Some(&body),
                    );
                } else {
                    let body = json!({"tinker_path": uri});
                    self.racy(
                        "weights_info of another key's published checkpoint",
                        Method::POST,
                        "/api/v1/weights_info",
                        Some(&body),
                    );
                }
                let run = uri
                    .trim_start_matches("tinker://")
                    .split('/')
                    .next()
                    .unwrap_or_default()
                    .to_string();
                let path = format!("/api/v1/training_runs/{run}/checkpoints");
                self.racy(
                    "list another key's published checkpoints",
                    Method::GET,
                    &path,
                    None,
                );
            }
        }
    }
}
