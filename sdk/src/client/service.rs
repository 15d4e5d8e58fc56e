//! [`ServiceClient`]: the connection to a service, its session and heartbeat, and the
//! factory of training, sampling and REST clients.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use reqwest::Method;
use serde_json::Value;

use super::config::{ClientBuilder, ClientConfig};
use super::error::{Error, Result};
use super::future::{decode, poll};
use super::http::{tagged, Transport};
use super::rest::RestClient;
use super::sampling::SamplingClient;
use super::tokenizer::Tokenizer;
use super::training::TrainingClient;
use crate::types::{
    CheckpointUri, ClientConfigRequest, ClientConfigResponse, CreateModelRequest,
    CreateSamplingSessionRequest, CreateSamplingSessionResponse, CreateSessionRequest,
    CreateSessionResponse, LoraConfig, ServerCapabilities, SessionHeartbeatRequest,
    TokenizerResponse, UntypedApiFuture, WeightsInfoRequest, WeightsInfoResponse,
};

/// What a sampling client samples.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SamplingSource {
    /// Saved weights: `tinker://<run>/sampler_weights/<name>` (or `weights/<name>`).
    Path(CheckpointUri),
    /// The base model itself.
    BaseModel(String),
}

pub(crate) struct Session {
    pub(crate) transport: Arc<Transport>,
    pub(crate) session_id: String,
    model_seq: AtomicU64,
    sampling_seq: AtomicU64,
    custom_loss_seq: AtomicU64,
    heartbeat: tokio::task::JoinHandle<()>,
}

impl Drop for Session {
    fn drop(&mut self) {
        self.heartbeat.abort();
    }
}

/// A connection to a Tinker-compatible service (such as `lathe serve`). Cheap to clone;
/// the session's heartbeat runs in the background until the last clone (and every client
/// made from it) is dropped.
///
/// ```no_run
/// # async fn demo() -> lathe_sdk::Result<()> {
/// use lathe_sdk::{ServiceClient, types::LoraConfig};
/// let service = ServiceClient::builder()
///     .base_url("http://127.0.0.1:8000")
///     .api_key("tml-...")
///     .build()
///     .await?;
/// let caps = service.get_server_capabilities().await?;
/// let trainer = service
///     .create_lora_training_client(&caps.supported_models[0].model_name, LoraConfig { rank: 8, ..Default::default() })
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct ServiceClient {
    pub(crate) session: Arc<Session>,
}

impl std::fmt::Debug for ServiceClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceClient")
            .field("base_url", &self.session.transport.config.base_url)
            .field("session_id", &self.session.session_id)
            .finish()
    }
}

impl ServiceClient {
    /// Connects with settings from the environment (`LATHE_BASE_URL`/`LATHE_API_KEY`,
    /// else `TINKER_BASE_URL`/`TINKER_API_KEY`).
    pub async fn new() -> Result<Self> {
        Self::builder().build().await
    }

    /// A builder starting from the environment.
    pub fn builder() -> ClientBuilder {
        ClientBuilder::default()
    }

