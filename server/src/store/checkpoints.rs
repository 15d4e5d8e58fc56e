//! Checkpoint files under the data dir: every save is a new, complete, immutable version.
//!
//! Layout: `<root>/<run_id>/<weights|sampler_weights>/<name>/<version>/` holding the PEFT
//! files, `optimizer.safetensors` (training state only), `lathe-checkpoint.json` (what the
//! index needs, so it can be rebuilt from disk) and the empty `checkpoint_complete` marker
//! the Tinker CLI expects, written last after every other file is fsynced. Checkpoints
//! saved before versions existed keep their files directly in `<name>/`: that is the
//! version [`LEGACY_VERSION`] (the empty string).
//!
//! Which version of a name is current is the index's business (`data_dir.rs`): a save
//! writes a fresh version beside the current one, then one transaction switches the index
//! row to it, then the replaced version is discarded. Discarding renames a version into
//! `<root>/.trash/` before removing it, so a half-removed checkpoint never sits at a
//! checkpoint path. Directories are created 0700 and files 0600: adapters are the
//! tenants' property.
//!
//! [`Faults`] names every step of these sequences, so a test can stop the process between
//! any two of them and prove that a restart loses and resurrects nothing.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use lathe_sdk::types::{CheckpointKind, CheckpointUri};
use serde::{Deserialize, Serialize};

use super::StoreError;

/// Marker file present in every complete checkpoint.
pub const COMPLETE_MARKER: &str = "checkpoint_complete";
/// Metadata file of a checkpoint.
pub const METADATA_FILE: &str = "lathe-checkpoint.json";
/// The version of a checkpoint written before versions existed: files directly in the
/// name's directory.
pub const LEGACY_VERSION: &str = "";
/// Prefix of every version directory.
const VERSION_PREFIX: &str = "v-";
/// Prefix of the temporary directories of the pre-version layout's writes.
const LEGACY_TMP_PREFIX: &str = ".tmp-";
/// Where discarded versions go before they are removed.
const TRASH: &str = ".trash";

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

    /// The checkpoint's URI, when its kind is valid.
    pub fn uri(&self) -> Option<CheckpointUri> {
        Some(CheckpointUri {
            run_id: self.run_id.clone(),
            kind: self.kind()?,
            name: self.name.clone(),
        })
    }
}

#[cfg(test)]
impl CheckpointMeta {
    /// A rank-4 attention + MLP checkpoint of `owner` on base model `m`, for tests.
    pub(crate) fn for_test(run_id: &str, kind: &str, name: &str, owner: &str) -> Self {
        Self {
            run_id: run_id.into(),
            kind: kind.into(),
            name: name.into(),
            owner: owner.into(),
            base_model: "m".into(),
            created_at: 1,
            expires_at: None,
            rank: 4,
            train_attn: true,
            train_mlp: true,
            train_unembed: false,
        }
    }
}

/// Named points in the store's write sequences. Production code runs with none set; a
/// test sets a hook that panics at one of them, which is what a `kill -9` there leaves.
#[derive(Clone, Default)]
pub struct Faults(Option<Arc<dyn Fn(&'static str) + Send + Sync>>);

impl Faults {
    /// Calls `hook` at every fault point with its name.
    pub fn new(hook: impl Fn(&'static str) + Send + Sync + 'static) -> Self {
        Self(Some(Arc::new(hook)))
    }

    /// Reached fault point `point`.
    pub fn hit(&self, point: &'static str) {
        if let Some(hook) = &self.0 {
            hook(point)
        }
    }
}

impl std::fmt::Debug for Faults {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Faults(set)"
        } else {
            "Faults(none)"
        })
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> StoreError + '_ {
    move |source| StoreError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Creates `dir` and its missing parents, owner-only.
pub(crate) fn create_private_dirs(dir: &Path) -> Result<(), StoreError> {
    let mut builder = fs::DirBuilder::new();
    builder.recursive(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::DirBuilderExt;
        builder.mode(0o700);
    }
    builder.create(dir).map_err(io(dir))
}

/// Makes an existing file or directory owner-only.
pub(crate) fn make_private(path: &Path, is_dir: bool) -> Result<(), StoreError> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = if is_dir { 0o700 } else { 0o600 };
        fs::set_permissions(path, fs::Permissions::from_mode(mode)).map_err(io(path))?;
    }
    #[cfg(not(unix))]
    let _ = (path, is_dir);
    Ok(())
}

