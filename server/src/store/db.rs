//! SQLite index of training runs and checkpoints (rusqlite, bundled SQLite, WAL,
//! `synchronous = FULL` so a committed switch survives a power cut).
//!
//! The index says which version of each checkpoint name is current: a version directory
//! that no row names is an unfinished save or a replaced or deleted version, and is
//! removed at start (`data_dir.rs`). Every switch is one transaction.

use std::collections::BTreeMap;
use std::path::Path;

use rusqlite::{params, Connection, OptionalExtension};

use super::checkpoints::CheckpointMeta;
use super::StoreError;

/// A training run's row.
#[derive(Debug, Clone, PartialEq)]
pub struct RunRow {
    /// `<session>:train:<n>`.
    pub id: String,
    /// Owner id.
    pub owner: String,
    /// Creating session.
    pub session_id: String,
    /// Base model name.
    pub base_model: String,
    /// LoRA rank.
    pub rank: usize,
    /// Attention adapted.
    pub train_attn: bool,
    /// MLP adapted.
    pub train_mlp: bool,
    /// lm_head adapted.
    pub train_unembed: bool,
    /// Unix seconds.
    pub created_at: i64,
    /// Unix seconds.
    pub last_request_at: i64,
    /// Metadata given at creation.
    pub user_metadata: BTreeMap<String, String>,
}

/// A checkpoint's row.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckpointRow {
    /// What the checkpoint directory records.
    pub meta: CheckpointMeta,
    /// Which version directory holds it (see `checkpoints.rs`).
    pub version: String,
    /// Bytes on disk.
    pub size_bytes: u64,
    /// Readable by every key.
    pub public: bool,
}

/// Runs without a checkpoint that the index keeps per owner (the newest).
pub const RECORDED_RUNS: usize = 1000;

