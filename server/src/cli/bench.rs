//! `lathe bench`: training and sampling throughput and memory, as one JSON object each.
//!
//! Numbers are medians over timed iterations after a warm-up, because the machines this
//! runs on are shared and noisy; min and max are printed too.

use std::time::Instant;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use clap::{Args, Subcommand};
use lathe_sdk::types::AdamParams;
use lathe_server::model::cpu::bf16::{self, blocks, panels};
use lathe_server::model::cpu::decode_weights::EXACT_F32_ROWS;
use lathe_server::model::cpu::pool::on_pool;
use lathe_server::model::cpu::quant::{BlockArith, QuantMatrix};
use lathe_server::model::weights::matmul_t;
use lathe_server::model::{Adapter, Backend, LoadedModel, LoraSpec, Precision, PrecisionChoice};
use lathe_server::sample::{sample_timed, DecodeMode, Picker, SampleJob, SampleTimings};
use lathe_server::train::adamw::{self, AdamState};
use lathe_server::train::{
    forward_backward, forward_backward_in_passes, pass_tokens, DatumJob, Loss, TokenInputs,
};
use rand::{rngs::StdRng, Rng, SeedableRng};
use serde_json::json;

/// Benchmarks.
#[derive(Subcommand)]
pub enum BenchCommand {
    /// forward_backward + optim_step on a batch of random tokens.
    Train(TrainArgs),
    /// Single-stream and multi-adapter batched decoding.
    Sample(SampleArgs),
    /// Matrix multiplication GFLOP/s at the model's shapes: f32, and bf16 on each bf16
    /// kernel this CPU has; and the decode step's block-quantized products, in
    /// microseconds, in each arithmetic this CPU has.
    Gemm(GemmArgs),
    /// The HTTP server: batching across sessions and protocol overhead, over loopback.
    Serve(super::bench_serve::ServeBenchArgs),
    /// JSON and protobuf: bytes and encode/decode time of a large forward_backward.
    Wire(super::bench_wire::WireBenchArgs),
}

/// Options of `lathe bench train`.
#[derive(Args)]
pub struct TrainArgs {
    /// `default`, a `.gguf` file or a Hugging Face directory.
    #[arg(long, default_value = "default")]
    model: String,
    /// Sequences per step.
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 128)]
    seq_len: usize,
    /// LoRA rank (on all seven projections).
    #[arg(long, default_value_t = 8)]
    rank: usize,
    /// Adapters the sequences are spread over (sequence i trains adapter i mod N), as
    /// when several sessions' requests share one pass; each takes its own AdamW step.
    #[arg(long, default_value_t = 1)]
    adapters: usize,
    /// Element type of the base model's products (`auto`: bf16 on a CPU with AMX
    /// tiles, f32 otherwise).
    #[arg(long, value_enum, default_value_t = PrecisionChoice::Auto)]
    precision: PrecisionChoice,
    #[command(flatten)]
    device: super::DeviceArg,
    /// Most tokens of one pass over the model (default: 1024 on the CPU, 8192 on a GPU,
    /// as `lathe serve` runs them).
    #[arg(long)]
    pass_tokens: Option<usize>,
    /// Timed iterations (after one warm-up).
    #[arg(long, default_value_t = 5)]
    iters: usize,
}

/// Options of `lathe bench sample`.
#[derive(Args)]
pub struct SampleArgs {
    /// `default`, a `.gguf` file or a Hugging Face directory.
    #[arg(long, default_value = "default")]
    model: String,
    /// Prompt tokens.
    #[arg(long, default_value_t = 32)]
    prompt_len: usize,
    /// New tokens per sequence.
    #[arg(long, default_value_t = 64)]
    new_tokens: usize,
    /// Streams decoded together in the batched run.
    #[arg(long, default_value_t = 8)]
    streams: usize,
    /// Distinct adapters among those streams.
    #[arg(long, default_value_t = 4)]
    adapters: usize,
    /// LoRA rank of the adapters.
    #[arg(long, default_value_t = 8)]
    rank: usize,
    /// Timed iterations (after one warm-up).
    #[arg(long, default_value_t = 3)]
    iters: usize,
    /// `fast`: block-quantized decode weights (exact for a Q4_1 GGUF; otherwise 8-bit
    /// plus f32 rescoring); `exact`: f32 decode.
    #[arg(long, value_enum, default_value_t = Mode::Fast)]
    mode: Mode,
    /// Nucleus mass of the sampler (1 = the whole vocabulary, no truncation).
    #[arg(long, default_value_t = 1.0)]
    top_p: f64,
    /// Element type of the base model's products in prefill and decoding (and in the
    /// trainer's pass that the sampled logprobs are compared with); `auto`: bf16 on a
    /// CPU with AMX tiles, f32 otherwise.
    #[arg(long, value_enum, default_value_t = PrecisionChoice::Auto)]
    precision: PrecisionChoice,
    #[command(flatten)]
    device: super::DeviceArg,
    /// Keep only this many most likely tokens.
    #[arg(long)]
    top_k: Option<usize>,
}

