//! `lathe serve`: the Tinker-compatible training server.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, ValueEnum};
use lathe_server::api::listener::ConnectionLimits;
use lathe_server::engine::{EngineConfig, KeyLimits};
use lathe_server::model::PrecisionChoice;
use lathe_server::sample::DecodeMode;
use lathe_server::server::{self, ServerConfig};

/// Options of `lathe serve`.
#[derive(Args)]
pub struct ServeArgs {
    /// `default`, a `.gguf` file or a Hugging Face model directory.
    #[arg(long, default_value = "default")]
    model: String,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0 picks a free one).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Index, checkpoints, API key and JWT secret live here.
    #[arg(long, default_value = "./lathe-data")]
    data_dir: PathBuf,
    /// Accepted API keys (repeatable). Without any, a `tml-` key is generated once and
    /// stored in <data-dir>/api-key.
    #[arg(long = "api-key", env = "LATHE_API_KEYS", value_delimiter = ',')]
    api_keys: Vec<String>,
    /// Most LoRA training sessions loaded at once.
    #[arg(long, default_value_t = 64)]
    max_sessions: usize,
    /// Tokens of one batch between two scheduling decisions: a fused multi-adapter
    /// forward/backward pass (a larger request runs as several passes), new prompts and a
    /// decode step (one token per sequence) share it. Default: 1024 on the CPU, 8192 on
    /// a GPU (the most tokens of one training pass there).
    #[arg(long)]
    max_batch_tokens: Option<usize>,
    /// Most sequences decoded together, across all keys (a sampling request waits for
    /// room, and later ones wait behind it; one larger than this runs when nothing else
    /// decodes).
    #[arg(long, default_value_t = EngineConfig::default().max_sample_streams)]
    max_sample_streams: usize,
    /// Largest body in bytes of the requests that carry tokens (forward_backward,
    /// forward, asample, MinT's reverse KL), after decompression too (413 beyond); the
    /// OpenAI completions take at most 4 MiB of it, every other request at most 1 MiB.
    #[arg(long, default_value_t = lathe_server::api::DEFAULT_MAX_REQUEST_BYTES)]
    max_request_bytes: usize,
    /// Ask protobuf clients (tinker 0.25+) to zstd-compress forward_backward bodies: worth
    /// it when clients reach the server over a network.
    #[arg(long)]
    zstd_forward_backward: bool,
    /// Seconds without a heartbeat before a session's runs are unloaded (they stay
    /// resumable from their checkpoints).
    #[arg(long, default_value_t = 300)]
    session_timeout: u64,
    /// Which weights pick sampled tokens.
    #[arg(long, value_enum, default_value_t = Mode::Fast)]
    decode_mode: Mode,
    /// Element type of the base model's products in training, prefill and decoding
    /// (`auto`: bf16 on a CPU with AMX tiles, f32 otherwise); on a CUDA device, bf16
    /// also stores the base weights in bf16.
    #[arg(long, value_enum, default_value_t = PrecisionChoice::Auto)]
    precision: PrecisionChoice,
    #[command(flatten)]
    device: super::DeviceArg,
    /// Per-key limits (what one API key may use at once).
    #[command(flatten)]
    limits: LimitArgs,
    /// Memory that finished results may hold until clients retrieve them; past it the
    /// oldest are dropped (their futures answer 404).
    #[arg(long, default_value_t = 1 << 30, help_heading = "Limits")]
    max_result_bytes: usize,
    /// Bytes of adapter state all loaded runs may hold in memory, counted as for
    /// --max-adapter-bytes (429 past it), an eighth of it kept for checkpoint adapters
    /// opened for sampling. Default: half of this machine's memory (or of its cgroup's
    /// limit); on a GPU, where adapters live, half of its memory free once the model is
    /// loaded. The log says which at start.
    #[arg(long, help_heading = "Limits")]
    max_total_adapter_bytes: Option<u64>,
    /// Bytes of answers each key's clients may have yet to read (an answer waits in
    /// memory for its client); past it the key's result retrievals, listings and OpenAI
    /// completions are refused with 429 (control calls never are).
    #[arg(long, default_value_t = lathe_server::api::DEFAULT_MAX_ANSWER_BYTES, help_heading = "Per-key limits")]
    max_answer_bytes: usize,
    /// Limits on HTTP connections, which hold before any key is checked.
    #[command(flatten)]
    connections: ConnectionArgs,
}

