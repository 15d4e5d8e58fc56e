//! The running decode's scheduling: requests admitted between steps join the batch,
//! cancelled ones leave it, and a bad request fails alone, the others unchanged.

mod common;

use common::*;
use lathe_server::model::Arch;
use lathe_server::sample::{sample, DecodeMode, SampleJob, TokenProgress};

/// A 20-token job of two samples on adapter 0, and a one-sample job of `short_tokens`
/// on the base model.
fn long_and_short(short_tokens: usize) -> (SampleJob, SampleJob) {
    let long = SampleJob {
        max_tokens: 20,
        ..sample_job(tokens(1, 7, 256), Some(0), 2, 5)
    };
    let short = SampleJob {
        max_tokens: short_tokens,
        ..sample_job(tokens(2, 4, 256), None, 1, 9)
    };
    (long, short)
}

#[test]
fn a_request_admitted_between_steps_joins_the_running_decode_and_leaves_first() {
    use lathe_server::sample::{Admission, RunningDecode};
    use std::sync::Arc;
    for mode in [DecodeMode::Exact, DecodeMode::Fast] {
        let model = tiny(Arch::Llama);
        let (t, tok) = (&model.transformer, &model.tokenizer);
        let a = Arc::new(random_adapter(&model, full_spec(4), 1));
        let (long, short) = long_and_short(3);
        let mut running = RunningDecode::new(mode);
        let (progress, watch) = TokenProgress::new(2);
        let admitted = running.admit(
            t,
            vec![Admission {
                key: "long",
                job: long.clone(),
                adapter: Some(a.clone()),
                progress: Some(progress),
            }],
        );
        assert!(admitted.is_empty());
        for _ in 0..5 {
            assert!(running.step(t, tok).is_empty());
        }
        assert_eq!(running.streams(), 2);
        let so_far: Vec<usize> = watch.borrow().iter().map(Vec::len).collect();
        assert_eq!(so_far, vec![5, 5], "each step publishes its picks");
        let admitted = running.admit(
            t,
            vec![Admission {
                key: "short",
                job: short.clone(),
                adapter: None,
                progress: None,
            }],
        );
        assert!(admitted.is_empty());
        assert_eq!(
            running.streams(),
            3,
            "the new request decodes with the running one"
        );
        let mut order = Vec::new();
        let mut outputs = std::collections::HashMap::new();
        let mut steps = 0;
        while !running.is_empty() {
            let mut finished = running.step(t, tok);
            finished.extend(running.rescore_all(t));
            for (key, out) in finished {
                order.push(key);
                outputs.insert(key, out.unwrap());
            }
            steps += 1;
        }
        assert_eq!(order, vec!["short", "long"], "{mode:?}");
        let published: Vec<Vec<u32>> = outputs["long"]
            .sequences
            .iter()
            .map(|s| s.tokens.clone())
            .collect();
        assert_eq!(*watch.borrow(), published, "the stream saw every token");
        assert!(
            watch.has_changed().is_err(),
            "a finished request ends its watch"
        );
        // 20 tokens in all: 5 steps before the join, the 15 after it (the last step picks
        // the 20th token and runs no forward pass; in fast mode, where the tiny f32
        // model's tokens are picked from 8-bit copies, their rescoring takes one pass).
        assert_eq!(steps, 15, "{mode:?}");
        // Each request's tokens and log-probabilities are those it gets decoded alone.
        for (key, j, adapters) in [("long", &long, vec![a.as_ref()]), ("short", &short, vec![])] {
            let alone = sample(t, tok, &adapters, std::slice::from_ref(j), mode).unwrap();
            let got = &outputs[key];
            assert_eq!(got.sequences.len(), alone[0].sequences.len());
            for (x, y) in got.sequences.iter().zip(&alone[0].sequences) {
                assert_eq!(x.tokens, y.tokens, "{key} {mode:?}");
                assert_eq!(x.stop, y.stop);
                for (p, q) in x.logprobs.iter().zip(&y.logprobs) {
                    assert!((p - q).abs() < 1e-5, "{key}: {p} vs {q}");
                }
            }
        }
    }
}

#[test]
fn a_cancelled_request_leaves_the_decode_and_the_others_are_unchanged() {
    use lathe_server::sample::{Admission, RunningDecode};
    use std::sync::Arc;
    let model = tiny(Arch::Llama);
    let (t, tok) = (&model.transformer, &model.tokenizer);
    let a = Arc::new(random_adapter(&model, full_spec(4), 1));
    let (long, short) = long_and_short(6);
    let mut running = RunningDecode::new(DecodeMode::Exact);
    let admissions = vec![
        Admission {
            key: "long",
            job: long,
            adapter: Some(a),
            progress: None,
        },
        Admission {
            key: "short",
            job: short.clone(),
            adapter: None,
            progress: None,
        },
    ];
    assert!(running.admit(t, admissions).is_empty());
    assert!(running.step(t, tok).is_empty());
    assert_eq!(running.cancel(&["long", "gone"]), vec!["long"]);
    assert_eq!(running.streams(), 1);
    assert!(
        running.cancel(&["long"]).is_empty(),
        "cancelling twice is a no-op"
    );
    let mut finished = Vec::new();
    while !running.is_empty() {
        finished.extend(running.step(t, tok));
        finished.extend(running.rescore_all(t));
    }
    assert_eq!(finished.len(), 1);
    let (key, out) = finished.pop().unwrap();
    assert_eq!(key, "short");
    let alone = sample(t, tok, &[], &[short], DecodeMode::Exact).unwrap();
    assert_eq!(
        out.unwrap().sequences[0].tokens,
        alone[0].sequences[0].tokens
    );
}

