//! Access to a checkpoint is decided when the work that uses it is dispatched, not when
//! it was queued: an owner who unpublishes or deletes a checkpoint while another key's
//! load or sample waits in the queue takes the access away from that work too.

use lathe_sdk::types::{CheckpointKind, CheckpointUri};

use super::futures::Poll;
use super::test_engine::{engine_with, job};
use super::{Engine, NewRun, SamplerRef};
use crate::model::LoraSpec;
use crate::store::checkpoints::CheckpointMeta;
use crate::store::db::CheckpointRow;
use crate::worker::{Done, Outcome, RunOp};

const SPEC: LoraSpec = LoraSpec {
    rank: 4,
    train_attn: true,
    train_mlp: true,
    train_unembed: false,
};

fn published(kind: CheckpointKind) -> (CheckpointRow, CheckpointUri) {
    let uri = CheckpointUri {
        run_id: "alice-run".into(),
        kind,
        name: "shared".into(),
    };
    let row = CheckpointRow {
        // `for_test` is rank 4 on attention and MLP: SPEC.
        meta: CheckpointMeta {
            base_model: "tiny".into(),
            ..CheckpointMeta::for_test(&uri.run_id, kind.type_name(), &uri.name, "alice")
        },
        version: "v-1".into(),
        size_bytes: 1,
        public: true,
    };
    (row, uri)
}

fn failure_of(engine: &mut Engine, request_id: &str, owner: &str) -> Option<String> {
    match engine.futures.poll(request_id, owner, true) {
        Some(Poll::Ready(r)) => r.as_ref().as_ref().err().map(|f| f.message.clone()),
        _ => None,
    }
}

#[test]
fn a_load_queued_before_the_owner_unpublishes_is_refused_when_it_runs() {
    let (row, uri) = published(CheckpointKind::Training);
    let (mut engine, sent) = engine_with(vec![row]);
    let session = engine.create_session("bob").unwrap();
    let run = engine
        .create_model(
            "bob",
            NewRun {
                session_id: session,
                model_seq_id: 0,
                spec: SPEC,
                seed: 1,
                user_metadata: Default::default(),
            },
        )
        .unwrap();
    let run_id = run.model_id.unwrap();
    let load = engine
        .load("bob", &run_id, Some(1), &uri, false)
        .expect("alice's checkpoint is published");
    // The create runs first (one operation per run per batch).
    engine.pump();
    let create_id = sent.lock().unwrap()[0].runs[0].request_id.clone();
    engine.complete(vec![Outcome {
        request_id: create_id,
        result: Ok(Done {
            body: crate::worker::Reply::ModelCreated {
                model_id: String::new(),
            },
            saved: None,
        }),
    }]);
    // Alice unpublishes while Bob's load waits.
    let (was, version) = engine.begin_set_public("alice", &uri, false).unwrap();
    assert!(was);
    engine.pump();
    assert_eq!(sent.lock().unwrap().len(), 1, "nothing sent for the load");
    let failure = failure_of(&mut engine, &load, "bob").expect("the load failed");
    assert!(failure.contains("unknown checkpoint"), "{failure}");
    // Published again, a load reaches the worker with the current version's directory.
    engine.finish_set_public(&uri, &version, true, false, true);
    engine.load("bob", &run_id, Some(2), &uri, false).unwrap();
    engine.pump();
    let sent = sent.lock().unwrap();
    let RunOp::Load { dir, .. } = &sent[1].runs[0].op else {
        panic!("expected the load")
    };
    assert!(
        dir.ends_with("alice-run/weights/shared/v-1"),
        "{}",
        dir.display()
    );
}

#[test]
fn a_sample_queued_before_the_owner_deletes_is_refused_when_it_runs() {
    let (row, uri) = published(CheckpointKind::Sampler);
    let (mut engine, sent) = engine_with(vec![row]);
    let queued = engine
        .sample("bob", SamplerRef::Path(uri.clone()), job())
        .unwrap()
        .request_id;
    let version = engine.begin_delete("alice", &uri).unwrap();
    engine.pump();
    assert!(sent.lock().unwrap().is_empty(), "nothing sent");
    assert!(failure_of(&mut engine, &queued, "bob").is_some());
    engine.finish_delete(&uri, &version, true);
    let err = engine
        .sample("bob", SamplerRef::Path(uri), job())
        .unwrap_err();
    assert!(err.message().contains("unknown checkpoint"));
}

/// Bob's own sampler checkpoint (an interpolation's output goes under the first
/// source's run) and Alice's published one.
fn bob_and_alices() -> (Engine, CheckpointUri, CheckpointUri) {
    let (alices, alice_uri) = published(CheckpointKind::Sampler);
    let bob_uri = CheckpointUri {
        run_id: "bob-run".into(),
        kind: CheckpointKind::Sampler,
        name: "mine".into(),
    };
    let bobs = CheckpointRow {
        meta: CheckpointMeta {
            base_model: "tiny".into(),
            ..CheckpointMeta::for_test(&bob_uri.run_id, "sampler", &bob_uri.name, "bob")
        },
        public: false,
        ..alices.clone()
    };
    let (engine, _) = engine_with(vec![alices, bobs]);
    (engine, bob_uri, alice_uri)
}

#[test]
fn an_interpolation_is_refused_if_a_source_is_taken_away_while_it_reads() {
    let (mut engine, bob_uri, alice_uri) = bob_and_alices();
    let sources = [bob_uri, alice_uri.clone()];
    let plan = engine
        .begin_interpolate("bob", &sources, &[0.5, 0.5], "sum".into())
        .expect("alice's checkpoint is published");
    let second = engine.begin_interpolate("bob", &sources, &[0.5, 0.5], "sum".into());
    assert!(
        second.unwrap_err().message().contains("being written"),
        "the output's name is taken while it is written"
    );
    // Alice unpublishes while Bob's interpolation reads her files.
    let (was, _) = engine.begin_set_public("alice", &alice_uri, false).unwrap();
    assert!(was);
    let err = engine.check_interpolated("bob", &plan).unwrap_err();
    assert!(
        err.message().contains("unknown checkpoint"),
        "{}",
        err.message()
    );
    assert!(
        engine.interpolating.is_empty(),
        "the refused interpolation frees its name and quota share"
    );
}

#[test]
fn interpolations_being_written_count_in_the_checkpoint_quota() {
    let (mut engine, bob_uri, alice_uri) = bob_and_alices();
    // Bob stores one checkpoint and may store two.
    engine.config.limits.checkpoints = 2;
    let sources = [bob_uri, alice_uri];
    let first = engine
        .begin_interpolate("bob", &sources, &[1.0, 1.0], "one".into())
        .unwrap();
    let err = engine
        .begin_interpolate("bob", &sources, &[1.0, 1.0], "two".into())
        .unwrap_err();
    assert!(
        err.message().contains("--max-checkpoints"),
        "{}",
        err.message()
    );
    engine.end_interpolate(&first.uri);
    engine
        .begin_interpolate("bob", &sources, &[1.0, 1.0], "two".into())
        .expect("the first one's share is free once it is over");
}