/// The default of `--max-total-adapter-bytes`: half of `device_free`, a GPU's memory
/// free once the model is loaded (adapters, their gradients and optimizer state live
/// there), else half of `host`, the memory this process may use, else the engine's
/// default. Returns the bytes and what they are half of.
fn default_total_adapter_bytes(device_free: Option<u64>, host: Option<u64>) -> (u64, &'static str) {
    match (device_free, host) {
        (Some(free), _) => (free / 2, "half of the GPU's free memory"),
        (None, Some(host)) => (host / 2, "half of this machine's memory"),
        (None, None) => (
            EngineConfig::default().max_adapter_bytes,
            "the engine's default",
        ),
    }
}

/// Limits on HTTP connections.
#[derive(Args)]
#[command(next_help_heading = "Connections")]
struct ConnectionArgs {
    /// Most connections open at once; past it new connections wait until one closes.
    #[arg(long, default_value_t = ConnectionLimits::default().max_connections as u32,
          value_parser = clap::value_parser!(u32).range(1..=1 << 20))]
    max_connections: u32,
    /// Most connections open at once from one remote address, an IPv6 /64 counting as
    /// one and a NAT64 address with a /96 prefix as the IPv4 one it carries (loopback
    /// addresses, such as a reverse proxy on this host, are exempt); past it a new one
    /// is closed.
    #[arg(long, default_value_t = ConnectionLimits::default().max_connections_per_ip as u32,
          value_parser = clap::value_parser!(u32).range(1..=1 << 20))]
    max_connections_per_ip: u32,
    /// Seconds a client has to send a request's head; an idle keep-alive connection
    /// closes after as long.
    #[arg(long, default_value_t = ConnectionLimits::default().header_timeout.as_secs(),
          value_parser = clap::value_parser!(u64).range(1..=86_400))]
    header_timeout: u64,
    /// Seconds a request body may send nothing (after which it must also average 16
    /// KiB/s), or a response wait for the client to take any of it, before the request
    /// fails and its connection closes.
    #[arg(long, default_value_t = ConnectionLimits::default().stall_timeout.as_secs(),
          value_parser = clap::value_parser!(u64).range(1..=86_400))]
    stall_timeout: u64,
}

impl ConnectionArgs {
    fn limits(&self) -> ConnectionLimits {
        ConnectionLimits {
            max_connections: self.max_connections as usize,
            max_connections_per_ip: self.max_connections_per_ip as usize,
            header_timeout: Duration::from_secs(self.header_timeout),
            stall_timeout: Duration::from_secs(self.stall_timeout),
        }
    }
}

/// Per-key limits. Occupancy limits answer 429 with Retry-After; limits on one
/// request's size answer 400.
#[derive(Args)]
#[command(next_help_heading = "Per-key limits")]
struct LimitArgs {
    /// Training runs one key may have loaded (429).
    #[arg(long, default_value_t = KeyLimits::default().live_runs)]
    max_live_runs: usize,
    /// Operations and sampling requests one key may have queued (429).
    #[arg(long, default_value_t = KeyLimits::default().queued_operations)]
    max_queued_operations: usize,
    /// Input tokens of one forward/forward_backward request (400).
    #[arg(long, default_value_t = KeyLimits::default().tokens_per_request)]
    max_tokens_per_request: usize,
    /// Sampling tokens one key may have in flight, num_samples x (prompt + max_tokens)
    /// summed over its requests (429; 400 for one request over it alone).
    #[arg(long, default_value_t = KeyLimits::default().sampling_tokens)]
    max_sampling_tokens: usize,
    /// Stop strings (or stop tokens) of one sampling request (400).
    #[arg(long, default_value_t = KeyLimits::default().stop_strings)]
    max_stop_strings: usize,
    /// Bytes of one stop string (400).
    #[arg(long, default_value_t = KeyLimits::default().stop_string_bytes)]
    max_stop_string_bytes: usize,
    /// Checkpoints one key may store (429).
    #[arg(long, default_value_t = KeyLimits::default().checkpoints)]
    max_checkpoints: usize,
    /// Bytes of checkpoints one key may store (429).
    #[arg(long, default_value_t = KeyLimits::default().checkpoint_bytes)]
    max_checkpoint_bytes: u64,
    /// Live sessions one key may have (429).
    #[arg(long, default_value_t = KeyLimits::default().sessions)]
    max_sessions_per_key: usize,
    /// Sampling sessions one key may have open (429).
    #[arg(long, default_value_t = KeyLimits::default().samplers)]
    max_samplers: usize,
    /// Bytes of adapter state one key's loaded runs may hold in memory: per run four
    /// times its adapter's f32 size (weights, gradient, AdamW moments), plus a copy per
    /// sampler snapshot (429).
    #[arg(long, default_value_t = KeyLimits::default().adapter_bytes)]
    max_adapter_bytes: u64,
}

