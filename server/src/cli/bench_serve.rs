//! `lathe bench serve`: the server over loopback HTTP on the real model.
//!
//! Three measurements, each a median over rounds, ratios taken within one run:
//! 1. `forward_backward` (1 x 64 tokens) from 8 sessions at once versus the same 8
//!    requests one after another: the gain from fusing sessions into one pass.
//! 2. 8 sessions sampling 64 tokens at once versus one session alone.
//! 3. Protocol overhead: a `forward_backward` + `optim_step` round trip on 16 tokens over
//!    HTTP minus the same work called in-process on the same model.
//! 4. With `--fairness`: a second API key (the hog) submits a `forward_backward` backlog
//!    of `--hog-passes` full passes, then the first key (the victim) submits a small one;
//!    the victim's latency, in passes of the hog's, against its latency alone. Then the
//!    hog samples 16 sequences of `--hog-sample-tokens` and the victim's small
//!    `forward_backward`, and a victim's short sample, run while the hog's decode runs.
//! 5. The wire: a 64k-token `forward_backward` request and result in JSON and protobuf
//!    (`bench_wire`).

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use lathe_sdk::types::AdamParams;
use lathe_server::model::{Adapter, LoadedModel, PrecisionChoice};
use lathe_server::server::{self, ServerConfig};
use lathe_server::train::adamw::{self, AdamState};
use lathe_server::train::{forward_backward, DatumJob, Loss, TokenInputs};
use serde_json::{json, Value};

use super::bench::{peak_rss_mib, round, seven_projections, stats};

/// Options of `lathe bench serve`.
#[derive(Args)]
pub struct ServeBenchArgs {
    /// `default`, a `.gguf` file or a Hugging Face directory.
    #[arg(long, default_value = "default")]
    model: String,
    #[command(flatten)]
    device: super::DeviceArg,
    /// Concurrent sessions.
    #[arg(long, default_value_t = 8)]
    sessions: usize,
    /// Tokens per forward_backward datum.
    #[arg(long, default_value_t = 64)]
    train_tokens: usize,
    /// New tokens per sample.
    #[arg(long, default_value_t = 64)]
    sample_tokens: usize,
    /// LoRA rank of every session.
    #[arg(long, default_value_t = 8)]
    rank: usize,
    /// Timed rounds per measurement (after one warm-up).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Also measure a small request's latency behind another key's backlog.
    #[arg(long)]
    fairness: bool,
    /// Passes in the hog's backlog (`--fairness`).
    #[arg(long, default_value_t = 6)]
    hog_passes: usize,
    /// New tokens of each of the hog's 16 sampled sequences (`--fairness`).
    #[arg(long, default_value_t = 128)]
    hog_sample_tokens: usize,
    /// Element type of the base model's products (`auto`: bf16 on a CPU with AMX
    /// tiles, f32 otherwise).
    #[arg(long, value_enum, default_value_t = PrecisionChoice::Auto)]
    precision: PrecisionChoice,
}

const KEY: &str = "tml-bench";
const HOG_KEY: &str = "tml-bench-hog";

#[derive(Clone)]
struct Http {
    url: String,
    client: reqwest::Client,
    key: &'static str,
}

impl Http {
    async fn post(&self, path: &str, body: &Value) -> anyhow::Result<Value> {
        let resp = self
            .client
            .post(format!("{}{path}", self.url))
            .header("X-API-Key", self.key)
            .json(body)
            .send()
            .await?;
        let status = resp.status();
        let v: Value = resp.json().await?;
        if !status.is_success() {
            bail!("{path}: HTTP {status}: {v}");
        }
        Ok(v)
    }

    /// Submits, then long-polls the future to its result.
    async fn call(&self, path: &str, body: &Value) -> anyhow::Result<Value> {
        let id = self.post(path, body).await?["request_id"]
            .as_str()
            .context("no request_id")?
            .to_string();
        self.wait(&id).await
    }

    async fn wait(&self, id: &str) -> anyhow::Result<Value> {
        loop {
            let v = self
                .post("/api/v1/retrieve_future", &json!({"request_id": id}))
                .await?;
            if v.get("type") == Some(&json!("try_again")) {
                continue;
            }
            if let Some(e) = v.get("error") {
                bail!("request failed: {e}");
            }
            return Ok(v);
        }
    }
}

