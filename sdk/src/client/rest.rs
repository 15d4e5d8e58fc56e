//! [`RestClient`]: training runs and checkpoints.

use std::path::Path;

use reqwest::Method;
use serde_json::Value;

use super::error::{Error, Result};
use super::future::decode;
use super::service::ServiceClient;
use crate::types::{
    CheckpointUri, CheckpointsListResponse, GetSamplerResponse, SetTtlRequest, TrainingRun,
    TrainingRunsResponse, WeightsInfoResponse,
};

/// Lists and manages the caller's runs and checkpoints.
#[derive(Clone, Debug)]
pub struct RestClient {
    service: ServiceClient,
}

fn checkpoint_path(uri: &CheckpointUri) -> String {
    format!(
        "/api/v1/training_runs/{}/checkpoints/{}",
        uri.run_id,
        uri.checkpoint_id()
    )
}

impl RestClient {
    pub(crate) fn new(service: ServiceClient) -> Self {
        Self { service }
    }

    async fn get<T: serde::de::DeserializeOwned>(&self, path: &str) -> Result<T> {
        self.service
            .transport()
            .execute(Method::GET, path, None)
            .await
            .and_then(decode)
    }

    /// A page of the caller's training runs, newest first.
    pub async fn list_training_runs(
        &self,
        limit: usize,
        offset: usize,
    ) -> Result<TrainingRunsResponse> {
        self.get(&format!(
            "/api/v1/training_runs?limit={limit}&offset={offset}&access_scope=owned"
        ))
        .await
    }

    /// One training run.
    pub async fn get_training_run(&self, run_id: &str) -> Result<TrainingRun> {
        self.get(&format!("/api/v1/training_runs/{run_id}")).await
    }

    /// A run's checkpoints.
    pub async fn list_checkpoints(&self, run_id: &str) -> Result<CheckpointsListResponse> {
        self.get(&format!("/api/v1/training_runs/{run_id}/checkpoints"))
            .await
    }

    /// A page of all the caller's checkpoints, newest first.
    pub async fn list_user_checkpoints(
        &self,
        limit: usize,
        offset: usize,
    ) -> Result<CheckpointsListResponse> {
        self.get(&format!(
            "/api/v1/checkpoints?limit={limit}&offset={offset}"
        ))
        .await
    }

    /// What a checkpoint was trained as.
    pub async fn get_weights_info(&self, uri: &CheckpointUri) -> Result<WeightsInfoResponse> {
        self.service.get_weights_info(uri).await
    }

    /// A sampling session's base model and weights.
    pub async fn get_sampler(&self, sampler_id: &str) -> Result<GetSamplerResponse> {
        self.get(&format!("/api/v1/samplers/{sampler_id}")).await
    }

    /// Deletes a checkpoint.
    pub async fn delete_checkpoint(&self, uri: &CheckpointUri) -> Result<()> {
        self.service
            .transport()
            .execute::<Value>(Method::DELETE, &checkpoint_path(uri), None)
            .await
            .map(|_| ())
    }

    /// Makes a checkpoint readable (loadable, samplable) by every key.
    pub async fn publish_checkpoint(&self, uri: &CheckpointUri) -> Result<()> {
        let path = format!("{}/publish", checkpoint_path(uri));
        self.service
            .transport()
            .execute::<Value>(Method::POST, &path, None)
            .await
            .map(|_| ())
    }

    /// Makes a checkpoint private again.
    pub async fn unpublish_checkpoint(&self, uri: &CheckpointUri) -> Result<()> {
        let path = format!("{}/publish", checkpoint_path(uri));
        self.service
            .transport()
            .execute::<Value>(Method::DELETE, &path, None)
            .await
            .map(|_| ())
    }

    /// Deletes the checkpoint `ttl_seconds` from now; `None` keeps it forever.
    pub async fn set_checkpoint_ttl(
        &self,
        uri: &CheckpointUri,
        ttl_seconds: Option<u64>,
    ) -> Result<()> {
        let path = format!("{}/ttl", checkpoint_path(uri));
        self.service
            .transport()
            .send::<Value>(Method::PUT, &path, &SetTtlRequest { ttl_seconds }, None)
            .await
            .map(|_| ())
    }

    /// Downloads a checkpoint as a tar archive (PEFT files at its root) to `dest`.
    /// Returns the bytes written.
    pub async fn download_checkpoint_archive(
        &self,
        uri: &CheckpointUri,
        dest: &Path,
    ) -> Result<u64> {
        let path = format!("{}/archive", checkpoint_path(uri));
        let location = self.service.transport().redirect_location(&path).await?;
        let bytes = self.service.transport().download(&location).await?;
        tokio::fs::write(dest, &bytes)
            .await
            .map_err(|e| Error::Transport(format!("writing {}: {e}", dest.display())))?;
        Ok(bytes.len() as u64)
    }
}