/// Decode mode flag.
#[derive(Clone, Copy, clap::ValueEnum)]
pub enum Mode {
    /// Block-quantized decode weights (f32 rescoring unless they are exact).
    Fast,
    /// f32 decode.
    Exact,
}

impl From<Mode> for DecodeMode {
    fn from(m: Mode) -> Self {
        match m {
            Mode::Fast => DecodeMode::Fast,
            Mode::Exact => DecodeMode::Exact,
        }
    }
}

/// Options of `lathe bench gemm`.
#[derive(Args)]
pub struct GemmArgs {
    /// Timed iterations per shape.
    #[arg(long, default_value_t = 20)]
    iters: usize,
}

/// Runs a benchmark and prints its JSON object on stdout.
pub fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    let report = match cmd {
        BenchCommand::Train(a) => bench_train(a)?,
        BenchCommand::Sample(a) => bench_sample(a)?,
        BenchCommand::Gemm(a) => bench_gemm(&a)?,
        BenchCommand::Serve(a) => super::bench_serve::run(a)?,
        BenchCommand::Wire(a) => super::bench_wire::measure(&a)?,
    };
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}

pub(super) struct Stats {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

pub(super) fn stats(mut v: Vec<f64>) -> Stats {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let median = if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    };
    Stats {
        median,
        min: v[0],
        max: v[n - 1],
    }
}

/// Peak resident memory of this process (VmHWM), in MiB.
pub(super) fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

fn threads() -> usize {
    candle_core::utils::get_num_threads()
}

/// GFLOP/s of `product`, an `(m, k) x (k, n)` product run `iters` times after one
/// warm-up, on random `a (m, k)` and `w (n, k)`.
fn product_gflops(
    m: usize,
    k: usize,
    n: usize,
    iters: usize,
    product: impl Fn(&Tensor, &Tensor) -> anyhow::Result<Tensor>,
) -> anyhow::Result<Stats> {
    let a = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu)?;
    let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu)?;
    let _ = product(&a, &w)?;
    let mut rates = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t = Instant::now();
        let c = product(&a, &w)?;
        let dt = t.elapsed().as_secs_f64();
        drop(c);
        rates.push(2.0 * (m * k * n) as f64 / dt / 1e9);
    }
    Ok(stats(rates))
}

/// f32 GFLOP/s of `a wᵀ` through candle.
fn gemm_gflops(m: usize, k: usize, n: usize, iters: usize) -> anyhow::Result<Stats> {
    product_gflops(m, k, n, iters, |a, w| Ok(a.matmul(&w.t()?)?))
}

/// GFLOP/s of `a wᵀ` in bf16 with f32 accumulation on `kernel`: `w` packed once (a
/// frozen weight), `a` rounded in each product, as training does.
fn bf16_gflops(
    kernel: bf16::Kernel,
    m: usize,
    k: usize,
    n: usize,
    iters: usize,
) -> anyhow::Result<Stats> {
    let packed = std::cell::OnceCell::new();
    product_gflops(m, k, n, iters, |a, w| {
        let weight = match packed.get() {
            Some(p) => p,
            None => {
                let p = bf16::PackedWeight::from_tensor(w)?;
                packed.get_or_init(|| p)
            }
        };
        Ok(bf16::matmul_t(a, bf16::Bf16Ref { kernel, weight })?)
    })
}

/// The training step's shapes on SmolLM2-135M at 512 tokens: MLP, attention, head.
const GEMM_SHAPES: [(usize, usize, usize); 4] = [
    (512, 576, 1536),
    (512, 1536, 576),
    (512, 576, 576),
    (512, 576, 8192),
];

/// A decode step's frozen products on SmolLM2-135M's shapes, in the GGML formats of its
/// Q4_1 file: `(name, rows, cols, format)`.
const DECODE_SHAPES: [(&str, usize, usize, GgmlDType); 4] = [
    ("qkv", 960, 576, GgmlDType::Q4_1),
    ("gate_up", 3072, 576, GgmlDType::Q4_1),
    ("down", 576, 1536, GgmlDType::Q4_1),
    ("head", 49152, 576, GgmlDType::Q8_0),
];

