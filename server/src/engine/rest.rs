//! REST queries over the index: runs, checkpoints, sessions, publishing, TTLs.

use std::path::PathBuf;
use std::time::{Duration, UNIX_EPOCH};

use lathe_sdk::types::{
    Checkpoint, CheckpointKind, CheckpointUri, CheckpointsListResponse, Cursor, TrainingRun,
    TrainingRunsResponse,
};

use crate::store::db::{CheckpointRow, RunRow};

use super::state::now_unix;
use super::{Engine, EngineError};

/// Most items one listing page returns.
pub const MAX_PAGE: usize = 1000;

fn rfc3339(unix: i64) -> String {
    humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_secs(unix.max(0) as u64))
        .to_string()
}

fn checkpoint_view(row: &CheckpointRow) -> Checkpoint {
    let kind = row.meta.kind().unwrap_or(CheckpointKind::Training);
    let uri = CheckpointUri {
        run_id: row.meta.run_id.clone(),
        kind,
        name: row.meta.name.clone(),
    };
    Checkpoint {
        checkpoint_id: uri.checkpoint_id(),
        checkpoint_type: kind.type_name().to_string(),
        time: rfc3339(row.meta.created_at),
        tinker_path: uri.to_string(),
        size_bytes: Some(row.size_bytes),
        public: row.public,
        expires_at: row.meta.expires_at.map(rfc3339),
    }
}

/// Parses a REST checkpoint id (`weights/<name>` or `sampler_weights/<name>`) of a run.
pub fn parse_checkpoint_id(
    run_id: &str,
    checkpoint_id: &str,
) -> Result<CheckpointUri, EngineError> {
    format!("tinker://{run_id}/{checkpoint_id}")
        .parse()
        .map_err(EngineError::BadRequest)
}

impl Engine {
    fn run_view(&self, row: RunRow) -> Result<TrainingRun, EngineError> {
        let ckpts = self.db.checkpoints_of_run(&row.id)?;
        let last = |kind: &str| {
            ckpts
                .iter()
                .filter(|c| c.meta.kind == kind)
                .max_by_key(|c| c.meta.created_at)
                .map(checkpoint_view)
        };
        Ok(TrainingRun {
            training_run_id: row.id.clone(),
            base_model: row.base_model.clone(),
            model_owner: row.owner.clone(),
            is_lora: true,
            corrupted: false,
            lora_rank: Some(row.rank),
            last_request_time: rfc3339(row.last_request_at),
            last_checkpoint: last("training"),
            last_sampler_checkpoint: last("sampler"),
            user_metadata: (!row.user_metadata.is_empty()).then_some(row.user_metadata),
        })
    }

    fn owned_run(&self, owner: &str, run_id: &str) -> Result<RunRow, EngineError> {
        self.db
            .run(run_id)?
            .filter(|r| r.owner == owner)
            .ok_or_else(|| EngineError::NotFound(format!("unknown training run {run_id}")))
    }

    /// A page of the owner's runs, newest first.
    pub fn list_runs(
        &self,
        owner: &str,
        offset: usize,
        limit: usize,
    ) -> Result<TrainingRunsResponse, EngineError> {
        let limit = limit.min(MAX_PAGE);
        let (rows, total) = self.db.runs_of(owner, offset, limit)?;
        let training_runs = rows
            .into_iter()
            .map(|r| self.run_view(r))
            .collect::<Result<_, _>>()?;
        Ok(TrainingRunsResponse {
            training_runs,
            cursor: Cursor {
                offset,
                limit,
                total_count: total,
            },
        })
    }

    /// One of the owner's runs.
    pub fn get_run(&self, owner: &str, run_id: &str) -> Result<TrainingRun, EngineError> {
        let row = self.owned_run(owner, run_id)?;
        self.run_view(row)
    }

