//! The soak client's transport (requests, expectations, tallies) and helpers.

use super::*;

impl Agent<'_> {
    // ---- transport and expectations ----

    pub(super) fn send(
        &self,
        key: &str,
        method: Method,
        path: &str,
        body: &Body,
    ) -> Result<(u16, Value), String> {
        let mut req = self
            .http
            .request(method, format!("{}{path}", self.url))
            .header("X-API-Key", key);
        req = match body {
            Body::Empty => req,
            Body::Json(v) => req.json(v),
            Body::Raw(b) => req
                .header("content-type", "application/json")
                .body(b.to_vec()),
        };
        let resp = req.send().map_err(|e| format!("transport error: {e:?}"))?;
        let status = resp.status().as_u16();
        let text = resp
            .text()
            .map_err(|e| format!("transport error reading the answer: {e:?}"))?;
        let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
        Ok((status, body))
    }

    pub(super) fn fail(&mut self, what: &str, msg: String) {
        let line = format!("client {} ({}) {what}: {msg}", self.id, self.key);
        eprintln!("SOAK ERROR {line}");
        self.errors.push(line);
    }

    pub(super) fn count(&mut self, class: Class, what: &'static str) {
        *self.tally.entry((class, what)).or_default() += 1;
    }

    pub(super) fn next_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    /// A request that must answer 200; its body.
    pub(super) fn ok(
        &mut self,
        what: &'static str,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Option<Value> {
        self.count(Class::Good, what);
        let body = body.map_or(Body::Empty, Body::Json);
        let req = describe(&method, path, &body);
        match self.send(self.key, method, path, &body) {
            Ok((200, v)) => Some(v),
            Ok((status, v)) => {
                self.fail(what, format!("{req} answered {status}: {}", short(&v)));
                None
            }
            Err(e) => {
                self.fail(what, format!("{req}: {e}"));
                None
            }
        }
    }

    /// Polls a future to its end: `Some(Ok(result))`, `Some(Err(failure))`, or `None`
    /// (recorded) when polling itself went wrong or it took too long.
    pub(super) fn wait(
        &mut self,
        what: &'static str,
        request_id: &str,
    ) -> Option<Result<Value, Value>> {
        let start = Instant::now();
        let body = json!({"request_id": request_id});
        loop {
            match self.send(
                self.key,
                Method::POST,
                "/api/v1/retrieve_future",
                &Body::Json(&body),
            ) {
                Ok((200, v)) if v["type"] == "try_again" => {
                    if start.elapsed() > FUTURE_DEADLINE {
                        self.fail(
                            what,
                            format!("future {request_id} unfinished after {FUTURE_DEADLINE:?}"),
                        );
                        return None;
                    }
                }
                Ok((200, v)) if v.get("error").is_some() => return Some(Err(v)),
                Ok((200, v)) => {
                    self.finished = Some((request_id.to_string(), v.clone(), Instant::now()));
                    return Some(Ok(v));
                }
                Ok((status, v)) => {
                    self.fail(
                        what,
                        format!(
                            "retrieve_future {request_id} answered {status}: {}",
                            short(&v)
                        ),
                    );
                    return None;
                }
                Err(e) => {
                    self.fail(what, format!("retrieve_future {request_id}: {e}"));
                    return None;
                }
            }
        }
    }

    /// Work that must be accepted and succeed; its result.
    pub(super) fn done(&mut self, what: &'static str, path: &str, body: &Value) -> Option<Value> {
        let v = self.ok(what, Method::POST, path, Some(body))?;
        let Some(id) = v["request_id"].as_str().map(str::to_string) else {
            self.fail(
                what,
                format!("POST {path} gave no request_id: {}", short(&v)),
            );
            return None;
        };
        if body.get("seq_id").is_some() {
            self.last_submit = Some((path.to_string(), body.clone(), id.clone()));
        }
        // Other keys probe a future of ours that is still in the table.
        let mut cards = self.shared.cards.lock().unwrap();
        if let Some(card) = cards.iter_mut().find(|c| c.run == self.run) {
            card.request_id.clone_from(&id);
        }
        drop(cards);
        match self.wait(what, &id)? {
            Ok(r) => Some(r),
            Err(f) => {
                self.fail(
                    what,
                    format!("POST {path} {} failed: {}", short(body), short(&f)),
                );
                None
            }
        }
    }

    /// A request that must be refused with a 4xx (`want`, if given) and a JSON detail.
    pub(super) fn refused_as(
        &mut self,
        key: &str,
        what: &'static str,
        method: Method,
        path: &str,
        body: Body,
        want: Option<u16>,
    ) -> Option<Value> {
        self.count(Class::Bad, what);
        let req = describe(&method, path, &body);
        match self.send(key, method, path, &body) {
            Ok((status, v))
                if (400..500).contains(&status)
                    && want.is_none_or(|w| w == status)
                    && has_detail(&v) =>
            {
                Some(v)
            }
            Ok((status, v)) => {
                let want = want.map_or("a 4xx".to_string(), |w| w.to_string());
                self.fail(
                    what,
                    format!(
                        "{req} answered {status} {}; expected {want} with a JSON detail",
                        short(&v)
                    ),
                );
                None
            }
            Err(e) => {
                self.fail(what, format!("{req}: {e}"));
                None
            }
        }
    }

    pub(super) fn refused(
        &mut self,
        what: &'static str,
        path: &str,
        body: &Value,
        want: Option<u16>,
    ) {
        let key = self.key;
        self.refused_as(key, what, Method::POST, path, Body::Json(body), want);
    }

    /// Work that is accepted and then fails with category `user`.
    pub(super) fn fails_as_user(&mut self, what: &'static str, path: &str, body: &Value) {
        self.count(Class::Bad, what);
        let req = describe(&Method::POST, path, &Body::Json(body));
        let id = match self.send(self.key, Method::POST, path, &Body::Json(body)) {
            Ok((200, v)) if v["request_id"].is_string() => {
                v["request_id"].as_str().unwrap().to_string()
            }
            Ok((status, v)) => {
                let msg = format!("{req} answered {status} {}; expected a future", short(&v));
                return self.fail(what, msg);
            }
            Err(e) => return self.fail(what, format!("{req}: {e}")),
        };
        match self.wait(what, &id) {
            Some(Err(f)) if f["category"] == "user" && f["error"].is_string() => {}
            Some(r) => {
                let got = r.unwrap_or_else(|e| e);
                self.fail(
                    what,
                    format!(
                        "{req} ended with {}; expected a failure of category user",
                        short(&got)
                    ),
                );
            }
            None => {}
        }
    }

    /// A request whose answer depends on another client's timing: success, a 4xx with a
    /// detail, or accepted work failing with category `user` are all fine.
    pub(super) fn racy(
        &mut self,
        what: &'static str,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) {
        self.count(Class::Racy, what);
        let b = body.map_or(Body::Empty, Body::Json);
        let req = describe(&method, path, &b);
        match self.send(self.key, method, path, &b) {
            Ok((200, v)) => {
                if let Some(id) = v["request_id"].as_str().map(str::to_string) {
                    if let Some(Err(f)) = self.wait(what, &id) {
                        if f["category"] != "user" {
                            self.fail(what, format!("{req} failed: {}", short(&f)));
                        }
                    }
                }
            }
            Ok((status, v)) if (400..500).contains(&status) && has_detail(&v) => {}
            Ok((status, v)) => self.fail(what, format!("{req} answered {status}: {}", short(&v))),
            Err(e) => self.fail(what, format!("{req}: {e}")),
        }
    }

    // ---- helpers ----

    pub(super) fn uri(&self, kind: Kind, name: &str) -> String {
        format!("tinker://{}/{}/{name}", self.run, kind.seg())
    }

    pub(super) fn rest_path(&self, kind: Kind, name: &str) -> String {
        format!(
            "/api/v1/training_runs/{}/checkpoints/{}/{name}",
            self.run,
            kind.seg()
        )
    }

    pub(super) fn new_name(&mut self, kind: Kind) -> String {
        self.names += 1;
        match kind {
            Kind::Weights => format!("c{}-step.{}", self.id, self.names),
            Kind::Sampler => format!("c{}_s{}", self.id, self.names),
        }
    }

    pub(super) fn live(&self, kind: Kind) -> Vec<String> {
        self.ckpts
            .keys()
            .filter(|(k, _)| *k == kind)
            .map(|(_, n)| n.clone())
            .collect()
    }

    /// Live checkpoints other than the kept ones: (kind, name).
    pub(super) fn disposable(&self) -> Vec<(Kind, String)> {
        self.ckpts
            .keys()
            .filter(|(_, n)| n != KEEP && n != KEEP_SAMPLER)
            .cloned()
            .collect()
    }

    pub(super) fn pick<T: Clone>(&mut self, items: &[T]) -> Option<T> {
        if items.is_empty() {
            return None;
        }
        Some(items[self.rng.random_range(0..items.len())].clone())
    }

    pub(super) fn tokens(&mut self, n: usize) -> Vec<i64> {
        (0..n)
            .map(|_| self.rng.random_range(0..BYTE_TOKENS))
            .collect()
    }

    pub(super) fn datum(&mut self) -> Value {
        let n = self.rng.random_range(2..=24);
        let t = self.tokens(n + 1);
        ce_datum(&t[..n], &t[1..])
    }

    /// An `asample` body aimed at `target` (one of the sampler fields); and how many
    /// sequences it asks for.
    pub(super) fn sample_body(&mut self, target: Value) -> (Value, usize) {
        let plen = self.rng.random_range(1..=8);
        let prompt = self.tokens(plen);
        let n = self.rng.random_range(1..=3);
        let temperature = [0.0, 0.7, 1.0][self.rng.random_range(0..3)];
        let mut body = json!({
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
            "sampling_params": {"max_tokens": self.rng.random_range(1..=6),
                                "temperature": temperature, "seed": self.rng.random::<u32>()},
            "num_samples": n,
        });
        for (k, v) in target.as_object().expect("an object") {
            body[k] = v.clone();
        }
        (body, n)
    }

    pub(super) fn sample(&mut self, what: &'static str, target: Value) -> bool {
        let (body, n) = self.sample_body(target);
        let Some(v) = self.done(what, "/api/v1/asample", &body) else {
            return false;
        };
        let seqs = v["sequences"].as_array().cloned().unwrap_or_default();
        let tokens_ok = seqs.iter().all(|s| {
            s["tokens"].as_array().is_some_and(|t| {
                !t.is_empty() && t.iter().all(|x| x.as_i64().is_some_and(|x| x >= 0))
            })
        });
        if seqs.len() != n || !tokens_ok {
            self.fail(
                what,
                format!(
                    "asample {} gave {}; expected {n} sequences",
                    short(&body),
                    short(&v)
                ),
            );
        }
        true
    }

    pub(super) fn card(&self) -> Card {
        Card {
            key: self.key,
            session: self.session.clone(),
            run: self.run.clone(),
            base_sampler: self.base_sampler.clone(),
            request_id: self
                .last_submit
                .as_ref()
                .map_or(String::new(), |l| l.2.clone()),
        }
    }

    pub(super) fn foreign(&mut self) -> Option<Card> {
        let others: Vec<Card> = self
            .shared
            .cards
            .lock()
            .unwrap()
            .iter()
            .filter(|c| c.key != self.key)
            .cloned()
            .collect();
        self.pick(&others)
    }
}
