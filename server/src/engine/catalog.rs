//! The engine's view of every checkpoint: who owns it, whether it is published, which
//! version is current, when it expires. Loaded from the index at start and kept in step
//! with it (the engine is the only writer of both), so that access is checked in memory
//! each time a checkpoint is used, not once when a request first names it.

use std::collections::HashMap;
use std::path::PathBuf;

use lathe_sdk::types::CheckpointUri;

use crate::store::checkpoints::CheckpointDir;
use crate::store::db::CheckpointRow;

use super::EngineError;

struct Entry {
    row: CheckpointRow,
    /// A delete is under way: invisible to everyone, about to go.
    deleting: bool,
}

/// Every checkpoint by URI.
pub(super) struct Catalog {
    entries: HashMap<CheckpointUri, Entry>,
    dir: CheckpointDir,
}

fn unknown(uri: &CheckpointUri) -> EngineError {
    EngineError::NotFound(format!("unknown checkpoint {uri}"))
}

impl Catalog {
    /// The catalog of `rows`, whose files live under `dir`.
    pub fn new(rows: Vec<CheckpointRow>, dir: CheckpointDir) -> Self {
        let entries = rows
            .into_iter()
            .filter_map(|row| {
                let uri = row.meta.uri()?;
                Some((
                    uri,
                    Entry {
                        row,
                        deleting: false,
                    },
                ))
            })
            .collect();
        Self { entries, dir }
    }

    fn live(&self, uri: &CheckpointUri) -> Option<&CheckpointRow> {
        self.entries
            .get(uri)
            .filter(|e| !e.deleting)
            .map(|e| &e.row)
    }

    /// A checkpoint `owner` may read now: its own, or published. Anything else is
    /// "unknown", so other keys learn nothing about what exists.
    pub fn readable(
        &self,
        owner: &str,
        uri: &CheckpointUri,
    ) -> Result<&CheckpointRow, EngineError> {
        self.live(uri)
            .filter(|r| r.meta.owner == owner || r.public)
            .ok_or_else(|| unknown(uri))
    }

    /// One of `owner`'s checkpoints.
    pub fn owned(&self, owner: &str, uri: &CheckpointUri) -> Result<&CheckpointRow, EngineError> {
        self.live(uri)
            .filter(|r| r.meta.owner == owner)
            .ok_or_else(|| unknown(uri))
    }

    /// Whether `owner` has a checkpoint saved by `run_id` (on the error path only: a scan).
    pub fn has_checkpoint_of_run(&self, owner: &str, run_id: &str) -> bool {
        self.entries
            .values()
            .any(|e| !e.deleting && e.row.meta.run_id == run_id && e.row.meta.owner == owner)
    }

    /// How many checkpoints `owner` stores, and their bytes (a scan, on saves only).
    pub fn usage_of(&self, owner: &str) -> (usize, u64) {
        self.entries
            .values()
            .filter(|e| e.row.meta.owner == owner)
            .fold((0, 0u64), |(n, bytes), e| {
                (n + 1, bytes.saturating_add(e.row.size_bytes))
            })
    }

    /// Whether a checkpoint of that name exists (whoever owns it).
    pub fn exists(&self, uri: &CheckpointUri) -> bool {
        self.entries.contains_key(uri)
    }

    /// The directory of a row's version.
    pub fn dir_of(&self, row: &CheckpointRow) -> Option<PathBuf> {
        Some(self.dir.path(&row.meta.uri()?, &row.version))
    }

    /// A save was committed.
    pub fn saved(&mut self, row: CheckpointRow) {
        if let Some(uri) = row.meta.uri() {
            self.entries.insert(
                uri,
                Entry {
                    row,
                    deleting: false,
                },
            );
        }
    }

    /// Hides one of `owner`'s checkpoints for deletion; returns the version to delete.
    pub fn begin_delete(
        &mut self,
        owner: &str,
        uri: &CheckpointUri,
    ) -> Result<String, EngineError> {
        let version = self.owned(owner, uri)?.version.clone();
        self.mark_deleting(uri);
        Ok(version)
    }