/// A complete checkpoint version found on disk.
#[derive(Debug, Clone, PartialEq)]
pub struct Found {
    /// What it records about itself.
    pub meta: CheckpointMeta,
    /// Its version ([`LEGACY_VERSION`] for the pre-version layout).
    pub version: String,
    /// Bytes on disk.
    pub size: u64,
}

/// Everything a scan of the checkpoint tree finds.
#[derive(Debug, Default)]
pub struct Scan {
    /// Complete versions.
    pub complete: Vec<Found>,
    /// Version directories without their completion marker (writes a crash interrupted).
    pub incomplete: Vec<(CheckpointUri, String)>,
}

/// Where checkpoints live.
#[derive(Debug, Clone)]
pub struct CheckpointDir {
    root: PathBuf,
    faults: Faults,
}

impl CheckpointDir {
    /// Uses (and creates, owner-only) `root`.
    pub fn new(root: PathBuf, faults: Faults) -> Result<Self, StoreError> {
        create_private_dirs(&root)?;
        make_private(&root, true)?;
        Ok(Self { root, faults })
    }

    /// The directory of a checkpoint name, which holds its versions.
    pub fn name_dir(&self, uri: &CheckpointUri) -> PathBuf {
        self.root
            .join(&uri.run_id)
            .join(uri.kind.segment())
            .join(&uri.name)
    }

    /// The directory of one version of a checkpoint (which may not exist).
    pub fn path(&self, uri: &CheckpointUri, version: &str) -> PathBuf {
        let dir = self.name_dir(uri);
        if version == LEGACY_VERSION {
            dir
        } else {
            dir.join(version)
        }
    }

    /// Writes a new version of a checkpoint: `fill` writes the payload into a fresh
    /// version directory, then metadata is added, every file is made owner-only and
    /// fsynced, and the completion marker is written and synced last. Nothing refers to
    /// the version until the index is switched to it. Returns the version and the bytes
    /// written; on failure the partial version is removed.
    pub fn write_version(
        &self,
        meta: &CheckpointMeta,
        fill: impl FnOnce(&Path) -> Result<(), StoreError>,
    ) -> Result<(String, u64), StoreError> {
        let uri = meta
            .uri()
            .ok_or_else(|| StoreError::Invalid(format!("unknown kind {}", meta.kind)))?;
        let name_dir = self.name_dir(&uri);
        let new_name = !name_dir.exists();
        create_private_dirs(&name_dir)?;
        if new_name {
            // The directories a first save creates must survive a power cut too.
            let kind_dir = name_dir.parent().expect("a name has a kind directory");
            let run_dir = kind_dir.parent().expect("a kind has a run directory");
            for dir in [kind_dir, run_dir, &self.root] {
                sync_dir(dir)?;
            }
        }
        let version = format!("{VERSION_PREFIX}{}", uuid::Uuid::new_v4().simple());
        let dir = name_dir.join(&version);
        create_private_dirs(&dir)?;
        self.faults.hit("write:created");
        let result = (|| {
            fill(&dir)?;
            let text = serde_json::to_vec_pretty(meta).expect("metadata serialises");
            write_file(&dir.join(METADATA_FILE), &text)?;
            self.faults.hit("write:payload");
            let mut size = 0;
            for entry in fs::read_dir(&dir).map_err(io(&dir))? {
                let path = entry.map_err(io(&dir))?.path();
                make_private(&path, false)?;
                size += fs::metadata(&path).map_err(io(&path))?.len();
                fs::File::open(&path)
                    .and_then(|f| f.sync_all())
                    .map_err(io(&path))?;
            }
            sync_dir(&dir)?;
            self.faults.hit("write:synced");
            let marker = dir.join(COMPLETE_MARKER);
            write_file(&marker, b"")?;
            fs::File::open(&marker)
                .and_then(|f| f.sync_all())
                .map_err(io(&marker))?;
            sync_dir(&dir)?;
            sync_dir(&name_dir)?;
            self.faults.hit("write:complete");
            Ok(size)
        })();
        match result {
            Ok(size) => Ok((version, size)),
            Err(e) => {
                let _ = fs::remove_dir_all(&dir);
                Err(e)
            }
        }
    }