    pub(crate) async fn connect(config: ClientConfig) -> Result<Self> {
        if config.api_key.is_empty() {
            return Err(Error::InvalidInput(
                "no API key: set LATHE_API_KEY or TINKER_API_KEY, or call .api_key()".into(),
            ));
        }
        if !(config.base_url.starts_with("http://") || config.base_url.starts_with("https://")) {
            return Err(Error::InvalidInput(format!(
                "base URL {:?} must start with http:// or https://",
                config.base_url
            )));
        }
        let transport = Arc::new(Transport::new(config)?);
        let sdk_version = concat!("lathe-rs-", env!("CARGO_PKG_VERSION"));
        let request = ClientConfigRequest {
            sdk_version: sdk_version.into(),
        };
        let cfg: ClientConfigResponse = transport
            .send(Method::POST, "/api/v1/client/config", &request, None)
            .await
            .and_then(decode)?;
        if cfg.pjwt_auth_enabled {
            transport.enable_jwt().await?;
        }
        let request = CreateSessionRequest {
            tags: Vec::new(),
            user_metadata: Some(
                transport
                    .config
                    .user_metadata
                    .iter()
                    .map(|(k, v)| (k.clone(), Value::String(v.clone())))
                    .collect(),
            ),
            sdk_version: Some(sdk_version.into()),
            project_id: None,
        };
        let created: CreateSessionResponse = transport
            .send(
                Method::POST,
                "/api/v1/create_session",
                &request,
                Some("create_session"),
            )
            .await
            .and_then(decode)?;
        for (level, msg) in [
            ("info", &created.info_message),
            ("warning", &created.warning_message),
            ("error", &created.error_message),
        ] {
            if let Some(m) = msg {
                tracing::info!(level, "server: {m}");
            }
        }
        let heartbeat = tokio::spawn(heartbeat(transport.clone(), created.session_id.clone()));
        Ok(Self {
            session: Arc::new(Session {
                transport,
                session_id: created.session_id,
                model_seq: AtomicU64::new(0),
                sampling_seq: AtomicU64::new(0),
                custom_loss_seq: AtomicU64::new(0),
                heartbeat,
            }),
        })
    }

    pub(crate) fn transport(&self) -> &Arc<Transport> {
        &self.session.transport
    }

    pub(crate) fn next_sampling_seq(&self) -> u64 {
        self.session.sampling_seq.fetch_add(1, Ordering::Relaxed)
    }

    pub(crate) fn next_custom_loss_seq(&self) -> u64 {
        self.session.custom_loss_seq.fetch_add(1, Ordering::Relaxed)
    }

    /// This connection's session id.
    pub fn session_id(&self) -> &str {
        &self.session.session_id
    }

    /// The base models the service trains.
    pub async fn get_server_capabilities(&self) -> Result<ServerCapabilities> {
        self.transport()
            .execute(Method::GET, "/api/v1/get_server_capabilities", None)
            .await
            .and_then(decode)
    }

    /// A new LoRA adapter on `base_model`, ready to train.
    pub async fn create_lora_training_client(
        &self,
        base_model: &str,
        lora: LoraConfig,
    ) -> Result<TrainingClient> {
        if lora.rank == 0 {
            return Err(Error::InvalidInput("LoRA rank must be at least 1".into()));
        }
        if !(lora.train_attn || lora.train_mlp || lora.train_unembed) {
            return Err(Error::InvalidInput(
                "at least one of train_attn, train_mlp, train_unembed must be set".into(),
            ));
        }
        let seq = self.session.model_seq.fetch_add(1, Ordering::Relaxed);
        let request = CreateModelRequest {
            session_id: self.session_id().to_string(),
            model_seq_id: seq,
            base_model: base_model.to_string(),
            lora_config: lora,
            user_metadata: None,
        };
        let fut: UntypedApiFuture = self
            .transport()
            .send(
                Method::POST,
                "/api/v1/create_model",
                &request,
                Some("create_model"),
            )
            .await
            .and_then(decode)?;
        let result = poll(self.transport(), &fut.request_id).await?;
        let model_id = result["model_id"]
            .as_str()
            .ok_or_else(|| Error::decode("no model_id", &result.to_string()))?
            .to_string();
        Ok(TrainingClient::new(self.clone(), model_id))
    }

    /// What a checkpoint was trained as (base model, rank, targets).
    pub async fn get_weights_info(&self, uri: &CheckpointUri) -> Result<WeightsInfoResponse> {
        let request = WeightsInfoRequest {
            tinker_path: uri.to_string(),
        };
        self.transport()
            .send(Method::POST, "/api/v1/weights_info", &request, None)
            .await
            .and_then(decode)
    }

