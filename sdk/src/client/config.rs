//! Client settings and the builder that makes a [`ServiceClient`](super::ServiceClient).

use std::collections::BTreeMap;
use std::time::Duration;

/// When and how long to retry.
#[derive(Debug, Clone, PartialEq)]
pub struct RetryPolicy {
    /// Give up once this much time has passed since the first attempt.
    pub max_elapsed: Duration,
    /// First wait.
    pub initial_backoff: Duration,
    /// Longest wait between attempts (the wait doubles each time).
    pub max_backoff: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_elapsed: Duration::from_secs(120),
            initial_backoff: Duration::from_millis(250),
            max_backoff: Duration::from_secs(8),
        }
    }
}

impl RetryPolicy {
    /// Never retry.
    pub fn none() -> Self {
        Self {
            max_elapsed: Duration::ZERO,
            ..Default::default()
        }
    }
}

/// Everything a client connection is configured with.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Service URL, e.g. `http://127.0.0.1:8000`.
    pub base_url: String,
    /// API key (`tml-...`, `sk-...`, or any key a Lathe server accepts).
    pub api_key: String,
    /// Connection timeout.
    pub connect_timeout: Duration,
    /// Timeout of one ordinary request.
    pub request_timeout: Duration,
    /// Timeout of one `retrieve_future` long-poll (the server holds it about 30 s).
    pub poll_timeout: Duration,
    /// Longest wait for a future's result; `None` waits forever.
    pub future_timeout: Option<Duration>,
    /// Retries.
    pub retry: RetryPolicy,
    /// Sent with `create_session`.
    pub user_metadata: BTreeMap<String, String>,
    /// Heartbeat interval of the session.
    pub heartbeat_interval: Duration,
}

impl Default for ClientConfig {
    fn default() -> Self {
        Self {
            base_url: "http://127.0.0.1:8000".into(),
            api_key: String::new(),
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(60),
            poll_timeout: Duration::from_secs(45),
            future_timeout: None,
            retry: RetryPolicy::default(),
            user_metadata: BTreeMap::new(),
            heartbeat_interval: Duration::from_secs(10),
        }
    }
}

impl ClientConfig {
    /// The configuration from the environment: `LATHE_BASE_URL` / `LATHE_API_KEY`, else
    /// `TINKER_BASE_URL` / `TINKER_API_KEY`.
    pub fn from_env() -> Self {
        let var = |lathe: &str, tinker: &str| {
            std::env::var(lathe)
                .ok()
                .filter(|v| !v.is_empty())
                .or_else(|| std::env::var(tinker).ok().filter(|v| !v.is_empty()))
        };
        let mut c = Self::default();
        if let Some(url) = var("LATHE_BASE_URL", "TINKER_BASE_URL") {
            c.base_url = url;
        }
        if let Some(key) = var("LATHE_API_KEY", "TINKER_API_KEY") {
            c.api_key = key;
        }
        c
    }
}

/// Builds a [`ServiceClient`](super::ServiceClient); starts from the environment.
#[derive(Debug, Clone)]
pub struct ClientBuilder {
    pub(crate) config: ClientConfig,
}

impl Default for ClientBuilder {
    fn default() -> Self {
        Self {
            config: ClientConfig::from_env(),
        }
    }
}

impl ClientBuilder {
    /// Service URL.
    pub fn base_url(mut self, url: impl Into<String>) -> Self {
        self.config.base_url = url.into();
        self
    }

    /// API key.
    pub fn api_key(mut self, key: impl Into<String>) -> Self {
        self.config.api_key = key.into();
        self
    }

    /// Timeout of one ordinary request.
    pub fn request_timeout(mut self, t: Duration) -> Self {
        self.config.request_timeout = t;
        self
    }

    /// Longest wait for any future's result.
    pub fn future_timeout(mut self, t: Duration) -> Self {
        self.config.future_timeout = Some(t);
        self
    }

    /// Retry policy.
    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        self.config.retry = policy;
        self
    }

    /// Metadata sent with the session.
    pub fn user_metadata(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.config.user_metadata.insert(key.into(), value.into());
        self
    }

    /// Heartbeat interval.
    pub fn heartbeat_interval(mut self, t: Duration) -> Self {
        self.config.heartbeat_interval = t;
        self
    }

    /// Connects: fetches the client config, exchanges the key for a JWT if the server
    /// asks, opens a session and starts its heartbeat.
    pub async fn build(self) -> super::error::Result<super::ServiceClient> {
        super::ServiceClient::connect(self.config).await
    }
}
