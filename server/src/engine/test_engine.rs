//! An engine for unit tests: a tiny model's description, an empty data dir, and a fake
//! worker that records the batches it is sent.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use super::{Engine, EngineConfig, ModelInfo, WorkerLink};
use crate::sample::{Picker, SampleJob};
use crate::store::checkpoints::{CheckpointDir, Faults};
use crate::store::db::CheckpointRow;
use crate::worker::Batch;

/// Records batches instead of running them; `alive` plays the worker thread's life.
pub(super) struct Recorder(Arc<Mutex<Vec<Batch>>>, Arc<AtomicBool>);

impl WorkerLink for Recorder {
    fn send(&mut self, batch: Batch) -> bool {
        if !self.is_alive() {
            return false;
        }
        self.0.lock().expect("not poisoned").push(batch);
        true
    }

    fn is_alive(&self) -> bool {
        self.1.load(Ordering::SeqCst)
    }
}

/// An engine with no checkpoints whose worker dies when `alive` is cleared.
pub(super) fn engine_with_worker(alive: Arc<AtomicBool>) -> (Engine, Arc<Mutex<Vec<Batch>>>) {
    build(Vec::new(), alive)
}

/// An engine over `checkpoints` whose worker records what it is sent.
pub(super) fn engine_with(checkpoints: Vec<CheckpointRow>) -> (Engine, Arc<Mutex<Vec<Batch>>>) {
    build(checkpoints, Arc::new(AtomicBool::new(true)))
}

fn build(
    checkpoints: Vec<CheckpointRow>,
    alive: Arc<AtomicBool>,
) -> (Engine, Arc<Mutex<Vec<Batch>>>) {
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
        lora_widths: Default::default(),
    };
    let dir = std::env::temp_dir().join(format!("lathe-batching-{}", uuid::Uuid::new_v4()));
    let engine = Engine::new(
        model,
        EngineConfig::default(),
        checkpoints,
        CheckpointDir::new(dir, Faults::default()).expect("checkpoint dir"),
        Box::new(Recorder(sent.clone(), alive)),
    );
    (engine, sent)
}

/// A small sampling job.
pub(super) fn job() -> SampleJob {
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

/// An engine with no checkpoints.
pub(super) fn engine() -> (Engine, Arc<Mutex<Vec<Batch>>>) {
    engine_with(Vec::new())
}
