//! The worker's reads of checkpoints the engine resolved at dispatch: a checkpoint that
//! its owner deleted (or that expired) while the batch waited is gone, and the request
//! that wanted it fails with a user error saying so, without the server's paths.

mod common;

use common::*;
use lathe_sdk::types::CheckpointUri;
use lathe_server::model::Arch;
use lathe_server::sample::{DecodeMode, Picker, SampleJob};
use lathe_server::store::checkpoints::Faults;
use lathe_server::store::Store;
use lathe_server::worker::{
    Batch, Blame, Reply, RunOp, RunWork, SampleWork, SamplerSource, Worker, CHECKPOINT_GONE,
};

fn sample_job(vocab: usize) -> SampleJob {
    SampleJob {
        prompt: tokens(1, 4, vocab),
        adapter: None,
        num_samples: 1,
        picker: Picker::default(),
        max_tokens: 2,
        stop_strings: vec![],
        stop_tokens: vec![],
        seed: Some(1),
        prompt_logprobs: false,
        topk_prompt_logprobs: 0,
    }
}

#[test]
fn a_checkpoint_deleted_after_dispatch_fails_its_readers_as_deleted() {
    let root = common::http::temp_dir("worker-reads");
    let (store, _) = Store::open(&root, Faults::default()).unwrap();
    let model = tiny(Arch::Llama);
    let vocab = model.transformer.config.vocab_size;
    let mut worker = Worker::new(model, DecodeMode::Exact, store);
    // A version directory the engine resolved, removed before the worker reads it.
    let gone = root
        .join("checkpoints")
        .join("run:train:0")
        .join("weights")
        .join("x");
    let uri: CheckpointUri = "tinker://run:train:0/weights/x".parse().unwrap();
    let batch = Batch {
        runs: vec![RunWork {
            request_id: "load".into(),
            run_id: "run:train:0".into(),
            op: RunOp::Load {
                uri,
                dir: gone.join("v-1"),
                optimizer: true,
                create: true,
            },
        }],
        samples: vec![SampleWork {
            request_id: "sample".into(),
            source: SamplerSource::Checkpoint(gone.join("v-2")),
            job: sample_job(vocab),
            progress: None,
        }],
        decode_step: true,
        ..Default::default()
    };
    let report = worker.run_batch(batch);
    assert_eq!(report.outcomes.len(), 2, "{:?}", report.outcomes);
    for outcome in &report.outcomes {
        let failure = outcome.result.as_ref().expect_err("the files are gone");
        assert_eq!(failure.blame, Blame::User, "{}", outcome.request_id);
        assert_eq!(failure.message, CHECKPOINT_GONE);
        assert!(!failure.message.contains(root.to_str().unwrap()));
    }
    // A version directory that is there but holds no checkpoint is a server fault, not
    // a delete.
    let broken = gone.join("v-3");
    std::fs::create_dir_all(&broken).unwrap();
    let report = worker.run_batch(Batch {
        samples: vec![SampleWork {
            request_id: "broken".into(),
            source: SamplerSource::Checkpoint(broken),
            job: sample_job(vocab),
            progress: None,
        }],
        ..Default::default()
    });
    let failure = report.outcomes[0].result.as_ref().expect_err("no files");
    assert_eq!(failure.blame, Blame::Server, "{}", failure.message);
    // The worker goes on: the base model still samples.
    let mut base = sample_job(vocab);
    base.max_tokens = 3;
    let mut report = worker.run_batch(Batch {
        samples: vec![SampleWork {
            request_id: "base".into(),
            source: SamplerSource::Base,
            job: base,
            progress: None,
        }],
        decode_step: true,
        ..Default::default()
    });
    while report.outcomes.is_empty() {
        report = worker.run_batch(Batch {
            decode_step: true,
            ..Default::default()
        });
    }
    let done = report.outcomes[0]
        .result
        .as_ref()
        .expect("the base model samples");
    assert!(
        matches!(&done.body, Reply::Sample(out) if out.sequences[0].tokens.len() == 3),
        "{:?}",
        done.body
    );
    std::fs::remove_dir_all(&root).unwrap();
}
