//! [`ApiFuture`]: a handle to work the server accepted, whose result is fetched later.

use std::sync::Arc;
use std::time::Instant;

use reqwest::Method;
use serde_json::{json, Value};

use super::error::{Error, Result};
use super::http::Transport;

type Combine<T> = Box<dyn FnOnce(Vec<Value>) -> Result<T> + Send>;

/// Work the server accepted. Submitting returns as soon as the server queued it; the
/// result is fetched with [`ApiFuture::result`], so a caller can submit
/// `forward_backward` and `optim_step` and only then await both (the server runs a
/// training client's operations in submission order).
pub struct ApiFuture<T> {
    transport: Arc<Transport>,
    request_ids: Vec<String>,
    combine: Combine<T>,
}

impl<T> std::fmt::Debug for ApiFuture<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiFuture")
            .field("request_ids", &self.request_ids)
            .finish()
    }
}

impl<T: Send + 'static> ApiFuture<T> {
    pub(crate) fn new(
        transport: Arc<Transport>,
        request_ids: Vec<String>,
        combine: impl FnOnce(Vec<Value>) -> Result<T> + Send + 'static,
    ) -> Self {
        Self {
            transport,
            request_ids,
            combine: Box::new(combine),
        }
    }

    /// The server's request ids (several when a batch was split into chunks).
    pub fn request_ids(&self) -> &[String] {
        &self.request_ids
    }

    /// Waits for the result (long-polling `retrieve_future`).
    pub async fn result(self) -> Result<T> {
        let mut values = Vec::with_capacity(self.request_ids.len());
        for id in &self.request_ids {
            values.push(poll(&self.transport, id).await?);
        }
        (self.combine)(values)
    }
}

/// Long-polls one request until it finishes.
pub(crate) async fn poll(transport: &Transport, request_id: &str) -> Result<Value> {
    let started = Instant::now();
    let body = json!({"request_id": request_id, "allow_metadata_only": false});
    loop {
        if let Some(limit) = transport.config.future_timeout {
            if started.elapsed() > limit {
                return Err(Error::Timeout(limit));
            }
        }
        let v: Value = transport
            .execute_with_timeout(
                Method::POST,
                "/api/v1/retrieve_future",
                Some(&body),
                transport.config.poll_timeout,
            )
            .await?;
        if v.get("type").and_then(Value::as_str) == Some("try_again") {
            continue;
        }
        if let Some(err) = v.get("error") {
            return Err(Error::RequestFailed {
                category: v["category"].as_str().unwrap_or("unknown").to_string(),
                message: err.as_str().map_or_else(|| err.to_string(), str::to_string),
            });
        }
        return Ok(v);
    }
}

/// Decodes a JSON value into `T`, keeping the body for the error message.
pub(crate) fn decode<T: serde::de::DeserializeOwned>(v: Value) -> Result<T> {
    serde_json::from_value(v.clone()).map_err(|e| Error::decode(e, &v.to_string()))
}

/// The one value of a single-request future, decoded.
pub(crate) fn single<T: serde::de::DeserializeOwned>(mut values: Vec<Value>) -> Result<T> {
    decode(values.pop().unwrap_or(Value::Null))
}
