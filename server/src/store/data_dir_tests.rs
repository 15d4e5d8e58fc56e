//! The store's crash guarantees, by deterministic fault injection: a simulated `kill -9`
//! (a panic that skips every later step) at each fault point of an overwrite, a delete and
//! a new save, then a restart. Whatever was acknowledged survives exactly; what was in
//! progress is either wholly old or wholly new; nothing deleted comes back; no garbage
//! stays behind.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::*;

fn meta(name: &str) -> CheckpointMeta {
    CheckpointMeta::for_test("s:train:0", "training", name, "alice")
}

fn uri(name: &str) -> CheckpointUri {
    meta(name).uri().unwrap()
}

/// Writes and commits a checkpoint whose payload is `content`, as the worker does.
fn save(store: &Store, name: &str, content: &str) -> Result<(), StoreError> {
    let (version, size) = store.checkpoints().write_version(&meta(name), |dir| {
        fs::write(dir.join("payload"), content).map_err(|e| StoreError::Io {
            path: dir.display().to_string(),
            source: e,
        })
    })?;
    store.commit_save(&meta(name), &version, size, true)?;
    Ok(())
}

fn delete(store: &Store, name: &str) -> Result<bool, StoreError> {
    let version = store
        .all_checkpoints()?
        .into_iter()
        .find(|r| r.meta.name == name)
        .map(|r| r.version)
        .unwrap_or_default();
    store.delete(&uri(name), &version)
}

/// The payload a name resolves to through the index, if any; panics on a half copy.
fn read(store: &Store, name: &str) -> Option<String> {
    let row = store
        .all_checkpoints()
        .unwrap()
        .into_iter()
        .find(|r| r.meta.name == name)?;
    let dir = store.version_dir(&uri(name), &row.version);
    assert!(
        dir.join(super::super::checkpoints::COMPLETE_MARKER)
            .is_file(),
        "{name}: the index names an incomplete copy"
    );
    Some(fs::read_to_string(dir.join("payload")).expect("a complete copy has its payload"))
}

fn temp() -> PathBuf {
    std::env::temp_dir().join(format!("lathe-store-{}", uuid::Uuid::new_v4()))
}

/// Runs the workload with a crash at the `crash_at`-th fault point (never, if past the
/// last); returns what was acknowledged and how many points were passed.
fn crash_during_workload(root: &Path, crash_at: usize) -> (Vec<&'static str>, usize) {
    let hits = Arc::new(AtomicUsize::new(0));
    let counter = hits.clone();
    let faults = Faults::new(move |point| {
        if counter.fetch_add(1, Ordering::SeqCst) + 1 == crash_at {
            panic!("injected crash at {point}");
        }
    });
    let (store, _) = Store::open(root, faults).unwrap();
    let mut acked = Vec::new();
    let _ = catch_unwind(AssertUnwindSafe(|| {
        save(&store, "a", "a2").unwrap();
        acked.push("overwrite a");
        assert!(delete(&store, "b").unwrap());
        acked.push("delete b");
        save(&store, "c", "c1").unwrap();
        acked.push("save c");
    }));
    (acked, hits.load(Ordering::SeqCst))
}

#[test]
fn a_crash_at_any_step_loses_nothing_saved_and_resurrects_nothing_deleted() {
    let mut crash_at = 1;
    loop {
        let root = temp();
        {
            let (store, _) = Store::open(&root, Faults::default()).unwrap();
            save(&store, "a", "a1").unwrap();
            save(&store, "b", "b1").unwrap();
        }
        let (acked, passed) = crash_during_workload(&root, crash_at);
        let (store, _) = Store::open(&root, Faults::default()).unwrap();
        let a = read(&store, "a");
        let b = read(&store, "b");
        let c = read(&store, "c");
        let at = format!("crash at point {crash_at} (acknowledged: {acked:?})");
        if acked.contains(&"overwrite a") {
            assert_eq!(a.as_deref(), Some("a2"), "{at}");
        } else {
            assert!(matches!(a.as_deref(), Some("a1" | "a2")), "a lost: {at}");
        }
        if acked.contains(&"delete b") {
            assert_eq!(b, None, "b resurrected: {at}");
        } else if acked.contains(&"overwrite a") {
            // The delete was in progress: b is whole or gone, never half.
            assert!(matches!(b.as_deref(), None | Some("b1")), "{at}");
        } else {
            assert_eq!(b.as_deref(), Some("b1"), "{at}");
        }
        if acked.contains(&"save c") {
            assert_eq!(c.as_deref(), Some("c1"), "{at}");
        } else {
            assert!(matches!(c.as_deref(), None | Some("c1")), "{at}");
        }
        // Nothing unreferenced stays, and a second start has nothing left to do.
        let scan = store.checkpoints().scan().unwrap();
        assert!(scan.incomplete.is_empty(), "{at}");
        assert_eq!(
            scan.complete.len(),
            store.all_checkpoints().unwrap().len(),
            "{at}"
        );
        drop(store);
        let (_, again) = Store::open(&root, Faults::default()).unwrap();
        assert_eq!(again, OpenReport::default(), "{at}");
        fs::remove_dir_all(&root).unwrap();
        if crash_at > passed {
            // This run passed every point without crashing: all were covered.
            assert_eq!(acked.len(), 3);
            assert!(passed >= 12, "only {passed} fault points");
            break;
        }
        crash_at += 1;
    }
}

