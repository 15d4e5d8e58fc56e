//! The `lathe` command: serve the training API, generate text, measure speed.

mod cli;

use clap::{Parser, Subcommand};

/// Tensors are large and short-lived: see `lathe_server::memory`.
#[global_allocator]
static GLOBAL: lathe_server::memory::MiMalloc = lathe_server::memory::MiMalloc;

/// Lathe: one frozen base model, many LoRA training sessions.
#[derive(Parser)]
#[command(name = "lathe", version, about)]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the Tinker HTTP protocol: many LoRA training sessions on one base model.
    Serve(cli::serve::ServeArgs),
    /// Generate a completion for a prompt (chat template applied unless --raw).
    Generate(cli::generate::GenerateArgs),
    /// Measure throughput and memory; prints one JSON object.
    #[command(subcommand)]
    Bench(cli::bench::BenchCommand),
}

fn main() -> anyhow::Result<()> {
    lathe_server::memory::keep_freed_memory();
    pin_thread_count();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match Args::parse().command {
        Command::Serve(args) => cli::serve::run(args),
        Command::Generate(args) => cli::generate::run(args),
        Command::Bench(cmd) => cli::bench::run(cmd),
    }
}

/// candle asks for its thread count on every matmul, and without `RAYON_NUM_THREADS` it
/// parses /proc/cpuinfo each time (7 % of decoding time). Resolve it once, before any
/// other thread exists.
fn pin_thread_count() {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let n = candle_core::utils::get_num_threads();
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
}
