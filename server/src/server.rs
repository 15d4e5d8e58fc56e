//! Starting a whole server: data dir, keys, index, worker thread, engine actor and HTTP
//! listener. Used by `lathe serve`, the end-to-end tests and the SDK examples (which
//! embed a server in-process).

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rand::distr::{Alphanumeric, SampleString};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::api::listener::ConnectionLimits;
use crate::api::{self, AppState, Auth};
use crate::engine::{self, Engine, EngineConfig, EngineHandle, ModelInfo};
use crate::model::LoadedModel;
use crate::sample::DecodeMode;
use crate::store::checkpoints::Faults;
use crate::store::Store;
use crate::worker::{self, Worker};

/// Everything `lathe serve` can be told.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Listen address.
    pub host: String,
    /// Listen port (0 picks a free one).
    pub port: u16,
    /// Index, checkpoints, keys.
    pub data_dir: PathBuf,
    /// Accepted API keys; empty means the key stored in (or generated into) the data dir.
    pub api_keys: Vec<String>,
    /// Engine limits and timeouts.
    pub engine: EngineConfig,
    /// Largest request body (413 beyond).
    pub max_request_bytes: usize,
    /// How long `retrieve_future` holds a pending request.
    pub poll_timeout: Duration,
    /// Sampling weights.
    pub decode_mode: DecodeMode,
    /// Ask protobuf clients to zstd-compress `forward_backward` bodies (worth it over a
    /// network; on one machine it only costs the client time). Compressed bodies are
    /// accepted either way.
    pub zstd_forward_backward: bool,
    /// Limits on HTTP connections (open at once, request heads, stalled transfers).
    pub connections: ConnectionLimits,
    /// Answer bytes each key's clients may have yet to read (429 beyond).
    pub max_answer_bytes: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 8000,
            data_dir: PathBuf::from("lathe-data"),
            api_keys: Vec::new(),
            engine: EngineConfig::default(),
            max_request_bytes: api::DEFAULT_MAX_REQUEST_BYTES,
            poll_timeout: Duration::from_secs(30),
            decode_mode: DecodeMode::Fast,
            zstd_forward_backward: false,
            connections: ConnectionLimits::default(),
            max_answer_bytes: api::DEFAULT_MAX_ANSWER_BYTES,
        }
    }
}

/// Errors starting a server.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// Data dir, key files, listener.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The index or checkpoint directory.
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
}

fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> ServeError {
    let context = context.into();
    move |source| ServeError::Io { context, source }
}

/// A running server.
pub struct RunningServer {
    /// Where it listens.
    pub addr: SocketAddr,
    /// The accepted keys (the first one is handy for clients in the same process).
    pub api_keys: Vec<String>,
    /// Whether the key was generated now (print it once).
    pub generated_key: bool,
    engine: EngineHandle,
    stop: Option<oneshot::Sender<()>>,
    http: Option<JoinHandle<()>>,
}

impl RunningServer {
    /// The base URL clients use.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Graceful stop: refuse new work, let the running batch finish (up to `grace`),
    /// fail what was queued, then close the listener.
    pub async fn shutdown(mut self, grace: Duration) {
        self.engine.shutdown(grace).await;
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(http) = self.http.take() {
            let _ = tokio::time::timeout(Duration::from_secs(5), http).await;
        }
    }
}

/// Writes `contents` to `path` readable by the owner only.
fn write_private(path: &Path, contents: &[u8]) -> Result<(), ServeError> {
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    let mut f = opts
        .open(path)
        .map_err(io_err(format!("creating {}", path.display())))?;
    f.write_all(contents)
        .map_err(io_err(format!("writing {}", path.display())))
}

/// The stored secret in `path`, created on first use.
fn stored_secret(path: &Path, make: impl FnOnce() -> String) -> Result<(String, bool), ServeError> {
    if let Ok(text) = std::fs::read_to_string(path) {
        let text = text.trim().to_string();
        if !text.is_empty() {
            return Ok((text, false));
        }
    }
    let value = make();
    write_private(path, format!("{value}\n").as_bytes())?;
    Ok((value, true))
}

