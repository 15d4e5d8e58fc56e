//! Command-line flags every recipe shares, and the connection: `TINKER_BASE_URL` /
//! `LATHE_BASE_URL` when set, else a server started in this process.

use std::path::{Path, PathBuf};

use clap::Args;
use lathe::types::LoraConfig;
use lathe::{ServiceClient, TrainingClient};
#[cfg(feature = "embedded")]
use lathe_server::model::PrecisionChoice;
#[cfg(feature = "embedded")]
use lathe_server::server::{RunningServer, ServerConfig};

use crate::resume::ResumeFrom;

/// Flags of every recipe. The recipe names its own defaults for the flags marked
/// "recipe's default" through [`parse_args`], and `--help` shows them.
///
/// Serialized, it holds the flags that change what the run computes or logs (the run's
/// settings, compared on resume): the step count and where, how often and whether to
/// save or check are left out.
#[derive(Args, Debug, Clone, serde::Serialize)]
pub struct CommonArgs {
    /// Training steps (recipe's default).
    #[arg(long)]
    #[serde(skip)]
    pub steps: usize,
    /// Seed of data, sampling and adapters.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// LoRA rank.
    #[arg(long, default_value_t = 16)]
    pub rank: usize,
    /// Adam learning rate (recipe's default).
    #[arg(long)]
    pub lr: f64,
    /// Problems (or cases) per step (recipe's default).
    #[arg(long)]
    pub batch: usize,
    /// Sampling temperature of training rollouts (recipe's default).
    #[arg(long)]
    pub temperature: f64,
    /// Evaluate on held-out problems every this many steps (recipe's default).
    #[arg(long)]
    pub eval_every: usize,
    /// Held-out problems (recipe's default).
    #[arg(long)]
    pub eval_size: usize,
    /// Save the training state (adapters and optimizer) every this many steps, and
    /// always at the end; 0 saves only at the end.
    #[arg(long, default_value_t = 5)]
    #[serde(skip)]
    pub save_every: usize,
    /// Continue a run: its directory, or one of its training-state URIs
    /// (`tinker://<run>/weights/<name>`, as `summary.json` and the log print). Pass the
    /// run's other flags again; `--steps` may be raised to train further.
    #[arg(long, value_name = "RUN_DIR|URI")]
    #[serde(skip)]
    pub resume: Option<ResumeFrom>,
    /// Weight of a KL penalty towards the base model on the sampled tokens an RL update
    /// trains on (after tinker-cookbook's `kl_penalty_coef`); 0 turns it off.
    #[arg(long, default_value_t = 0.0)]
    pub kl_coef: f64,
    /// Use one session for every role even if more could be created.
    #[arg(long)]
    pub force_fallback: bool,
    /// Output directory (default `runs/<recipe>-<unix time>/`).
    #[arg(long)]
    #[serde(skip)]
    pub out: Option<PathBuf>,
    /// Exit non-zero unless the recipe's stated criterion is met.
    #[arg(long)]
    #[serde(skip)]
    pub check: bool,
    /// Model of the embedded server (when no TINKER_BASE_URL is set): `default`, a
    /// `.gguf` file or a Hugging Face directory.
    #[cfg(feature = "embedded")]
    #[arg(long, default_value = "default")]
    pub model: String,
    /// Limit of LoRA sessions of the embedded server (1 exercises the fallback).
    #[cfg(feature = "embedded")]
    #[arg(long, default_value_t = 8)]
    pub max_sessions: usize,
    /// Element type of the embedded server's base-model products in training, prefill
    /// and decoding (`auto`: bf16 on a CPU with AMX tiles, f32 otherwise).
    #[cfg(feature = "embedded")]
    #[arg(long, value_enum, default_value_t = PrecisionChoice::Auto)]
    #[serde(serialize_with = "precision_in_effect")]
    pub precision: PrecisionChoice,
}

/// Records the precision a run's embedded server computes in (`"f32"` or `"bf16"`: bf16
/// only where this CPU has a bf16 kernel, as the server falls back), not the choice
/// (`auto` means another precision on another CPU), so that a resume on another
/// machine, or of a run saved before `auto` was the default, is compared with what
/// actually ran; `"remote"` when the run trains on a server named by
/// `TINKER_BASE_URL` / `LATHE_BASE_URL`, whose precision is that server's flag.
#[cfg(feature = "embedded")]
fn precision_in_effect<S: serde::Serializer>(p: &PrecisionChoice, s: S) -> Result<S::Ok, S::Error> {
    if remote_url().is_some() {
        return s.serialize_str("remote");
    }
    serde::Serialize::serialize(&p.in_effect(lathe_server::model::Backend::Cpu), s)
}