/// Microseconds per decode product (`m` activation rows times exact block weights) in
/// each arithmetic this CPU has, beside the trainer's f32 product, its packed bf16
/// product of the same weights on each bf16 kernel and the bf16 panel copy's product
/// (AVX512-BF16), medians over `iters`. The row counts are one and eight streams'
/// decode steps, short and batched prompts' prefill, and `EXACT_F32_ROWS`'s
/// neighbourhood, where prefill leaves the block weights for the trainer's product.
fn decode_products(iters: usize) -> anyhow::Result<Vec<serde_json::Value>> {
    let mut ariths = vec![(BlockArith::F32, "f32".to_string())];
    for &kernel in bf16::available() {
        if blocks::usable(kernel) {
            ariths.push((BlockArith::Bf16(kernel), format!("bf16_{}", kernel.name())));
        }
    }
    let mut out = Vec::new();
    for (name, rows, cols, format) in DECODE_SHAPES {
        let w = Tensor::randn(0f32, 0.05, (rows, cols), &Device::Cpu)?;
        let w = QTensor::quantize(&w, format)?.dequantize(&Device::Cpu)?;
        let q = QuantMatrix::new(&w)?;
        let panel = panels::usable()
            .then(|| panels::QuantPanels::new(&q))
            .flatten();
        let packed = bf16::available()
            .iter()
            .map(|&k| Ok((k, bf16::PackedWeight::from_tensor(&w)?)))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let mut counts = vec![1, 8, 32, 128, 512, EXACT_F32_ROWS, 2 * EXACT_F32_ROWS];
        counts.sort_unstable();
        counts.dedup();
        for m in counts {
            let x: Vec<f32> = Tensor::randn(0f32, 1.0, (m, cols), &Device::Cpu)?
                .flatten_all()?
                .to_vec1()?;
            let mut row =
                json!({"product": name, "rows": rows, "cols": cols, "m": m, "format": q.format()});
            for &(arith, ref label) in &ariths {
                if matches!(arith, BlockArith::Bf16(_)) && m > blocks::MAX_ROWS {
                    continue;
                }
                let us = median_micros(iters, || q.matmul_t_host(&x, m, arith, None))?;
                row[format!("{label}_us_median")] = json!(us);
            }
            let xt = Tensor::from_slice(&x, (m, cols), &Device::Cpu)?;
            // The trainer's f32 product (what prefill takes beyond the block weights'
            // rows, `DecodeLinear::quantizes`).
            let us = median_micros(iters, || matmul_t(Backend::Cpu, &xt, &w))?;
            row["f32_trainer_us_median"] = json!(us);
            // The same products from the panel copy of the blocks (what decoding uses
            // for up to 8 rows with the `VDPBF16PS` kernel).
            if let Some(p) = panel.as_ref().filter(|_| m <= panels::MAX_ROWS) {
                let us = median_micros(iters, || Ok(p.product(&x, m, None)))?;
                row["bf16_panels_us_median"] = json!(us);
            }
            // The trainer's own bf16 product from its packed weights (what decoding
            // uses where that is faster, see `DecodeMode::on`).
            for (kernel, weight) in &packed {
                let w = bf16::Bf16Ref {
                    kernel: *kernel,
                    weight,
                };
                let us = median_micros(iters, || bf16::matmul_t(&xt, w))?;
                row[format!("bf16_packed_{}_us_median", kernel.name())] = json!(us);
            }
            out.push(row);
        }
    }
    Ok(out)
}

/// Median microseconds of `iters` calls of `product` after one warm-up call.
fn median_micros<T>(
    iters: usize,
    product: impl Fn() -> candle_core::Result<T>,
) -> anyhow::Result<f64> {
    product()?;
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t = Instant::now();
        let y = product()?;
        times.push(t.elapsed().as_secs_f64() * 1e6);
        drop(y);
    }
    Ok(round(stats(times).median))
}