/// The open database.
pub struct Db {
    conn: Connection,
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS runs (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    session_id TEXT NOT NULL,
    base_model TEXT NOT NULL,
    rank INTEGER NOT NULL,
    train_attn INTEGER NOT NULL,
    train_mlp INTEGER NOT NULL,
    train_unembed INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    last_request_at INTEGER NOT NULL,
    user_metadata TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS runs_owner ON runs(owner, created_at);
CREATE INDEX IF NOT EXISTS runs_owner_active ON runs(owner, last_request_at);
CREATE TABLE IF NOT EXISTS checkpoints (
    run_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    name TEXT NOT NULL,
    owner TEXT NOT NULL,
    base_model TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    expires_at INTEGER,
    size_bytes INTEGER NOT NULL,
    public INTEGER NOT NULL DEFAULT 0,
    rank INTEGER NOT NULL,
    train_attn INTEGER NOT NULL,
    train_mlp INTEGER NOT NULL,
    train_unembed INTEGER NOT NULL,
    version TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (run_id, kind, name)
);
CREATE INDEX IF NOT EXISTS checkpoints_owner ON checkpoints(owner, created_at);
";

const CKPT_COLUMNS: &str = "run_id, kind, name, owner, base_model, created_at, expires_at, \
     size_bytes, public, rank, train_attn, train_mlp, train_unembed, version";

fn ckpt_from_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<CheckpointRow> {
    Ok(CheckpointRow {
        meta: CheckpointMeta {
            run_id: r.get(0)?,
            kind: r.get(1)?,
            name: r.get(2)?,
            owner: r.get(3)?,
            base_model: r.get(4)?,
            created_at: r.get(5)?,
            expires_at: r.get(6)?,
            rank: r.get::<_, i64>(9)? as usize,
            train_attn: r.get(10)?,
            train_mlp: r.get(11)?,
            train_unembed: r.get(12)?,
        },
        version: r.get(13)?,
        size_bytes: r.get::<_, i64>(7)?.max(0) as u64,
        public: r.get(8)?,
    })
}

fn run_from_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<RunRow> {
    let meta: String = r.get(10)?;
    Ok(RunRow {
        id: r.get(0)?,
        owner: r.get(1)?,
        session_id: r.get(2)?,
        base_model: r.get(3)?,
        rank: r.get::<_, i64>(4)? as usize,
        train_attn: r.get(5)?,
        train_mlp: r.get(6)?,
        train_unembed: r.get(7)?,
        created_at: r.get(8)?,
        last_request_at: r.get(9)?,
        user_metadata: serde_json::from_str(&meta).unwrap_or_default(),
    })
}

const RUN_COLUMNS: &str = "id, owner, session_id, base_model, rank, train_attn, train_mlp, \
     train_unembed, created_at, last_request_at, user_metadata";

impl Db {
    /// Opens (creating) the database file.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        let conn = Connection::open(path)?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "FULL")?;
        Self::prepare(conn)
    }

    /// An in-memory database (tests).
    pub fn in_memory() -> Result<Self, StoreError> {
        Self::prepare(Connection::open_in_memory()?)
    }

    /// Creates the schema, and adds the `version` column to an index written before
    /// checkpoints had versions (its rows name the pre-version layout, version `''`).
    fn prepare(conn: Connection) -> Result<Self, StoreError> {
        conn.execute_batch(SCHEMA)?;
        let has_version: bool = conn
            .prepare("SELECT 1 FROM pragma_table_info('checkpoints') WHERE name = 'version'")?
            .exists([])?;
        if !has_version {
            conn.execute_batch(
                "ALTER TABLE checkpoints ADD COLUMN version TEXT NOT NULL DEFAULT ''",
            )?;
        }
        Ok(Self { conn })
    }

    /// Records a new run, and forgets its owner's runs without a checkpoint past the
    /// [`RECORDED_RUNS`] most recently active (by last request, then by insertion): each
    /// row holds up to 16 KiB of metadata, and a key creating runs in a loop would
    /// otherwise fill the disk every key shares (runs with checkpoints are bounded by the
    /// key's checkpoint limit). A run still in use requests often, and stays.
    pub fn insert_run(&mut self, run: &RunRow) -> Result<(), StoreError> {
        let tx = self.conn.transaction()?;
        tx.execute(
            &format!("INSERT OR REPLACE INTO runs ({RUN_COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)"),
            params![
                run.id,
                run.owner,
                run.session_id,
                run.base_model,
                run.rank as i64,
                run.train_attn,
                run.train_mlp,
                run.train_unembed,
                run.created_at,
                run.last_request_at,
                serde_json::to_string(&run.user_metadata).expect("map serialises"),
            ],
        )?;
        tx.execute(
            "DELETE FROM runs WHERE id IN (
                SELECT id FROM runs r WHERE owner = ?1
                    AND NOT EXISTS (SELECT 1 FROM checkpoints c WHERE c.run_id = r.id)
                ORDER BY last_request_at DESC, rowid DESC LIMIT -1 OFFSET ?2)",
            params![run.owner, RECORDED_RUNS as i64],
        )?;
        tx.commit()?;
        Ok(())
    }

    /// Updates runs' last activity times, in one transaction.
    pub fn touch_runs(&mut self, touched: &[(String, i64)]) -> Result<(), StoreError> {
        let tx = self.conn.transaction()?;
        for (id, at) in touched {
            tx.execute(
                "UPDATE runs SET last_request_at = ?2 WHERE id = ?1",
                params![id, at],
            )?;
        }
        tx.commit()?;
        Ok(())
    }

    /// One run.
    pub fn run(&self, id: &str) -> Result<Option<RunRow>, StoreError> {
        Ok(self
            .conn
            .query_row(
                &format!("SELECT {RUN_COLUMNS} FROM runs WHERE id = ?1"),
                params![id],
                run_from_row,
            )
            .optional()?)
    }

