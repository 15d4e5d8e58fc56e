//! The one place HTTP happens: authentication, retries and error mapping for every call.

use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use reqwest::{Method, StatusCode};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

use super::config::ClientConfig;
use super::error::{Error, Result};

/// Shared by every handle of one service connection.
pub(crate) struct Transport {
    http: reqwest::Client,
    pub(crate) config: ClientConfig,
    /// A JWT from `/auth/token` and its expiry (unix seconds), when the server wants one.
    jwt: Mutex<Option<(String, u64)>>,
    jwt_enabled: std::sync::atomic::AtomicBool,
    /// Whether `forward_backward` goes as protobuf; cleared when the server answers 415
    /// (one that speaks only the JSON wire of tinker 0.22–0.24).
    pub(crate) protobuf: std::sync::atomic::AtomicBool,
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// `exp` of a JWT, read from its payload (the signature is the server's business).
fn jwt_expiry(jwt: &str) -> Option<u64> {
    let payload = jwt.split('.').nth(1)?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .ok()?;
    serde_json::from_slice::<Value>(&bytes).ok()?["exp"].as_u64()
}

fn retryable(status: StatusCode) -> bool {
    status == StatusCode::REQUEST_TIMEOUT
        || status == StatusCode::TOO_MANY_REQUESTS
        || status.is_server_error()
}

impl Transport {
    pub(crate) fn new(config: ClientConfig) -> Result<Self> {
        let http = reqwest::Client::builder()
            .connect_timeout(config.connect_timeout)
            // Below a Lathe server's default header timeout (30 s), after which it closes
            // an idle connection: a request is not sent on one the server is closing.
            .pool_idle_timeout(Duration::from_secs(20))
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("lathe-sdk/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| Error::Transport(e.to_string()))?;
        Ok(Self {
            http,
            config,
            jwt: Mutex::new(None),
            jwt_enabled: false.into(),
            protobuf: true.into(),
        })
    }

    /// Switches to JWTs from `/auth/token` (the server asked for it in its client config).
    pub(crate) async fn enable_jwt(&self) -> Result<()> {
        self.jwt_enabled
            .store(true, std::sync::atomic::Ordering::Relaxed);
        self.refresh_jwt().await
    }

    async fn refresh_jwt(&self) -> Result<()> {
        let empty = Value::Object(Default::default());
        let answer: crate::types::AuthTokenResponse = self
            .send_once(
                Method::POST,
                "/api/v1/auth/token",
                &Payload::Json(&empty),
                None,
                &self.config.api_key,
                self.config.request_timeout,
            )
            .await?
            .json()?;
        let jwt = answer.jwt;
        let exp = jwt_expiry(&jwt).unwrap_or(now_unix() + 60);
        *self.jwt.lock().expect("jwt lock") = Some((jwt, exp));
        Ok(())
    }

    /// The credential to send: the JWT (refreshed 5 minutes before it expires) or the key.
    async fn credential(&self) -> Result<String> {
        if !self.jwt_enabled.load(std::sync::atomic::Ordering::Relaxed) {
            return Ok(self.config.api_key.clone());
        }
        let current = self.jwt.lock().expect("jwt lock").clone();
        match current {
            Some((jwt, exp)) if exp > now_unix() + 300 => Ok(jwt),
            _ => {
                self.refresh_jwt().await?;
                Ok(self
                    .jwt
                    .lock()
                    .expect("jwt lock")
                    .clone()
                    .expect("just set")
                    .0)
            }
        }
    }

    async fn send_once(
        &self,
        method: Method,
        path: &str,
        payload: &Payload<'_>,
        accept: Option<&str>,
        credential: &str,
        timeout: Duration,
    ) -> Result<Raw> {
        let url = format!("{}{path}", self.config.base_url.trim_end_matches('/'));
        let mut req = self
            .http
            .request(method, url)
            .header("X-API-Key", credential)
            .timeout(timeout);
        match payload {
            Payload::Empty => {}
            Payload::Json(b) => req = req.json(b),
            Payload::Bytes { content_type, data } => {
                req = req
                    .header(reqwest::header::CONTENT_TYPE, *content_type)
                    .body(data.clone());
            }
        }
        if let Some(accept) = accept {
            req = req.header(reqwest::header::ACCEPT, accept);
        }
        let resp = req.send().await.map_err(|e| {
            if e.is_timeout() {
                Error::Timeout(timeout)
            } else {
                Error::Transport(e.to_string())
            }
        })?;
        let status = resp.status();
        let content_type = resp
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        let bytes = resp
            .bytes()
            .await
            .map_err(|e| Error::Transport(e.to_string()))?;
        if !status.is_success() {
            let text = String::from_utf8_lossy(&bytes).into_owned();
            let parsed: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
            let message = parsed["detail"]
                .as_str()
                .or_else(|| parsed["message"].as_str())
                .map(str::to_string)
                .unwrap_or_else(|| text.clone());
            return Err(Error::Api {
                status: status.as_u16(),
                code: parsed["code"].as_str().unwrap_or("unknown").to_string(),
                message,
            });
        }
        Ok(Raw {
            content_type,
            bytes,
        })
    }

    /// Sends a request with retries: connection failures, timeouts, 408, 429 and 5xx are
    /// retried with exponential backoff until the policy's time budget is spent; other
    /// 4xx are returned at once. A 401 on a JWT triggers one refresh.
    /// Sends a typed request as JSON (with the `type` tag the Python SDK writes, when
    /// given) and decodes a JSON answer.
    pub(crate) async fn send<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        request: &impl Serialize,
        kind: Option<&'static str>,
    ) -> Result<T> {
        let body = tagged(request, kind)?;
        self.execute(method, path, Some(&body)).await
    }

