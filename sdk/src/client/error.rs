//! The SDK's one error type.

/// Everything that can go wrong talking to a Tinker-compatible service.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The server answered with an error status (after retries, for retryable ones).
    #[error("HTTP {status} ({code}): {message}")]
    Api {
        /// HTTP status.
        status: u16,
        /// The server's error code (`invalid_request`, `not_found`, `capacity`, ...), or
        /// `unknown` when the body had none.
        code: String,
        /// The server's message.
        message: String,
    },
    /// The server accepted the request, then the work failed (`category` is `user` for
    /// bad input, `server` for a fault on its side).
    #[error("request failed ({category}): {message}")]
    RequestFailed {
        /// `user`, `server` or `unknown`.
        category: String,
        /// What went wrong.
        message: String,
    },
    /// The connection failed (after retries).
    #[error("transport error: {0}")]
    Transport(String),
    /// The server's answer was not what the protocol says.
    #[error("could not decode the server's answer: {message}; body: {body}")]
    Decode {
        /// Why decoding failed.
        message: String,
        /// The body, truncated.
        body: String,
    },
    /// Waiting for a result took longer than the configured limit.
    #[error("timed out after {0:?}")]
    Timeout(std::time::Duration),
    /// Checked before sending: the request cannot succeed.
    #[error("invalid input: {0}")]
    InvalidInput(String),
}

impl Error {
    /// Whether the server blamed the input (a 4xx, or a failed future of category `user`).
    pub fn is_user_error(&self) -> bool {
        match self {
            Error::Api { status, .. } => (400..500).contains(status),
            Error::RequestFailed { category, .. } => category == "user",
            Error::InvalidInput(_) => true,
            _ => false,
        }
    }

    pub(crate) fn decode(message: impl std::fmt::Display, body: &str) -> Self {
        let mut body = body.to_string();
        if body.len() > 2000 {
            let mut cut = 2000;
            while !body.is_char_boundary(cut) {
                cut -= 1;
            }
            body.truncate(cut);
            body.push_str("...");
        }
        Error::Decode {
            message: message.to_string(),
            body,
        }
    }
}

/// Results of SDK calls.
pub type Result<T, E = Error> = std::result::Result<T, E>;