    /// A page of an owner's runs, newest first, and the total count.
    pub fn runs_of(
        &self,
        owner: &str,
        offset: usize,
        limit: usize,
    ) -> Result<(Vec<RunRow>, usize), StoreError> {
        let total: i64 = self.conn.query_row(
            "SELECT COUNT(*) FROM runs WHERE owner = ?1",
            params![owner],
            |r| r.get(0),
        )?;
        let mut stmt = self.conn.prepare(&format!(
            "SELECT {RUN_COLUMNS} FROM runs WHERE owner = ?1 ORDER BY created_at DESC, id LIMIT ?2 OFFSET ?3"
        ))?;
        let rows = stmt
            .query_map(params![owner, limit as i64, offset as i64], run_from_row)?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        Ok((rows, total as usize))
    }

    /// Points a checkpoint's name at `version` (a new row, or a replaced one, which
    /// becomes private again) in one transaction; returns the version it replaced.
    pub fn switch_checkpoint(
        &mut self,
        meta: &CheckpointMeta,
        version: &str,
        size: u64,
    ) -> Result<Option<String>, StoreError> {
        let tx = self.conn.transaction()?;
        let old: Option<String> = tx
            .query_row(
                "SELECT version FROM checkpoints WHERE run_id = ?1 AND kind = ?2 AND name = ?3",
                params![meta.run_id, meta.kind, meta.name],
                |r| r.get(0),
            )
            .optional()?;
        insert_checkpoint_row(&tx, meta, version, size)?;
        tx.commit()?;
        Ok(old)
    }

    /// Every checkpoint row.
    pub fn all_checkpoints(&self) -> Result<Vec<CheckpointRow>, StoreError> {
        let mut stmt = self
            .conn
            .prepare(&format!("SELECT {CKPT_COLUMNS} FROM checkpoints"))?;
        let rows = stmt
            .query_map([], ckpt_from_row)?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        Ok(rows)
    }

    /// One checkpoint.
    pub fn checkpoint(
        &self,
        run_id: &str,
        kind: &str,
        name: &str,
    ) -> Result<Option<CheckpointRow>, StoreError> {
        Ok(self
            .conn
            .query_row(
                &format!("SELECT {CKPT_COLUMNS} FROM checkpoints WHERE run_id = ?1 AND kind = ?2 AND name = ?3"),
                params![run_id, kind, name],
                ckpt_from_row,
            )
            .optional()?)
    }

    /// A run's checkpoints, oldest first.
    pub fn checkpoints_of_run(&self, run_id: &str) -> Result<Vec<CheckpointRow>, StoreError> {
        let mut stmt = self.conn.prepare(&format!(
            "SELECT {CKPT_COLUMNS} FROM checkpoints WHERE run_id = ?1 ORDER BY created_at, name"
        ))?;
        let rows = stmt
            .query_map(params![run_id], ckpt_from_row)?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        Ok(rows)
    }

    /// A page of an owner's checkpoints, newest first, and the total count.
    pub fn checkpoints_of_owner(
        &self,
        owner: &str,
        offset: usize,
        limit: usize,
    ) -> Result<(Vec<CheckpointRow>, usize), StoreError> {
        let total: i64 = self.conn.query_row(
            "SELECT COUNT(*) FROM checkpoints WHERE owner = ?1",
            params![owner],
            |r| r.get(0),
        )?;
        let mut stmt = self.conn.prepare(&format!(
            "SELECT {CKPT_COLUMNS} FROM checkpoints WHERE owner = ?1 ORDER BY created_at DESC, run_id, name LIMIT ?2 OFFSET ?3"
        ))?;
        let rows = stmt
            .query_map(params![owner, limit as i64, offset as i64], ckpt_from_row)?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        Ok((rows, total as usize))
    }

    /// Removes a checkpoint's row if it still names `version` (a save that replaced it
    /// meanwhile wins); returns whether a row went.
    pub fn delete_checkpoint(
        &self,
        run_id: &str,
        kind: &str,
        name: &str,
        version: &str,
    ) -> Result<bool, StoreError> {
        let n = self.conn.execute(
            "DELETE FROM checkpoints WHERE run_id = ?1 AND kind = ?2 AND name = ?3 AND version = ?4",
            params![run_id, kind, name, version],
        )?;
        Ok(n > 0)
    }

