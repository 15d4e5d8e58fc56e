//! Command-line flags every recipe shares, and the connection: `TINKER_BASE_URL` /
//! `LATHE_BASE_URL` when set, else a server started in this process.

use std::path::{Path, PathBuf};

use clap::Args;
use lathe::types::LoraConfig;
use lathe::{ServiceClient, TrainingClient};
use lathe_server::model::Precision;
use lathe_server::server::{RunningServer, ServerConfig};

/// Training steps of a recipe that names no default of its own.
pub const DEFAULT_STEPS: usize = 12;

/// Flags of every recipe.
#[derive(Args, Debug, Clone)]
pub struct CommonArgs {
    /// Training steps (default: the recipe's own, 12 unless its help says otherwise).
    #[arg(long)]
    pub steps: Option<usize>,
    /// Seed of data, sampling and adapters.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// LoRA rank.
    #[arg(long, default_value_t = 16)]
    pub rank: usize,
    /// Adam learning rate (default: the recipe's own, 5e-4 unless its help says
    /// otherwise).
    #[arg(long)]
    pub lr: Option<f64>,
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
    /// Element type of the embedded server's base-model products in training and
    /// prefill.
    #[arg(long, value_enum, default_value_t = Precision::F32)]
    pub precision: Precision,
}

impl CommonArgs {
    /// `--steps`, or the recipe's default.
    pub fn steps_or(&self, default: usize) -> usize {
        self.steps.unwrap_or(default)
    }

    /// `--lr`, or the recipe's default.
    pub fn lr_or(&self, default: f64) -> f64 {
        self.lr.unwrap_or(default)
    }

    /// The LoRA config of agent `i` (its own adapter seed).
    pub fn lora(&self, i: usize) -> LoraConfig {
        LoraConfig {
            rank: self.rank,
            seed: Some(self.seed + i as u64),
            ..Default::default()
        }
    }

    /// The sampling seed of training step `step`.
    pub fn step_seed(&self, step: usize) -> u64 {
        self.seed * 1_000_003 + step as u64 * 101
    }
}

/// What every recipe starts with: its output directory, the connection and the base
/// model's tokenizer.
pub struct Start {
    /// Where the run writes.
    pub run: crate::run::RunDir,
    /// The service.
    pub conn: Connection,
    /// The base model's tokenizer.
    pub tok: lathe::Tokenizer,
}

/// Creates the run directory, connects (or embeds a server) and fetches the tokenizer,
/// saying where each is on stderr.
pub async fn start(recipe: &str, args: &CommonArgs) -> anyhow::Result<Start> {
    let run = crate::run::RunDir::create(recipe, args.out.as_deref())?;
    eprintln!("{recipe}: output in {}", run.path.display());
    let conn = connect(args, &run.path).await?;
    eprintln!("endpoint {}, base model {}", conn.endpoint, conn.base_model);
    let tok = conn.service.get_tokenizer(&conn.base_model).await?;
    Ok(Start { run, conn, tok })
}

/// A connection and the embedded server behind it, if any.
pub struct Connection {
    /// The service.
    pub service: ServiceClient,
    /// The base model to train.
    pub base_model: String,
    /// Where the service is.
    pub endpoint: String,
    /// The base model's context length, when the server says.
    pub max_context: Option<usize>,
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
        let (spec, precision) = (args.model.clone(), args.precision);
        let model = tokio::task::spawn_blocking(move || {
            lathe_server::embedded::load_model_in(&spec, precision)
        })
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
    let model = caps
        .supported_models
        .first()
        .ok_or_else(|| anyhow::anyhow!("the service offers no base model"))?;
    let (base_model, max_context) = (model.model_name.clone(), model.max_context_length);
    Ok(Connection {
        service,
        base_model,
        endpoint,
        max_context,
        _server: server,
    })
}

/// How a multi-agent run is set up: one session per role, or one playing every role (and
/// why).
#[derive(Debug, PartialEq)]
pub enum Mode<T> {
    /// One session per role.
    Separate(T),
    /// One session for every role.
    Fallback(String),
}