    fn mark_deleting(&mut self, uri: &CheckpointUri) {
        if let Some(e) = self.entries.get_mut(uri) {
            e.deleting = true;
        }
    }

    /// A delete of `version` ended: it goes if `deleted`, else it is visible again. A
    /// save that replaced the version meanwhile is left alone.
    pub fn end_delete(&mut self, uri: &CheckpointUri, version: &str, deleted: bool) {
        let Some(e) = self.entries.get_mut(uri) else {
            return;
        };
        if e.row.version != version {
            return;
        }
        if deleted {
            self.entries.remove(uri);
        } else {
            e.deleting = false;
        }
    }

    /// Sets whether `version` of a checkpoint is published (a newer version is left
    /// alone: it starts private).
    pub fn set_public(&mut self, uri: &CheckpointUri, version: &str, public: bool) {
        if let Some(e) = self
            .entries
            .get_mut(uri)
            .filter(|e| e.row.version == version)
        {
            e.row.public = public;
        }
    }

    /// Sets the expiry of `version` of a checkpoint.
    pub fn set_expiry(&mut self, uri: &CheckpointUri, version: &str, at: Option<i64>) {
        if let Some(e) = self
            .entries
            .get_mut(uri)
            .filter(|e| e.row.version == version)
        {
            e.row.meta.expires_at = at;
        }
    }

    /// Checkpoints whose expiry has passed, hidden for deletion (with their versions).
    pub fn take_expired(&mut self, now_unix: i64) -> Vec<(CheckpointUri, String)> {
        let due: Vec<(CheckpointUri, String)> = self
            .entries
            .iter()
            .filter(|(_, e)| !e.deleting && e.row.meta.expires_at.is_some_and(|t| t <= now_unix))
            .map(|(uri, e)| (uri.clone(), e.row.version.clone()))
            .collect();
        for (uri, _) in &due {
            self.mark_deleting(uri);
        }
        due
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::checkpoints::{CheckpointMeta, Faults};

    fn row(name: &str, owner: &str, version: &str) -> CheckpointRow {
        CheckpointRow {
            meta: CheckpointMeta::for_test("r", "sampler", name, owner),
            version: version.into(),
            size_bytes: 1,
            public: false,
        }
    }

    #[test]
    fn access_follows_ownership_publication_and_deletion() {
        let dir = std::env::temp_dir().join(format!("lathe-cat-{}", uuid::Uuid::new_v4()));
        let mut c = Catalog::new(
            vec![row("a", "alice", "v-1")],
            CheckpointDir::new(dir.clone(), Faults::default()).unwrap(),
        );
        let a = row("a", "alice", "v-1").meta.uri().unwrap();
        assert!(c.readable("alice", &a).is_ok());
        assert!(c.readable("bob", &a).is_err());
        c.set_public(&a, "v-1", true);
        assert!(c.readable("bob", &a).is_ok());
        assert!(c.owned("bob", &a).is_err(), "published is not owned");
        let v = c.begin_delete("alice", &a).unwrap();
        assert!(c.readable("bob", &a).is_err() && c.readable("alice", &a).is_err());
        // A save replaced the version meanwhile: the delete leaves the new one alone.
        c.saved(row("a", "alice", "v-2"));
        c.end_delete(&a, &v, true);
        assert_eq!(c.readable("alice", &a).unwrap().version, "v-2");
        assert!(
            c.readable("bob", &a).is_err(),
            "a new version is private again"
        );
        c.set_expiry(&a, "v-1", Some(10));
        assert!(c.take_expired(10).is_empty(), "that version is gone");
        c.set_expiry(&a, "v-2", Some(10));
        assert!(c.take_expired(9).is_empty());
        assert_eq!(c.take_expired(10), vec![(a.clone(), "v-2".to_string())]);
        assert!(c.take_expired(11).is_empty(), "already being deleted");
        c.end_delete(&a, "v-2", true);
        assert!(!c.exists(&a));
        let _ = std::fs::remove_dir_all(dir);
    }
}
