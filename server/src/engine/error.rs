//! Engine errors: what a request did wrong, in a form the api layer maps to HTTP.

/// Why the engine refused a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineError {
    /// Malformed or out-of-range input (400).
    BadRequest(String),
    /// Unknown id, or one owned by another key (404).
    NotFound(String),
    /// The session was expired (410).
    Gone(String),
    /// The server is at a configured limit (400, so SDKs do not retry for minutes).
    Capacity(String),
    /// The key is at one of its occupancy limits (429 with `Retry-After`).
    Limit(super::LimitExceeded),
    /// The server is shutting down (503).
    Unavailable(String),
    /// A fault on the server (500).
    Internal(String),
}

impl EngineError {
    /// The message.
    pub fn message(&self) -> &str {
        match self {
            EngineError::BadRequest(m)
            | EngineError::NotFound(m)
            | EngineError::Gone(m)
            | EngineError::Capacity(m)
            | EngineError::Unavailable(m)
            | EngineError::Internal(m) => m,
            EngineError::Limit(l) => &l.message,
        }
    }
}

impl std::fmt::Display for EngineError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.message())
    }
}

impl std::error::Error for EngineError {}

impl From<crate::store::StoreError> for EngineError {
    fn from(e: crate::store::StoreError) -> Self {
        use crate::store::StoreError;
        match e {
            // What the request asked for cannot be done: the same request fails again.
            StoreError::Exists(_) | StoreError::Invalid(_) => {
                EngineError::BadRequest(e.to_string())
            }
            StoreError::Locked(_) => EngineError::Unavailable(e.to_string()),
            StoreError::Io { .. } | StoreError::Db(_) | StoreError::Candle(_) => {
                EngineError::Internal(e.to_string())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::StoreError;

    #[test]
    fn store_errors_keep_their_meaning() {
        let exists = EngineError::from(StoreError::Exists("a".into()));
        assert!(
            matches!(exists, EngineError::BadRequest(_)),
            "an existing name is not a 500"
        );
        let invalid = EngineError::from(StoreError::Invalid("x".into()));
        assert!(matches!(invalid, EngineError::BadRequest(_)));
        let io = EngineError::from(StoreError::Io {
            path: "p".into(),
            source: std::io::Error::other("disk"),
        });
        assert!(matches!(io, EngineError::Internal(_)));
    }
}
