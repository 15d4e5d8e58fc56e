//! The data directory as one durable store: an exclusive lock, the SQLite index and the
//! checkpoint files, with the sequences that keep them agreeing through any crash.
//!
//! Invariant: at every instant each saved checkpoint name has exactly one complete copy
//! reachable from the index, and a deleted one never comes back.
//! - Save: the worker writes a new version directory (complete and fsynced, see
//!   `checkpoints.rs`); [`Store::commit_save`] switches the index row to it in one
//!   transaction; only then is the replaced version discarded. A crash before the switch
//!   leaves the old copy current (the new directory is garbage); after it, the new one.
//! - Delete: the version's files go to the trash first, then the row. A crash between
//!   leaves a row without files, which the next start drops: the deletion completes.
//! - Start ([`Store::open`]): lock, then reconcile. Rows whose version is not complete on
//!   disk are dropped; version directories no row names are discarded; the trash is
//!   emptied. A missing index is rebuilt from the newest complete version of each name,
//!   and a complete pre-version checkpoint that no row names is adopted (an earlier
//!   build indexed a save only after its files were in place).

use std::collections::{HashMap, HashSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use lathe_sdk::types::CheckpointUri;

use super::checkpoints::{
    create_private_dirs, make_private, CheckpointDir, CheckpointMeta, Faults, Found, Trashed,
    LEGACY_VERSION,
};
use super::db::{CheckpointRow, Db, RunRow};
use super::StoreError;

/// The index file inside the data dir.
pub const INDEX_FILE: &str = "lathe.db";
/// The lock file inside the data dir.
pub const LOCK_FILE: &str = "lock";

/// What reconciling the index with the disk did at start.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct OpenReport {
    /// Rows dropped because their files were gone (a delete a crash interrupted).
    pub dropped: usize,
    /// Rows written for checkpoints found on disk (a rebuilt index, adopted legacy ones).
    pub adopted: usize,
    /// Version directories removed (unfinished saves, replaced or deleted versions).
    pub collected: usize,
}

struct Inner {
    db: Db,
    checkpoints: CheckpointDir,
    faults: Faults,
    /// Held for the store's lifetime: the exclusive lock on the data dir.
    _lock: fs::File,
}

/// What [`Store::delete_expired`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpiredDelete {
    /// The files and the row are gone.
    Deleted,
    /// The index records a later expiry (or none): kept, with that expiry.
    Kept(Option<i64>),
    /// That version is no longer the checkpoint's (replaced or deleted meanwhile).
    Replaced,
}

/// The data dir's index and files, shared by the engine (through a blocking pool) and the
/// worker thread (which writes checkpoint versions and commits them). Every method is
/// blocking I/O: never call it on an async task.
#[derive(Clone)]
pub struct Store {
    inner: Arc<Mutex<Inner>>,
    checkpoints: CheckpointDir,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("checkpoints", &self.checkpoints)
            .finish()
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> StoreError + '_ {
    move |source| StoreError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Takes the data dir's exclusive lock, or says who holds it.
fn lock(root: &Path) -> Result<fs::File, StoreError> {
    let path = root.join(LOCK_FILE);
    let mut opts = fs::OpenOptions::new();
    opts.read(true).write(true).create(true).truncate(false);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    let file = opts.open(&path).map_err(io(&path))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(fs::TryLockError::WouldBlock) => Err(StoreError::Locked(root.display().to_string())),
        Err(fs::TryLockError::Error(e)) => Err(io(&path)(e)),
    }
}