    /// Removes one version of a checkpoint: a version directory is first renamed into the
    /// trash (so no checkpoint path ever shows a half-removed one), a legacy version loses
    /// its completion marker first. Missing is fine.
    pub fn discard(&self, uri: &CheckpointUri, version: &str) -> Result<(), StoreError> {
        match self.trash(uri, version)? {
            Some(trashed) => trashed.remove(),
            None => Ok(()),
        }
    }

    /// The first half of [`CheckpointDir::discard`]: the version leaves its checkpoint
    /// path (renamed into the trash, durably). What is left to do, removing its files,
    /// can run without the index's lock; a crash leaves it to the next start's
    /// [`CheckpointDir::empty_trash`]. `None`: nothing left to remove (a legacy version
    /// is removed here; a missing one is fine).
    pub fn trash(&self, uri: &CheckpointUri, version: &str) -> Result<Option<Trashed>, StoreError> {
        let path = self.path(uri, version);
        if version == LEGACY_VERSION {
            return discard_legacy(&path).map(|()| None);
        }
        let trash = self.root.join(TRASH);
        create_private_dirs(&trash)?;
        let target = trash.join(uuid::Uuid::new_v4().simple().to_string());
        match fs::rename(&path, &target) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io(&path)(e)),
        }
        let name_dir = path.parent().expect("a version has a parent").to_path_buf();
        sync_dir(&name_dir)?;
        self.faults.hit("discard:trashed");
        Ok(Some(Trashed { target, name_dir }))
    }

    /// Removes whatever discards a crash interrupted.
    pub fn empty_trash(&self) -> Result<(), StoreError> {
        let trash = self.root.join(TRASH);
        match fs::remove_dir_all(&trash) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io(&trash)(e)),
        }
    }

    /// Every checkpoint version on disk. First recovers the pre-version layout's
    /// interrupted overwrites: a complete `.tmp-*` directory whose name has no directory
    /// is the old copy an earlier build moved aside and never put back, so it is renamed
    /// to its name again; any other `.tmp-*` directory goes to the trash.
    pub fn scan(&self) -> Result<Scan, StoreError> {
        let mut scan = Scan::default();
        for run in read_dirs(&self.root)? {
            if hidden(&run) {
                continue;
            }
            for kind_dir in read_dirs(&run)? {
                let kind = match file_name(&kind_dir) {
                    "weights" => CheckpointKind::Training,
                    "sampler_weights" => CheckpointKind::Sampler,
                    _ => continue,
                };
                self.recover_legacy_temporaries(&kind_dir)?;
                for name_dir in read_dirs(&kind_dir)? {
                    if hidden(&name_dir) {
                        continue;
                    }
                    let uri = CheckpointUri {
                        run_id: file_name(&run).to_string(),
                        kind,
                        name: file_name(&name_dir).to_string(),
                    };
                    if let Some(found) = read_complete(&name_dir, LEGACY_VERSION) {
                        scan.complete.push(found);
                    }
                    for version_dir in read_dirs(&name_dir)? {
                        let version = file_name(&version_dir);
                        if !version.starts_with(VERSION_PREFIX) {
                            continue;
                        }
                        match read_complete(&version_dir, version) {
                            Some(found) if found.meta.uri().as_ref() == Some(&uri) => {
                                scan.complete.push(found)
                            }
                            _ => scan.incomplete.push((uri.clone(), version.to_string())),
                        }
                    }
                }
            }
        }
        Ok(scan)
    }

    fn recover_legacy_temporaries(&self, kind_dir: &Path) -> Result<(), StoreError> {
        for tmp in read_dirs(kind_dir)? {
            if !file_name(&tmp).starts_with(LEGACY_TMP_PREFIX) {
                continue;
            }
            let home = read_complete(&tmp, LEGACY_VERSION)
                .map(|found| kind_dir.join(&found.meta.name))
                .filter(|home| !home.exists());
            match home {
                Some(home) => {
                    tracing::warn!(from = %tmp.display(), to = %home.display(), "restoring a checkpoint an interrupted overwrite left aside");
                    fs::rename(&tmp, &home).map_err(io(&tmp))?;
                }
                None => {
                    let trash = self.root.join(TRASH);
                    create_private_dirs(&trash)?;
                    let target = trash.join(uuid::Uuid::new_v4().simple().to_string());
                    fs::rename(&tmp, &target).map_err(io(&tmp))?;
                }
            }
        }
        Ok(())
    }
}