/// Starts a server on `model` inside the current tokio runtime.
pub async fn start(
    mut model: LoadedModel,
    config: ServerConfig,
) -> Result<RunningServer, ServeError> {
    crate::memory::keep_freed_memory();
    let dir = &config.data_dir;
    // The data dir's lock comes before anything else touches it.
    let (store, report) = Store::open(dir, Faults::default())?;
    if report != Default::default() {
        tracing::info!(
            dropped = report.dropped,
            adopted = report.adopted,
            collected = report.collected,
            "checkpoint index reconciled with the data dir"
        );
    }
    let (api_keys, generated_key) = if config.api_keys.is_empty() {
        let (key, generated) = stored_secret(&dir.join("api-key"), || {
            format!("tml-{}", Alphanumeric.sample_string(&mut rand::rng(), 40))
        })?;
        (vec![key], generated)
    } else {
        (config.api_keys.clone(), false)
    };
    let (secret, _) = stored_secret(&dir.join("jwt-secret"), || {
        Alphanumeric.sample_string(&mut rand::rng(), 64)
    })?;
    let info = ModelInfo::of(&model);
    // The worker needs only token ids; the template moves to the HTTP layer.
    let text = api::openai::TextModel {
        tokenizer: model.tokenizer.clone(),
        chat_template: model.chat_template.take(),
    };
    let catalog = store.all_checkpoints()?;
    let (handle, rx) = engine::channel(store.clone());
    let wanted = config.decode_mode.on(&model.transformer);
    if wanted != config.decode_mode {
        tracing::info!(
            "decoding with the trainer's own products (--decode-mode exact): on this \
             device or in this precision the block-quantized decode weights would not \
             compute them"
        );
    }
    let decode_mode = wanted.on_this_cpu();
    if decode_mode != wanted {
        tracing::warn!(
            "decode mode fast asked for, but this CPU has no AVX-512, which the \
             block-quantized decode kernels need to beat f32; decoding with the f32 weights \
             (--decode-mode exact)"
        );
    }
    // A rescoring pass is one candidate of the batch budget: it must fit one.
    let rescore_rows =
        crate::train::pass_tokens(&model.transformer).min(config.engine.max_batch_tokens);
    let worker = worker::spawn(
        Worker::new(model, decode_mode, store.clone())
            .rescoring_in_passes_of(rescore_rows)
            .caching_sampler_adapters_up_to(config.engine.sampler_cache_bytes()),
        handle.outcome_sink(),
    );
    let engine = Engine::new(
        info.clone(),
        config.engine.clone(),
        catalog,
        store.checkpoints().clone(),
        Box::new(worker),
    );
    tokio::spawn(engine::run(engine, rx, handle.clone()));
    let state = AppState {
        engine: handle.clone(),
        auth: Arc::new(Auth::new(&api_keys, secret.as_bytes())),
        model: Arc::new(info),
        poll_timeout: config.poll_timeout,
        limits: config.engine.limits.clone(),
        max_request_bytes: config.max_request_bytes,
        zstd_forward_backward: config.zstd_forward_backward,
        cpu_slots: Arc::new(api::KeySlots::new(
            std::thread::available_parallelism().map_or(1, |n| n.get()),
        )),
        text: Arc::new(text),
        answer_budget: api::AnswerBudget::new(config.max_answer_bytes),
        tokenizer_answer: Arc::default(),
        store_slots: Arc::new(api::KeySlots::with_per_key(
            api::STORE_SLOTS,
            api::STORE_SLOTS_PER_KEY,
        )),
    };
    // Request bodies keep a pace (api/paced_body.rs) or fail with 408.
    let stall = config.connections.stall_timeout;
    let app = api::router(state).layer(axum::middleware::map_request(
        move |req: axum::extract::Request| async move { api::paced_body::pace(req, stall) },
    ));
    let listener = tokio::net::TcpListener::bind((config.host.as_str(), config.port))
        .await
        .map_err(io_err(format!(
            "listening on {}:{}",
            config.host, config.port
        )))?;
    let addr = listener
        .local_addr()
        .map_err(io_err("reading the listen address"))?;
    let (stop, stopped) = oneshot::channel::<()>();
    let connections = config.connections.clone();
    let http = tokio::spawn(async move {
        // Dropping the `RunningServer` (its sender) stops the listener too.
        api::listener::serve(listener, app, connections, async {
            let _ = stopped.await;
        })
        .await;
    });
    Ok(RunningServer {
        addr,
        api_keys,
        generated_key,
        engine: handle,
        stop: Some(stop),
        http: Some(http),
    })
}
