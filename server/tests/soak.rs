//! Soak: eight clients on the two test keys drive one in-process server on the tiny model
//! for a bounded time (20 s; set `LATHE_SOAK_SECS` to change it), mixing training,
//! sampling (the base model, saved sampler checkpoints, in-memory snapshots), saves with
//! and without overwrite, loads, deletes, publishing, listings and every kind of bad
//! request, including other keys' resources.
//!
//! Every good request must succeed, and every bad one must be refused with a 4xx and a
//! JSON `detail` (or, once accepted, fail with category `user`). No request may get a
//! 5xx, a transport error or a hang. The process's resident memory must stop growing
//! after the first third of the run. At the end every checkpoint a client believes it
//! holds must be listed and loadable.

mod common;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::http::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use reqwest::Method;
use serde_json::{json, Value};

/// The production binary's allocator, so memory behaves as it does under `lathe serve`.
#[global_allocator]
static GLOBAL: lathe_server::memory::MiMalloc = lathe_server::memory::MiMalloc;

const CLIENTS: usize = 8;
const DEFAULT_SECS: u64 = 20;
/// Longest one future may take before it counts as a hang.
const FUTURE_DEADLINE: Duration = Duration::from_secs(45);
/// How long the server keeps finished futures. Their table holds every result for this
/// long (the default is an hour, for clients re-polling after a network error), so it
/// grows with the request rate until then; a few seconds let it level off within the
/// warm-up, and the memory check then sees everything else.
const FUTURE_TTL: Duration = Duration::from_secs(4);
/// Longest one HTTP exchange may take (`retrieve_future` holds for 2 s at most).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Live checkpoints each client keeps at most, per kind (far below the per-key quota).
const MAX_CKPTS_PER_KIND: usize = 8;
/// A client that has seen this many errors stops: the first ones tell the story.
const MAX_ERRORS: usize = 10;
/// In-memory snapshots the server keeps per run; taking one more evicts the least
/// recently sampled.
const SNAPSHOTS: usize = lathe_server::engine::MAX_SNAPSHOTS_PER_RUN;
/// Token ids the tiny model accepts are below 259 (256 bytes and 3 specials).
const BYTE_TOKENS: i64 = 256;
/// Names every client saves at the start and never deletes nor publishes: other keys
/// probe them, and they must survive to the end.
const KEEP: &str = "keep";
const KEEP_SAMPLER: &str = "keep-s";

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Weights,
    Sampler,
}

impl Kind {
    /// The kind's segment in URIs and REST paths.
    fn seg(self) -> &'static str {
        match self {
            Kind::Weights => "weights",
            Kind::Sampler => "sampler_weights",
        }
    }
}

/// What a client believes about one of its checkpoints.
#[derive(Clone, Copy, Debug)]
struct Ckpt {
    /// Bumped by every save of the name (a save makes a new version).
    generation: u64,
    public: bool,
}

/// A sampling session opened on a sampler checkpoint, pinned to the version it saw.
struct Pinned {
    sampler: String,
    name: String,
    generation: u64,
}

/// What other clients may know of a client: ids to probe across keys.
#[derive(Clone)]
struct Card {
    key: &'static str,
    session: String,
    run: String,
    base_sampler: String,
    request_id: String,
}

#[derive(Default)]
struct Shared {
    cards: Mutex<Vec<Card>>,
    /// Published checkpoints (key, URI), as their owners last said.
    published: Mutex<BTreeSet<(&'static str, String)>>,
}

enum Body<'b> {
    Empty,
    Json(&'b Value),
    Raw(&'b [u8]),
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Class {
    Good,
    Bad,
    Racy,
}

fn has_detail(v: &Value) -> bool {
    v["detail"].as_str().is_some_and(|d| !d.is_empty())
}

fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.chars().count() > 400 {
        format!("{}...", s.chars().take(400).collect::<String>())
    } else {
        s
    }
}

fn describe(method: &Method, path: &str, body: &Body) -> String {
    match body {
        Body::Empty => format!("{method} {path}"),
        Body::Json(v) => format!("{method} {path} {}", short(v)),
        Body::Raw(b) => format!("{method} {path} {:?}", String::from_utf8_lossy(b)),
    }
}

/// Resident set size of this process, in bytes.
fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|f| f.parse().ok())
        .expect("resident pages in statm");
    pages * page_size()
}