/// A version renamed into the trash, its files still to remove.
#[must_use = "the trashed files stay until removed (or until the next start)"]
pub struct Trashed {
    target: PathBuf,
    name_dir: PathBuf,
}

impl Trashed {
    /// Removes the trashed files, and the checkpoint's name directory once its last
    /// version has gone.
    pub fn remove(self) -> Result<(), StoreError> {
        fs::remove_dir_all(&self.target).map_err(io(&self.target))?;
        let _ = fs::remove_dir(&self.name_dir);
        Ok(())
    }
}

/// Removes a pre-version checkpoint's files (not its name directory's version
/// subdirectories): the marker first, so a crash midway leaves an incomplete leftover,
/// never a complete-looking half.
fn discard_legacy(dir: &Path) -> Result<(), StoreError> {
    match fs::remove_file(dir.join(COMPLETE_MARKER)) {
        Ok(()) => sync_dir(dir)?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(dir)(e)),
    }
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io(dir)(e)),
    };
    for entry in entries {
        let path = entry.map_err(io(dir))?.path();
        if path.is_file() {
            fs::remove_file(&path).map_err(io(&path))?;
        }
    }
    Ok(())
}

fn hidden(path: &Path) -> bool {
    file_name(path).starts_with('.')
}

fn file_name(path: &Path) -> &str {
    path.file_name().and_then(|n| n.to_str()).unwrap_or("")
}