/// Parses the command line into `T` with the recipe's `defaults` (`(flag id, value)`,
/// the id being the field name: `"eval_every"`) for the flags [`CommonArgs`] leaves to
/// the recipe; `--help` shows them.
pub fn parse_args<T: clap::Parser>(defaults: &[(&'static str, &'static str)]) -> T {
    let mut command = T::command();
    for &(id, value) in defaults {
        command = command.mut_arg(id, |a| a.default_value(value).required(false));
    }
    let matches = command.get_matches();
    T::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
}

impl CommonArgs {
    /// The LoRA config of agent `i` (its own adapter seed).
    pub fn lora(&self, i: usize) -> LoraConfig {
        LoraConfig {
            rank: self.rank,
            seed: Some(self.seed + i as u64),
            ..Default::default()
        }
    }
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
    #[cfg(feature = "embedded")]
    _server: Option<RunningServer>,
}

/// Whether `LATHE_BASE_URL` or `TINKER_BASE_URL` names a server.
fn remote_url() -> Option<String> {
    ["LATHE_BASE_URL", "TINKER_BASE_URL"]
        .iter()
        .filter_map(|v| std::env::var(v).ok())
        .find(|s| !s.is_empty())
}

/// Connects to `LATHE_BASE_URL`/`TINKER_BASE_URL`, or (with the `embedded` feature)
/// starts a server in-process on `args.model` with its data under `out/server-data`.
pub async fn connect(args: &CommonArgs, out: &Path) -> anyhow::Result<Connection> {
    #[cfg(feature = "embedded")]
    let (service, server, endpoint) = match remote_url() {
        Some(url) => (ServiceClient::new().await?, None, url),
        None => {
            let (spec, precision) = (args.model.clone(), args.precision);
            let model = tokio::task::spawn_blocking(move || {
                let options = lathe_server::embedded::ModelOptions {
                    precision,
                    ..Default::default()
                };
                lathe_server::embedded::load_model_with(&spec, options)
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
            let endpoint = format!("{} (in-process)", server.base_url());
            (service, Some(server), endpoint)
        }
    };
    #[cfg(not(feature = "embedded"))]
    let (service, endpoint) = {
        let _ = (args, out);
        let url = remote_url().ok_or_else(|| {
            anyhow::anyhow!(
                "set TINKER_BASE_URL (or LATHE_BASE_URL) to a server: this build has no embedded server (feature `embedded`)"
            )
        })?;
        (ServiceClient::new().await?, url)
    };
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
        #[cfg(feature = "embedded")]
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

    /// Sessions resumed from checkpoints: one per role, or one playing all `roles`
    /// (`fallback_reason` says why).
    pub fn from_trainers(
        trainers: Vec<TrainingClient>,
        roles: usize,
        fallback_reason: Option<String>,
    ) -> Self {
        let trainers = if trainers.len() == 1 {
            vec![trainers[0].clone(); roles.max(1)]
        } else {
            trainers
        };
        Self {
            trainers,
            fallback_reason,
        }
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

    /// The settings a run records (and a resume compares) hold the precision that runs,
    /// not `auto`.
    #[cfg(feature = "embedded")]
    #[test]
    fn settings_record_the_precision_in_effect() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            common: CommonArgs,
        }
        use clap::Parser;
        let in_effect = |flags: &[&str]| {
            // The flags each recipe gives a default.
            let required = [
                "--steps",
                "1",
                "--lr",
                "1e-4",
                "--batch",
                "1",
                "--temperature",
                "1",
                "--eval-every",
                "1",
                "--eval-size",
                "1",
            ];
            let args = std::iter::once("recipe")
                .chain(required)
                .chain(flags.iter().copied());
            let cli = Cli::try_parse_from(args).unwrap();
            serde_json::to_value(&cli.common).unwrap()["precision"].clone()
        };
        if remote_url().is_some() {
            assert_eq!(in_effect(&[]), "remote");
            return;
        }
        let auto = PrecisionChoice::Auto.resolve(lathe_server::model::Backend::Cpu);
        assert_eq!(in_effect(&[]), serde_json::to_value(auto).unwrap());
        assert_eq!(in_effect(&["--precision", "f32"]), "f32");
        let bf16 = if lathe_server::model::cpu::bf16::kernel().is_some() {
            "bf16"
        } else {
            "f32"
        };
        assert_eq!(in_effect(&["--precision", "bf16"]), bf16);
    }

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