fn bench_gemm(a: &GemmArgs) -> anyhow::Result<serde_json::Value> {
    let mut per_shape = Vec::new();
    let mut best = 0f64;
    let mut best_bf16 = serde_json::Map::new();
    for (m, k, n) in GEMM_SHAPES {
        let s = gemm_gflops(m, k, n, a.iters)?;
        best = best.max(s.median);
        let mut row = json!({"m": m, "k": k, "n": n, "gflops_median": round(s.median), "gflops_min": round(s.min), "gflops_max": round(s.max)});
        for &kernel in bf16::available() {
            let b = bf16_gflops(kernel, m, k, n, a.iters)?;
            row[format!("{}_gflops_median", kernel.name())] = json!(round(b.median));
            let entry = best_bf16.entry(kernel.name()).or_insert(json!(0.0));
            if b.median > entry.as_f64().unwrap_or(0.0) {
                *entry = json!(round(b.median));
            }
        }
        per_shape.push(row);
    }
    Ok(json!({
        "bench": "gemm",
        "threads": threads(),
        "gflops": round(best),
        "bf16_gflops": best_bf16,
        "shapes": per_shape,
        // On the pool with its threads kept awake, as decoding and prefill run.
        "decode_products": on_pool(|| decode_products(a.iters))?,
    }))
}