    /// A run's checkpoints (the owner's run; others see only published ones).
    pub fn list_run_checkpoints(
        &self,
        owner: &str,
        run_id: &str,
    ) -> Result<CheckpointsListResponse, EngineError> {
        let rows = self.db.checkpoints_of_run(run_id)?;
        let visible: Vec<Checkpoint> = rows
            .iter()
            .filter(|r| r.meta.owner == owner || r.public)
            .map(checkpoint_view)
            .collect();
        if visible.is_empty() && self.owned_run(owner, run_id).is_err() {
            return Err(EngineError::NotFound(format!(
                "unknown training run {run_id}"
            )));
        }
        Ok(CheckpointsListResponse {
            checkpoints: visible,
            cursor: None,
        })
    }

    /// A page of the owner's checkpoints, newest first.
    pub fn list_user_checkpoints(
        &self,
        owner: &str,
        offset: usize,
        limit: usize,
    ) -> Result<CheckpointsListResponse, EngineError> {
        let limit = limit.min(MAX_PAGE);
        let (rows, total) = self.db.checkpoints_of_owner(owner, offset, limit)?;
        Ok(CheckpointsListResponse {
            checkpoints: rows.iter().map(checkpoint_view).collect(),
            cursor: Some(Cursor {
                offset,
                limit,
                total_count: total,
            }),
        })
    }

    fn owned_checkpoint(
        &self,
        owner: &str,
        uri: &CheckpointUri,
    ) -> Result<CheckpointRow, EngineError> {
        self.db
            .checkpoint(&uri.run_id, uri.kind.type_name(), &uri.name)?
            .filter(|r| r.meta.owner == owner)
            .ok_or_else(|| EngineError::NotFound(format!("unknown checkpoint {uri}")))
    }

    /// Deletes one of the owner's checkpoints (index row first, then files).
    pub fn delete_checkpoint(
        &mut self,
        owner: &str,
        uri: &CheckpointUri,
    ) -> Result<(), EngineError> {
        self.owned_checkpoint(owner, uri)?;
        self.db
            .delete_checkpoint(&uri.run_id, uri.kind.type_name(), &uri.name)?;
        self.checkpoints.remove(&uri.run_id, uri.kind, &uri.name)?;
        Ok(())
    }

    /// Publishes (readable by every key) or unpublishes a checkpoint.
    pub fn set_public(
        &mut self,
        owner: &str,
        uri: &CheckpointUri,
        public: bool,
    ) -> Result<(), EngineError> {
        self.owned_checkpoint(owner, uri)?;
        self.db
            .set_public(&uri.run_id, uri.kind.type_name(), &uri.name, public)?;
        Ok(())
    }

    /// Sets (seconds from now) or clears a checkpoint's TTL.
    pub fn set_ttl(
        &mut self,
        owner: &str,
        uri: &CheckpointUri,
        ttl: Option<u64>,
    ) -> Result<(), EngineError> {
        self.owned_checkpoint(owner, uri)?;
        let expires = ttl.map(|t| now_unix() + t.min(i64::MAX as u64 / 2) as i64);
        self.db
            .set_expiry(&uri.run_id, uri.kind.type_name(), &uri.name, expires)?;
        Ok(())
    }

    /// The directory of a checkpoint `owner` may download.
    pub fn checkpoint_dir(&self, owner: &str, uri: &CheckpointUri) -> Result<PathBuf, EngineError> {
        Ok(self.resolve_checkpoint(owner, uri)?.1)
    }

    /// A session's runs and samplers.
    pub fn get_session(
        &self,
        owner: &str,
        id: &str,
    ) -> Result<(Vec<String>, Vec<String>), EngineError> {
        let s = self
            .sessions
            .get(id)
            .filter(|s| s.owner == owner)
            .ok_or_else(|| EngineError::NotFound(format!("unknown session {id}")))?;
        Ok((s.runs.clone(), s.samplers.clone()))
    }

    /// The owner's live sessions.
    pub fn list_sessions(&self, owner: &str) -> Vec<String> {
        let mut ids: Vec<String> = self
            .sessions
            .iter()
            .filter(|(_, s)| s.owner == owner)
            .map(|(id, _)| id.clone())
            .collect();
        ids.sort();
        ids
    }
}
