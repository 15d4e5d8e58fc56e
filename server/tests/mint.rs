//! MinT's extensions over HTTP: `checkpoints/interpolate` (the exact sum of deltas is
//! tested in `store::interpolate`; here, the endpoint's contract and access rules).

mod common;

use common::http::*;
use serde_json::{json, Value};

/// Greedy sampled logprobs of a checkpoint.
fn greedy(c: &Client, path: &str) -> Vec<f64> {
    let v = c
        .call(
            "/api/v1/asample",
            &json!({"model_path": path, "num_samples": 1,
                    "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7, 8]}]},
                    "sampling_params": {"max_tokens": 6, "temperature": 0.0}}),
        )
        .unwrap();
    serde_json::from_value(v["sequences"][0]["logprobs"].clone()).unwrap()
}

fn interpolate(c: &Client, body: Value) -> Result<Value, Value> {
    c.call("/api/v1/mint/checkpoints/interpolate", &body)
}

#[test]
fn interpolate_saves_the_weighted_sum_under_the_first_run() {
    let dir = temp_dir("mint-interp");
    let server = TestServer::start(&dir, |_| {});
    let alice = server.client(KEY_A);
    let bob = server.client(KEY_B);
    let session = alice.session();
    let data = vec![ce_datum(&[1, 2, 3, 4, 5], &[2, 3, 4, 5, 6])];
    let mut x = Trainer::new(&alice, &session, 0, 1);
    let mut y = Trainer::new(&alice, &session, 1, 2);
    for _ in 0..3 {
        x.step(data.clone(), 5e-2);
        y.step(vec![ce_datum(&[9, 8, 7, 6], &[8, 7, 6, 5])], 5e-2);
    }
    let px = x.save_sampler("x");
    let py = y.save_state("y");

    // Coefficients (1, 0) give source 0's model back; (0, 1) source 1's.
    for (coefs, source) in [([1.0, 0.0], &px), ([0.0, 1.0], &py)] {
        let r = interpolate(
            &alice,
            json!({"source_paths": [px, py], "coefficients": coefs}),
        )
        .unwrap();
        assert_eq!(r["type"], "mint_interpolate_checkpoints");
        assert_eq!(r["checkpoint_type"], "sampler");
        let path = r["path"].as_str().unwrap();
        assert!(
            path.starts_with(&format!("tinker://{}/sampler_weights/mintx-", x.model_id)),
            "{path}"
        );
        let (want, got) = (greedy(&alice, source), greedy(&alice, path));
        assert_eq!(want.len(), got.len());
        for (a, b) in want.iter().zip(&got) {
            assert!((a - b).abs() < 1e-4, "{coefs:?}: {want:?} vs {got:?}");
        }
    }
    // A mix differs from both, and is listed with the key's checkpoints.
    let r = interpolate(
        &alice,
        json!({"source_paths": [px, py], "coefficients": [0.5, 0.5], "output_path": "half"}),
    )
    .unwrap();
    let half = r["path"].as_str().unwrap().to_string();
    assert!(half.ends_with("/sampler_weights/half"));
    assert_ne!(greedy(&alice, &half), greedy(&alice, &px));
    let (_, list) = alice.get(&format!("/api/v1/training_runs/{}/checkpoints", x.model_id));
    assert!(list.to_string().contains("sampler_weights/half"), "{list}");

    // Refused: the same name again, one source, mismatched coefficients, another key's
    // private checkpoint, and another key's run as the output's home.
    let bad = [
        (
            json!({"source_paths": [px, py], "coefficients": [1, 1], "output_path": "half"}),
            "exists",
        ),
        (json!({"source_paths": [px], "coefficients": [1]}), "2 to"),
        (
            json!({"source_paths": [px, py], "coefficients": [1]}),
            "coefficients",
        ),
        (
            json!({"source_paths": [px, py], "coefficients": [1, 1], "output_checkpoint_type": "training"}),
            "sampler",
        ),
    ];
    for (body, needle) in bad {
        let (status, v) = alice.post("/api/v1/mint/checkpoints/interpolate", &body);
        assert_eq!(status, 400, "{body}: {v}");
        assert!(v.to_string().contains(needle), "{body}: {v}");
    }
    let (status, v) = bob.post(
        "/api/v1/mint/checkpoints/interpolate",
        &json!({"source_paths": [px, py], "coefficients": [1, 1]}),
    );
    assert_eq!(status, 404, "{v}");
    let (s, _) = alice.post(
        &format!(
            "/api/v1/training_runs/{}/checkpoints/sampler_weights/x/publish",
            x.model_id
        ),
        &json!({}),
    );
    assert!(s < 300);
    let bob_session = bob.session();
    let mut z = Trainer::new(&bob, &bob_session, 0, 3);
    z.step(data, 1e-2);
    let pz = z.save_sampler("z");
    let (status, v) = bob.post(
        "/api/v1/mint/checkpoints/interpolate",
        &json!({"source_paths": [px, pz], "coefficients": [1, 1]}),
    );
    assert_eq!(status, 400, "{v}");
    assert!(v.to_string().contains("not yours"), "{v}");
    assert!(interpolate(
        &bob,
        json!({"source_paths": [pz, px], "coefficients": [1, 1]})
    )
    .is_ok());
    server.stop();
}