/// Falls back to one session when the further sessions could not be created or were not
/// wanted.
pub fn choose_mode<T, E: std::fmt::Display>(
    force: bool,
    more: impl FnOnce() -> Result<T, E>,
) -> Mode<T> {
    if force {
        return Mode::Fallback("--force-fallback".into());
    }
    match more() {
        Ok(t) => Mode::Separate(t),
        Err(e) => Mode::Fallback(format!("could not create another session: {e}")),
    }
}

/// The training sessions of a multi-agent recipe.
pub struct AgentSessions {
    trainers: Vec<TrainingClient>,
    /// Why one session plays every role, in fallback mode.
    pub fallback_reason: Option<String>,
}

impl AgentSessions {
    /// Creates one session per role (role `i` gets `lora(i)`); when a further session
    /// cannot be created (e.g. the server's session limit) or `force_fallback` is set,
    /// says why on stderr and uses the first session for every role. Failing to create
    /// the first session is an error.
    pub async fn open(
        conn: &Connection,
        roles: usize,
        force_fallback: bool,
        lora: impl Fn(usize) -> LoraConfig,
    ) -> anyhow::Result<Self> {
        let first = conn
            .service
            .create_lora_training_client(&conn.base_model, lora(0))
            .await?;
        let mut more = Vec::new();
        let mut error = None;
        if !force_fallback {
            for i in 1..roles {
                match conn
                    .service
                    .create_lora_training_client(&conn.base_model, lora(i))
                    .await
                {
                    Ok(t) => more.push(t),
                    Err(e) => {
                        error = Some(e);
                        break;
                    }
                }
            }
        }
        let mode = choose_mode(force_fallback, || error.map_or(Ok(more), Err));
        Ok(match mode {
            Mode::Separate(more) => Self {
                trainers: std::iter::once(first).chain(more).collect(),
                fallback_reason: None,
            },
            Mode::Fallback(reason) => {
                eprintln!("falling back to one session playing every role: {reason}");
                Self {
                    trainers: vec![first; roles],
                    fallback_reason: Some(reason),
                }
            }
        })
    }

    /// The session that plays `role`.
    pub fn trainer(&self, role: usize) -> &TrainingClient {
        &self.trainers[role]
    }

    /// How many different sessions there are (1 in fallback mode).
    pub fn distinct(&self) -> usize {
        if self.fallback_reason.is_some() {
            1
        } else {
            self.trainers.len()
        }
    }

    /// `"fallback"` or `"two-agent"` / `"<n>-agent"`.
    pub fn mode(&self) -> &'static str {
        match (self.fallback_reason.is_some(), self.trainers.len()) {
            (true, _) => "fallback",
            (false, 2) => "two-agent",
            (false, 1) => "single-agent",
            _ => "multi-agent",
        }
    }
}

/// Saves `trainer`'s state and sampler weights as `name`; returns both URIs as JSON.
pub async fn save_final(trainer: &TrainingClient, name: &str) -> anyhow::Result<serde_json::Value> {
    let state = trainer.save_state(name).await?.result().await?;
    let sampler = trainer
        .save_weights_for_sampler(name)
        .await?
        .result()
        .await?;
    Ok(serde_json::json!({"state": state.to_string(), "sampler": sampler.to_string()}))
}

/// Logs to stderr at `RUST_LOG` (default `warn`), so progress bars stay readable.
pub fn init_tracing() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fallback_is_chosen_when_a_session_fails_or_is_not_wanted() {
        assert_eq!(choose_mode(false, || Ok::<_, String>(7)), Mode::Separate(7));
        assert!(
            matches!(choose_mode(false, || Err::<u8, _>("capacity")), Mode::Fallback(r) if r.contains("capacity"))
        );
        assert!(matches!(
            choose_mode(true, || Ok::<_, String>(7)),
            Mode::Fallback(_)
        ));
    }
}
