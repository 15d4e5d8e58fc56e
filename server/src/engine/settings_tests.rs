//! A checkpoint's setting changes run one at a time through the actor: two racing
//! changes cannot leave the catalog (which decides access) and the index (which every
//! restart reads) saying different things.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::test_engine::engine_with;
use super::{channel, run};
use crate::store::checkpoints::{CheckpointMeta, Faults};
use crate::store::{Store, StoreError};

/// A publish whose index write lands first but whose finish reaches the actor last,
/// around an unpublish that does all of its steps in between: access must end as the
/// index records it (private: the unpublish was written last).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unpublish_racing_a_publish_leaves_access_as_the_index_records_it() {
    let root = std::env::temp_dir().join(format!("lathe-settings-{}", uuid::Uuid::new_v4()));
    let hold = Arc::new(AtomicBool::new(false));
    let held = hold.clone();
    // Told when the publish's index write is done; the publish is then held there.
    let (written_tx, written) = tokio::sync::oneshot::channel::<()>();
    let written_tx = Mutex::new(Some(written_tx));
    let faults = Faults::new(move |point| {
        if point == "set_public:published" && held.swap(false, Ordering::SeqCst) {
            if let Some(tx) = written_tx.lock().unwrap().take() {
                let _ = tx.send(());
            }
            std::thread::sleep(Duration::from_millis(400));
        }
    });
    let (store, _) = Store::open(&root, faults).unwrap();
    let meta = CheckpointMeta {
        base_model: "tiny".into(),
        ..CheckpointMeta::for_test("alice-run", "sampler", "shared", "alice")
    };
    let (version, size) = store
        .checkpoints()
        .write_version(&meta, |dir| {
            std::fs::write(dir.join("payload"), "x").map_err(|e| StoreError::Io {
                path: dir.display().to_string(),
                source: e,
            })
        })
        .unwrap();
    store.commit_save(&meta, &version, size, true).unwrap();
    let uri = meta.uri().unwrap();
    let (engine, _sent) = engine_with(store.all_checkpoints().unwrap());
    let (handle, rx) = channel(store.clone());
    tokio::spawn(run(engine, rx, handle.clone()));

    hold.store(true, Ordering::SeqCst);
    let publish = {
        let (handle, uri) = (handle.clone(), uri.clone());
        tokio::spawn(async move { handle.set_public("alice".into(), uri, true).await })
    };
    // The publish is written and held before it finishes; the unpublish starts now.
    written.await.unwrap();
    handle
        .set_public("alice".into(), uri.clone(), false)
        .await
        .unwrap();
    publish.await.unwrap().unwrap();

    let indexed = store.all_checkpoints().unwrap()[0].public;
    assert!(!indexed, "the unpublish was written last");
    let open = matches!(handle.weights_info("bob".into(), uri).await, Ok(Ok(_)));
    assert_eq!(open, indexed, "access and the index disagree");
    let _ = std::fs::remove_dir_all(root);
}
