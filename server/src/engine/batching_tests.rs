//! The engine's decision to wait for other clients before dispatching, with a fake
//! worker that records what it is sent.

use super::SamplerRef;

use super::test_engine::{engine, job};

#[test]
fn a_lone_sampling_client_is_dispatched_at_once() {
    let (mut engine, sent) = engine();
    for _ in 0..2 {
        engine
            .sample("alice", SamplerRef::BaseModel, job())
            .expect("queued");
        assert_eq!(engine.pump(), None, "nobody else to wait for");
        assert_eq!(sent.lock().unwrap().len(), 1);
        sent.lock().unwrap().clear();
        engine.complete(Vec::new());
    }
}

#[test]
fn sampling_waits_for_other_recent_clients_and_then_batches_them() {
    let (mut engine, sent) = engine();
    // Bob sampled a moment ago; Alice's request now waits for him to send his next one.
    engine
        .sample("bob", SamplerRef::BaseModel, job())
        .expect("queued");
    assert_eq!(engine.pump(), None);
    engine.complete(Vec::new());
    sent.lock().unwrap().clear();
    engine
        .sample("alice", SamplerRef::BaseModel, job())
        .expect("queued");
    let wake = engine.pump().expect("waits the batch window");
    assert!(sent.lock().unwrap().is_empty());
    engine
        .sample("bob", SamplerRef::BaseModel, job())
        .expect("queued");
    std::thread::sleep(wake.saturating_duration_since(std::time::Instant::now()));
    assert_eq!(engine.pump(), None);
    let sent = sent.lock().unwrap();
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0].samples.len(), 2, "both requests share one decode");
}

#[test]
fn a_dead_worker_fails_everything_pending_and_the_engine_reports_it() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let alive = std::sync::Arc::new(AtomicBool::new(true));
    let (mut engine, sent) = super::test_engine::engine_with_worker(alive.clone());
    assert_eq!(engine.health(), Ok(()));
    let running = engine
        .sample("alice", SamplerRef::BaseModel, job())
        .unwrap()
        .request_id;
    engine.pump();
    assert_eq!(sent.lock().unwrap().len(), 1, "dispatched");
    let queued = engine
        .sample("bob", SamplerRef::BaseModel, job())
        .unwrap()
        .request_id;
    alive.store(false, Ordering::SeqCst);
    engine.tick(std::time::Instant::now());
    for (id, owner) in [(&running, "alice"), (&queued, "bob")] {
        match engine.futures.poll(id, owner) {
            Some(super::futures::Poll::Ready(r)) => {
                let failure = r.as_ref().as_ref().unwrap_err();
                assert!(
                    failure.message.contains("worker has stopped"),
                    "{}",
                    failure.message
                );
            }
            _ => panic!("{id} still pending after the worker died"),
        }
    }
    assert!(engine.health().unwrap_err().contains("worker has stopped"));
    let err = engine
        .sample("carol", SamplerRef::BaseModel, job())
        .unwrap_err();
    assert!(matches!(err, super::EngineError::Unavailable(_)));
}
