//! The worker's containment of one request's failure within a fused batch.

use candle_core::Device;

use super::*;
use crate::model::{tiny::tiny_model, Arch, LoraSpec};
use crate::store::checkpoints::Faults;
use crate::train::{DatumJob, Loss, TokenInputs};
use crate::worker::{Blame, Pass};

/// Runs whose id starts with this panic in any forward pass they are part of.
const PANICS: &str = "panics-in-forward";

/// The test's stand-in for a panic that some input could cause in a fused pass.
pub(super) fn failpoint(group: &[&RunWork]) {
    if group.iter().any(|w| w.run_id.starts_with(PANICS)) {
        panic!("failpoint: a forward pass with {PANICS}");
    }
}

fn datum(tokens: usize) -> DatumJob {
    DatumJob {
        tokens: vec![1; tokens],
        targets: vec![2; tokens],
        k: 1,
        adapter: 0,
        loss: Loss::CrossEntropy,
        inputs: TokenInputs {
            weights: vec![1.0; tokens],
            ..Default::default()
        },
    }
}

fn work(request_id: &str, run_id: &str, op: RunOp) -> RunWork {
    RunWork {
        request_id: request_id.into(),
        run_id: run_id.into(),
        op,
    }
}

/// A panic in a fused multi-adapter pass fails only the request that causes it: the
/// others of the pass run again alone and succeed, and the worker goes on.
#[test]
fn a_panic_in_a_fused_pass_fails_only_the_request_that_causes_it() {
    let root = std::env::temp_dir().join(format!("lathe-runner-panic-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let (store, _) = Store::open(&root, Faults::default()).unwrap();
    let model = tiny_model(Arch::Llama, 7, &Device::Cpu).unwrap();
    let mut worker = Worker::new(model, DecodeMode::Exact, store);
    let bad = format!("{PANICS}:train:0");
    let spec = LoraSpec {
        rank: 2,
        train_attn: true,
        train_mlp: false,
        train_unembed: false,
    };
    let create = |id: &str, run: &str| work(id, run, RunOp::Create { spec, seed: 1 });
    let report = worker.run_batch(Batch {
        runs: vec![create("c1", "good:train:0"), create("c2", &bad)],
        ..Default::default()
    });
    assert!(report.outcomes.iter().all(|o| o.result.is_ok()));
    let forward = || RunOp::Forward {
        data: vec![datum(5)],
        with_grad: true,
        pass: Pass::WHOLE,
    };
    let report = worker.run_batch(Batch {
        runs: vec![
            work("good", "good:train:0", forward()),
            work("bad", &bad, forward()),
        ],
        ..Default::default()
    });
    let result = |id: &str| {
        let o = report.outcomes.iter().find(|o| o.request_id == id);
        o.expect("answered").result.clone()
    };
    assert!(result("good").is_ok(), "{:?}", result("good").err());
    let failure = result("bad").expect_err("the panicking request fails");
    assert_eq!(failure.blame, Blame::Server, "{}", failure.message);
    // The good run's gradient was kept: an optimizer step (which fails on a run with no
    // gradient) runs on it.
    let report = worker.run_batch(Batch {
        runs: vec![work(
            "step",
            "good:train:0",
            RunOp::OptimStep(Default::default()),
        )],
        ..Default::default()
    });
    assert!(report.outcomes[0].result.is_ok());
    let _ = std::fs::remove_dir_all(&root);
}