/// The checkpoint in `dir` when it is complete and its metadata readable.
fn read_complete(dir: &Path, version: &str) -> Option<Found> {
    if !dir.join(COMPLETE_MARKER).is_file() {
        return None;
    }
    let meta_path = dir.join(METADATA_FILE);
    let text = fs::read(&meta_path).ok()?;
    match serde_json::from_slice::<CheckpointMeta>(&text) {
        Ok(meta) => Some(Found {
            meta,
            version: version.to_string(),
            size: dir_size(dir),
        }),
        Err(e) => {
            tracing::warn!(path = %meta_path.display(), "unreadable checkpoint metadata: {e}");
            None
        }
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
                .filter(|m| m.is_file())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<(), StoreError> {
    let mut opts = fs::OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    let mut f = opts.open(path).map_err(io(path))?;
    f.write_all(bytes).map_err(io(path))
}

fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(io(dir))
}

/// The files of a checkpoint version that its archive holds, in archive order.
fn archive_entries(dir: &Path) -> Result<Vec<PathBuf>, StoreError> {
    let mut entries: Vec<PathBuf> = fs::read_dir(dir)
        .map_err(io(dir))?
        .filter_map(|e| Some(e.ok()?.path()))
        .filter(|p| p.is_file())
        .collect();
    entries.sort();
    Ok(entries)
}

/// The length in bytes of the tar [`archive_into`] writes for `dir` as it is now: a
/// 512-byte header per file and its data in whole 512-byte blocks, then two zero
/// blocks. `None` where a name needs more than the header's 100 bytes (the archive
/// then carries extra header blocks, and the length is not given).
pub fn archive_len(dir: &Path) -> Result<Option<u64>, StoreError> {
    let mut len = 1024u64;
    for path in archive_entries(dir)? {
        let name = path.file_name().map_or(0, |n| n.len());
        if name >= 100 {
            return Ok(None);
        }
        let size = fs::metadata(&path).map_err(io(&path))?.len();
        len = len
            .saturating_add(512)
            .saturating_add(size.div_ceil(512) * 512);
    }
    Ok(Some(len))
}

/// Writes a tar archive of a checkpoint version's files (at the archive root, in name
/// order) into `out`, for download: file by file, so that memory does not grow with the
/// checkpoint's size.
pub fn archive_into(dir: &Path, out: impl Write) -> Result<(), StoreError> {
    let mut builder = tar::Builder::new(out);
    for path in archive_entries(dir)? {
        let name = path.file_name().expect("file has a name");
        builder
            .append_path_with_name(&path, name)
            .map_err(io(&path))?;
    }
    builder
        .into_inner()
        .map_err(io(dir))?
        .flush()
        .map_err(io(dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(name: &str) -> CheckpointMeta {
        CheckpointMeta::for_test("s:train:0", "training", name, "o")
    }

    fn temp() -> PathBuf {
        std::env::temp_dir().join(format!("lathe-ckpt-{}", uuid::Uuid::new_v4()))
    }

    #[test]
    fn versions_are_complete_private_and_scannable() {
        let tmp = temp();
        let dir = CheckpointDir::new(tmp.clone(), Faults::default()).unwrap();
        let (v1, size) = dir
            .write_version(&meta("a"), |p| write_file(&p.join("x.bin"), b"hello"))
            .unwrap();
        assert!(size >= 5);
        // A failing fill leaves no version behind.
        let err = dir.write_version(&meta("b"), |_| Err(StoreError::Invalid("boom".into())));
        assert!(err.is_err());
        let b = meta("b").uri().unwrap();
        assert_eq!(fs::read_dir(dir.name_dir(&b)).unwrap().count(), 0);
        // A second version sits beside the first; both are found.
        let (v2, _) = dir
            .write_version(&meta("a"), |p| write_file(&p.join("y.bin"), b"new"))
            .unwrap();
        assert_ne!(v1, v2);
        let a = meta("a").uri().unwrap();
        let found = dir.scan().unwrap();
        assert_eq!(found.complete.len(), 2);
        assert!(found.incomplete.is_empty());
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode(&tmp), 0o700);
            assert_eq!(mode(&dir.path(&a, &v1)), 0o700);
            assert_eq!(mode(&dir.path(&a, &v1).join("x.bin")), 0o600);
            assert_eq!(mode(&dir.path(&a, &v1).join(METADATA_FILE)), 0o600);
        }
        dir.discard(&a, &v1).unwrap();
        assert!(!dir.path(&a, &v1).exists());
        dir.discard(&a, &v1).unwrap();
        let mut tar = Vec::new();
        archive_into(&dir.path(&a, &v2), &mut tar).unwrap();
        assert_eq!(
            archive_len(&dir.path(&a, &v2)).unwrap(),
            Some(tar.len() as u64)
        );
        let mut names: Vec<String> = tar::Archive::new(tar.as_slice())
            .entries()
            .unwrap()
            .map(|e| e.unwrap().path().unwrap().display().to_string())
            .collect();
        names.sort();
        assert_eq!(names, [COMPLETE_MARKER, METADATA_FILE, "y.bin"]);
        fs::remove_dir_all(tmp).unwrap();
    }

    #[test]
    fn the_pre_version_layout_is_read_and_its_lost_overwrites_recovered() {
        let tmp = temp();
        let dir = CheckpointDir::new(tmp.clone(), Faults::default()).unwrap();
        let a = meta("a").uri().unwrap();
        // A legacy checkpoint: files directly in the name's directory.
        let legacy = dir.name_dir(&a);
        fs::create_dir_all(&legacy).unwrap();
        write_file(
            &legacy.join(METADATA_FILE),
            &serde_json::to_vec(&meta("a")).unwrap(),
        )
        .unwrap();
        write_file(&legacy.join(COMPLETE_MARKER), b"").unwrap();
        // The old overwrite's crash: "b" moved aside, never put back.
        let kind_dir = legacy.parent().unwrap();
        let aside = kind_dir.join(".tmp-old-123");
        fs::create_dir_all(&aside).unwrap();
        write_file(
            &aside.join(METADATA_FILE),
            &serde_json::to_vec(&meta("b")).unwrap(),
        )
        .unwrap();
        write_file(&aside.join(COMPLETE_MARKER), b"").unwrap();
        // And an interrupted legacy write.
        fs::create_dir_all(kind_dir.join(".tmp-half")).unwrap();
        let scan = dir.scan().unwrap();
        let mut names: Vec<(String, String)> = scan
            .complete
            .iter()
            .map(|f| (f.meta.name.clone(), f.version.clone()))
            .collect();
        names.sort();
        assert_eq!(names, [("a".into(), "".into()), ("b".into(), "".into())]);
        assert!(!aside.exists() && !kind_dir.join(".tmp-half").exists());
        // Discarding the legacy version leaves a newer version beside it untouched.
        let (v, _) = dir.write_version(&meta("a"), |_| Ok(())).unwrap();
        dir.discard(&a, LEGACY_VERSION).unwrap();
        let scan = dir.scan().unwrap();
        assert!(scan
            .complete
            .iter()
            .any(|f| f.meta.name == "a" && f.version == v));
        assert!(!scan
            .complete
            .iter()
            .any(|f| f.meta.name == "a" && f.version.is_empty()));
        fs::remove_dir_all(tmp).unwrap();
    }
}
