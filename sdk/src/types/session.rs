//! Bodies of the session endpoints: client configuration, JWT exchange, sessions and
//! their heartbeat and finish, server capabilities (`tinker-wire.md` §2.3–§2.4).

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// `POST /api/v1/client/config` answer: the feature flags an SDK reads first. Every field
/// is optional on the wire; [`Default`] is what an absent field means.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ClientConfigResponse {
    /// Exchange the key for a JWT at `/auth/token` (needed by MinT's `sk-` keys).
    pub pjwt_auth_enabled: bool,
    /// Where the SDK takes its credential from.
    pub credential_default_source: String,
    /// The pyqwest transport follows redirects, which breaks the archive endpoint.
    pub use_pyqwest_transport: bool,
    /// Whether forward/backward chunks may be sent concurrently.
    pub parallel_fwdbwd_chunks: bool,
    /// Send forward/backward as protobuf (0.22–0.24).
    pub proto_write_fwdbwd: bool,
    /// zstd-compress protobuf forward/backward bodies.
    pub proto_compress_fwdbwd: bool,
    /// gRPC endpoint (none: REST only).
    pub grpc_target: Option<String>,
    /// Retrieve futures over gRPC.
    pub enable_grpc_retrieve_future: bool,
    /// Disable the SDK's sample retry handler.
    pub sample_no_retries: bool,
    /// Longest billing pause the SDK tolerates.
    pub billing_exception_max_pause_duration_sec: u64,
    /// Client-side budget for in-flight sample bytes.
    pub sample_dispatch_bytes_semaphore_size: u64,
    /// Client-side budget for in-flight response bytes.
    pub inflight_response_bytes_semaphore_size: u64,
    /// 0.24.1+: create training clients from state through `load_weights` alone.
    pub create_model_via_load_weights: bool,
    /// 0.26+: batch sample retrieval.
    pub sample_use_retrieve_futures: bool,
    /// Server-side custom losses.
    pub custom_loss_server_side: bool,
    /// Join an existing sampling session.
    pub sample_join_sampling_session: bool,
}

impl Default for ClientConfigResponse {
    /// Every flag off: what a server that sends an empty object means.
    fn default() -> Self {
        Self {
            pjwt_auth_enabled: false,
            ..Self::lathe()
        }
    }
}

impl ClientConfigResponse {
    /// Lathe's answer (the compatibility stage, `scripts/compat/run-acceptance`, runs the
    /// SDK versions it serves against it): JWTs on (MinT's `sk-` keys need them), no
    /// pyqwest (it follows the archive redirect), no parallel chunks, no protobuf for
    /// 0.22–0.24 (0.25+ sends protobuf regardless), no zstd unless the server asks, no gRPC.
    pub fn lathe() -> Self {
        Self {
            pjwt_auth_enabled: true,
            credential_default_source: "api_key".into(),
            use_pyqwest_transport: false,
            parallel_fwdbwd_chunks: false,
            proto_write_fwdbwd: false,
            proto_compress_fwdbwd: false,
            grpc_target: None,
            enable_grpc_retrieve_future: false,
            sample_no_retries: false,
            billing_exception_max_pause_duration_sec: 3600,
            sample_dispatch_bytes_semaphore_size: 10 * 1024 * 1024,
            inflight_response_bytes_semaphore_size: 50 * 1024 * 1024,
            create_model_via_load_weights: false,
            sample_use_retrieve_futures: true,
            custom_loss_server_side: true,
            sample_join_sampling_session: true,
        }
    }
}

/// `POST /api/v1/client/dynamic_config` answer (SDK 0.25+ fetches it at start and then
/// every `refresh_interval_sec`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ClientDynamicConfigResponse {
    /// Seconds between the SDK's fetches.
    pub refresh_interval_sec: u64,
    /// Whether an abandoned sampling future sends `cancel_future`.
    pub sample_cancel_enabled: bool,
    /// Cancellations the SDK sends at once.
    pub sample_cancel_max_batch_size: u64,
}