    /// Records a run for a checkpoint found on disk whose run the index lacks, so it is
    /// listed and resumable.
    pub fn ensure_run_of(&self, meta: &CheckpointMeta) -> Result<(), StoreError> {
        self.conn.execute(
            &format!("INSERT OR IGNORE INTO runs ({RUN_COLUMNS}) VALUES (?1, ?2, '', ?3, ?4, ?5, ?6, ?7, ?8, ?8, '{{}}')"),
            params![
                meta.run_id, meta.owner, meta.base_model, meta.rank as i64,
                meta.train_attn, meta.train_mlp, meta.train_unembed, meta.created_at,
            ],
        )?;
        Ok(())
    }

    /// Sets whether a checkpoint is readable by every key.
    /// Applies to `version` only (a save that replaced it meanwhile is not touched);
    /// returns whether it still was current.
    pub fn set_public(
        &self,
        run_id: &str,
        kind: &str,
        name: &str,
        version: &str,
        public: bool,
    ) -> Result<bool, StoreError> {
        let n = self.conn.execute(
            "UPDATE checkpoints SET public = ?5 WHERE run_id = ?1 AND kind = ?2 AND name = ?3 AND version = ?4",
            params![run_id, kind, name, version, public],
        )?;
        Ok(n > 0)
    }

    /// Sets or clears a checkpoint's expiry.
    /// Applies to `version` only; returns whether it still was current.
    pub fn set_expiry(
        &self,
        run_id: &str,
        kind: &str,
        name: &str,
        version: &str,
        expires_at: Option<i64>,
    ) -> Result<bool, StoreError> {
        let n = self.conn.execute(
            "UPDATE checkpoints SET expires_at = ?5 WHERE run_id = ?1 AND kind = ?2 AND name = ?3 AND version = ?4",
            params![run_id, kind, name, version, expires_at],
        )?;
        Ok(n > 0)
    }
}

