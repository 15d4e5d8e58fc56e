//! `retrieve_futures` and `join_sampling_session` (tinker 0.38, behind the client-config
//! flags `sample_use_retrieve_futures` and `sample_join_sampling_session`).

use serde::{Deserialize, Serialize};

/// Whose completions to poll: one sampling session, one copy of its client.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SamplingSessionFuturesTarget {
    /// The sampling session.
    pub sampling_session_id: String,
    /// The copy of the client (`seq_id / 10^9` of its requests; 0 for the original).
    #[serde(default)]
    pub cloned_sampler_id: u64,
}

/// `POST /api/v1/retrieve_futures`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FuturesRetrieveRequest {
    /// The session polled.
    pub target: SamplingSessionFuturesTarget,
    /// The cursor of the previous answer (0 at first): events up to it were seen.
    #[serde(default)]
    pub prev_cursor: u64,
    /// Longest wait for a new completion, in seconds (the server caps it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<f64>,
    /// Requests whose results the client has fetched.
    #[serde(default)]
    pub retrieved_request_ids: Vec<String>,
}

/// A finished or failed request of the polled session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "lowercase")]
pub enum FutureCompletion {
    /// Its result is ready (fetch it with `retrieve_future`).
    Finished {
        /// The request.
        request_id: String,
        /// The result's size, when the server knows it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        response_payload_uncompressed_size: Option<u64>,
    },
    /// It failed (`retrieve_future` answers the failure).
    Failed {
        /// The request.
        request_id: String,
    },
}

/// `retrieve_futures` answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FuturesRetrieveResponse {
    /// Completions after the previous cursor, oldest first.
    pub completions: Vec<FutureCompletion>,
    /// The cursor to send next.
    pub cursor: u64,
}

/// `POST /api/v1/join_sampling_session`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JoinSamplingSessionRequest {
    /// The sampling session a copied client joins.
    pub sampling_session_id: String,
}

/// `join_sampling_session` answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JoinSamplingSessionResponse {
    /// The copy's id, unique within the session (the original client is 0).
    pub client_counter: u64,
}