impl Store {
    /// Opens the data dir at `root` (created owner-only): takes its exclusive lock before
    /// touching anything else, opens the index and reconciles it with the checkpoint
    /// files. A second server on the same dir fails here with [`StoreError::Locked`] and
    /// changes nothing.
    pub fn open(root: &Path, faults: Faults) -> Result<(Self, OpenReport), StoreError> {
        create_private_dirs(root)?;
        make_private(root, true)?;
        let lock = lock(root)?;
        let db_path = root.join(INDEX_FILE);
        let fresh = !db_path.exists();
        let db = Db::open(&db_path)?;
        for suffix in ["", "-wal", "-shm"] {
            let path = PathBuf::from(format!("{}{suffix}", db_path.display()));
            if path.exists() {
                make_private(&path, false)?;
            }
        }
        let checkpoints = CheckpointDir::new(root.join("checkpoints"), faults.clone())?;
        let mut inner = Inner {
            db,
            checkpoints: checkpoints.clone(),
            faults,
            _lock: lock,
        };
        let report = inner.reconcile(fresh)?;
        Ok((
            Self {
                inner: Arc::new(Mutex::new(inner)),
                checkpoints,
            },
            report,
        ))
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock (only a failpoint test does that) leaves the
        // index and files in a state `open` would reconcile; carry on with it.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Where checkpoint versions are written (the worker writes them without the lock).
    pub fn checkpoints(&self) -> &CheckpointDir {
        &self.checkpoints
    }

    /// The directory of a checkpoint version.
    pub fn version_dir(&self, uri: &CheckpointUri, version: &str) -> PathBuf {
        self.checkpoints.path(uri, version)
    }

    /// Makes a written version current (see the module doc); returns its row. Without
    /// `overwrite`, a name that exists already keeps its copy and the new version is
    /// discarded ([`StoreError::Exists`]).
    pub fn commit_save(
        &self,
        meta: &CheckpointMeta,
        version: &str,
        size: u64,
        overwrite: bool,
    ) -> Result<CheckpointRow, StoreError> {
        self.lock().commit_save(meta, version, size, overwrite)
    }

    /// Deletes a checkpoint if `version` is still its current one (files first, then
    /// the row); returns whether it was.
    pub fn delete(&self, uri: &CheckpointUri, version: &str) -> Result<bool, StoreError> {
        let trashed = self.lock().delete(uri, version)?;
        Ok(remove_outside_the_lock(uri, trashed))
    }

    /// Deletes `version` of a checkpoint the engine found expired at `now_unix`, if the
    /// index agrees: it is still the current version and its recorded expiry has
    /// passed. Two TTL changes of one checkpoint can reach the engine's catalog in the
    /// other order than the index wrote them, so the index, not the catalog, decides.
    pub fn delete_expired(
        &self,
        uri: &CheckpointUri,
        version: &str,
        now_unix: i64,
    ) -> Result<ExpiredDelete, StoreError> {
        let mut inner = self.lock();
        let row = inner
            .db
            .checkpoint(&uri.run_id, uri.kind.type_name(), &uri.name)?;
        match row {
            Some(row) if row.version == version => match row.meta.expires_at {
                Some(at) if at <= now_unix => {
                    let trashed = inner.delete(uri, version)?;
                    drop(inner);
                    remove_outside_the_lock(uri, trashed);
                    Ok(ExpiredDelete::Deleted)
                }
                at => Ok(ExpiredDelete::Kept(at)),
            },
            _ => Ok(ExpiredDelete::Replaced),
        }
    }

    /// Every checkpoint row (the engine's in-memory catalog at start).
    pub fn all_checkpoints(&self) -> Result<Vec<CheckpointRow>, StoreError> {
        self.lock().db.all_checkpoints()
    }

    /// Publishes or unpublishes `version` of a checkpoint; false if it is no longer the
    /// current one.
    pub fn set_public(
        &self,
        uri: &CheckpointUri,
        version: &str,
        public: bool,
    ) -> Result<bool, StoreError> {
        let (current, faults) = {
            let inner = self.lock();
            let current = inner.db.set_public(
                &uri.run_id,
                uri.kind.type_name(),
                &uri.name,
                version,
                public,
            )?;
            (current, inner.faults.clone())
        };
        // After the index lock is released: a test holds a change here to race another.
        faults.hit(if public {
            "set_public:published"
        } else {
            "set_public:unpublished"
        });
        Ok(current)
    }

    /// Sets or clears the expiry of `version` of a checkpoint; false if it is no longer
    /// the current one.
    pub fn set_expiry(
        &self,
        uri: &CheckpointUri,
        version: &str,
        at: Option<i64>,
    ) -> Result<bool, StoreError> {
        self.lock()
            .db
            .set_expiry(&uri.run_id, uri.kind.type_name(), &uri.name, version, at)
    }

    /// Records a new run.
    pub fn insert_run(&self, run: &RunRow) -> Result<(), StoreError> {
        self.lock().db.insert_run(run)
    }

    /// Records runs' latest activity, in one transaction.
    pub fn touch_runs(&self, touched: &[(String, i64)]) -> Result<(), StoreError> {
        self.lock().db.touch_runs(touched)
    }

    /// One run.
    pub fn run(&self, id: &str) -> Result<Option<RunRow>, StoreError> {
        self.lock().db.run(id)
    }

    /// A page of an owner's runs (newest first) and the total.
    pub fn runs_of(
        &self,
        owner: &str,
        offset: usize,
        limit: usize,
    ) -> Result<(Vec<RunRow>, usize), StoreError> {
        self.lock().db.runs_of(owner, offset, limit)
    }

    /// A run's checkpoints, oldest first.
    pub fn checkpoints_of_run(&self, run_id: &str) -> Result<Vec<CheckpointRow>, StoreError> {
        self.lock().db.checkpoints_of_run(run_id)
    }

    /// A page of an owner's checkpoints (newest first) and the total.
    pub fn checkpoints_of_owner(
        &self,
        owner: &str,
        offset: usize,
        limit: usize,
    ) -> Result<(Vec<CheckpointRow>, usize), StoreError> {
        self.lock().db.checkpoints_of_owner(owner, offset, limit)
    }
}

impl Inner {
    fn commit_save(
        &mut self,
        meta: &CheckpointMeta,
        version: &str,
        size: u64,
        overwrite: bool,
    ) -> Result<CheckpointRow, StoreError> {
        let uri = meta
            .uri()
            .ok_or_else(|| StoreError::Invalid(format!("unknown kind {}", meta.kind)))?;
        if !overwrite
            && self
                .db
                .checkpoint(&uri.run_id, uri.kind.type_name(), &uri.name)?
                .is_some()
        {
            let _ = self.checkpoints.discard(&uri, version);
            return Err(StoreError::Exists(uri.name));
        }
        self.faults.hit("commit:begin");
        let old = self.db.switch_checkpoint(meta, version, size)?;
        self.faults.hit("commit:switched");
        if let Some(old) = old.filter(|o| o != version) {
            // The new version is current and durable: failing to remove the old one only
            // leaves garbage for the next start.
            if let Err(e) = self.checkpoints.discard(&uri, &old) {
                tracing::warn!(checkpoint = %uri, "removing the replaced version: {e}");
            }
        }
        self.faults.hit("commit:done");
        Ok(CheckpointRow {
            meta: meta.clone(),
            version: version.to_string(),
            size_bytes: size,
            public: false,
        })
    }

