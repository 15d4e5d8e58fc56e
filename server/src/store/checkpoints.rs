//! Checkpoint directories under the data dir, written atomically.
//!
//! Layout: `<root>/<run_id>/<weights|sampler_weights>/<name>/` holding the PEFT files,
//! `optimizer.safetensors` (training state only), `lathe-checkpoint.json` (what the
//! SQLite index needs, so the index can be rebuilt from disk) and the empty
//! `checkpoint_complete` marker the Tinker CLI expects. A checkpoint is first written
//! into a hidden temporary directory beside its final place, every file is fsynced, and
//! then one `rename` makes it visible: a crash leaves either nothing or a whole
//! checkpoint, never half of one. Leftover temporary directories are removed at start.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use lathe_sdk::types::CheckpointKind;
use serde::{Deserialize, Serialize};

use super::StoreError;

/// Marker file present in every complete checkpoint.
pub const COMPLETE_MARKER: &str = "checkpoint_complete";
/// Metadata file of a checkpoint.
pub const METADATA_FILE: &str = "lathe-checkpoint.json";
const TMP_PREFIX: &str = ".tmp-";

/// What a checkpoint directory records about itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointMeta {
    /// The run that saved it.
    pub run_id: String,
    /// `training` or `sampler`.
    pub kind: String,
    /// Its name.
    pub name: String,
    /// Owner id of the key that saved it.
    pub owner: String,
    /// The base model.
    pub base_model: String,
    /// Unix seconds.
    pub created_at: i64,
    /// Unix seconds after which it is deleted, if any.
    pub expires_at: Option<i64>,
    /// Adapter rank.
    pub rank: usize,
    /// Attention adapted.
    pub train_attn: bool,
    /// MLP adapted.
    pub train_mlp: bool,
    /// lm_head adapted.
    pub train_unembed: bool,
}

impl CheckpointMeta {
    /// The kind as an enum.
    pub fn kind(&self) -> Option<CheckpointKind> {
        match self.kind.as_str() {
            "training" => Some(CheckpointKind::Training),
            "sampler" => Some(CheckpointKind::Sampler),
            _ => None,
        }
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> StoreError + '_ {
    move |source| StoreError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Where checkpoints live.
#[derive(Debug, Clone)]
pub struct CheckpointDir {
    root: PathBuf,
}

impl CheckpointDir {
    /// Uses (and creates) `root`.
    pub fn new(root: PathBuf) -> Result<Self, StoreError> {
        fs::create_dir_all(&root).map_err(io(&root))?;
        Ok(Self { root })
    }

    /// The final directory of a checkpoint (which may not exist).
    pub fn path(&self, run_id: &str, kind: CheckpointKind, name: &str) -> PathBuf {
        self.root.join(run_id).join(kind.segment()).join(name)
    }

    /// Writes a checkpoint: `fill` writes the payload into a fresh temporary directory,
    /// then metadata and marker are added, everything is fsynced and the directory is
    /// renamed into place. With `overwrite`, an existing checkpoint is replaced; without,
    /// it is an error. Returns the bytes written.
    pub fn write(
        &self,
        meta: &CheckpointMeta,
        overwrite: bool,
        fill: impl FnOnce(&Path) -> Result<(), StoreError>,
    ) -> Result<u64, StoreError> {
        let kind = meta
            .kind()
            .ok_or_else(|| StoreError::Invalid(format!("unknown kind {}", meta.kind)))?;
        let dest = self.path(&meta.run_id, kind, &meta.name);
        let parent = dest.parent().expect("checkpoint path has a parent");
        fs::create_dir_all(parent).map_err(io(parent))?;
        if dest.exists() && !overwrite {
            return Err(StoreError::Exists(meta.name.clone()));
        }
        let tmp = parent.join(format!("{TMP_PREFIX}{}", uuid::Uuid::new_v4()));
        fs::create_dir(&tmp).map_err(io(&tmp))?;
        let result = (|| {
            fill(&tmp)?;
            let text = serde_json::to_vec_pretty(meta).expect("metadata serialises");
            write_file(&tmp.join(METADATA_FILE), &text)?;
            write_file(&tmp.join(COMPLETE_MARKER), b"")?;
            let mut size = 0;
            for entry in fs::read_dir(&tmp).map_err(io(&tmp))? {
                let path = entry.map_err(io(&tmp))?.path();
                size += fs::metadata(&path).map_err(io(&path))?.len();
                fs::File::open(&path)
                    .and_then(|f| f.sync_all())
                    .map_err(io(&path))?;
            }
            sync_dir(&tmp)?;
            if dest.exists() {
                // Replace: move the old one aside first, so the name always points at a
                // complete checkpoint, then delete it.
                let old = parent.join(format!("{TMP_PREFIX}old-{}", uuid::Uuid::new_v4()));
                fs::rename(&dest, &old).map_err(io(&dest))?;
                fs::rename(&tmp, &dest).map_err(io(&dest))?;
                let _ = fs::remove_dir_all(&old);
            } else {
                fs::rename(&tmp, &dest).map_err(io(&dest))?;
            }
            sync_dir(parent)?;
            Ok(size)
        })();
        if result.is_err() {
            let _ = fs::remove_dir_all(&tmp);
        }
        result
    }

    /// Deletes a checkpoint directory (missing is fine).
    pub fn remove(&self, run_id: &str, kind: CheckpointKind, name: &str) -> Result<(), StoreError> {
        let path = self.path(run_id, kind, name);
        match fs::remove_dir_all(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io(&path)(e)),
        }
    }

    /// Every complete checkpoint on disk, with its size; removes leftover temporary
    /// directories of interrupted writes.
    pub fn scan(&self) -> Result<Vec<(CheckpointMeta, u64)>, StoreError> {
        let mut out = Vec::new();
        for run in read_dirs(&self.root)? {
            for kind_dir in read_dirs(&run)? {
                for ckpt in read_dirs(&kind_dir)? {
                    let name = ckpt.file_name().and_then(|n| n.to_str()).unwrap_or("");
                    if name.starts_with(TMP_PREFIX) {
                        tracing::info!(path = %ckpt.display(), "removing an interrupted checkpoint write");
                        let _ = fs::remove_dir_all(&ckpt);
                        continue;
                    }
                    if !ckpt.join(COMPLETE_MARKER).exists() {
                        continue;
                    }
                    let meta_path = ckpt.join(METADATA_FILE);
                    let Ok(text) = fs::read(&meta_path) else {
                        continue;
                    };
                    match serde_json::from_slice::<CheckpointMeta>(&text) {
                        Ok(meta) => out.push((meta, dir_size(&ckpt))),
                        Err(e) => {
                            tracing::warn!(path = %meta_path.display(), "unreadable checkpoint metadata: {e}")
                        }
                    }
                }
            }
        }
        Ok(out)
    }
}

fn read_dirs(dir: &Path) -> Result<Vec<PathBuf>, StoreError> {
    let mut out = Vec::new();
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(io(dir)(e)),
    };
    for entry in entries {
        let path = entry.map_err(io(dir))?.path();
        if path.is_dir() {
            out.push(path);
        }
    }
    Ok(out)
}