fn kl_body(model_id: &str, reference: &str, weights: Value) -> Value {
    let input = |t: &[i64]| json!({"chunks": [{"type": "encoded_text", "tokens": t}]});
    json!({
        "model_id": model_id,
        "reference_model_path": reference,
        "data": [{
            "student_input": input(&[1, 2, 3]),
            "reference_input": input(&[9, 1, 2, 3]),
            "target_tokens": {"data": [4, 5, 6], "dtype": "int64"},
            "weights": weights,
        }],
        "temperature": 1.0,
        "seq_id": null,
        "type": "mint_forward_backward_reverse_kl",
    })
}

#[test]
fn reverse_kl_steps_move_the_student_to_the_reference_without_taking_a_seq_id() {
    let dir = temp_dir("mint-kl");
    let server = TestServer::start(&dir, |_| {});
    let alice = server.client(KEY_A);
    let session = alice.session();
    let mut teacher = Trainer::new(&alice, &session, 0, 1);
    for _ in 0..4 {
        teacher.step(
            vec![ce_datum(&[9, 1, 2, 3, 4, 5], &[1, 2, 3, 4, 5, 6])],
            5e-2,
        );
    }
    let reference = teacher.save_sampler("teacher");
    let mut student = Trainer::new(&alice, &session, 1, 2);
    let weights = json!({"data": [1.0, 1.0, 1.0], "dtype": "float32"});
    let mut losses = Vec::new();
    for _ in 0..6 {
        let r = alice
            .call(
                "/api/v1/mint/forward_backward_reverse_kl",
                &kl_body(&student.model_id, &reference, weights.clone()),
            )
            .unwrap();
        assert_eq!(r["type"], "mint_forward_backward_reverse_kl");
        assert_eq!(r["metrics"]["num_samples:sum"], 1.0);
        assert_eq!(r["metrics"]["num_tokens:sum"], 3.0);
        let loss = r["outputs"][0]["loss"]["data"][0].as_f64().unwrap();
        assert!((loss - r["metrics"]["loss:mean"].as_f64().unwrap()).abs() < 1e-5);
        losses.push(loss);
        // The numbered sequence is the student's own: the step took no seq_id.
        student.seq += 1;
        alice
            .call(
                "/api/v1/optim_step",
                &optim_body(&student.model_id, student.seq, 2e-2),
            )
            .unwrap();
    }
    assert!(losses[0] > 0.0);
    assert!(
        losses[5] < 0.5 * losses[0],
        "the student approaches the reference: {losses:?}"
    );

    // The base model as the reference; refused: wrong weights, another key's reference.
    let base = alice.base_model();
    alice
        .call(
            "/api/v1/mint/forward_backward_reverse_kl",
            &kl_body(&student.model_id, &base, weights.clone()),
        )
        .unwrap();
    let short = json!({"data": [1.0, 1.0], "dtype": "float32"});
    let (status, v) = alice.post(
        "/api/v1/mint/forward_backward_reverse_kl",
        &kl_body(&student.model_id, &reference, short),
    );
    assert_eq!(status, 400, "{v}");
    // One step is one worker operation, so its size is bounded.
    let mut long = kl_body(&student.model_id, &reference, json!(null));
    long["data"][0]["target_tokens"] = json!({"data": vec![4; 1025], "dtype": "int64"});
    long["data"][0]["weights"] = json!({"data": vec![1.0; 1025], "dtype": "float32"});
    let (status, v) = alice.post("/api/v1/mint/forward_backward_reverse_kl", &long);
    assert_eq!(status, 400, "{v}");
    assert!(v.to_string().contains("1024"), "{v}");
    let bob = server.client(KEY_B);
    let bob_session = bob.session();
    let theirs = Trainer::new(&bob, &bob_session, 0, 5);
    let (status, v) = bob.post(
        "/api/v1/mint/forward_backward_reverse_kl",
        &kl_body(&theirs.model_id, &reference, weights),
    );
    assert_eq!(status, 404, "{v}");
    server.stop();
}
