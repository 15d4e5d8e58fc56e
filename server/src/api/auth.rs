//! API keys and the JWTs the server issues for them.
//!
//! A key is any string the operator configures (`tml-...`, MinT's `sk-...`). Runs and
//! checkpoints belong to an *owner id* derived from the key by SHA-256, so ownership
//! survives restarts without storing keys. `/auth/token` exchanges a key for a JWT
//! (HS256, signed by a secret kept in the data dir) that the SDKs then send instead; a
//! JWT is accepted while it is unexpired and its owner is still a configured key's.

use std::collections::HashMap;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use jsonwebtoken::{decode, encode, Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::error::ApiError;
use super::AppState;
use crate::engine::now_unix;

/// How long an issued JWT is valid. The SDK refreshes it 5 minutes before expiry.
pub const JWT_LIFETIME: Duration = Duration::from_secs(3600);

/// The authenticated caller, put into request extensions by [`require_auth`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner(pub String);

#[derive(Debug, Serialize, Deserialize)]
struct Claims {
    sub: String,
    exp: u64,
    iat: u64,
    /// Set on archive-download tokens: the only checkpoint they open.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    path: Option<String>,
}

/// Configured keys and the JWT secret.
pub struct Auth {
    owners: HashMap<String, String>,
    encoding: EncodingKey,
    decoding: DecodingKey,
}

/// The owner id of a key.
pub fn owner_of(key: &str) -> String {
    let digest = Sha256::digest(key.as_bytes());
    let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    format!("user-{hex}")
}

impl Auth {
    /// Accepts `keys`; signs JWTs with `secret`.
    pub fn new(keys: &[String], secret: &[u8]) -> Self {
        Self {
            owners: keys.iter().map(|k| (k.clone(), owner_of(k))).collect(),
            encoding: EncodingKey::from_secret(secret),
            decoding: DecodingKey::from_secret(secret),
        }
    }

    fn issue(&self, owner: &str, lifetime: Duration, path: Option<String>) -> String {
        let now = now_unix().max(0) as u64;
        let claims = Claims {
            sub: owner.to_string(),
            iat: now,
            exp: now + lifetime.as_secs(),
            path,
        };
        encode(&Header::new(Algorithm::HS256), &claims, &self.encoding)
            .expect("HS256 signing cannot fail")
    }

    fn verify(&self, token: &str) -> Option<Claims> {
        let mut v = Validation::new(Algorithm::HS256);
        v.leeway = 0;
        let claims = decode::<Claims>(token, &self.decoding, &v).ok()?.claims;
        self.owners
            .values()
            .any(|o| *o == claims.sub)
            .then_some(claims)
    }

    /// The owner of a raw key or of a session JWT.
    pub fn authenticate(&self, credential: &str) -> Option<String> {
        if let Some(owner) = self.owners.get(credential) {
            return Some(owner.clone());
        }
        self.verify(credential)
            .filter(|c| c.path.is_none())
            .map(|c| c.sub)
    }

    /// A session JWT for an authenticated owner.
    pub fn session_token(&self, owner: &str) -> String {
        self.issue(owner, JWT_LIFETIME, None)
    }

    /// A short-lived token that downloads exactly one checkpoint archive.
    pub fn archive_token(&self, owner: &str, uri: &str, lifetime: Duration) -> String {
        self.issue(owner, lifetime, Some(uri.to_string()))
    }

    /// The owner and checkpoint URI of a valid archive token.
    pub fn verify_archive_token(&self, token: &str) -> Option<(String, String)> {
        let c = self.verify(token)?;
        Some((c.sub, c.path?))
    }
}

/// The credential of a request: `X-API-Key`, or `Authorization: Bearer`.
pub fn credential(req: &Request) -> Option<&str> {
    let headers = req.headers();
    if let Some(v) = headers.get("x-api-key").and_then(|v| v.to_str().ok()) {
        return Some(v.trim());
    }
    headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
}

/// Middleware: rejects requests without a valid key or JWT (401), else records the
/// [`Owner`].
pub async fn require_auth(State(state): State<AppState>, mut req: Request, next: Next) -> Response {
    let owner = match credential(&req) {
        None => {
            return ApiError::unauthorized("missing API key: send it in the X-API-Key header")
                .into_response()
        }
        Some(c) => state.auth.authenticate(c),
    };
    match owner {
        Some(owner) => {
            req.extensions_mut().insert(Owner(owner));
            next.run(req).await
        }
        None => ApiError::unauthorized("invalid or expired API key or token").into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_tokens_authenticate_their_owner_only() {
        let auth = Auth::new(&["tml-a".into(), "sk-b".into()], b"secret");
        let a = auth.authenticate("tml-a").unwrap();
        assert_ne!(a, auth.authenticate("sk-b").unwrap());
        assert!(auth.authenticate("tml-c").is_none());
        let jwt = auth.session_token(&a);
        assert_eq!(auth.authenticate(&jwt), Some(a.clone()));
        // Signed by another server: rejected.
        let other = Auth::new(&["tml-a".into()], b"other");
        assert!(other.authenticate(&jwt).is_none());
        // An archive token is not a session token.
        let t = auth.archive_token(&a, "tinker://r/weights/x", Duration::from_secs(60));
        assert!(auth.authenticate(&t).is_none());
        assert_eq!(
            auth.verify_archive_token(&t),
            Some((a, "tinker://r/weights/x".to_string()))
        );
        // Expired tokens are rejected.
        let expired = auth.issue("user-x", Duration::ZERO, None);
        std::thread::sleep(Duration::from_millis(1100));
        assert!(auth.authenticate(&expired).is_none());
    }
}