fn insert_checkpoint_row(
    conn: &Connection,
    meta: &CheckpointMeta,
    version: &str,
    size: u64,
) -> Result<(), StoreError> {
    conn.execute(
        &format!("INSERT OR REPLACE INTO checkpoints ({CKPT_COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, 0, ?9, ?10, ?11, ?12, ?13)"),
        params![
            meta.run_id,
            meta.kind,
            meta.name,
            meta.owner,
            meta.base_model,
            meta.created_at,
            meta.expires_at,
            i64::try_from(size).unwrap_or(i64::MAX),
            meta.rank as i64,
            meta.train_attn,
            meta.train_mlp,
            meta.train_unembed,
            version,
        ],
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(run: &str, name: &str, created_at: i64) -> CheckpointMeta {
        CheckpointMeta {
            created_at,
            ..CheckpointMeta::for_test(run, "training", name, "alice")
        }
    }

    /// A key's runs without checkpoints are kept up to [`RECORDED_RUNS`], the newest;
    /// a run with a checkpoint and another key's runs are kept whatever their age.
    #[test]
    fn a_keys_runs_without_checkpoints_are_bounded() {
        let mut db = Db::in_memory().unwrap();
        let run = |id: &str, owner: &str, at: i64| RunRow {
            id: id.into(),
            owner: owner.into(),
            session_id: "s".into(),
            base_model: "m".into(),
            rank: 8,
            train_attn: true,
            train_mlp: true,
            train_unembed: false,
            created_at: at,
            last_request_at: at,
            user_metadata: BTreeMap::new(),
        };
        db.insert_run(&run("kept", "alice", 0)).unwrap();
        db.switch_checkpoint(&meta("kept", "a", 1), "v-1", 100)
            .unwrap();
        db.insert_run(&run("bob's", "bob", 0)).unwrap();
        for i in 1..=RECORDED_RUNS + 5 {
            db.insert_run(&run(&format!("r{i}"), "alice", i as i64))
                .unwrap();
        }
        assert_eq!(db.runs_of("alice", 0, 10).unwrap().1, RECORDED_RUNS + 1);
        assert!(db.run("kept").unwrap().is_some());
        assert!(db.run("bob's").unwrap().is_some());
        for gone in 1..=5 {
            assert!(db.run(&format!("r{gone}")).unwrap().is_none(), "r{gone}");
        }
        assert!(db.run("r6").unwrap().is_some());
    }

    #[test]
    fn runs_and_checkpoints_round_trip() {
        let mut db = Db::in_memory().unwrap();
        let run = RunRow {
            id: "s:train:0".into(),
            owner: "alice".into(),
            session_id: "s".into(),
            base_model: "m".into(),
            rank: 8,
            train_attn: true,
            train_mlp: false,
            train_unembed: true,
            created_at: 10,
            last_request_at: 10,
            user_metadata: [("k".to_string(), "v".to_string())].into(),
        };
        db.insert_run(&run).unwrap();
        assert_eq!(db.run("s:train:0").unwrap().unwrap(), run);
        assert_eq!(db.runs_of("bob", 0, 10).unwrap().1, 0);
        assert_eq!(
            db.switch_checkpoint(&meta("s:train:0", "a", 11), "v-1", 100)
                .unwrap(),
            None
        );
        db.switch_checkpoint(&meta("s:train:0", "b", 12), "v-2", 200)
            .unwrap();
        let (page, total) = db.checkpoints_of_owner("alice", 0, 1).unwrap();
        assert_eq!((page[0].meta.name.as_str(), total), ("b", 2));
        assert!(db
            .set_public("s:train:0", "training", "a", "v-1", true)
            .unwrap());
        assert!(
            db.checkpoint("s:train:0", "training", "a")
                .unwrap()
                .unwrap()
                .public
        );
        // A new version replaces the old one and is private again.
        assert_eq!(
            db.switch_checkpoint(&meta("s:train:0", "a", 13), "v-3", 100)
                .unwrap()
                .as_deref(),
            Some("v-1")
        );
        let a = db
            .checkpoint("s:train:0", "training", "a")
            .unwrap()
            .unwrap();
        assert_eq!((a.version.as_str(), a.public), ("v-3", false));
        assert!(!db
            .set_expiry("s:train:0", "training", "b", "v-0", Some(5))
            .unwrap());
        assert!(db
            .set_expiry("s:train:0", "training", "b", "v-2", Some(5))
            .unwrap());
        // Deleting a version that was replaced meanwhile deletes nothing.
        assert!(!db
            .delete_checkpoint("s:train:0", "training", "a", "v-1")
            .unwrap());
        assert!(db
            .delete_checkpoint("s:train:0", "training", "b", "v-2")
            .unwrap());
        assert_eq!(db.checkpoints_of_run("s:train:0").unwrap().len(), 1);
        assert_eq!(db.all_checkpoints().unwrap().len(), 1);
    }

    #[test]
    fn an_index_from_before_versions_is_migrated_in_place() {
        let path = std::env::temp_dir().join(format!("lathe-db-{}.db", uuid::Uuid::new_v4()));
        {
            let conn = Connection::open(&path).unwrap();
            let old_schema = SCHEMA.replace("    version TEXT NOT NULL DEFAULT '',\n", "");
            assert!(!old_schema.contains("version"));
            conn.execute_batch(&old_schema).unwrap();
            conn.execute(
                "INSERT INTO checkpoints (run_id, kind, name, owner, base_model, created_at, \
                 size_bytes, rank, train_attn, train_mlp, train_unembed) \
                 VALUES ('r', 'training', 'old', 'alice', 'm', 1, 10, 8, 1, 1, 0)",
                [],
            )
            .unwrap();
        }
        let db = Db::open(&path).unwrap();
        let row = db.checkpoint("r", "training", "old").unwrap().unwrap();
        assert_eq!(row.version, "");
        drop(db);
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn runs_of_checkpoints_found_on_disk_are_recorded() {
        let db = Db::in_memory().unwrap();
        db.ensure_run_of(&meta("other", "x", 3)).unwrap();
        assert_eq!(db.run("other").unwrap().unwrap().owner, "alice");
    }
}