    async fn resume(&self, uri: &CheckpointUri, optimizer: bool) -> Result<TrainingClient> {
        let info = self.get_weights_info(uri).await?;
        let lora = LoraConfig {
            rank: info.lora_rank,
            seed: None,
            train_unembed: info.train_unembed,
            train_mlp: info.train_mlp,
            train_attn: info.train_attn,
        };
        let client = self
            .create_lora_training_client(&info.base_model, lora)
            .await?;
        let fut = if optimizer {
            client.load_state_with_optimizer(uri).await?
        } else {
            client.load_state(uri).await?
        };
        fut.result().await?;
        Ok(client)
    }

    /// A training client resumed from `tinker://<run>/weights/<name>` (weights only; the
    /// optimizer starts fresh).
    pub async fn create_training_client_from_state(
        &self,
        uri: &CheckpointUri,
    ) -> Result<TrainingClient> {
        self.resume(uri, false).await
    }

    /// A training client resumed from a checkpoint with its optimizer state, so training
    /// continues exactly where it stopped.
    pub async fn create_training_client_from_state_with_optimizer(
        &self,
        uri: &CheckpointUri,
    ) -> Result<TrainingClient> {
        self.resume(uri, true).await
    }

    /// A sampling client on saved weights or on the base model.
    pub async fn create_sampling_client(&self, source: SamplingSource) -> Result<SamplingClient> {
        let seq = self.next_sampling_seq();
        let (model_path, base_model) = match &source {
            SamplingSource::Path(uri) => (Some(uri.to_string()), None),
            SamplingSource::BaseModel(name) => (None, Some(name.clone())),
        };
        let request = CreateSamplingSessionRequest {
            session_id: self.session_id().to_string(),
            sampling_session_seq_id: seq,
            base_model: base_model.clone(),
            model_path,
        };
        let created: CreateSamplingSessionResponse = self
            .transport()
            .send(
                Method::POST,
                "/api/v1/create_sampling_session",
                &request,
                Some("create_sampling_session"),
            )
            .await
            .and_then(decode)?;
        Ok(SamplingClient::new(
            self.clone(),
            created.sampling_session_id,
            base_model,
        ))
    }

    /// A client for listing and managing runs and checkpoints.
    pub fn create_rest_client(&self) -> RestClient {
        RestClient::new(self.clone())
    }

    /// The tokenizer and chat template of a base model, served by Lathe's tokenizer
    /// extension (`GET /api/v1/lathe/tokenizer`).
    pub async fn get_tokenizer(&self, base_model: &str) -> Result<Tokenizer> {
        let path = format!(
            "/api/v1/lathe/tokenizer?base_model={}",
            urlencode(base_model)
        );
        let resp: TokenizerResponse = self
            .transport()
            .execute(Method::GET, &path, None)
            .await
            .and_then(decode)?;
        Tokenizer::from_response(resp)
    }
}

/// Percent-encodes a query value.
pub(crate) fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Keeps the session alive until aborted (when the last handle is dropped).
async fn heartbeat(transport: Arc<Transport>, session_id: String) {
    let request = SessionHeartbeatRequest {
        session_id: session_id.clone(),
    };
    let body = match tagged(&request, Some("session_heartbeat")) {
        Ok(body) => body,
        Err(e) => {
            tracing::error!("heartbeat request: {e}");
            return;
        }
    };
    let mut failing_since: Option<std::time::Instant> = None;
    loop {
        tokio::time::sleep(transport.config.heartbeat_interval).await;
        match transport
            .execute::<Value>(Method::POST, "/api/v1/session_heartbeat", Some(&body))
            .await
        {
            Ok(_) => failing_since = None,
            Err(Error::Api {
                status: 404 | 410, ..
            }) => {
                tracing::warn!("session {session_id} is gone on the server; heartbeat stopped");
                return;
            }
            Err(e) => {
                let since = *failing_since.get_or_insert_with(std::time::Instant::now);
                if since.elapsed() > std::time::Duration::from_secs(120) {
                    tracing::warn!("heartbeat failing for over 2 minutes: {e}");
                }
            }
        }
    }
}