fn datum(tokens: &[u32]) -> Value {
    let n = tokens.len() - 1;
    json!({
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": &tokens[..n]}]},
        "loss_fn_inputs": {
            "target_tokens": {"data": &tokens[1..], "dtype": "int64"},
            "weights": {"data": vec![1.0; n], "dtype": "float32"}
        }
    })
}

fn tokens(seed: usize, n: usize, vocab: usize) -> Vec<u32> {
    (0..n)
        .map(|i| ((seed * 7919 + i * 104_729) % (vocab - 10) + 5) as u32)
        .collect()
}

struct Run {
    id: String,
    seq: u64,
}

impl Run {
    fn next(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }
}

async fn fb(http: &Http, run: &mut Run, toks: &[u32]) -> anyhow::Result<()> {
    let body = json!({"forward_backward_input": {"data": [datum(toks)], "loss_fn": "cross_entropy"},
                      "model_id": run.id, "seq_id": run.next()});
    http.call("/api/v1/forward_backward", &body).await?;
    Ok(())
}

/// Runs the benchmark and returns its report.
pub fn run(a: ServeBenchArgs) -> anyhow::Result<Value> {
    let spec = seven_projections(a.rank);
    // In-process reference for the overhead measurement, on its own copy of the model.
    let reference = super::load_model(&a.model, a.device, a.precision)?;
    let mut direct = Direct::new(&reference, spec)?;
    let model = super::load_model(&a.model, a.device, a.precision)?;
    let vocab = model.transformer.config.vocab_size;
    let precision = model.transformer.precision();
    // The pass size `lathe serve` schedules on this device.
    let pass = lathe_server::train::pass_tokens(&model.transformer);
    let data_dir = std::env::temp_dir().join(format!("lathe-bench-serve-{}", std::process::id()));
    let config = ServerConfig {
        port: 0,
        data_dir: data_dir.clone(),
        api_keys: vec![KEY.into(), HOG_KEY.into()],
        // The benchmark's clients send no heartbeats; its sessions must outlive it.
        engine: lathe_server::engine::EngineConfig {
            session_timeout: Duration::from_secs(24 * 3600),
            max_batch_tokens: pass,
            ..Default::default()
        },
        ..Default::default()
    };
    let rt = tokio::runtime::Runtime::new()?;
    let report = rt.block_on(async move {
        let srv = server::start(model, config).await?;
        let http = Http {
            url: srv.base_url(),
            client: reqwest::Client::builder().timeout(Duration::from_secs(600)).build()?,
            key: KEY,
        };
        let caps = http.client.get(format!("{}/api/v1/get_server_capabilities", http.url))
            .header("X-API-Key", KEY).send().await?.json::<Value>().await?;
        let base = caps["supported_models"][0]["model_name"].as_str().context("model name")?.to_string();
        let session = http.post("/api/v1/create_session", &json!({})).await?["session_id"]
            .as_str().context("session id")?.to_string();
        let mut runs = Vec::new();
        for i in 0..a.sessions {
            let body = json!({"session_id": session, "model_seq_id": i, "base_model": base,
                "lora_config": {"rank": spec.rank, "seed": i, "train_attn": true, "train_mlp": true,
                                "train_unembed": false}});
            let id = http.call("/api/v1/create_model", &body).await?["model_id"].as_str().context("id")?.to_string();
            runs.push(Run { id, seq: 0 });
        }
        let train = tokens(1, a.train_tokens + 1, vocab);

        // 1. forward_backward: one after another, then all at once.
        let mut seq_times = Vec::new();
        let mut conc_times = Vec::new();
        for round in 0..=a.rounds {
            let t = Instant::now();
            for r in runs.iter_mut() {
                fb(&http, r, &train).await?;
            }
            let sequential = t.elapsed().as_secs_f64();
            let t = Instant::now();
            let futs = runs.iter_mut().map(|r| fb(&http, r, &train));
            for res in futures::future::join_all(futs).await {
                res?;
            }
            let concurrent = t.elapsed().as_secs_f64();
            if round > 0 {
                seq_times.push(sequential);
                conc_times.push(concurrent);
            }
            eprintln!("bench serve: forward_backward round {round}: sequential {sequential:.2} s, concurrent {concurrent:.2} s");
        }
        let total_tokens = (a.sessions * a.train_tokens) as f64;
        let ratios: Vec<f64> = seq_times.iter().zip(&conc_times).map(|(s, c)| s / c).collect();

        // 2. Sampling: one session alone, then every session at once.
        let mut samplers = Vec::new();
        for (i, r) in runs.iter_mut().enumerate() {
            let body = json!({"model_id": r.id, "seq_id": r.next(), "sampling_session_seq_id": i});
            let v = http.call("/api/v1/save_weights_for_sampler", &body).await?;
            samplers.push(v["sampling_session_id"].as_str().context("sampler")?.to_string());
        }
        let prompt = tokens(2, 16, vocab);
        let sample = |sampler: String, seed: usize| {
            let http = &http;
            let prompt = &prompt;
            async move {
                let body = json!({"prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
                    "sampling_params": {"max_tokens": a.sample_tokens, "seed": seed, "temperature": 1.0},
                    "sampling_session_id": sampler, "num_samples": 1});
                let v = http.call("/api/v1/asample", &body).await?;
                anyhow::Ok(v["sequences"][0]["tokens"].as_array().map_or(0, |t| t.len()))
            }
        };
        let mut single = Vec::new();
        let mut multi = Vec::new();
        for round in 0..=a.rounds {
            let t = Instant::now();
            let n = sample(samplers[0].clone(), round).await?;
            let one = n as f64 / t.elapsed().as_secs_f64();
            let t = Instant::now();
            let futs = samplers.iter().enumerate().map(|(i, s)| sample(s.clone(), round * 100 + i));
            let mut n = 0;
            for res in futures::future::join_all(futs).await {
                n += res?;
            }
            let many = n as f64 / t.elapsed().as_secs_f64();
            if round > 0 {
                single.push(one);
                multi.push(many);
            }
            eprintln!("bench serve: sampling round {round}: one session {one:.1} tok/s, {} sessions {many:.1} tok/s", a.sessions);
        }
        let sample_ratios: Vec<f64> = single.iter().zip(&multi).map(|(s, m)| m / s).collect();

        // 3. Protocol overhead: forward_backward + optim_step on 16 tokens, pipelined.
        let small = tokens(3, 17, vocab);
        let mut http_times = Vec::new();
        let mut direct_times = Vec::new();
        let r = &mut runs[0];
        for round in 0..=a.rounds * 5 {
            // Interleaved with the HTTP round trips, so both see the same machine load.
            let direct_s = direct.round_trip(&reference)?;
            let t = Instant::now();
            let fb_body = json!({"forward_backward_input": {"data": [datum(&small)], "loss_fn": "cross_entropy"},
                                 "model_id": r.id, "seq_id": r.next()});
            let fb_id = http.post("/api/v1/forward_backward", &fb_body).await?["request_id"].as_str().context("id")?.to_string();
            let opt_body = json!({"adam_params": {"learning_rate": 1e-4}, "model_id": r.id, "seq_id": r.next()});
            let opt_id = http.post("/api/v1/optim_step", &opt_body).await?["request_id"].as_str().context("id")?.to_string();
            http.wait(&fb_id).await?;
            http.wait(&opt_id).await?;
            if round > 0 {
                http_times.push(t.elapsed().as_secs_f64());
                direct_times.push(direct_s);
            }
        }
        let overheads: Vec<f64> = http_times.iter().zip(&direct_times).map(|(h, d)| (h - d) * 1000.0).collect();

        // 4. Fairness: the victim's small request behind another key's backlog.
        let fairness = if a.fairness {
            let hog = Http { key: HOG_KEY, ..http.clone() };
            let hog_session = hog.post("/api/v1/create_session", &json!({})).await?["session_id"]
                .as_str().context("session id")?.to_string();
            let body = json!({"session_id": hog_session, "model_seq_id": 0, "base_model": base,
                "lora_config": {"rank": spec.rank, "seed": 99}});
            let id = hog.call("/api/v1/create_model", &body).await?["model_id"].as_str().context("id")?.to_string();
            let mut hog_run = Run { id, seq: 0 };
            let hog_datum = datum(&tokens(4, pass + 1, vocab));
            let victim_tokens = tokens(5, a.train_tokens + 1, vocab);
            let victim = &mut runs[1];
            let (mut alone, mut behind, mut passes) = (Vec::new(), Vec::new(), Vec::new());
            for round in 0..=a.rounds {
                let t = Instant::now();
                fb(&http, victim, &victim_tokens).await?;
                let alone_s = t.elapsed().as_secs_f64();
                let body = json!({"forward_backward_input": {"data": vec![hog_datum.clone(); a.hog_passes],
                                  "loss_fn": "cross_entropy"}, "model_id": hog_run.id, "seq_id": hog_run.next()});
                let t_hog = Instant::now();
                let hog_id = hog.post("/api/v1/forward_backward", &body).await?["request_id"]
                    .as_str().context("id")?.to_string();
                // Let the hog's first pass start, as a backlog would have.
                tokio::time::sleep(Duration::from_millis(200)).await;
                let t = Instant::now();
                fb(&http, victim, &victim_tokens).await?;
                let behind_s = t.elapsed().as_secs_f64();
                hog.wait(&hog_id).await?;
                let pass_s = t_hog.elapsed().as_secs_f64() / (a.hog_passes as f64 + 1.0);
                eprintln!("bench serve: fairness round {round}: victim alone {alone_s:.2} s, behind {} hog passes {behind_s:.2} s, one pass {pass_s:.2} s", a.hog_passes);
                if round > 0 {
                    alone.push(alone_s);
                    behind.push(behind_s);
                    passes.push(behind_s / pass_s);
                }
            }
            // The hog samples 16 long sequences; the victim trains, then samples briefly.
            let body = json!({"model_id": hog_run.id, "seq_id": hog_run.next(), "sampling_session_seq_id": 0});
            let v = hog.call("/api/v1/save_weights_for_sampler", &body).await?;
            let hog_sampler = v["sampling_session_id"].as_str().context("sampler")?.to_string();
            let short = |sampler: &str| json!({"prompt": {"chunks": [{"type": "encoded_text", "tokens": tokens(6, 16, vocab)}]},
                "sampling_params": {"max_tokens": 8, "seed": 1, "temperature": 1.0},
                "sampling_session_id": sampler, "num_samples": 1});
            let (mut fb_behind, mut sample_alone, mut sample_behind, mut hog_decode) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            for round in 0..=a.rounds {
                let t = Instant::now();
                http.call("/api/v1/asample", &short(&samplers[1])).await?;
                let short_alone = t.elapsed().as_secs_f64();
                let body = json!({"prompt": {"chunks": [{"type": "encoded_text", "tokens": tokens(7, 16, vocab)}]},
                    "sampling_params": {"max_tokens": a.hog_sample_tokens, "seed": round, "temperature": 1.0},
                    "sampling_session_id": hog_sampler, "num_samples": 16});
                let t_hog = Instant::now();
                let hog_id = hog.post("/api/v1/asample", &body).await?["request_id"].as_str().context("id")?.to_string();
                tokio::time::sleep(Duration::from_millis(200)).await;
                let t = Instant::now();
                fb(&http, victim, &victim_tokens).await?;
                let fb_s = t.elapsed().as_secs_f64();
                let t = Instant::now();
                http.call("/api/v1/asample", &short(&samplers[1])).await?;
                let short_s = t.elapsed().as_secs_f64();
                hog.wait(&hog_id).await?;
                let hog_s = t_hog.elapsed().as_secs_f64();
                eprintln!("bench serve: fairness round {round}: behind the hog's 16 x {} sample ({hog_s:.2} s): victim forward_backward {fb_s:.2} s, victim sample {short_s:.2} s (alone {short_alone:.2} s)", a.hog_sample_tokens);
                if round > 0 {
                    fb_behind.push(fb_s);
                    sample_alone.push(short_alone);
                    sample_behind.push(short_s);
                    hog_decode.push(hog_s);
                }
            }
            let behind_sampling = json!({
                "hog_sequences": 16,
                "hog_new_tokens": a.hog_sample_tokens,
                "hog_sample_s_median": round(stats(hog_decode).median),
                "victim_forward_backward_s_median": round(stats(fb_behind).median),
                "victim_sample_8_tokens_alone_s_median": round(stats(sample_alone).median),
                "victim_sample_8_tokens_behind_s_median": round(stats(sample_behind).median),
            });
            let (alone, behind, passes) = (stats(alone), stats(behind), stats(passes));
            Some(json!({
                "behind_sampling": behind_sampling,
                "hog_backlog_passes": a.hog_passes,
                "pass_tokens": pass,
                "victim_tokens": a.train_tokens,
                "victim_alone_s_median": round(alone.median),
                "victim_behind_backlog_s_median": round(behind.median),
                "victim_latency_in_passes_median": round(passes.median),
                "victim_latency_in_passes_max": round(passes.max),
                "target_passes": 2.0,
            }))
        } else {
            None
        };
        let http_ms = stats(http_times).median * 1000.0;
        let inproc = stats(direct_times).median;
        let overhead = stats(overheads);
        srv.shutdown(Duration::from_secs(60)).await;
        let fb_seq = stats(seq_times.clone());
        let fb_conc = stats(conc_times.clone());
        let fb_ratio = stats(ratios);
        let s1 = stats(single);
        let sm = stats(multi);
        let sr = stats(sample_ratios);
        anyhow::Ok(json!({
            "benchmark": "serve",
            "precision": precision,
            "sessions": a.sessions,
            "rank": a.rank,
            "forward_backward": {
                "tokens_per_request": a.train_tokens,
                "sequential_tokens_per_s_median": round(total_tokens / fb_seq.median),
                "concurrent_tokens_per_s_median": round(total_tokens / fb_conc.median),
                "concurrent_over_sequential_median": round(fb_ratio.median),
                "concurrent_over_sequential_min": round(fb_ratio.min),
                "concurrent_over_sequential_max": round(fb_ratio.max),
                "target_ratio": 1.5,
            },
            "sampling": {
                "new_tokens": a.sample_tokens,
                "one_session_tokens_per_s_median": round(s1.median),
                "all_sessions_tokens_per_s_median": round(sm.median),
                "all_over_one_median": round(sr.median),
                "all_over_one_min": round(sr.min),
                "all_over_one_max": round(sr.max),
                "target_ratio": 3.0,
            },
            "protocol_overhead": {
                "tokens": 16,
                "http_round_trip_ms_median": round(http_ms),
                "in_process_ms_median": round(inproc * 1000.0),
                "overhead_ms_median": round(overhead.median),
                "overhead_ms_min": round(overhead.min),
                "overhead_ms_max": round(overhead.max),
                "target_overhead_ms": 15.0,
            },
            "fairness": fairness,
            "wire": super::bench_wire::measure(&Default::default())?,
            "peak_rss_mib": round(peak_rss_mib()),
        }))
    });
    let _ = std::fs::remove_dir_all(&data_dir);
    report
}