    pub(crate) async fn execute<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<T> {
        self.execute_with_timeout(method, path, body, self.config.request_timeout)
            .await
    }

    /// [`execute`](Self::execute) with its own timeout, decoding a JSON answer.
    pub(crate) async fn execute_with_timeout<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
        timeout: Duration,
    ) -> Result<T> {
        let payload = body.map_or(Payload::Empty, Payload::Json);
        let raw = self
            .execute_raw(method, path, &payload, None, timeout)
            .await?;
        raw.json()
    }

    /// Sends `payload` (with `accept` as the `Accept` header, if given) under the retry
    /// policy of [`execute`](Self::execute) and answers the body as the server sent it.
    pub(crate) async fn execute_raw(
        &self,
        method: Method,
        path: &str,
        payload: &Payload<'_>,
        accept: Option<&str>,
        timeout: Duration,
    ) -> Result<Raw> {
        let policy = &self.config.retry;
        let started = Instant::now();
        let mut delay = policy.initial_backoff;
        let mut refreshed = false;
        loop {
            let credential = self.credential().await?;
            let result = self
                .send_once(method.clone(), path, payload, accept, &credential, timeout)
                .await;
            let retry = match &result {
                Err(Error::Transport(_)) | Err(Error::Timeout(_)) => true,
                Err(Error::Api { status: 401, .. })
                    if !refreshed
                        && self.jwt_enabled.load(std::sync::atomic::Ordering::Relaxed) =>
                {
                    refreshed = true;
                    self.refresh_jwt().await?;
                    continue;
                }
                Err(Error::Api { status, .. }) => {
                    retryable(StatusCode::from_u16(*status).unwrap_or(StatusCode::OK))
                }
                _ => false,
            };
            if !retry || started.elapsed() + delay > policy.max_elapsed {
                return result;
            }
            tracing::debug!(path, ?delay, "retrying after {:?}", result.as_ref().err());
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(policy.max_backoff);
        }
    }
}

/// What a request carries.
pub(crate) enum Payload<'a> {
    /// No body.
    Empty,
    /// A JSON body.
    Json(&'a Value),
    /// A protobuf body.
    Bytes {
        /// Its media type.
        content_type: &'static str,
        /// The encoded message (cheap to clone for retries).
        data: bytes::Bytes,
    },
}

/// The `Accept` of a request that takes protobuf results (and JSON for the rest).
pub(crate) const ACCEPT_PROTOBUF: &str = "application/x-protobuf, application/json";

/// A successful answer's body.
pub(crate) struct Raw {
    /// The `Content-Type` it came with.
    pub(crate) content_type: String,
    /// The body.
    pub(crate) bytes: bytes::Bytes,
}

impl Raw {
    /// Whether the body is protobuf.
    pub(crate) fn is_proto(&self) -> bool {
        self.content_type.starts_with(crate::proto::CONTENT_TYPE)
    }

