//! The engine's decision to wait for other clients before dispatching, with a fake
//! worker that records what it is sent.

use std::sync::{Arc, Mutex};

use super::{Engine, EngineConfig, ModelInfo, SamplerRef, WorkerLink};
use crate::sample::{Picker, SampleJob};
use crate::store::{checkpoints::CheckpointDir, db::Db};
use crate::worker::Batch;

struct Recorder(Arc<Mutex<Vec<Batch>>>);

impl WorkerLink for Recorder {
    fn send(&mut self, batch: Batch) -> bool {
        self.0.lock().expect("not poisoned").push(batch);
        true
    }
}

fn engine() -> (Engine, Arc<Mutex<Vec<Batch>>>) {
    let sent = Arc::new(Mutex::new(Vec::new()));
    let model = ModelInfo {
        name: "tiny".into(),
        aliases: vec![],
        arch: "llama".into(),
        vocab_size: 100,
        max_seq_len: 64,
        tokenizer_json: String::new(),
        chat_template: None,
        eos_token: None,
        bos_token: None,
    };
    let dir = std::env::temp_dir().join(format!("lathe-batching-{}", uuid::Uuid::new_v4()));
    let engine = Engine::new(
        model,
        EngineConfig::default(),
        Db::in_memory().expect("db"),
        CheckpointDir::new(dir).expect("checkpoint dir"),
        Box::new(Recorder(sent.clone())),
    );
    (engine, sent)
}

fn job() -> SampleJob {
    SampleJob {
        prompt: vec![1, 2, 3],
        adapter: None,
        num_samples: 1,
        picker: Picker::default(),
        max_tokens: 4,
        stop_strings: vec![],
        stop_tokens: vec![],
        seed: Some(0),
        prompt_logprobs: false,
        topk_prompt_logprobs: 0,
    }
}

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