/// forward_backward + optim_step on 16 tokens, called directly on a model.
struct Direct {
    adapter: Adapter,
    state: AdamState,
    job: DatumJob,
}

impl Direct {
    fn new(model: &LoadedModel, spec: lathe_server::model::LoraSpec) -> anyhow::Result<Self> {
        let t = &model.transformer;
        let toks = tokens(3, 17, t.config.vocab_size);
        Ok(Self {
            adapter: Adapter::new(&t.config, spec, 0, t.weights.dtype(), t.device())?,
            state: AdamState::default(),
            job: DatumJob {
                tokens: toks[..16].to_vec(),
                targets: toks[1..].to_vec(),
                k: 1,
                adapter: 0,
                loss: Loss::CrossEntropy,
                inputs: TokenInputs {
                    weights: vec![1.0; 16],
                    ..Default::default()
                },
            },
        })
    }

    /// Seconds for one round trip.
    fn round_trip(&mut self, model: &LoadedModel) -> anyhow::Result<f64> {
        let start = Instant::now();
        let t = &model.transformer;
        let (_, grads) =
            forward_backward(t, &[&self.adapter], std::slice::from_ref(&self.job), true)?;
        adamw::step(
            t.backend(),
            &mut self.adapter,
            &mut self.state,
            &grads[0],
            &AdamParams::default(),
        )?;
        Ok(start.elapsed().as_secs_f64())
    }
}
