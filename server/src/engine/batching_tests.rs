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
        match engine.futures.poll(id, owner, true) {
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

fn datum(tokens: usize) -> crate::train::DatumJob {
    crate::train::DatumJob {
        tokens: vec![1; tokens],
        targets: vec![2; tokens],
        k: 1,
        adapter: 0,
        loss: crate::train::Loss::CrossEntropy,
        inputs: crate::train::TokenInputs {
            weights: vec![1.0; tokens],
            ..Default::default()
        },
    }
}

/// The worker's answer to a forward pass over `n` datums with loss `loss` each.
fn pass_result(request_id: &str, n: usize, loss: f64) -> crate::worker::Outcome {
    use crate::worker::{DatumOutput, ForwardResult, Reply};
    let output = ForwardResult {
        datums: (0..n)
            .map(|i| DatumOutput {
                logprobs: vec![i as f32],
                elementwise_loss: vec![loss as f32],
                k: 1,
            })
            .collect(),
        loss: loss * n as f64,
        custom: None,
    };
    crate::worker::Outcome {
        request_id: request_id.into(),
        result: Ok(crate::worker::Done {
            body: Reply::Forward(output),
            saved: None,
        }),
    }
}

/// Pumps, waiting out the batching window if the engine asks to.
fn pump_now(engine: &mut super::Engine) {
    while let Some(at) = engine.pump() {
        std::thread::sleep(at.saturating_duration_since(std::time::Instant::now()));
    }
}

/// `create_model` of a rank-4 attention run of `owner` in a new session.
fn create_run(
    engine: &mut super::Engine,
    owner: &str,
) -> Result<lathe_sdk::types::UntypedApiFuture, super::EngineError> {
    let session = engine.create_session(owner).unwrap();
    engine.create_model(
        owner,
        super::NewRun {
            session_id: session,
            model_seq_id: 0,
            spec: crate::model::LoraSpec {
                rank: 4,
                train_attn: true,
                train_mlp: false,
                train_unembed: false,
            },
            seed: 1,
            user_metadata: Default::default(),
        },
    )
}

/// A run of `owner` whose create has run; returns its id.
fn live_run(
    engine: &mut super::Engine,
    sent: &std::sync::Mutex<Vec<crate::worker::Batch>>,
    owner: &str,
) -> String {
    let run = create_run(engine, owner).unwrap();
    pump_now(engine);
    let id = sent.lock().unwrap().pop().unwrap().runs[0]
        .request_id
        .clone();
    engine.complete(vec![crate::worker::Outcome {
        request_id: id,
        result: Ok(crate::worker::Done {
            body: crate::worker::Reply::ModelCreated {
                model_id: run.model_id.clone().unwrap(),
            },
            saved: None,
        }),
    }]);
    run.model_id.unwrap()
}

#[test]
fn a_small_request_waits_at_most_one_pass_behind_another_keys_backlog() {
    use crate::worker::{Pass, RunOp};
    let (mut engine, sent) = engine();
    let hog = live_run(&mut engine, &sent, "hog");
    let victim = live_run(&mut engine, &sent, "victim");
    // The hog's request: 6 datums of 600 tokens, so one per 1024-token pass.
    let big = RunOp::Forward {
        data: (0..6).map(|_| datum(600)).collect(),
        with_grad: true,
        pass: Pass::WHOLE,
    };
    let hog_req = engine.submit("hog", &hog, Some(1), big).unwrap();
    let passes =
        |sent: &std::sync::Mutex<Vec<crate::worker::Batch>>| -> Vec<(String, usize, Pass)> {
            let b = sent.lock().unwrap().pop().expect("a batch was sent");
            b.runs
                .iter()
                .map(|w| match &w.op {
                    RunOp::Forward { data, pass, .. } => (w.run_id.clone(), data.len(), *pass),
                    _ => panic!("a forward pass"),
                })
                .collect()
        };
    pump_now(&mut engine);
    assert_eq!(
        passes(&sent),
        vec![(
            hog.clone(),
            1,
            Pass {
                first: true,
                last: false
            }
        )]
    );
    // The victim submits while the hog's first pass runs.
    let small = RunOp::Forward {
        data: vec![datum(100)],
        with_grad: true,
        pass: Pass::WHOLE,
    };
    let victim_req = engine.submit("victim", &victim, Some(1), small).unwrap();
    engine.complete(vec![pass_result(&hog_req, 1, 1.0)]);
    pump_now(&mut engine);
    // The very next pass serves the victim first (the hog's next datum shares it only if
    // it fits: 100 + 600 <= 1024).
    let next = passes(&sent);
    assert_eq!(next[0], (victim.clone(), 1, Pass::WHOLE));
    assert_eq!(
        next[1],
        (
            hog.clone(),
            1,
            Pass {
                first: false,
                last: false
            }
        )
    );
    engine.complete(vec![
        pass_result(&victim_req, 1, 0.5),
        pass_result(&hog_req, 1, 1.0),
    ]);
    let victim_done = match engine.futures.poll(&victim_req, "victim", true) {
        Some(super::futures::Poll::Ready(r)) => r.as_ref().clone().unwrap(),
        _ => panic!("the victim's request is done after one pass"),
    };
    let victim_done = victim_done.into_forward().unwrap();
    assert_eq!(victim_done.loss, 0.5);
    // The hog's remaining passes run one at a time, and its answer joins all six.
    for left in (0..4).rev() {
        pump_now(&mut engine);
        let p = passes(&sent);
        assert_eq!(
            p,
            vec![(
                hog.clone(),
                1,
                Pass {
                    first: false,
                    last: left == 0
                }
            )]
        );
        engine.complete(vec![pass_result(&hog_req, 1, 1.0)]);
    }
    match engine.futures.poll(&hog_req, "hog", true) {
        Some(super::futures::Poll::Ready(r)) => {
            let body = r.as_ref().clone().unwrap().into_forward().unwrap();
            assert_eq!(body.datums.len(), 6);
            assert_eq!(body.loss, 6.0);
        }
        _ => panic!("the hog's request is done after its last pass"),
    }
}

#[test]
fn a_failed_pass_fails_its_request_and_drops_the_rest() {
    use crate::worker::{Pass, RunOp};
    let (mut engine, sent) = engine();
    let run = live_run(&mut engine, &sent, "a");
    let big = RunOp::Forward {
        data: (0..3).map(|_| datum(600)).collect(),
        with_grad: true,
        pass: Pass::WHOLE,
    };
    let req = engine.submit("a", &run, Some(1), big).unwrap();
    let after = engine
        .submit("a", &run, Some(2), RunOp::OptimStep(Default::default()))
        .unwrap();
    pump_now(&mut engine);
    sent.lock().unwrap().clear();
    engine.complete(vec![crate::worker::Outcome {
        request_id: req.clone(),
        result: Err(crate::worker::Failure::server("boom")),
    }]);
    assert!(matches!(
        engine.futures.poll(&req, "a", true),
        Some(super::futures::Poll::Ready(r)) if r.is_err()
    ));
    // The run moves on to its next operation.
    pump_now(&mut engine);
    let b = sent.lock().unwrap().pop().unwrap();
    assert_eq!(b.runs[0].request_id, after);
}

#[test]
fn a_snapshot_evicted_before_it_was_taken_is_never_taken() {
    use crate::worker::RunOp;
    let (mut engine, sent) = engine();
    let run = live_run(&mut engine, &sent, "a");
    let ids: Vec<String> = (1..=5)
        .map(|seq| {
            engine
                .snapshot_for_sampler("a", &run, Some(seq), Some(seq))
                .unwrap()
        })
        .collect();
    // The fifth evicted the first while all five were still queued.
    pump_now(&mut engine);
    let batch = sent.lock().unwrap().pop();
    let taken: Vec<String> = batch
        .iter()
        .flat_map(|b| &b.runs)
        .filter_map(|w| match &w.op {
            RunOp::Snapshot { sampler_id } => Some(sampler_id.clone()),
            _ => None,
        })
        .collect();
    assert!(taken.iter().all(|s| !s.ends_with(":sample:1")), "{taken:?}");
    match engine.futures.poll(&ids[0], "a", true) {
        Some(super::futures::Poll::Ready(r)) => {
            let failure = r.as_ref().as_ref().unwrap_err();
            assert!(
                failure.message.contains("evicted before it was taken"),
                "{}",
                failure.message
            );
        }
        _ => panic!("the evicted snapshot's future answers at once"),
    }
}

#[test]
fn the_operation_a_run_waits_for_is_admitted_at_the_queue_limit() {
    use crate::worker::RunOp;
    let (mut engine, sent) = engine();
    engine.config.limits.queued_operations = 1;
    let run = live_run(&mut engine, &sent, "a");
    let step = || RunOp::OptimStep(Default::default());
    engine.submit("a", &run, Some(2), step()).unwrap();
    let full = engine.submit("a", &run, Some(3), step()).unwrap_err();
    assert!(matches!(full, super::EngineError::Limit(_)), "{full:?}");
    // Seq 1 is what the run waits for: admitted although the queue is full.
    engine.submit("a", &run, Some(1), step()).unwrap();
}

/// The worker's report: `outcomes` finished, `decoding` still decoding.
fn report(
    outcomes: Vec<crate::worker::Outcome>,
    decoding: &[(&str, usize)],
) -> crate::worker::BatchReport {
    crate::worker::BatchReport {
        outcomes,
        decoding: decoding.iter().map(|(r, n)| (r.to_string(), *n)).collect(),
        rescoring: Vec::new(),
    }
}

#[test]
fn a_sampling_request_joins_a_running_decode_at_its_next_step() {
    let (mut engine, sent) = engine();
    let mut long = job();
    long.max_tokens = 50;
    let a = engine
        .sample("alice", SamplerRef::BaseModel, long)
        .unwrap()
        .request_id;
    pump_now(&mut engine);
    let first = sent.lock().unwrap().pop().unwrap();
    assert_eq!(first.samples.len(), 1);
    assert!(first.decode_step, "admitted sequences step at once");
    engine.complete(report(vec![], &[(&a, 1)]));
    assert!(!engine.is_idle(), "alice's request is still decoding");
    // Bob arrives while alice's sequence decodes: his request is admitted at the next
    // step, with no batching window (the worker is busy decoding anyway).
    let b = engine
        .sample("bob", SamplerRef::BaseModel, job())
        .unwrap()
        .request_id;
    assert_eq!(engine.pump(), None);
    let next = sent.lock().unwrap().pop().unwrap();
    assert_eq!(next.samples.len(), 1);
    assert_eq!(next.samples[0].request_id, b);
    assert!(next.decode_step);
    // Nothing new: decode steps go on, one batch each, until nothing is left.
    engine.complete(report(vec![], &[(&a, 1), (&b, 1)]));
    assert_eq!(engine.pump(), None);
    let step = sent.lock().unwrap().pop().unwrap();
    assert!(step.decode_step && step.samples.is_empty() && step.runs.is_empty());
    let done = |id: &str| crate::worker::Outcome {
        request_id: id.into(),
        result: Ok(crate::worker::Done {
            body: crate::worker::Reply::Sample(Default::default()),
            saved: None,
        }),
    };
    // Bob's short request leaves first; alice's goes on.
    engine.complete(report(vec![done(&b)], &[(&a, 1)]));
    assert!(matches!(
        engine.futures.poll(&b, "bob", true),
        Some(super::futures::Poll::Ready(_))
    ));
    engine.pump();
    engine.complete(report(vec![done(&a)], &[]));
    assert!(engine.is_idle());
    assert_eq!(engine.pump(), None);
    assert!(
        sent.lock().unwrap().len() == 1,
        "no step once nothing decodes"
    );
}

/// The victim submits a 100-token `forward_backward` on `run` (its first operation);
/// returns the batch the engine sends next.
fn victims_small_pass(
    engine: &mut super::Engine,
    sent: &std::sync::Mutex<Vec<crate::worker::Batch>>,
    run: &str,
) -> crate::worker::Batch {
    let small = crate::worker::RunOp::Forward {
        data: vec![datum(100)],
        with_grad: true,
        pass: crate::worker::Pass::WHOLE,
    };
    engine.submit("victim", run, Some(1), small).unwrap();
    pump_now(engine);
    sent.lock().unwrap().pop().unwrap()
}

#[test]
fn a_forward_request_waits_at_most_one_decode_step_behind_another_keys_sampling() {
    let (mut engine, sent) = engine();
    let run = live_run(&mut engine, &sent, "victim");
    let mut big = job();
    big.num_samples = 16;
    big.max_tokens = 40;
    let hog = engine
        .sample("hog", SamplerRef::BaseModel, big)
        .unwrap()
        .request_id;
    pump_now(&mut engine);
    engine.complete(report(vec![], &[(&hog, 16)]));
    // The hog's sequences have decoded a while.
    for _ in 0..5 {
        pump_now(&mut engine);
        engine.complete(report(vec![], &[(&hog, 16)]));
    }
    let batch = victims_small_pass(&mut engine, &sent, &run);
    assert_eq!(
        batch.runs.len(),
        1,
        "the victim's pass runs in the next batch"
    );
    assert!(
        batch.decode_step,
        "beside one decode step (116 tokens fit the budget)"
    );
}

/// A request whose tokens wait to be rescored decodes no sequence; each pass of it is a
/// candidate of its key, charged like a training pass and taking its rows of the batch
/// budget, so another key's pass (or a smaller rescoring) goes between its passes.
#[test]
fn rescoring_passes_are_charged_and_another_keys_work_goes_between_them() {
    let (mut engine, sent) = engine();
    let run = live_run(&mut engine, &sent, "victim");
    let hog = engine
        .sample("hog", SamplerRef::BaseModel, job())
        .unwrap()
        .request_id;
    pump_now(&mut engine);
    let pass = crate::train::PASS_TOKENS;
    let report_rescoring = |engine: &mut super::Engine, rescoring: &[(&str, usize)]| {
        let mut r = report(vec![], &[(&hog, 0)]);
        r.rescoring = rescoring
            .iter()
            .map(|(id, n)| (id.to_string(), *n))
            .collect();
        engine.complete(r);
    };
    report_rescoring(&mut engine, &[(&hog, pass)]);
    for _ in 0..3 {
        pump_now(&mut engine);
        let batch = sent.lock().unwrap().pop().unwrap();
        assert_eq!(batch.rescore, vec![hog.clone()], "one pass of the hog's");
        assert!(!batch.decode_step, "no sequence decodes");
        report_rescoring(&mut engine, &[(&hog, pass)]);
    }
    let levels = engine.service.levels(&["hog", "victim"]);
    assert!(
        levels[0] >= 3 * pass as u64,
        "three passes of {pass} rows charged to the hog: {levels:?}"
    );
    let batch = victims_small_pass(&mut engine, &sent, &run);
    assert_eq!(batch.runs.len(), 1, "the victim's pass runs next");
    assert!(
        batch.rescore.is_empty(),
        "a full rescoring pass has no room beside it in the budget"
    );
    report_rescoring(&mut engine, &[(&hog, pass)]);
    pump_now(&mut engine);
    let batch = sent.lock().unwrap().pop().unwrap();
    assert_eq!(batch.rescore, vec![hog.clone()], "then the hog's next pass");
}

#[test]
fn decoding_goes_on_while_the_server_drains() {
    let (mut engine, sent) = engine();
    let a = engine
        .sample("alice", SamplerRef::BaseModel, job())
        .unwrap()
        .request_id;
    pump_now(&mut engine);
    engine.complete(report(vec![], &[(&a, 1)]));
    engine.begin_shutdown();
    assert!(!engine.is_idle());
    assert_eq!(engine.pump(), None);
    assert!(sent.lock().unwrap().pop().unwrap().decode_step);
    engine.complete(report(vec![], &[]));
    assert!(engine.is_idle());
}

#[test]
fn a_decode_split_across_keys_does_not_starve_another_keys_training() {
    use crate::worker::{Pass, RunOp};
    let (mut engine, sent) = engine();
    let run = live_run(&mut engine, &sent, "trainer");
    // One key decodes 63 sequences, a second key 1: the step must not be ranked at the
    // light key's level, or the trainer would wait about 1000 steps per pass.
    let mut wide = job();
    wide.num_samples = 63;
    wide.max_tokens = 50;
    let mut long = job();
    long.max_tokens = 50;
    let h = engine
        .sample("hog", SamplerRef::BaseModel, wide)
        .unwrap()
        .request_id;
    let v = engine
        .sample("light", SamplerRef::BaseModel, long)
        .unwrap()
        .request_id;
    pump_now(&mut engine);
    engine.complete(report(vec![], &[(&h, 63), (&v, 1)]));
    let backlog = RunOp::Forward {
        data: (0..40).map(|_| datum(1000)).collect(),
        with_grad: true,
        pass: Pass::WHOLE,
    };
    let fb = engine.submit("trainer", &run, Some(1), backlog).unwrap();
    let mut passes = 0;
    for _ in 0..100 {
        pump_now(&mut engine);
        let batch = sent.lock().unwrap().pop().expect("a batch");
        let outcomes = if batch.runs.is_empty() {
            vec![]
        } else {
            passes += 1;
            vec![pass_result(&fb, 1, 1.0)]
        };
        engine.complete(report(outcomes, &[(&h, 63), (&v, 1)]));
    }
    // A 1000-token pass cannot share a batch with a 64-token step: about one pass per
    // 16 steps.
    assert!(passes >= 5, "{passes} passes in 100 batches");
}

#[test]
fn cancelled_samples_leave_the_queue_or_the_decode_and_training_is_not_cancelled() {
    use crate::worker::{Failure, Outcome, RunOp, CANCELLED};
    let (mut engine, sent) = engine();
    let mut long = job();
    long.max_tokens = 50;
    let a = engine
        .sample("alice", SamplerRef::BaseModel, long)
        .unwrap()
        .request_id;
    pump_now(&mut engine);
    assert_eq!(sent.lock().unwrap().pop().unwrap().samples.len(), 1);
    // b queues behind the busy worker; only its own key can cancel it, and it fails at once.
    let b = engine
        .sample("alice", SamplerRef::BaseModel, job())
        .unwrap()
        .request_id;
    assert!(
        engine.cancel_future("bob", &b).is_err(),
        "another key's request"
    );
    engine.cancel_future("alice", &b).unwrap();
    let failed = |engine: &mut super::Engine, id: &str| match engine.futures.poll(id, "alice", true)
    {
        Some(super::futures::Poll::Ready(r)) => r.as_ref().clone().err().map(|f| f.message),
        _ => None,
    };
    assert_eq!(failed(&mut engine, &b).as_deref(), Some(CANCELLED));
    // a is at the worker: its cancel goes with the next batch, and b is not admitted.
    engine.cancel_future("alice", &a).unwrap();
    engine.cancel_future("alice", &a).unwrap();
    engine.complete(report(vec![], &[(&a, 1)]));
    engine.pump();
    let next = sent.lock().unwrap().pop().unwrap();
    assert_eq!(
        next.cancel,
        vec![a.clone()],
        "one cancel, however often asked"
    );
    assert!(next.samples.is_empty());
    engine.complete(report(
        vec![Outcome {
            request_id: a.clone(),
            result: Err(Failure::user(CANCELLED)),
        }],
        &[],
    ));
    assert_eq!(failed(&mut engine, &a).as_deref(), Some(CANCELLED));
    assert!(engine.is_idle());
    // Cancelling a finished request changes nothing.
    engine.cancel_future("alice", &a).unwrap();
    // A training operation is refused: its run's later operations depend on it.
    let run = live_run(&mut engine, &sent, "alice");
    let op = RunOp::OptimStep(Default::default());
    let id = engine.submit("alice", &run, Some(1), op).unwrap();
    let err = engine.cancel_future("alice", &id).unwrap_err();
    assert!(err.to_string().contains("training operation"), "{err}");
}

#[test]
fn saves_still_queued_count_against_the_checkpoint_quota() {
    let (mut engine, sent) = engine();
    engine.config.limits.checkpoints = 2;
    // Each save then counts 1 x rank 4 x 4 bytes, three times (a training checkpoint).
    engine.model.lora_widths.attn = 1;
    let run = live_run(&mut engine, &sent, "a");
    let save = |engine: &mut super::Engine, seq: u64, name: &str| {
        engine.save(
            "a",
            &run,
            Some(seq),
            super::SaveRequest {
                kind: lathe_sdk::types::CheckpointKind::Training,
                name: name.into(),
                overwrite: false,
                ttl: None,
            },
        )
    };
    // Nothing is written yet (the worker has not run them): two queued saves fill the
    // quota, and a third new name is refused rather than admitted past it.
    save(&mut engine, 1, "one").unwrap();
    // The first is being written (dispatched to the worker), the second queued.
    pump_now(&mut engine);
    save(&mut engine, 2, "two").unwrap();
    match save(&mut engine, 3, "three") {
        Err(super::EngineError::Limit(l)) => assert_eq!(l.limit, "max_checkpoints"),
        other => panic!("{other:?}"),
    }
    // Bytes too, the new save's own included: room for half of one more save is not
    // room for it.
    engine.config.limits.checkpoints = 100;
    let each = engine.model.lora_widths.checkpoint_bytes(
        &crate::model::LoraSpec {
            rank: 4,
            train_attn: true,
            train_mlp: false,
            train_unembed: false,
        },
        true,
    );
    engine.config.limits.checkpoint_bytes = 2 * each + each / 2;
    match save(&mut engine, 3, "three") {
        Err(super::EngineError::Limit(l)) => assert_eq!(l.limit, "max_checkpoint_bytes"),
        other => panic!("{other:?}"),
    }
}

/// The last eighth of `--max-sessions` is kept for keys without a loaded run: a key
/// with runs stops short of it, another key still gets its first run there, and a full
/// server refuses everyone.
#[test]
fn the_last_run_slots_are_kept_for_keys_without_a_run() {
    let (mut engine, sent) = engine();
    engine.config.max_sessions = 8;
    engine.config.limits.live_runs = 100;
    let create = create_run;
    for _ in 0..7 {
        create(&mut engine, "hog").unwrap();
    }
    let refused = create(&mut engine, "hog").unwrap_err();
    assert!(
        matches!(refused, super::EngineError::Capacity(_)),
        "{refused:?}"
    );
    assert!(
        refused.to_string().contains("kept for keys without"),
        "{refused}"
    );
    create(&mut engine, "newcomer").unwrap();
    let full = create(&mut engine, "third").unwrap_err();
    assert!(full.to_string().contains("at its limit"), "{full}");
    drop(sent);
}