impl Default for ClientDynamicConfigResponse {
    /// What the SDK assumes when the server sends nothing.
    fn default() -> Self {
        Self {
            refresh_interval_sec: 300,
            sample_cancel_enabled: false,
            sample_cancel_max_batch_size: 64,
        }
    }
}

impl ClientDynamicConfigResponse {
    /// Lathe's answer: abandoned samples are cancelled (`cancel_future`).
    pub fn lathe() -> Self {
        Self {
            sample_cancel_enabled: true,
            ..Self::default()
        }
    }
}

/// `POST /api/v1/auth/token` answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AuthTokenResponse {
    /// A signed JWT to send as `X-API-Key` from now on.
    pub jwt: String,
}

/// `POST /api/v1/client/config`: the first call of every client.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClientConfigRequest {
    /// The client's SDK and version.
    pub sdk_version: String,
}

/// `POST /api/v1/create_session`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CreateSessionRequest {
    /// Free-form tags (`TINKER_TAGS`).
    #[serde(default)]
    pub tags: Vec<String>,
    /// Free-form metadata.
    #[serde(default)]
    pub user_metadata: Option<BTreeMap<String, serde_json::Value>>,
    /// The client's SDK version.
    #[serde(default)]
    pub sdk_version: Option<String>,
    /// Optional project.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub project_id: Option<String>,
}

/// `create_session` answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CreateSessionResponse {
    /// The new session's id.
    pub session_id: String,
    /// Shown by the SDK as info.
    #[serde(default)]
    pub info_message: Option<String>,
    /// Shown by the SDK as a warning.
    #[serde(default)]
    pub warning_message: Option<String>,
    /// Shown by the SDK as an error.
    #[serde(default)]
    pub error_message: Option<String>,
}

/// `POST /api/v1/session_heartbeat`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionHeartbeatRequest {
    /// The session to keep alive.
    pub session_id: String,
}

/// `POST /api/v1/sessions/{id}/finish` (SDK 0.38's `ServiceClient.close`): the client is
/// done with the session.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FinishSessionRequest {
    /// How the client's work ended.
    pub reason: FinishReason,
    /// A human-readable explanation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// Why a client finished its session.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FinishReason {
    /// `success`, `errored` or `interrupted`.
    #[serde(rename = "type")]
    pub kind: FinishStatus,
}

/// How a client's work ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishStatus {
    /// It completed.
    Success,
    /// It raised an error.
    Errored,
    /// It was interrupted (Ctrl-C).
    Interrupted,
    /// A status a newer SDK may send: accepted, so that finishing never fails.
    #[serde(other)]
    Other,
}

impl FinishStatus {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishStatus::Success => "success",
            FinishStatus::Errored => "errored",
            FinishStatus::Interrupted => "interrupted",
            FinishStatus::Other => "other",
        }
    }
}

/// One model the server can train, in `get_server_capabilities`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SupportedModel {
    /// The name to pass as `base_model`.
    pub model_name: String,
    /// Longest sequence (prompt plus completion) in tokens.
    #[serde(default)]
    pub max_context_length: Option<usize>,
}

/// `GET /api/v1/get_server_capabilities` answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServerCapabilities {
    /// The base models served.
    pub supported_models: Vec<SupportedModel>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finish_reasons_of_newer_sdks_are_accepted() {
        let body = serde_json::json!({"reason": {"type": "abandoned"}, "detail": "x"});
        let req: FinishSessionRequest = serde_json::from_value(body).unwrap();
        assert_eq!(req.reason.kind, FinishStatus::Other);
        let body = serde_json::json!({"reason": {"type": "errored"}});
        let req: FinishSessionRequest = serde_json::from_value(body).unwrap();
        assert_eq!(req.reason.kind.as_str(), "errored");
    }
}