pub(super) fn round(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

/// The benchmarks' adapter: rank `rank` on the seven projections of every block.
pub(super) fn seven_projections(rank: usize) -> LoraSpec {
    LoraSpec {
        rank,
        train_attn: true,
        train_mlp: true,
        train_unembed: false,
    }
}

fn random_tokens(rng: &mut StdRng, n: usize, vocab: usize) -> Vec<u32> {
    // Skip the first ids (special tokens) so the text looks like ordinary tokens.
    (0..n)
        .map(|_| rng.random_range(100..vocab as u32))
        .collect()
}

fn bench_train(a: TrainArgs) -> anyhow::Result<serde_json::Value> {
    let model = super::load_model(&a.model, a.device, a.precision)?;
    let t = &model.transformer;
    let spec = seven_projections(a.rank);
    let n_adapters = a.adapters.clamp(1, a.batch.max(1));
    let mut adapters = (0..n_adapters)
        .map(|i| Adapter::new(&t.config, spec, i as u64, DType::F32, t.device()))
        .collect::<Result<Vec<_>, _>>()?;
    let mut states = vec![AdamState::default(); n_adapters];
    let mut rng = StdRng::seed_from_u64(0);
    let jobs: Vec<DatumJob> = (0..a.batch)
        .map(|i| {
            let toks = random_tokens(&mut rng, a.seq_len + 1, t.config.vocab_size);
            DatumJob {
                tokens: toks[..a.seq_len].to_vec(),
                targets: toks[1..].to_vec(),
                k: 1,
                adapter: i % n_adapters,
                loss: Loss::CrossEntropy,
                inputs: TokenInputs {
                    weights: vec![1.0; a.seq_len],
                    ..Default::default()
                },
            }
        })
        .collect();
    let tokens = (a.batch * a.seq_len) as f64;
    let params = AdamParams::default();
    let mut rates = Vec::new();
    let (mut fb_times, mut opt_times) = (Vec::new(), Vec::new());
    for i in 0..=a.iters {
        let t0 = Instant::now();
        let grads = {
            let refs: Vec<&Adapter> = adapters.iter().collect();
            let pass = a.pass_tokens.unwrap_or_else(|| pass_tokens(t)).max(1);
            let trained = forward_backward_in_passes(t, &refs, &jobs, true, pass)?;
            if let Some(why) = trained.failed.into_iter().flatten().next() {
                anyhow::bail!("{why}");
            }
            trained.grads
        };
        let t1 = Instant::now();
        for ((adapter, state), g) in adapters.iter_mut().zip(&mut states).zip(&grads) {
            adamw::step(t.backend(), adapter, state, g, &params)?;
        }
        let t2 = Instant::now();
        let total = (t2 - t0).as_secs_f64();
        eprintln!(
            "iteration {i}{}: {:.0} tokens/s",
            if i == 0 { " (warm-up)" } else { "" },
            tokens / total
        );
        if i > 0 {
            rates.push(tokens / total);
            fb_times.push((t1 - t0).as_secs_f64());
            opt_times.push((t2 - t1).as_secs_f64());
        }
    }
    let s = stats(rates);
    // The peak the run is measured against: the CPU product it uses, at the MLP's
    // shape (none on another device).
    let gemm = match (t.backend(), t.precision(), bf16::kernel()) {
        (Backend::Device, ..) => None,
        (_, Precision::Bf16, Some(kernel)) => Some(bf16_gflops(kernel, 512, 576, 1536, 20)?),
        _ => Some(gemm_gflops(512, 576, 1536, 20)?),
    };
    let params_count = t.weights.num_params() as f64;
    let achieved = 4.0 * params_count * s.median / 1e9;
    Ok(json!({
        "bench": "train",
        "model": model.name,
        "device": a.device.device.to_string(),
        "precision": t.precision(),
        "bf16_kernel": (t.backend() == Backend::Cpu)
            .then(bf16::kernel)
            .flatten()
            .map(bf16::Kernel::name),
        "threads": threads(),
        "batch": a.batch, "seq_len": a.seq_len, "rank": a.rank, "adapters": n_adapters,
        "pass_tokens": a.pass_tokens.unwrap_or_else(|| pass_tokens(t)).max(1),
        "trainable_params": adapters[0].num_params(),
        "tokens_per_s_median": round(s.median), "tokens_per_s_min": round(s.min), "tokens_per_s_max": round(s.max),
        "forward_backward_s_median": round(stats(fb_times).median * 1000.0) / 1000.0,
        "optim_step_s_median": round(stats(opt_times).median * 1000.0) / 1000.0,
        "peak_rss_mib": round(peak_rss_mib()),
        "gemm_gflops": gemm.as_ref().map(|g| round(g.median)),
        "achieved_gflops": round(achieved),
        "fraction_of_gemm": gemm.as_ref().map(|g| round(achieved / g.median)),
    }))
}

fn bench_sample(a: SampleArgs) -> anyhow::Result<serde_json::Value> {
    anyhow::ensure!(
        a.top_p > 0.0 && a.top_p <= 1.0,
        "--top-p must be in (0, 1], got {}",
        a.top_p
    );
    anyhow::ensure!(a.top_k != Some(0), "--top-k must be at least 1");
    let model = super::load_model(&a.model, a.device, a.precision)?;
    let t = &model.transformer;
    let spec = seven_projections(a.rank);
    let adapters = (0..a.adapters.max(1))
        .map(|i| random_b_adapter(&model, spec, i as u64))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let refs: Vec<&Adapter> = adapters.iter().collect();
    let mut rng = StdRng::seed_from_u64(1);
    let job = |rng: &mut StdRng, adapter: usize| SampleJob {
        prompt: random_tokens(rng, a.prompt_len, t.config.vocab_size),
        adapter: Some(adapter),
        num_samples: 1,
        picker: Picker {
            top_p: a.top_p,
            top_k: a.top_k,
            ..Picker::default()
        },
        max_tokens: a.new_tokens,
        stop_strings: vec![],
        // Never stop early: every stream produces exactly `new_tokens`.
        stop_tokens: vec![],
        seed: Some(0),
        prompt_logprobs: false,
        topk_prompt_logprobs: 0,
    };
    // Tokens/s end to end (prefill, decode and rescoring), and the phases' seconds.
    let run = |jobs: &[SampleJob]| -> anyhow::Result<(f64, SampleTimings)> {
        let t0 = Instant::now();
        let (out, phases) = sample_timed(t, &model.tokenizer, &refs, jobs, a.mode.into())?;
        let n: usize = out
            .iter()
            .flat_map(|o| &o.sequences)
            .map(|s| s.tokens.len())
            .sum();
        Ok((n as f64 / t0.elapsed().as_secs_f64(), phases))
    };
    let single = vec![job(&mut rng, 0)];
    let multi: Vec<SampleJob> = (0..a.streams)
        .map(|i| job(&mut rng, i % adapters.len()))
        .collect();
    let (mut single_rates, mut multi_rates, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    let (mut single_phases, mut multi_phases) = (Vec::new(), Vec::new());
    for i in 0..=a.iters {
        let (s, sp) = run(&single)?;
        let (m, mp) = run(&multi)?;
        eprintln!(
            "iteration {i}{}: single {s:.1} tokens/s, {} streams {m:.1} tokens/s",
            if i == 0 { " (warm-up)" } else { "" },
            a.streams
        );
        if i > 0 {
            single_rates.push(s);
            multi_rates.push(m);
            ratios.push(m / s);
            single_phases.push(sp);
            multi_phases.push(mp);
        }
    }
    // Per phase: median seconds, and for decoding the tokens/s of that phase alone.
    let steps = a.new_tokens.saturating_sub(1).max(1) as f64;
    let phases = |p: &[SampleTimings], streams: usize| {
        let med = |f: &dyn Fn(&SampleTimings) -> f64| stats(p.iter().map(f).collect()).median;
        let decode = med(&|t| t.decode.as_secs_f64());
        json!({
            "prefill_s_median": round(med(&|t| t.prefill.as_secs_f64())),
            "decode_s_median": round(decode),
            "rescore_s_median": round(med(&|t| t.rescore.as_secs_f64())),
            "decode_only_tokens_per_s": round(steps * streams as f64 / decode),
        })
    };
    let (s, m, r) = (stats(single_rates), stats(multi_rates), stats(ratios));
    let agreement = trainer_agreement(&model, &refs, &multi, a.mode.into())?;
    Ok(json!({
        "bench": "sample",
        "device": a.device.device.to_string(),
        "precision": t.precision(),
        // The mode decoding ran in, which the model may have changed (`DecodeMode::on`).
        "mode": match DecodeMode::from(a.mode).on(t) {
            DecodeMode::Fast => "fast",
            DecodeMode::Exact => "exact",
        },
        "top_p": a.top_p,
        "top_k": a.top_k,
        "model": model.name,
        "threads": threads(),
        "prompt_len": a.prompt_len, "new_tokens": a.new_tokens, "rank": a.rank,
        "single_stream_tokens_per_s_median": round(s.median),
        "single_stream_tokens_per_s_min": round(s.min),
        "single_stream_tokens_per_s_max": round(s.max),
        "streams": a.streams, "adapters": adapters.len(),
        "batched_tokens_per_s_median": round(m.median),
        "batched_tokens_per_s_min": round(m.min),
        "batched_tokens_per_s_max": round(m.max),
        "batched_over_single_ratio_median": round(r.median),
        "single_stream_phases": phases(&single_phases, 1),
        "batched_phases": phases(&multi_phases, a.streams),
        "trainer_agreement": agreement,
        "peak_rss_mib": round(peak_rss_mib()),
    }))
}

/// How well the sampler's logprobs of the tokens it picked agree with the trainer's
/// forward pass over the same sequences (what an RL recipe's importance ratio sees):
/// the mean over tokens of `exp(trainer - sampler)` (1 when they agree) and the largest
/// `|trainer - sampler|`.
fn trainer_agreement(
    model: &LoadedModel,
    adapters: &[&Adapter],
    jobs: &[SampleJob],
    mode: DecodeMode,
) -> anyhow::Result<serde_json::Value> {
    let t = &model.transformer;
    let (out, _) = sample_timed(t, &model.tokenizer, adapters, jobs, mode)?;
    let mut datums = Vec::new();
    let mut sampled = Vec::new();
    for (job, o) in jobs.iter().zip(&out) {
        for seq in &o.sequences {
            let full: Vec<u32> = job.prompt.iter().chain(&seq.tokens).copied().collect();
            let n = full.len() - 1;
            let mut weights = vec![0.0; n];
            weights[job.prompt.len() - 1..].fill(1.0);
            datums.push(DatumJob {
                tokens: full[..n].to_vec(),
                targets: full[1..].to_vec(),
                k: 1,
                adapter: job.adapter.unwrap_or(0),
                loss: Loss::CrossEntropy,
                inputs: TokenInputs {
                    weights,
                    ..Default::default()
                },
            });
            sampled.push((job.prompt.len() - 1, seq.logprobs.clone()));
        }
    }
    let (results, _) = forward_backward(t, adapters, &datums, false)?;
    let (mut ratio_sum, mut count, mut worst) = (0.0f64, 0usize, 0.0f64);
    for (r, (start, lps)) in results.iter().zip(&sampled) {
        for (trainer, sampler) in r.logprobs[*start..].iter().zip(lps) {
            let d = f64::from(*trainer) - f64::from(*sampler);
            ratio_sum += d.exp();
            worst = worst.max(d.abs());
            count += 1;
        }
    }
    Ok(json!({
        "tokens": count,
        "ratio_mean": (ratio_sum / count.max(1) as f64 * 1e5).round() / 1e5,
        "max_abs_logprob_diff": (worst * 1e5).round() / 1e5,
    }))
}

/// An adapter with small random B, so its delta is not a no-op (as after training).
fn random_b_adapter(model: &LoadedModel, spec: LoraSpec, seed: u64) -> anyhow::Result<Adapter> {
    let mut a = Adapter::new(
        &model.transformer.config,
        spec,
        seed,
        DType::F32,
        model.transformer.device(),
    )?;
    for pair in a.pairs.values_mut() {
        pair.b = (Tensor::randn(0f32, 1.0, pair.b.dims(), pair.b.device())? * 0.01)?;
    }
    Ok(a)
}
