//! REST resources: listings of runs and checkpoints (blocking reads of the store, which
//! `EngineHandle` runs on the blocking pool), and the engine's half of deleting,
//! publishing and TTLs (access checks and the in-memory catalog; the index write happens
//! between `begin_*` and `finish_*`, off the actor).

use std::path::PathBuf;
use std::time::{Duration, UNIX_EPOCH};

use lathe_sdk::types::{
    Checkpoint, CheckpointKind, CheckpointUri, CheckpointsListResponse, Cursor, TrainingRun,
    TrainingRunsResponse,
};

use crate::store::db::{CheckpointRow, RunRow};
use crate::store::Store;

use super::state::now_unix;
use super::{Engine, EngineError, Ttl};

/// Most items one listing page returns.
pub const MAX_PAGE: usize = 1000;

/// The latest instant `humantime` formats (9999-12-31T23:59:59Z); it panics beyond.
const LAST_FORMATTABLE_UNIX: i64 = 253_402_300_799;

/// An RFC 3339 timestamp of any Unix time, clamped to years 1970 to 9999: a stored
/// expiry from an older server or a hand-edited index must never panic a listing.
fn rfc3339(unix: i64) -> String {
    let secs = unix.clamp(0, LAST_FORMATTABLE_UNIX) as u64;
    humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_secs(secs)).to_string()
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

fn run_view(store: &Store, row: RunRow) -> Result<TrainingRun, EngineError> {
    let ckpts = store.checkpoints_of_run(&row.id)?;
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

fn owned_run(store: &Store, owner: &str, run_id: &str) -> Result<RunRow, EngineError> {
    store
        .run(run_id)?
        .filter(|r| r.owner == owner)
        .ok_or_else(|| EngineError::NotFound(format!("unknown training run {run_id}")))
}

/// A page of the owner's runs, newest first. Blocking.
pub fn list_runs(
    store: &Store,
    owner: &str,
    offset: usize,
    limit: usize,
) -> Result<TrainingRunsResponse, EngineError> {
    let limit = limit.min(MAX_PAGE);
    let (rows, total) = store.runs_of(owner, offset, limit)?;
    let training_runs = rows
        .into_iter()
        .map(|r| run_view(store, r))
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

/// One of the owner's runs. Blocking.
pub fn get_run(store: &Store, owner: &str, run_id: &str) -> Result<TrainingRun, EngineError> {
    let row = owned_run(store, owner, run_id)?;
    run_view(store, row)
}

/// A run's checkpoints (the owner's run; others see only published ones). Blocking.
pub fn list_run_checkpoints(
    store: &Store,
    owner: &str,
    run_id: &str,
) -> Result<CheckpointsListResponse, EngineError> {
    let rows = store.checkpoints_of_run(run_id)?;
    let visible: Vec<Checkpoint> = rows
        .iter()
        .filter(|r| r.meta.owner == owner || r.public)
        .map(checkpoint_view)
        .collect();
    if visible.is_empty() && owned_run(store, owner, run_id).is_err() {
        return Err(EngineError::NotFound(format!(
            "unknown training run {run_id}"
        )));
    }
    Ok(CheckpointsListResponse {
        checkpoints: visible,
        cursor: None,
    })
}

/// A page of the owner's checkpoints, newest first. Blocking.
pub fn list_user_checkpoints(
    store: &Store,
    owner: &str,
    offset: usize,
    limit: usize,
) -> Result<CheckpointsListResponse, EngineError> {
    let limit = limit.min(MAX_PAGE);
    let (rows, total) = store.checkpoints_of_owner(owner, offset, limit)?;
    Ok(CheckpointsListResponse {
        checkpoints: rows.iter().map(checkpoint_view).collect(),
        cursor: Some(Cursor {
            offset,
            limit,
            total_count: total,
        }),
    })
}

impl Engine {
    /// Starts deleting one of the owner's checkpoints: from now on nobody can use it.
    /// Returns the version to delete.
    pub fn begin_delete(
        &mut self,
        owner: &str,
        uri: &CheckpointUri,
    ) -> Result<String, EngineError> {
        self.catalog.begin_delete(owner, uri)
    }

    /// A delete of `version` ended (`deleted`: it is gone; else it is usable again).
    pub fn finish_delete(&mut self, uri: &CheckpointUri, version: &str, deleted: bool) {
        self.catalog.end_delete(uri, version, deleted);
    }

    /// An expired checkpoint's delete ended (`None`: it failed, and is retried at the
    /// next tick). Where the index recorded a later expiry than the catalog had (two TTL
    /// changes applied here in the other order than written), the checkpoint stays, with
    /// the index's expiry.
    pub fn finish_expired(
        &mut self,
        uri: &CheckpointUri,
        version: &str,
        outcome: Option<crate::store::ExpiredDelete>,
    ) {
        use crate::store::ExpiredDelete;
        match outcome {
            Some(ExpiredDelete::Deleted | ExpiredDelete::Replaced) => {
                self.catalog.end_delete(uri, version, true)
            }
            Some(ExpiredDelete::Kept(at)) => {
                self.catalog.set_expiry(uri, version, at);
                self.catalog.end_delete(uri, version, false);
            }
            None => self.catalog.end_delete(uri, version, false),
        }
    }

    /// Checks that `owner` may publish or unpublish; unpublishing takes effect at once
    /// (before the index write), so access is never wider than the index says. Returns
    /// the current setting, to restore if the write fails, and the version it applies to.
    pub fn begin_set_public(
        &mut self,
        owner: &str,
        uri: &CheckpointUri,
        public: bool,
    ) -> Result<(bool, String), EngineError> {
        let row = self.catalog.owned(owner, uri)?;
        let (was, version) = (row.public, row.version.clone());
        if !public {
            self.catalog.set_public(uri, &version, false);
        }
        Ok((was, version))
    }

    /// The publish write of `version` ended: `public` if it was written, else back to
    /// `was`. A version a save replaced meanwhile is gone; the new one stays private.
    pub fn finish_set_public(
        &mut self,
        uri: &CheckpointUri,
        version: &str,
        public: bool,
        was: bool,
        written: bool,
    ) {
        self.catalog
            .set_public(uri, version, if written { public } else { was });
    }

    /// Checks that `owner` may set a TTL; returns the expiry to write and the version.
    pub fn begin_set_ttl(
        &mut self,
        owner: &str,
        uri: &CheckpointUri,
        ttl: Option<Ttl>,
    ) -> Result<(Option<i64>, String), EngineError> {
        let version = self.catalog.owned(owner, uri)?.version.clone();
        Ok((ttl.map(|t| t.expires_at(now_unix())), version))
    }

    /// The TTL write of `version` succeeded.
    pub fn finish_set_ttl(&mut self, uri: &CheckpointUri, version: &str, expires_at: Option<i64>) {
        self.catalog.set_expiry(uri, version, expires_at);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_stored_time_formats_without_panicking() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(-5), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(i64::MAX), "9999-12-31T23:59:59Z");
        assert_eq!(rfc3339(LAST_FORMATTABLE_UNIX + 1), "9999-12-31T23:59:59Z");
    }
}