impl LimitArgs {
    fn limits(&self) -> KeyLimits {
        KeyLimits {
            live_runs: self.max_live_runs.max(1),
            queued_operations: self.max_queued_operations.max(1),
            tokens_per_request: self.max_tokens_per_request.max(1),
            sampling_tokens: self.max_sampling_tokens.max(1),
            stop_strings: self.max_stop_strings,
            stop_string_bytes: self.max_stop_string_bytes.max(1),
            checkpoints: self.max_checkpoints,
            checkpoint_bytes: self.max_checkpoint_bytes,
            sessions: self.max_sessions_per_key.max(1),
            samplers: self.max_samplers.max(1),
            adapter_bytes: self.max_adapter_bytes,
        }
    }
}

/// Sampling weights (reported log-probabilities are the trainer's in both).
#[derive(Clone, Copy, ValueEnum)]
enum Mode {
    /// Block-quantized weights pick tokens: a Q4_1 model's own exact 4-bit blocks, or
    /// 8-bit copies whose picks the f32 weights then score.
    Fast,
    /// f32 weights pick and score tokens.
    Exact,
}

/// Runs `lathe serve` until SIGINT or SIGTERM.
pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let model = super::load_model(&args.model, args.device, args.precision)?;
    let name = model.name.clone();
    let max_adapter_bytes = match args.max_total_adapter_bytes {
        Some(bytes) => bytes,
        None => {
            let device_free =
                lathe_server::model::backend::device_memory(model.transformer.device())?
                    .map(|(free, _)| free);
            let (bytes, what) =
                default_total_adapter_bytes(device_free, lathe_server::memory::physical_bytes());
            tracing::info!("--max-total-adapter-bytes {bytes} ({what})");
            bytes
        }
    };
    let config = ServerConfig {
        host: args.host,
        port: args.port,
        data_dir: args.data_dir,
        api_keys: args
            .api_keys
            .into_iter()
            .filter(|k| !k.is_empty())
            .collect(),
        engine: EngineConfig {
            max_sessions: args.max_sessions.max(1),
            max_batch_tokens: args
                .max_batch_tokens
                .unwrap_or_else(|| lathe_server::train::pass_tokens(&model.transformer))
                .max(1),
            max_sample_streams: args.max_sample_streams.max(1),
            session_timeout: Duration::from_secs(args.session_timeout.max(1)),
            limits: args.limits.limits(),
            max_result_bytes: args.max_result_bytes,
            max_adapter_bytes,
            ..Default::default()
        },
        max_request_bytes: args.max_request_bytes,
        zstd_forward_backward: args.zstd_forward_backward,
        connections: args.connections.limits(),
        max_answer_bytes: args.max_answer_bytes.max(1),
        decode_mode: match args.decode_mode {
            Mode::Fast => DecodeMode::Fast,
            Mode::Exact => DecodeMode::Exact,
        },
        ..Default::default()
    };
    let data_dir = config.data_dir.clone();
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    runtime.block_on(async move {
        let server = server::start(model, config)
            .await
            .context("starting the server")?;
        if server.generated_key {
            eprintln!(
                "generated API key (stored in {}): {}",
                data_dir.join("api-key").display(),
                server.api_keys[0]
            );
        }
        tracing::info!(model = %name, data_dir = %data_dir.display(), "ready on {}", server.base_url());
        println!("lathe serve: ready on {}", server.base_url());
        wait_for_signal().await;
        tracing::info!("shutting down: finishing the running batch");
        server.shutdown(Duration::from_secs(120)).await;
        tracing::info!("stopped");
        Ok(())
    })
}

async fn wait_for_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("installing the SIGTERM handler");
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_adapter_memory_default_is_half_the_gpus_free_memory_then_the_machines() {
        let gib = 1u64 << 30;
        assert_eq!(
            default_total_adapter_bytes(Some(60 * gib), Some(128 * gib)).0,
            30 * gib
        );
        assert_eq!(
            default_total_adapter_bytes(None, Some(24 * gib)).0,
            12 * gib
        );
        assert_eq!(
            default_total_adapter_bytes(None, None).0,
            EngineConfig::default().max_adapter_bytes
        );
    }
}