/// The page size, from the auxiliary vector (`AT_PAGESZ`); 4 KiB if it cannot be read.
fn page_size() -> u64 {
    const AT_PAGESZ: u64 = 6;
    let auxv = std::fs::read("/proc/self/auxv").unwrap_or_default();
    auxv.chunks_exact(16)
        .map(|c| {
            let word = |b: &[u8]| u64::from_ne_bytes(b.try_into().expect("8 bytes"));
            (word(&c[..8]), word(&c[8..]))
        })
        .find(|&(k, _)| k == AT_PAGESZ)
        .map_or(4096, |(_, v)| v)
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// One client: its resources, what it believes about them, and what went wrong.
struct Agent<'a> {
    id: usize,
    key: &'static str,
    url: String,
    http: reqwest::blocking::Client,
    rng: StdRng,
    shared: &'a Shared,
    base_model: String,
    session: String,
    run: String,
    /// The last `seq_id` used on the run (create is 0).
    seq: u64,
    /// Whether the run holds a gradient not yet applied.
    has_grad: bool,
    /// The last `sampling_session_seq_id` used (the base sampler is 0).
    sampler_seq: u64,
    base_sampler: String,
    /// Live snapshot samplers, least recently sampled first.
    snapshots: VecDeque<String>,
    /// Snapshot samplers the server has evicted.
    evicted: VecDeque<String>,
    ckpts: BTreeMap<(Kind, String), Ckpt>,
    deleted: VecDeque<(Kind, String)>,
    pinned: VecDeque<Pinned>,
    names: u64,
    generation: u64,
    /// The last accepted ordered submission (path, body, request id), to retry.
    last_submit: Option<(String, Value, String)>,
    /// The last finished future (request id, result, when), to poll again.
    finished: Option<(String, Value, Instant)>,
    errors: Vec<String>,
    tally: BTreeMap<(Class, &'static str), u64>,
}

impl<'a> Agent<'a> {
    fn new(id: usize, url: &str, shared: &'a Shared, base_model: &str) -> Self {
        Self {
            id,
            key: if id.is_multiple_of(2) { KEY_A } else { KEY_B },
            url: url.to_string(),
            http: reqwest::blocking::Client::builder()
                .timeout(REQUEST_TIMEOUT)
                .redirect(reqwest::redirect::Policy::none())
                .build()
                .unwrap(),
            rng: StdRng::seed_from_u64(0x50a1c + id as u64),
            shared,
            base_model: base_model.to_string(),
            session: String::new(),
            run: String::new(),
            seq: 0,
            has_grad: false,
            sampler_seq: 0,
            base_sampler: String::new(),
            snapshots: VecDeque::new(),
            evicted: VecDeque::new(),
            ckpts: BTreeMap::new(),
            deleted: VecDeque::new(),
            pinned: VecDeque::new(),
            names: 0,
            generation: 0,
            last_submit: None,
            finished: None,
            errors: Vec::new(),
            tally: BTreeMap::new(),
        }
    }

    // ---- transport and expectations ----

    fn send(
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

    fn fail(&mut self, what: &str, msg: String) {
        let line = format!("client {} ({}) {what}: {msg}", self.id, self.key);
        eprintln!("SOAK ERROR {line}");
        self.errors.push(line);
    }

    fn count(&mut self, class: Class, what: &'static str) {
        *self.tally.entry((class, what)).or_default() += 1;
    }

    fn next_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    /// A request that must answer 200; its body.
    fn ok(
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
    fn wait(&mut self, what: &'static str, request_id: &str) -> Option<Result<Value, Value>> {
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
    fn done(&mut self, what: &'static str, path: &str, body: &Value) -> Option<Value> {
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
    fn refused_as(
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

    fn refused(&mut self, what: &'static str, path: &str, body: &Value, want: Option<u16>) {
        let key = self.key;
        self.refused_as(key, what, Method::POST, path, Body::Json(body), want);
    }

    /// Work that is accepted and then fails with category `user`.
    fn fails_as_user(&mut self, what: &'static str, path: &str, body: &Value) {
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
    fn racy(&mut self, what: &'static str, method: Method, path: &str, body: Option<&Value>) {
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

    fn uri(&self, kind: Kind, name: &str) -> String {
        format!("tinker://{}/{}/{name}", self.run, kind.seg())
    }

    fn rest_path(&self, kind: Kind, name: &str) -> String {
        format!(
            "/api/v1/training_runs/{}/checkpoints/{}/{name}",
            self.run,
            kind.seg()
        )
    }

    fn new_name(&mut self, kind: Kind) -> String {
        self.names += 1;
        match kind {
            Kind::Weights => format!("c{}-step.{}", self.id, self.names),
            Kind::Sampler => format!("c{}_s{}", self.id, self.names),
        }
    }

    fn live(&self, kind: Kind) -> Vec<String> {
        self.ckpts
            .keys()
            .filter(|(k, _)| *k == kind)
            .map(|(_, n)| n.clone())
            .collect()
    }

    /// Live checkpoints other than the kept ones: (kind, name).
    fn disposable(&self) -> Vec<(Kind, String)> {
        self.ckpts
            .keys()
            .filter(|(_, n)| n != KEEP && n != KEEP_SAMPLER)
            .cloned()
            .collect()
    }

    fn pick<T: Clone>(&mut self, items: &[T]) -> Option<T> {
        if items.is_empty() {
            return None;
        }
        Some(items[self.rng.random_range(0..items.len())].clone())
    }

    fn tokens(&mut self, n: usize) -> Vec<i64> {
        (0..n)
            .map(|_| self.rng.random_range(0..BYTE_TOKENS))
            .collect()
    }

    fn datum(&mut self) -> Value {
        let n = self.rng.random_range(2..=24);
        let t = self.tokens(n + 1);
        ce_datum(&t[..n], &t[1..])
    }

    /// An `asample` body aimed at `target` (one of the sampler fields); and how many
    /// sequences it asks for.
    fn sample_body(&mut self, target: Value) -> (Value, usize) {
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

    fn sample(&mut self, what: &'static str, target: Value) -> bool {
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

    fn card(&self) -> Card {
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

    fn foreign(&mut self) -> Option<Card> {
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

    // ---- setup ----

    fn setup(&mut self) -> bool {
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

    fn train(&mut self) {
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

    fn forward(&mut self) {
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

    fn sample_base(&mut self) {
        let target = if self.rng.random_bool(0.5) {
            json!({"sampling_session_id": self.base_sampler})
        } else {
            json!({"base_model": self.base_model})
        };
        self.sample("sample base model", target);
    }

    fn snapshot(&mut self) {
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

    fn sample_snapshot(&mut self) {
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
    fn save(&mut self, kind: Kind, name: String, overwrite: bool) {
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

    fn save_some(&mut self, kind: Kind) {
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

    fn sample_checkpoint(&mut self) {
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
    fn sample_pinned(&mut self) {
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

    fn load(&mut self) {
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

    fn delete(&mut self) {
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

    fn publish(&mut self) {
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
    fn check_listing(&mut self, what: &'static str) {
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

    fn listings(&mut self) {
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

    // ---- bad requests ----

    fn bad(&mut self) {
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
    fn bad_foreign(&mut self) {
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

    // ---- the loop and the final check ----

    fn step(&mut self) {
        let weights = [
            (22, 0),  // train
            (6, 1),   // sample base
            (4, 2),   // snapshot
            (5, 3),   // sample a snapshot
            (6, 4),   // save weights
            (5, 5),   // save sampler weights
            (5, 6),   // sample a saved checkpoint
            (3, 7),   // sample a pinned session
            (4, 8),   // load
            (4, 9),   // delete
            (3, 10),  // publish / unpublish
            (8, 11),  // listings and small reads
            (20, 12), // bad requests
        ];
        let total: u32 = weights.iter().map(|w| w.0).sum();
        let mut roll = self.rng.random_range(0..total);
        let op = weights
            .iter()
            .find(|(w, _)| {
                if roll < *w {
                    true
                } else {
                    roll -= w;
                    false
                }
            })
            .map_or(0, |w| w.1);
        match op {
            0 => self.train(),
            1 => self.sample_base(),
            2 => self.snapshot(),
            3 => self.sample_snapshot(),
            4 => self.save_some(Kind::Weights),
            5 => self.save_some(Kind::Sampler),
            6 => self.sample_checkpoint(),
            7 => self.sample_pinned(),
            8 => self.load(),
            9 => self.delete(),
            10 => self.publish(),
            11 => self.listings(),
            _ => self.bad(),
        }
    }

    /// Every checkpoint this client believes it holds is listed, and loads (sampler
    /// weights also sample).
    fn verify(&mut self) {
        self.check_listing("final listing");
        let all: Vec<(Kind, String)> = self.ckpts.keys().cloned().collect();
        for (kind, name) in all {
            let uri = self.uri(kind, &name);
            let s = self.next_seq();
            let body = json!({"model_id": self.run, "path": uri,
                              "optimizer": kind == Kind::Weights, "seq_id": s});
            self.done("final load", "/api/v1/load_weights", &body);
            if kind == Kind::Sampler {
                self.sample("final sample of a checkpoint", json!({"model_path": uri}));
            }
        }
    }
}

#[test]
fn eight_clients_mixing_everything_get_clean_answers_and_memory_levels_off() {
    let secs: u64 = std::env::var("LATHE_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(DEFAULT_SECS)
        .max(3);
    let run_for = Duration::from_secs(secs);
    let dir = temp_dir("soak");
    let server = TestServer::start(&dir, |cfg| cfg.engine.future_ttl = FUTURE_TTL);
    let base_model = server.client(KEY_A).base_model();
    let shared = Shared::default();
    let stop = AtomicBool::new(false);
    let started = Instant::now();
    let deadline = started + run_for;

    let (agents, samples, end_rss) = std::thread::scope(|scope| {
        let sampler = scope.spawn(|| {
            let mut samples = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                samples.push((started.elapsed(), rss_bytes()));
                let next = Duration::from_secs(samples.len() as u64);
                while !stop.load(Ordering::Relaxed) && started.elapsed() < next {
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
            samples
        });
        let handles: Vec<_> = (0..CLIENTS)
            .map(|id| {
                let (shared, url, base_model) = (&shared, &server.url, &base_model);
                scope.spawn(move || {
                    let mut agent = Agent::new(id, url, shared, base_model);
                    if agent.setup() {
                        while Instant::now() < deadline && agent.errors.len() < MAX_ERRORS {
                            agent.step();
                        }
                    }
                    agent
                })
            })
            .collect();
        let joined: Vec<_> = handles.into_iter().map(|h| h.join()).collect();
        let end_rss = rss_bytes();
        // Stopped before anything can panic, so the scope always ends.
        stop.store(true, Ordering::Relaxed);
        let samples = sampler.join().unwrap();
        (joined, samples, end_rss)
    });
    let agents: Vec<Agent> = agents
        .into_iter()
        .map(|a| a.expect("a client thread panicked"))
        .collect();
    let mixed_for = started.elapsed();

    // What ran.
    let mut tally: BTreeMap<(Class, &str), u64> = BTreeMap::new();
    for a in &agents {
        for (k, n) in &a.tally {
            *tally.entry(*k).or_default() += n;
        }
    }
    let total = |c: Class| {
        tally
            .iter()
            .filter(|((k, _), _)| *k == c)
            .map(|(_, n)| n)
            .sum::<u64>()
    };
    println!(
        "soak: {CLIENTS} clients for {mixed_for:.1?}: {} good, {} bad, {} racy requests",
        total(Class::Good),
        total(Class::Bad),
        total(Class::Racy)
    );
    for ((class, what), n) in &tally {
        println!("  {class:?} {what}: {n}");
    }

    // Memory: after the first third, the resident size levels off.
    let warmup = run_for / 3;
    println!("rss samples (s, MiB):");
    for (t, b) in &samples {
        println!("  {:6.1} {:8.1}", t.as_secs_f64(), mib(*b));
    }
    println!("  end    {:8.1}", mib(end_rss));
    let warm_max = samples
        .iter()
        .filter(|(t, _)| *t <= warmup)
        .map(|s| s.1)
        .max()
        .expect("a sample in the warm-up");
    let allowed = warm_max + (warm_max / 10).max(32 << 20);

    // Every client's checkpoints are listed and loadable, and the server is healthy.
    let mut errors: Vec<String> = Vec::new();
    for mut a in agents {
        if !a.run.is_empty() {
            a.verify();
        }
        errors.extend(a.errors);
    }
    let health = server.client(KEY_A).get("/api/v1/healthz");
    server.stop();
    let _ = std::fs::remove_dir_all(&dir);

    assert!(
        errors.is_empty(),
        "{} unexpected answers:\n{}",
        errors.len(),
        errors.join("\n")
    );
    assert_eq!(health.0, 200, "healthz: {}", health.1);
    assert!(
        end_rss <= allowed,
        "resident memory grew: {:.1} MiB at the end, {:.1} MiB at most in the first {warmup:?} \
         (allowed {:.1} MiB)",
        mib(end_rss),
        mib(warm_max),
        mib(allowed)
    );
}
