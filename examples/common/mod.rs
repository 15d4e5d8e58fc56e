//! Shared by the examples: connect to `LATHE_BASE_URL` / `TINKER_BASE_URL` when set,
//! otherwise start a Lathe server in this process on the default model.

use std::path::Path;

use lathe::ServiceClient;
use lathe_server::server::RunningServer;

/// A connection, and the embedded server behind it (if any), kept alive together.
pub struct Connection {
    pub service: ServiceClient,
    pub base_model: String,
    _server: Option<RunningServer>,
}

pub async fn connect() -> anyhow::Result<Connection> {
    let remote = ["LATHE_BASE_URL", "TINKER_BASE_URL"]
        .iter()
        .any(|v| std::env::var(v).is_ok_and(|s| !s.is_empty()));
    let (service, server) = if remote {
        (ServiceClient::new().await?, None)
    } else {
        // Persistent, so `resume` can pick up in a new process what it saved before.
        let data_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("lathe-data/examples");
        eprintln!(
            "no LATHE_BASE_URL/TINKER_BASE_URL: starting a server in-process ({})",
            data_dir.display()
        );
        let server = lathe_server::embedded::start(&data_dir).await?;
        let service = ServiceClient::builder()
            .base_url(server.base_url())
            .api_key(&server.api_keys[0])
            .build()
            .await?;
        (service, Some(server))
    };
    let caps = service.get_server_capabilities().await?;
    let base_model = caps
        .supported_models
        .first()
        .ok_or_else(|| anyhow::anyhow!("the server offers no base model"))?
        .model_name
        .clone();
    Ok(Connection {
        service,
        base_model,
        _server: server,
    })
}