    /// The body as JSON (an empty body reads as `null`).
    pub(crate) fn json<T: DeserializeOwned>(&self) -> Result<T> {
        let text = String::from_utf8_lossy(&self.bytes);
        let text = if text.is_empty() { "null".into() } else { text };
        serde_json::from_str(&text).map_err(|e| Error::decode(e, &text))
    }
}

impl Transport {
    /// The `Location` of a redirecting endpoint (the checkpoint archive).
    pub(crate) async fn redirect_location(&self, path: &str) -> Result<String> {
        let credential = self.credential().await?;
        let url = format!("{}{path}", self.config.base_url.trim_end_matches('/'));
        let resp = self
            .http
            .get(url)
            .header("X-API-Key", credential)
            .timeout(self.config.request_timeout)
            .send()
            .await
            .map_err(|e| Error::Transport(e.to_string()))?;
        let status = resp.status();
        if status.is_redirection() {
            if let Some(loc) = resp.headers().get(reqwest::header::LOCATION) {
                return loc
                    .to_str()
                    .map(str::to_string)
                    .map_err(|e| Error::decode(e, "Location header"));
            }
        }
        let text = resp.text().await.unwrap_or_default();
        Err(Error::Api {
            status: status.as_u16(),
            code: "unexpected".into(),
            message: format!("expected a redirect to the archive, got: {text}"),
        })
    }

    /// Fetches a download link (it carries its own credential).
    pub(crate) async fn download(&self, url: &str) -> Result<Vec<u8>> {
        let resp = self
            .http
            .get(url)
            .send()
            .await
            .map_err(|e| Error::Transport(e.to_string()))?;
        let status = resp.status();
        if !status.is_success() {
            return Err(Error::Api {
                status: status.as_u16(),
                code: "download".into(),
                message: resp.text().await.unwrap_or_default(),
            });
        }
        Ok(resp
            .bytes()
            .await
            .map_err(|e| Error::Transport(e.to_string()))?
            .to_vec())
    }
}

/// A typed request as its JSON body, with `"type": kind` added when given (the Python
/// SDK tags every request so; Lathe ignores the tag, other servers may not).
pub(crate) fn tagged(request: &impl Serialize, kind: Option<&'static str>) -> Result<Value> {
    let mut body = serde_json::to_value(request).map_err(|e| Error::InvalidInput(e.to_string()))?;
    if let (Some(kind), Value::Object(map)) = (kind, &mut body) {
        map.insert("type".into(), Value::String(kind.into()));
    }
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jwt_expiry_reads_the_payload() {
        // {"sub":"x","exp":1234567890}
        let payload = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .encode(br#"{"sub":"x","exp":1234567890}"#);
        assert_eq!(jwt_expiry(&format!("h.{payload}.s")), Some(1_234_567_890));
        assert_eq!(jwt_expiry("garbage"), None);
    }

    /// The bodies this SDK writes are those the official Python SDK writes for the same
    /// operation (captured by `scripts/compat/capture-wire.py`).
    #[test]
    fn tagged_requests_equal_the_official_sdks_bodies() {
        use crate::types::{AdamParams, OptimStepRequest, SaveWeightsRequest};
        let capture = |text: &str| -> Value { serde_json::from_str(text).unwrap() };
        let optim = OptimStepRequest {
            adam_params: AdamParams {
                learning_rate: 0.001,
                beta1: 0.8,
                beta2: 0.95,
                eps: 1e-12,
                weight_decay: 0.0,
                grad_clip_norm: 0.0,
            },
            model_id: "s:train:0".into(),
            seq_id: Some(4),
        };
        assert_eq!(
            tagged(&optim, Some("optim_step")).unwrap(),
            capture(include_str!("../../tests/captures/0.22.0-optim_step.json"))
        );
        let save = SaveWeightsRequest {
            model_id: "s:train:0".into(),
            path: Some("step-4".into()),
            seq_id: Some(5),
            overwrite: false,
            ttl_seconds: None,
        };
        assert_eq!(
            tagged(&save, Some("save_weights")).unwrap(),
            capture(include_str!(
                "../../tests/captures/0.38.0-save_weights.json"
            ))
        );
    }
}
