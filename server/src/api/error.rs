//! The one table of error codes and HTTP statuses. Every error leaves the server as a
//! JSON body `{"detail": <message>, "code": <code>}`: never an empty 400, which the
//! Python SDK would take for a proxy failure and retry. Permanent errors are 4xx (the SDK
//! retries 408/409/429/5xx for minutes); 5xx only for faults a retry may cure.

use axum::extract::rejection::JsonRejection;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::engine::EngineError;

/// An error response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Stable machine-readable code.
    pub code: &'static str,
    /// Human-readable message.
    pub message: String,
    /// For 429: the limit reached (a `lathe serve` flag's name) and when to retry.
    pub limit: Option<(&'static str, u64)>,
}

impl ApiError {
    pub(super) fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            limit: None,
        }
    }

    /// 429 `rate_limited` naming `limit` (a `lathe serve` flag's name), with
    /// `Retry-After: retry_after_s`.
    pub fn limited(limit: &'static str, message: impl Into<String>, retry_after_s: u64) -> Self {
        Self {
            limit: Some((limit, retry_after_s)),
            ..Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limited", message)
        }
    }

    /// 415 for a body that must be JSON and is not said to be.
    pub fn not_json() -> Self {
        Self::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "expected Content-Type: application/json",
        )
    }

    /// 400 `invalid_request`.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request", message)
    }

    /// 401 `unauthorized`.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "unauthorized", message)
    }

    /// 404 `not_found`.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", message)
    }

    /// 413 `payload_too_large`.
    pub fn too_large() -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            "request body is larger than the server's limit (--max-request-bytes)",
        )
    }

    /// 500 `internal`.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message)
    }
}

impl ApiError {
    /// An error answer that did not come from Lathe's handlers (an extractor's rejection
    /// of a query string, a path segment or an oversized body: axum answers those in
    /// plain text), as an `ApiError` with that status and text.
    pub(super) fn from_plain(status: StatusCode, text: &str) -> Self {
        let code = match status {
            StatusCode::BAD_REQUEST => "invalid_request",
            StatusCode::NOT_FOUND => "not_found",
            StatusCode::METHOD_NOT_ALLOWED => "method_not_allowed",
            StatusCode::PAYLOAD_TOO_LARGE => return Self::too_large(),
            StatusCode::UNSUPPORTED_MEDIA_TYPE => "unsupported_media_type",
            StatusCode::UNPROCESSABLE_ENTITY => "invalid_request",
            s if s.is_server_error() => "internal",
            _ => "error",
        };
        let text = text.trim();
        let message = if text.is_empty() {
            status.canonical_reason().unwrap_or("error").to_string()
        } else {
            text.to_string()
        };
        Self::new(status, code, message)
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::BadRequest(m) => Self::bad_request(m),
            EngineError::NotFound(m) => Self::not_found(m),
            EngineError::Gone(m) => Self::new(StatusCode::GONE, "gone", m),
            EngineError::Capacity(m) => Self::new(StatusCode::BAD_REQUEST, "capacity", m),
            EngineError::Unavailable(m) => {
                Self::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", m)
            }
            EngineError::Internal(m) => Self::internal(m),
            EngineError::Limit(l) => Self::limited(l.limit, l.message, l.retry_after_s),
        }
    }
}

impl ApiError {
    /// 408 `request_timeout`: the request body arrived too slowly (the SDKs retry it).
    pub(super) fn body_too_slow(e: &(dyn std::error::Error + 'static)) -> Option<Self> {
        super::paced_body::is_too_slow(e).then(|| {
            Self::new(
                StatusCode::REQUEST_TIMEOUT,
                "request_timeout",
                format!("reading the body: {e}"),
            )
        })
    }
}

impl From<JsonRejection> for ApiError {
    fn from(r: JsonRejection) -> Self {
        if let Some(slow) = Self::body_too_slow(&r) {
            return slow;
        }
        match r.status() {
            StatusCode::PAYLOAD_TOO_LARGE => Self::too_large(),
            StatusCode::UNSUPPORTED_MEDIA_TYPE => Self::not_json(),
            _ => Self::bad_request(format!("invalid JSON body: {}", r.body_text())),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        match self.limit {
            None => {
                let body = Json(json!({"detail": self.message, "code": self.code}));
                (self.status, body).into_response()
            }
            Some((limit, retry_after)) => {
                let body = Json(json!({"detail": self.message, "code": self.code, "limit": limit}));
                let retry = [(axum::http::header::RETRY_AFTER, retry_after.to_string())];
                (self.status, retry, body).into_response()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_errors_map_to_permanent_4xx() {
        let cases = [
            (EngineError::BadRequest("x".into()), 400),
            (EngineError::NotFound("x".into()), 404),
            (EngineError::Gone("x".into()), 410),
            (EngineError::Capacity("x".into()), 400),
            (EngineError::Unavailable("x".into()), 503),
            (EngineError::Internal("x".into()), 500),
        ];
        for (e, status) in cases {
            assert_eq!(ApiError::from(e).status.as_u16(), status);
        }
    }

    #[test]
    fn a_key_at_its_limit_gets_429_naming_it_with_retry_after() {
        let e = EngineError::Limit(crate::engine::LimitExceeded {
            limit: "max_queued_operations",
            message: "full".into(),
            retry_after_s: 3,
        });
        let resp = ApiError::from(e).into_response();
        assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(resp.headers()[axum::http::header::RETRY_AFTER], "3");
    }
}
