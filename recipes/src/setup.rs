//! Command-line flags every recipe shares, and the connection: `TINKER_BASE_URL` /
//! `LATHE_BASE_URL` when set, else a server started in this process.

use std::path::{Path, PathBuf};

use clap::Args;
use lathe::ServiceClient;
use lathe_server::server::{RunningServer, ServerConfig};

/// Flags of every recipe.
#[derive(Args, Debug, Clone)]
pub struct CommonArgs {
    /// Training steps.
    #[arg(long, default_value_t = 12)]
    pub steps: usize,
    /// Seed of data, sampling and adapters.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// LoRA rank.
    #[arg(long, default_value_t = 16)]
    pub rank: usize,
    /// Adam learning rate.
    #[arg(long, default_value_t = 5e-4)]
    pub lr: f64,
    /// Output directory (default `runs/<recipe>-<unix time>/`).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Exit non-zero unless the recipe's stated criterion is met.
    #[arg(long)]
    pub check: bool,
    /// Model of the embedded server (when no TINKER_BASE_URL is set): `default`, a
    /// `.gguf` file or a Hugging Face directory.
    #[arg(long, default_value = "default")]
    pub model: String,
    /// Limit of LoRA sessions of the embedded server (1 exercises the fallback).
    #[arg(long, default_value_t = 8)]
    pub max_sessions: usize,
}

/// A connection and the embedded server behind it, if any.
pub struct Connection {
    /// The service.
    pub service: ServiceClient,
    /// The base model to train.
    pub base_model: String,
    /// Where the service is.
    pub endpoint: String,
    _server: Option<RunningServer>,
}

/// Connects to `LATHE_BASE_URL`/`TINKER_BASE_URL`, or starts a server in-process on
/// `args.model` with its data under `out/server-data`.
pub async fn connect(args: &CommonArgs, out: &Path) -> anyhow::Result<Connection> {
    let remote = ["LATHE_BASE_URL", "TINKER_BASE_URL"]
        .iter()
        .any(|v| std::env::var(v).is_ok_and(|s| !s.is_empty()));
    let (service, server) = if remote {
        (ServiceClient::new().await?, None)
    } else {
        let spec = args.model.clone();
        let model = tokio::task::spawn_blocking(move || lathe_server::embedded::load_model(&spec))
            .await??;
        let config = ServerConfig {
            port: 0,
            data_dir: out.join("server-data"),
            engine: lathe_server::engine::EngineConfig {
                max_sessions: args.max_sessions.max(1),
                ..Default::default()
            },
            ..Default::default()
        };
        let server = lathe_server::server::start(model, config).await?;
        let service = ServiceClient::builder()
            .base_url(server.base_url())
            .api_key(&server.api_keys[0])
            .build()
            .await?;
        (service, Some(server))
    };
    let endpoint = server.as_ref().map_or_else(
        || {
            std::env::var("LATHE_BASE_URL")
                .or_else(|_| std::env::var("TINKER_BASE_URL"))
                .unwrap_or_default()
        },
        |s| format!("{} (in-process)", s.base_url()),
    );
    let caps = service.get_server_capabilities().await?;
    let base_model = caps
        .supported_models
        .first()
        .ok_or_else(|| anyhow::anyhow!("the service offers no base model"))?
        .model_name
        .clone();
    Ok(Connection {
        service,
        base_model,
        endpoint,
        _server: server,
    })
}