#[test]
fn a_bad_request_fails_alone_at_admission() {
    use lathe_server::sample::{Admission, RunningDecode};
    let model = tiny(Arch::Llama);
    let t = &model.transformer;
    let mut running = RunningDecode::new(DecodeMode::Exact);
    let too_long = SampleJob {
        max_tokens: t.max_seq_len(),
        ..sample_job(tokens(1, 7, 256), None, 1, 0)
    };
    let finished = running.admit(
        t,
        vec![
            Admission {
                key: 1,
                job: too_long,
                adapter: None,
                progress: None,
            },
            Admission {
                key: 2,
                job: sample_job(tokens(2, 4, 256), None, 3, 0),
                adapter: None,
                progress: None,
            },
        ],
    );
    assert_eq!(finished.len(), 1);
    assert_eq!(finished[0].0, 1);
    let err = finished[0].1.as_ref().unwrap_err().to_string();
    assert!(err.contains("context limit"), "{err}");
    assert_eq!(running.streams(), 3);
    assert_eq!(running.live().collect::<Vec<_>>(), vec![(&2, 3)]);
}

/// Sampled tokens rescored with the trainer's weights are scored one bounded pass per
/// call, each listed with its rows beforehand (so the engine schedules and charges it),
/// while other requests go on decoding; the result equals rescoring in one pass.
#[test]
fn rescoring_runs_in_bounded_passes_beside_the_decode() {
    use lathe_server::sample::{Admission, RunningDecode};
    let model = tiny(Arch::Llama);
    let (t, tok) = (&model.transformer, &model.tokenizer);
    if !matches!(DecodeMode::Fast.on(t), DecodeMode::Fast) {
        // The device backend (LATHE_TEST_BACKEND=device) decodes with the trainer's own
        // products: nothing is rescored there.
        return;
    }
    let job = SampleJob {
        max_tokens: 9,
        ..sample_job(tokens(3, 6, 256), None, 3, 11)
    };
    let (long, _) = long_and_short(1);
    let long = SampleJob {
        adapter: None,
        num_samples: 1,
        max_tokens: 40,
        ..long
    };
    let run = |pass_rows: usize| {
        let mut running = RunningDecode::new(DecodeMode::Fast).with_rescore_pass_rows(pass_rows);
        let admit = |running: &mut RunningDecode<&'static str>, key, job: &SampleJob| {
            let admitted = running.admit(
                t,
                vec![Admission {
                    key,
                    job: job.clone(),
                    adapter: None,
                    progress: None,
                }],
            );
            assert!(admitted.is_empty());
        };
        admit(&mut running, "rescored", &job);
        admit(&mut running, "long", &long);
        let mut outputs = std::collections::HashMap::new();
        let (mut passes, mut rows) = (0, 0);
        let mut long_tokens_while_rescoring = 0;
        while !running.is_empty() {
            let listed: Vec<(&'static str, usize)> =
                running.rescoring().map(|(k, n)| (*k, n)).collect();
            let streams_before = running.streams();
            let mut finished = Vec::new();
            for (key, n) in listed {
                assert!(
                    n >= 1 && n <= pass_rows,
                    "{n} rows in passes of {pass_rows}"
                );
                if key == "rescored" {
                    passes += 1;
                    rows += n;
                    long_tokens_while_rescoring += streams_before;
                }
                finished.extend(running.rescore(t, &key));
            }
            finished.extend(running.step(t, tok));
            for (key, out) in finished {
                outputs.insert(key, out.unwrap());
            }
        }
        (outputs, passes, rows, long_tokens_while_rescoring)
    };
    let (whole, whole_passes, whole_rows, _) = run(100_000);
    let (pieces, passes, rows, beside) = run(4);
    let expected_rows: usize = whole["rescored"]
        .sequences
        .iter()
        .map(|g| g.tokens.len().saturating_sub(1))
        .sum();
    assert!(expected_rows > 8, "the test needs several passes");
    assert_eq!((whole_passes, whole_rows), (1, expected_rows));
    assert_eq!(rows, expected_rows, "every sampled token scored once");
    assert_eq!(passes, expected_rows.div_ceil(4));
    assert!(
        beside >= passes,
        "the long request decoded through every pass"
    );
    for key in ["rescored", "long"] {
        assert_eq!(pieces[key].sequences.len(), whole[key].sequences.len());
        for (x, y) in pieces[key].sequences.iter().zip(&whole[key].sequences) {
            assert_eq!(x.tokens, y.tokens, "{key}");
            for (p, q) in x.logprobs.iter().zip(&y.logprobs) {
                assert!((p - q).abs() < 1e-5, "{key}: {p} vs {q}");
            }
        }
    }
}