    /// Deletes `version` if it is current: its files leave the checkpoint's path (into
    /// the trash), then its row goes. `None`: it was not current. The trashed files are
    /// the caller's to remove once the lock is released.
    fn delete(
        &mut self,
        uri: &CheckpointUri,
        version: &str,
    ) -> Result<Option<Option<Trashed>>, StoreError> {
        let current = self
            .db
            .checkpoint(&uri.run_id, uri.kind.type_name(), &uri.name)?;
        if current.is_none_or(|row| row.version != version) {
            return Ok(None);
        }
        self.faults.hit("delete:begin");
        let trashed = self.checkpoints.trash(uri, version)?;
        self.faults.hit("delete:files-gone");
        self.db
            .delete_checkpoint(&uri.run_id, uri.kind.type_name(), &uri.name, version)?;
        self.faults.hit("delete:done");
        Ok(Some(trashed))
    }

    fn reconcile(&mut self, fresh: bool) -> Result<OpenReport, StoreError> {
        let scan = self.checkpoints.scan()?;
        let key = |f: &Found| f.meta.uri().map(|u| (u, f.version.clone()));
        let on_disk: HashSet<(CheckpointUri, String)> =
            scan.complete.iter().filter_map(key).collect();
        let mut report = OpenReport::default();
        let mut current: HashSet<(CheckpointUri, String)> = HashSet::new();
        let mut named: HashSet<CheckpointUri> = HashSet::new();
        for row in self.db.all_checkpoints()? {
            let Some(uri) = row.meta.uri() else { continue };
            if on_disk.contains(&(uri.clone(), row.version.clone())) {
                named.insert(uri.clone());
                current.insert((uri, row.version));
            } else {
                tracing::warn!(checkpoint = %uri, "the index names a checkpoint whose files are gone (a delete was interrupted); dropping it");
                self.db.delete_checkpoint(
                    &uri.run_id,
                    uri.kind.type_name(),
                    &uri.name,
                    &row.version,
                )?;
                report.dropped += 1;
            }
        }
        // Rows for what the index should name but does not.
        let mut adopt: HashMap<CheckpointUri, &Found> = HashMap::new();
        for found in &scan.complete {
            let Some(uri) = found.meta.uri() else {
                continue;
            };
            let eligible = if fresh {
                true
            } else {
                found.version == LEGACY_VERSION && !named.contains(&uri)
            };
            if !eligible {
                continue;
            }
            let newer = adopt.get(&uri).is_none_or(|prev| {
                (found.meta.created_at, &found.version) > (prev.meta.created_at, &prev.version)
            });
            if newer {
                adopt.insert(uri, found);
            }
        }
        for (uri, found) in adopt {
            tracing::info!(checkpoint = %uri, "indexing a checkpoint found on disk");
            self.db
                .switch_checkpoint(&found.meta, &found.version, found.size)?;
            self.db.ensure_run_of(&found.meta)?;
            current.insert((uri, found.version.clone()));
            report.adopted += 1;
        }
        let garbage = scan
            .complete
            .iter()
            .filter_map(key)
            .filter(|k| !current.contains(k))
            .chain(scan.incomplete.iter().cloned());
        for (uri, version) in garbage {
            self.checkpoints.discard(&uri, &version)?;
            report.collected += 1;
        }
        self.checkpoints.empty_trash()?;
        Ok(report)
    }
}

/// Removes a deleted version's trashed files (after the index's lock is released: a
/// large checkpoint's removal would hold every save and listing); returns whether a
/// version was deleted. A failure only leaves files for the next start's trash sweep.
fn remove_outside_the_lock(uri: &CheckpointUri, deleted: Option<Option<Trashed>>) -> bool {
    match deleted {
        Some(Some(trashed)) => {
            if let Err(e) = trashed.remove() {
                tracing::warn!(checkpoint = %uri, "removing a deleted version's files: {e}");
            }
            true
        }
        Some(None) => true,
        None => false,
    }
}

#[cfg(test)]
#[path = "data_dir_tests.rs"]
mod tests;