#[test]
fn a_second_server_on_the_same_dir_is_refused_and_changes_nothing() {
    let root = temp();
    let (first, _) = Store::open(&root, Faults::default()).unwrap();
    save(&first, "a", "a1").unwrap();
    // A save in progress: its version is written, not yet committed.
    let (pending, _) = first
        .checkpoints()
        .write_version(&meta("p"), |_| Ok(()))
        .unwrap();
    let err = Store::open(&root, Faults::default()).unwrap_err();
    assert!(matches!(err, StoreError::Locked(_)), "{err}");
    assert!(err.to_string().contains("another lathe server"));
    assert!(first.version_dir(&uri("p"), &pending).exists());
    assert_eq!(read(&first, "a").as_deref(), Some("a1"));
    drop(first);
    let (_, report) = Store::open(&root, Faults::default()).unwrap();
    assert_eq!(
        report.collected, 1,
        "the uncommitted version is garbage once its server is gone"
    );
    fs::remove_dir_all(&root).unwrap();
}

#[test]
fn a_lost_index_is_rebuilt_from_the_newest_complete_versions() {
    let root = temp();
    {
        let (store, _) = Store::open(&root, Faults::default()).unwrap();
        save(&store, "a", "a1").unwrap();
        save(&store, "b", "b1").unwrap();
    }
    fs::remove_file(root.join(INDEX_FILE)).unwrap();
    let _ = fs::remove_file(root.join(format!("{INDEX_FILE}-wal")));
    let _ = fs::remove_file(root.join(format!("{INDEX_FILE}-shm")));
    let (store, report) = Store::open(&root, Faults::default()).unwrap();
    assert_eq!(report.adopted, 2);
    assert_eq!(read(&store, "a").as_deref(), Some("a1"));
    assert!(store.run("s:train:0").unwrap().is_some());
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&root), 0o700);
        assert_eq!(mode(&root.join(INDEX_FILE)), 0o600);
        assert_eq!(mode(&root.join(LOCK_FILE)), 0o600);
    }
    drop(store);
    fs::remove_dir_all(&root).unwrap();
}

/// The index decides an expiry delete: where it records no expiry or a later one (two
/// TTL changes reached the engine's catalog in the other order than written), the
/// checkpoint stays and its recorded expiry comes back; a replaced version is left.
#[test]
fn an_expiry_delete_follows_the_index_not_the_catalog() {
    let root = temp();
    let (store, _) = Store::open(&root, Faults::default()).unwrap();
    save(&store, "a", "a1").unwrap();
    let version = store.all_checkpoints().unwrap()[0].version.clone();
    let u = uri("a");
    assert!(store.set_expiry(&u, &version, None).unwrap());
    assert_eq!(
        store.delete_expired(&u, &version, 200).unwrap(),
        ExpiredDelete::Kept(None)
    );
    assert!(store.set_expiry(&u, &version, Some(300)).unwrap());
    assert_eq!(
        store.delete_expired(&u, &version, 200).unwrap(),
        ExpiredDelete::Kept(Some(300))
    );
    assert_eq!(read(&store, "a").as_deref(), Some("a1"));
    assert_eq!(
        store.delete_expired(&u, "v-other", 400).unwrap(),
        ExpiredDelete::Replaced
    );
    assert_eq!(
        store.delete_expired(&u, &version, 300).unwrap(),
        ExpiredDelete::Deleted
    );
    assert_eq!(read(&store, "a"), None);
    drop(store);
    let _ = fs::remove_dir_all(root);
}
