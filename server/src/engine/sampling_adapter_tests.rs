//! Checkpoint adapters that sampling requests hold in the worker count in the key's and
//! the server's adapter memory, each directory once, and a request whose adapter the
//! worker must read is charged the read.

use lathe_sdk::types::{CheckpointKind, CheckpointUri};

use super::test_engine::{engine_with, job};
use super::{Engine, LoraWidths, SamplerRef};
use crate::store::checkpoints::CheckpointMeta;
use crate::store::db::CheckpointRow;
use crate::worker::ByteLru;

/// Bob's sampler checkpoints `a` and `b` (rank 4 on attention and MLP), in an engine
/// whose adapters take 32,000 bytes each (64,000 held while sampling: two copies).
fn bobs_checkpoints() -> (Engine, CheckpointUri, CheckpointUri) {
    let uri = |name: &str| CheckpointUri {
        run_id: "bob-run".into(),
        kind: CheckpointKind::Sampler,
        name: name.into(),
    };
    let row = |u: &CheckpointUri| CheckpointRow {
        meta: CheckpointMeta {
            base_model: "tiny".into(),
            ..CheckpointMeta::for_test(&u.run_id, "sampler", &u.name, "bob")
        },
        version: "v-1".into(),
        size_bytes: 1,
        public: false,
    };
    let (a, b) = (uri("a"), uri("b"));
    let (mut engine, _) = engine_with(vec![row(&a), row(&b), row(&uri("c"))]);
    engine.model.lora_widths = LoraWidths {
        attn: 1000,
        mlp: 1000,
        unembed: 0,
    };
    (engine, a, b)
}

#[test]
fn sampling_adapters_count_in_adapter_memory_each_directory_once() {
    let (mut engine, a, b) = bobs_checkpoints();
    engine.config.limits.adapter_bytes = 100_000;
    let on = |uri: &CheckpointUri| SamplerRef::Path(uri.clone());
    let first = engine.sample("bob", on(&a), job()).unwrap().request_id;
    assert_eq!(engine.adapter_memory(Some("bob")), 64_000);
    engine
        .sample("bob", on(&a), job())
        .expect("a second request on the same checkpoint shares its adapter");
    assert_eq!(engine.adapter_memory(Some("bob")), 64_000);
    let err = engine.sample("bob", on(&b), job()).unwrap_err();
    assert!(
        err.message().contains("--max-adapter-bytes"),
        "{}",
        err.message()
    );
    // Once no request holds it, another checkpoint's adapter fits.
    engine.cancel_future("bob", &first).unwrap();
    let queued: Vec<String> = engine.inflight.keys().cloned().collect();
    for id in queued {
        engine.cancel_future("bob", &id).unwrap();
    }
    assert_eq!(engine.adapter_memory(Some("bob")), 0);
    engine.sample("bob", on(&b), job()).unwrap();
}

#[test]
fn a_sample_is_charged_its_adapters_read_until_the_worker_keeps_it() {
    let (mut engine, a, _) = bobs_checkpoints();
    // 2 MiB adapters: reading one is charged two tokens.
    engine.model.lora_widths.attn = 1 << 16;
    engine.model.lora_widths.mlp = 1 << 16;
    let request = engine
        .sample("bob", SamplerRef::Path(a.clone()), job())
        .unwrap()
        .request_id;
    let work = |e: &Engine| {
        e.samples
            .iter()
            .find(|q| q.work.request_id == request)
            .map(|q| q.work.clone())
            .unwrap()
    };
    let queued = work(&engine);
    assert_eq!(engine.adapter_read_tokens(&queued), 2);
    engine.pump();
    assert!(engine.samples.is_empty(), "sent to the worker");
    assert_eq!(
        engine.adapter_read_tokens(&queued),
        0,
        "the worker keeps the adapter it read"
    );
}

#[test]
fn the_engine_sees_the_workers_cache_as_the_worker_fills_it() {
    let (mut engine, a, b) = bobs_checkpoints();
    let c = CheckpointUri {
        name: "c".into(),
        ..a.clone()
    };
    // 1 MiB adapters, each read charged one token; the cache keeps two.
    engine.model.lora_widths.attn = 1 << 15;
    engine.model.lora_widths.mlp = 1 << 15;
    engine.worker_adapters = ByteLru::with_budget(2 << 20);
    engine.config.batch_window = std::time::Duration::ZERO;
    let queue = |e: &mut Engine, uri: &CheckpointUri| {
        let id = e
            .sample("bob", SamplerRef::Path(uri.clone()), job())
            .unwrap()
            .request_id;
        let work = e.samples.back().unwrap().work.clone();
        assert_eq!(work.request_id, id);
        work
    };
    let on_a = queue(&mut engine, &a);
    let on_b = queue(&mut engine, &b);
    assert_eq!(engine.adapter_read_tokens(&on_a), 1);
    engine.pump();
    assert!(engine.samples.is_empty(), "both sent in one batch, a first");
    engine.complete(Vec::new());
    let on_c = queue(&mut engine, &c);
    engine.pump();
    // The worker opened a, then b, then c: a, the least recently used, went.
    assert_eq!(engine.adapter_read_tokens(&on_c), 0);
    assert_eq!(engine.adapter_read_tokens(&on_b), 0);
    assert_eq!(
        engine.adapter_read_tokens(&on_a),
        1,
        "the worker reads a again"
    );
}
