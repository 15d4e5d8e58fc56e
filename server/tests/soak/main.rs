//! Soak: eight clients on the two test keys drive one in-process server on the tiny model
//! for a bounded time (20 s; set `LATHE_SOAK_SECS` to change it), mixing training,
//! sampling (the base model, saved sampler checkpoints, in-memory snapshots; results
//! retrieved one by one or reported by `retrieve_futures`), OpenAI completions, saves
//! with and without overwrite, loads, deletes, publishing, listings and every kind of
//! bad request, including other keys' resources.
//!
//! Every good request must succeed, and every bad one must be refused with a 4xx and a
//! JSON `detail` (or, once accepted, fail with category `user`). No request may get a
//! 5xx, a transport error or a hang. The process's resident memory must stop growing
//! after the first third of the run. At the end every checkpoint a client believes it
//! holds must be listed and loadable.

#[path = "../common/mod.rs"]
mod common;

mod bad_requests;
mod client;
mod operations;

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
    /// The last `seq_id` of a sample on the base sampler reported by `retrieve_futures`,
    /// and that poller's cursor.
    futures_seq: u64,
    futures_cursor: u64,
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
            futures_seq: 0,
            futures_cursor: 0,
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
            (4, 13),  // an OpenAI completion, or a sample reported by retrieve_futures
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
            13 => self.openai_or_futures(),
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
    // Sampling sessions close only with their session, which a soak client keeps for the
    // whole run; the per-key cap (tested in hostile.rs) would be reached on a fast machine
    // and is not what this test is about.
    let server = TestServer::start(&dir, |cfg| {
        cfg.engine.future_ttl = FUTURE_TTL;
        cfg.engine.limits.samplers = 1 << 16;
    });
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