fn dir_size(dir: &Path) -> u64 {
    fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok()?.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<(), StoreError> {
    let mut f = fs::File::create(path).map_err(io(path))?;
    f.write_all(bytes).map_err(io(path))
}

fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(io(dir))
}

/// A tar archive of a checkpoint directory (files at the archive root), for download.
pub fn archive(dir: &Path) -> Result<Vec<u8>, StoreError> {
    let mut builder = tar::Builder::new(Vec::new());
    let mut entries: Vec<PathBuf> = fs::read_dir(dir)
        .map_err(io(dir))?
        .filter_map(|e| Some(e.ok()?.path()))
        .filter(|p| p.is_file())
        .collect();
    entries.sort();
    for path in entries {
        let name = path.file_name().expect("file has a name");
        builder
            .append_path_with_name(&path, name)
            .map_err(io(&path))?;
    }
    builder.into_inner().map_err(io(dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(name: &str) -> CheckpointMeta {
        CheckpointMeta {
            run_id: "s:train:0".into(),
            kind: "training".into(),
            name: name.into(),
            owner: "o".into(),
            base_model: "m".into(),
            created_at: 1,
            expires_at: None,
            rank: 4,
            train_attn: true,
            train_mlp: true,
            train_unembed: false,
        }
    }

    #[test]
    fn writes_are_atomic_and_scannable() {
        let tmp = std::env::temp_dir().join(format!("lathe-ckpt-{}", uuid::Uuid::new_v4()));
        let dir = CheckpointDir::new(tmp.clone()).unwrap();
        let size = dir
            .write(&meta("a"), false, |p| {
                write_file(&p.join("x.bin"), b"hello")
            })
            .unwrap();
        assert!(size >= 5);
        // A failing fill leaves nothing behind.
        let err = dir.write(&meta("b"), false, |_| {
            Err(StoreError::Invalid("boom".into()))
        });
        assert!(err.is_err());
        assert!(!dir
            .path("s:train:0", CheckpointKind::Training, "b")
            .exists());
        // Same name without overwrite is refused; with overwrite it is replaced.
        assert!(matches!(
            dir.write(&meta("a"), false, |_| Ok(())),
            Err(StoreError::Exists(_))
        ));
        dir.write(&meta("a"), true, |p| write_file(&p.join("y.bin"), b"new"))
            .unwrap();
        let a = dir.path("s:train:0", CheckpointKind::Training, "a");
        assert!(a.join("y.bin").exists() && !a.join("x.bin").exists());
        // A stray temporary directory (a crash mid-write) is cleaned up by scan.
        let stray = a.parent().unwrap().join(".tmp-crashed");
        fs::create_dir_all(&stray).unwrap();
        let found = dir.scan().unwrap();
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].0, meta("a"));
        assert!(!stray.exists());
        let tar = archive(&a).unwrap();
        let mut names: Vec<String> = tar::Archive::new(tar.as_slice())
            .entries()
            .unwrap()
            .map(|e| e.unwrap().path().unwrap().display().to_string())
            .collect();
        names.sort();
        assert_eq!(names, [COMPLETE_MARKER, METADATA_FILE, "y.bin"]);
        fs::remove_dir_all(tmp).unwrap();
    }
}
