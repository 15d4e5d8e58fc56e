//! The soak client's setup and good operations: training, sampling, checkpoints, listings.

use super::*;

impl Agent<'_> {
    // ---- setup ----

    pub(super) fn setup(&mut self) -> bool {
        let Some(v) = self.ok(
            "create_session",
            Method::POST,
            "/api/v1/create_session",
            Some(&json!({"sdk_version": "soak", "tags": ["soak"]})),
        ) else {
            return false;
        };
        self.session = v["session_id"].as_str().unwrap_or_default().to_string();
        let body = json!({"session_id": self.session, "model_seq_id": 0,
                          "base_model": self.base_model,
                          "lora_config": {"rank": 4, "seed": self.id, "train_unembed": true,
                                          "train_mlp": true, "train_attn": true},
                          "type": "create_model"});
        let Some(v) = self.done("create_model", "/api/v1/create_model", &body) else {
            return false;
        };
        self.run = v["model_id"].as_str().unwrap_or_default().to_string();
        let body = json!({"session_id": self.session, "sampling_session_seq_id": 0,
                          "base_model": self.base_model});
        let Some(v) = self.ok(
            "create_sampling_session",
            Method::POST,
            "/api/v1/create_sampling_session",
            Some(&body),
        ) else {
            return false;
        };
        self.base_sampler = v["sampling_session_id"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        self.train();
        self.save(Kind::Weights, KEEP.to_string(), false);
        self.save(Kind::Sampler, KEEP_SAMPLER.to_string(), false);
        let card = self.card();
        self.shared.cards.lock().unwrap().push(card);
        self.errors.is_empty()
    }

    // ---- good operations ----

    pub(super) fn train(&mut self) {
        let k = self.rng.random_range(1..=3);
        let data: Vec<Value> = (0..k).map(|_| self.datum()).collect();
        let s = self.next_seq();
        let body = fb_body(&self.run, s, data);
        if let Some(v) = self.done("forward_backward", "/api/v1/forward_backward", &body) {
            self.has_grad = true;
            if !v["metrics"]["loss:sum"]
                .as_f64()
                .is_some_and(f64::is_finite)
            {
                self.fail(
                    "forward_backward",
                    format!("loss not finite: {}", short(&v)),
                );
            }
        }
        if self.has_grad && self.rng.random_bool(0.8) {
            let s = self.next_seq();
            let lr = [1e-4, 1e-3, 1e-2][self.rng.random_range(0..3)];
            let body = optim_body(&self.run, s, lr);
            if self
                .done("optim_step", "/api/v1/optim_step", &body)
                .is_some()
            {
                self.has_grad = false;
            }
        }
    }

    pub(super) fn forward(&mut self) {
        let data = vec![self.datum()];
        let s = self.next_seq();
        let body = json!({"forward_input": {"data": data, "loss_fn": "cross_entropy"},
                          "model_id": self.run, "seq_id": s});
        if let Some(v) = self.done("forward", "/api/v1/forward", &body) {
            if !v["metrics"]["loss:sum"]
                .as_f64()
                .is_some_and(f64::is_finite)
            {
                self.fail("forward", format!("loss not finite: {}", short(&v)));
            }
        }
    }

    pub(super) fn sample_base(&mut self) {
        let target = if self.rng.random_bool(0.5) {
            json!({"sampling_session_id": self.base_sampler})
        } else {
            json!({"base_model": self.base_model})
        };
        self.sample("sample base model", target);
    }

    pub(super) fn snapshot(&mut self) {
        let s = self.next_seq();
        let body = json!({"model_id": self.run, "seq_id": s});
        let Some(v) = self.done(
            "snapshot for sampler",
            "/api/v1/save_weights_for_sampler",
            &body,
        ) else {
            return;
        };
        let Some(id) = v["sampling_session_id"].as_str().map(str::to_string) else {
            return self.fail("snapshot for sampler", format!("no sampler: {}", short(&v)));
        };
        self.snapshots.push_back(id.clone());
        while self.snapshots.len() > SNAPSHOTS {
            let old = self.snapshots.pop_front().expect("non-empty");
            self.evicted.push_back(old);
            if self.evicted.len() > 8 {
                self.evicted.pop_front();
            }
        }
        self.sample("sample snapshot", json!({"sampling_session_id": id}));
    }

    pub(super) fn sample_snapshot(&mut self) {
        if self.snapshots.is_empty() {
            return self.snapshot();
        }
        let i = self.rng.random_range(0..self.snapshots.len());
        let id = self.snapshots.remove(i).expect("in range");
        // Sampling marks it as the most recently used.
        self.snapshots.push_back(id.clone());
        self.sample("sample snapshot", json!({"sampling_session_id": id}));
    }

    /// Saves `name`; `overwrite` only matters for training checkpoints (sampler saves
    /// always replace).
    pub(super) fn save(&mut self, kind: Kind, name: String, overwrite: bool) {
        let s = self.next_seq();
        let mut body = json!({"model_id": self.run, "path": name, "seq_id": s});
        if overwrite || self.rng.random_bool(0.3) {
            body["overwrite"] = json!(overwrite);
        }
        if self.rng.random_bool(0.3) {
            body["ttl_seconds"] = json!(3600 * self.rng.random_range(1..=48));
        }
        let (what, path) = match kind {
            Kind::Weights => ("save_weights", "/api/v1/save_weights"),
            Kind::Sampler => (
                "save_weights_for_sampler",
                "/api/v1/save_weights_for_sampler",
            ),
        };
        let Some(v) = self.done(what, path, &body) else {
            return;
        };
        let uri = self.uri(kind, &name);
        if v["path"] != json!(uri) {
            self.fail(what, format!("saved {uri} but was told {}", short(&v)));
        }
        self.generation += 1;
        self.deleted.retain(|d| d != &(kind, name.clone()));
        // A save makes a new, private version.
        let ckpt = Ckpt {
            generation: self.generation,
            public: false,
        };
        if self
            .ckpts
            .insert((kind, name), ckpt)
            .is_some_and(|c| c.public)
        {
            self.shared
                .published
                .lock()
                .unwrap()
                .remove(&(self.key, uri));
        }
    }

    pub(super) fn save_some(&mut self, kind: Kind) {
        let live = self.live(kind);
        let replace = live.len() >= MAX_CKPTS_PER_KIND || self.rng.random_bool(0.35);
        if replace {
            let name = self.pick(&live).expect("keep is live");
            return self.save(kind, name, true);
        }
        let deleted: Vec<String> = self
            .deleted
            .iter()
            .filter(|(k, _)| *k == kind)
            .map(|(_, n)| n.clone())
            .collect();
        // A deleted name can be saved again without overwrite.
        let name = match self.pick(&deleted) {
            Some(n) if self.rng.random_bool(0.4) => n,
            _ => self.new_name(kind),
        };
        self.save(kind, name, false);
    }

    pub(super) fn sample_checkpoint(&mut self) {
        let live = self.live(Kind::Sampler);
        let name = self.pick(&live).expect("keep-s is live");
        let uri = self.uri(Kind::Sampler, &name);
        if self.rng.random_bool(0.5) {
            self.sample("sample checkpoint by path", json!({"model_path": uri}));
            return;
        }
        self.sampler_seq += 1;
        let body = json!({"session_id": self.session,
                          "sampling_session_seq_id": self.sampler_seq, "model_path": uri});
        let Some(v) = self.ok(
            "create_sampling_session on checkpoint",
            Method::POST,
            "/api/v1/create_sampling_session",
            Some(&body),
        ) else {
            return;
        };
        let Some(sampler) = v["sampling_session_id"].as_str().map(str::to_string) else {
            return self.fail("create_sampling_session", format!("no id: {}", short(&v)));
        };
        self.sample(
            "sample checkpoint session",
            json!({"sampling_session_id": sampler}),
        );
        let generation = self.ckpts[&(Kind::Sampler, name.clone())].generation;
        self.pinned.push_back(Pinned {
            sampler,
            name,
            generation,
        });
        if self.pinned.len() > 6 {
            self.pinned.pop_front();
        }
    }

    /// Samples a session opened on a checkpoint: fine while the checkpoint is still the
    /// version it was opened on, 404 once it was replaced or deleted.
    pub(super) fn sample_pinned(&mut self) {
        let Some(p) = self.pinned.pop_front() else {
            return self.sample_checkpoint();
        };
        let current = self
            .ckpts
            .get(&(Kind::Sampler, p.name.clone()))
            .map(|c| c.generation);
        if current == Some(p.generation) {
            self.sample(
                "sample checkpoint session",
                json!({"sampling_session_id": p.sampler}),
            );
            self.pinned.push_back(p);
        } else {
            let (body, _) = self.sample_body(json!({"sampling_session_id": p.sampler}));
            self.refused(
                "sample a replaced or deleted checkpoint's session",
                "/api/v1/asample",
                &body,
                Some(404),
            );
        }
    }

    pub(super) fn load(&mut self) {
        let all: Vec<(Kind, String)> = self.ckpts.keys().cloned().collect();
        let (kind, name) = self.pick(&all).expect("keep is live");
        let optimizer = kind == Kind::Weights && self.rng.random_bool(0.5);
        let s = self.next_seq();
        let uri = self.uri(kind, &name);
        let body = json!({"model_id": self.run, "path": uri, "optimizer": optimizer, "seq_id": s});
        if self
            .done("load_weights", "/api/v1/load_weights", &body)
            .is_some()
        {
            self.has_grad = false;
        }
    }

    pub(super) fn delete(&mut self) {
        let Some((kind, name)) = self.pick(&self.disposable()) else {
            return self.save_some(Kind::Weights);
        };
        let path = self.rest_path(kind, &name);
        if self
            .ok("delete checkpoint", Method::DELETE, &path, None)
            .is_some()
        {
            let uri = self.uri(kind, &name);
            self.shared
                .published
                .lock()
                .unwrap()
                .remove(&(self.key, uri));
            self.ckpts.remove(&(kind, name.clone()));
            self.deleted.push_back((kind, name));
            if self.deleted.len() > 8 {
                self.deleted.pop_front();
            }
        }
    }

    pub(super) fn publish(&mut self) {
        let Some((kind, name)) = self.pick(&self.disposable()) else {
            return self.save_some(Kind::Sampler);
        };
        let public = self.ckpts[&(kind, name.clone())].public;
        let path = format!("{}/publish", self.rest_path(kind, &name));
        let (what, method) = if public {
            ("unpublish", Method::DELETE)
        } else {
            ("publish", Method::POST)
        };
        let body = json!({});
        let body = (!public).then_some(&body);
        if self.ok(what, method, &path, body).is_some() {
            let uri = self.uri(kind, &name);
            let mut published = self.shared.published.lock().unwrap();
            if public {
                published.remove(&(self.key, uri));
            } else {
                published.insert((self.key, uri));
            }
            drop(published);
            if let Some(c) = self.ckpts.get_mut(&(kind, name)) {
                c.public = !public;
            }
        }
    }

    /// The run's checkpoint listing must be exactly what this client believes.
    pub(super) fn check_listing(&mut self, what: &'static str) {
        let path = format!("/api/v1/training_runs/{}/checkpoints", self.run);
        let Some(v) = self.ok(what, Method::GET, &path, None) else {
            return;
        };
        let listed: BTreeMap<String, bool> = v["checkpoints"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .iter()
            .map(|c| {
                let id = c["checkpoint_id"].as_str().unwrap_or("?").to_string();
                (id, c["public"].as_bool().unwrap_or(false))
            })
            .collect();
        let believed: BTreeMap<String, bool> = self
            .ckpts
            .iter()
            .map(|((k, n), c)| (format!("{}/{n}", k.seg()), c.public))
            .collect();
        if listed != believed {
            self.fail(
                what,
                format!("GET {path} lists {listed:?}; this client saved {believed:?}"),
            );
        }
    }

    /// An OpenAI completion on the base model, or a sample on the base sampler whose
    /// completion `retrieve_futures` reports (tinker 0.38's poller) before it is
    /// retrieved.
    pub(super) fn openai_or_futures(&mut self) {
        if self.rng.random_bool(0.5) {
            let len = self.rng.random_range(1..=8);
            let body = json!({"model": self.base_model, "prompt": self.tokens(len),
                              "max_tokens": self.rng.random_range(1..=4), "temperature": 0.0});
            let what = "openai completion";
            let Some(v) = self.ok(what, Method::POST, "/v1/completions", Some(&body)) else {
                return;
            };
            if v["choices"].as_array().is_none_or(|c| c.len() != 1) {
                self.fail(what, format!("expected one choice: {}", short(&v)));
            }
            return;
        }
        let what = "sample reported by retrieve_futures";
        let (mut body, n) = self.sample_body(json!({"sampling_session_id": self.base_sampler}));
        self.futures_seq += 1;
        body["seq_id"] = json!(self.futures_seq);
        let Some(v) = self.ok(what, Method::POST, "/api/v1/asample", Some(&body)) else {
            return;
        };
        let Some(id) = v["request_id"].as_str().map(str::to_string) else {
            return self.fail(what, format!("no request_id: {}", short(&v)));
        };
        for _ in 0..30 {
            let poll = json!({"target": {"type": "sampling_session",
                                         "sampling_session_id": self.base_sampler,
                                         "cloned_sampler_id": 0},
                              "prev_cursor": self.futures_cursor, "timeout": 5.0});
            let Some(v) = self.ok(what, Method::POST, "/api/v1/retrieve_futures", Some(&poll))
            else {
                return;
            };
            self.futures_cursor = v["cursor"].as_u64().unwrap_or(self.futures_cursor);
            let reported = v["completions"]
                .as_array()
                .is_some_and(|c| c.iter().any(|e| e["request_id"] == id.as_str()));
            if reported {
                match self.wait(what, &id) {
                    Some(Ok(r)) if r["sequences"].as_array().is_some_and(|s| s.len() == n) => {}
                    Some(other) => self.fail(what, format!("its result: {other:?}")),
                    None => {}
                }
                return;
            }
        }
        self.fail(what, format!("{id} was never reported"));
    }

    pub(super) fn listings(&mut self) {
        match self.rng.random_range(0..12) {
            0 => self.check_listing("list run checkpoints"),
            1 => {
                let Some(v) = self.ok(
                    "list user checkpoints",
                    Method::GET,
                    "/api/v1/checkpoints?limit=1000",
                    None,
                ) else {
                    return;
                };
                let listed: BTreeSet<String> = v["checkpoints"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
                    .iter()
                    .filter_map(|c| c["tinker_path"].as_str().map(str::to_string))
                    .collect();
                let missing: Vec<String> = self
                    .ckpts
                    .keys()
                    .map(|(k, n)| self.uri(*k, n))
                    .filter(|u| !listed.contains(u))
                    .collect();
                if !missing.is_empty() {
                    self.fail("list user checkpoints", format!("missing {missing:?}"));
                }
            }
            2 => {
                let offset = self.rng.random_range(0..4);
                let path = format!("/api/v1/training_runs?offset={offset}&limit=5");
                self.ok("list runs", Method::GET, &path, None);
            }
            3 => {
                let path = format!("/api/v1/training_runs/{}", self.run);
                if let Some(v) = self.ok("get run", Method::GET, &path, None) {
                    if v["training_run_id"] != json!(self.run) {
                        self.fail("get run", format!("{path} gave {}", short(&v)));
                    }
                }
            }
            4 => {
                let path = format!("/api/v1/sessions/{}", self.session);
                if let Some(v) = self.ok("get session", Method::GET, &path, None) {
                    let runs = v["training_run_ids"]
                        .as_array()
                        .cloned()
                        .unwrap_or_default();
                    if !runs.contains(&json!(self.run)) {
                        self.fail("get session", format!("{path} gave {}", short(&v)));
                    }
                }
                self.ok("list sessions", Method::GET, "/api/v1/sessions", None);
            }
            5 => {
                let path = format!("/api/v1/samplers/{}", self.base_sampler);
                self.ok("get sampler", Method::GET, &path, None);
                let body = json!({"session_id": self.session});
                self.ok(
                    "session_heartbeat",
                    Method::POST,
                    "/api/v1/session_heartbeat",
                    Some(&body),
                );
            }
            6 => {
                let body = json!({"model_id": self.run});
                self.ok("get_info", Method::POST, "/api/v1/get_info", Some(&body));
                let all: Vec<(Kind, String)> = self.ckpts.keys().cloned().collect();
                let (kind, name) = self.pick(&all).expect("keep is live");
                let body = json!({"tinker_path": self.uri(kind, &name)});
                self.ok(
                    "weights_info",
                    Method::POST,
                    "/api/v1/weights_info",
                    Some(&body),
                );
            }
            7 => {
                self.ok("healthz", Method::GET, "/api/v1/healthz", None);
                self.ok(
                    "get_server_capabilities",
                    Method::GET,
                    "/api/v1/get_server_capabilities",
                    None,
                );
            }
            8 => {
                // A finished future answers the same again (well within FUTURE_TTL).
                let Some((id, result, at)) = self.finished.clone() else {
                    return;
                };
                if at.elapsed() > FUTURE_TTL / 4 {
                    return;
                }
                let body = json!({"request_id": id});
                if let Some(v) = self.ok(
                    "retrieve a finished future again",
                    Method::POST,
                    "/api/v1/retrieve_future",
                    Some(&body),
                ) {
                    if v != result {
                        self.fail(
                            "retrieve a finished future again",
                            format!("{id} gave {} then {}", short(&result), short(&v)),
                        );
                    }
                }
            }
            9 => {
                // A retried submission answers with its first future.
                let Some((path, body, id)) = self.last_submit.clone() else {
                    return;
                };
                if let Some(v) = self.ok("retry a submission", Method::POST, &path, Some(&body)) {
                    if v["request_id"] != json!(id) {
                        self.fail(
                            "retry a submission",
                            format!("{path} {} gave {} (first: {id})", short(&body), short(&v)),
                        );
                    }
                }
                // A retried snapshot must not take another one (evicting a live snapshot).
                if path.ends_with("save_weights_for_sampler") && body.get("path").is_none() {
                    for id in self.snapshots.clone() {
                        if !self.sample(
                            "sample a snapshot after a retried snapshot",
                            json!({"sampling_session_id": id}),
                        ) {
                            // Reported; forget it rather than fail on it again.
                            self.snapshots.retain(|s| s != &id);
                        }
                    }
                }
            }
            10 => {
                let all: Vec<(Kind, String)> = self.ckpts.keys().cloned().collect();
                let (kind, name) = self.pick(&all).expect("keep is live");
                let path = format!("{}/ttl", self.rest_path(kind, &name));
                let ttl = if self.rng.random_bool(0.3) {
                    Value::Null
                } else {
                    json!(3600 * self.rng.random_range(1..=1000))
                };
                self.ok(
                    "set ttl",
                    Method::PUT,
                    &path,
                    Some(&json!({ "ttl_seconds": ttl })),
                );
            }
            _ => self.forward(),
        }
    }
}
