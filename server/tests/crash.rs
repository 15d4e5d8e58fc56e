//! `kill -9` in the middle of training and checkpoint writes: after a restart every
//! listed checkpoint is whole, training resumes with identical optimizer state, and a
//! sampler samples what it sampled before.

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::http::*;
use lathe_server::model::tiny::write_hf_dir;
use lathe_server::model::Arch;
use serde_json::{json, Value};

const KEY: &str = "tml-crash-test";

fn data(seed: i64) -> Vec<Value> {
    let toks: Vec<i64> = (0..12).map(|i| (seed * 13 + i * 5) % 250 + 3).collect();
    vec![ce_datum(&toks[..11], &toks[1..])]
}

/// Starts `lathe serve` and returns it with its base URL (read from the ready line).
fn serve(model: &Path, data_dir: &Path) -> (Child, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_lathe"))
        .args(["serve", "--model", model.to_str().unwrap(), "--port", "0"])
        .args(["--data-dir", data_dir.to_str().unwrap(), "--api-key", KEY])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let url = line
        .trim()
        .strip_prefix("lathe serve: ready on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_string();
    (child, url)
}

fn sample(c: &Client, session: &str, seq: u64, path: &str) -> Value {
    let s = c.ok(
        "/api/v1/create_sampling_session",
        &json!({"session_id": session, "sampling_session_seq_id": seq, "model_path": path}),
    );
    c.call(
        "/api/v1/asample",
        &json!({"prompt": {"chunks": [{"type": "encoded_text", "tokens": [4, 5, 6]}]},
                "sampling_params": {"max_tokens": 6, "seed": 5, "temperature": 1.0},
                "sampling_session_id": s["sampling_session_id"], "num_samples": 2}),
    )
    .unwrap()["sequences"]
        .clone()
}

#[test]
fn kill_9_loses_nothing_that_was_saved() {
    let root = temp_dir("crash");
    let model = root.join("model");
    write_hf_dir(&model, Arch::Qwen2, 9).unwrap();
    let data_dir = root.join("data");

    let (mut child, url) = serve(&model, &data_dir);
    let c = Client::new(&url, KEY);
    let session = c.session();
    let mut t = Trainer::new(&c, &session, 0, 3);
    t.step(data(1), 1e-2);
    let state = t.save_state("before-crash");
    let sampler = t.save_sampler("sampler-before-crash");
    t.step(data(2), 1e-2);
    let expected = t.forward_loss(data(2));
    let sampled = sample(&c, &session, 1, &sampler);

    // Keep training and saving, and kill the server in the middle of it.
    let hammer = {
        let c = c.clone();
        let model_id = t.model_id.clone();
        let mut seq = t.seq;
        std::thread::spawn(move || {
            for i in 0.. {
                let bodies = [
                    (
                        "/api/v1/forward_backward",
                        fb_body(&model_id, seq + 1, data(i)),
                    ),
                    ("/api/v1/optim_step", optim_body(&model_id, seq + 2, 1e-2)),
                    (
                        "/api/v1/save_weights",
                        json!({"model_id": model_id, "path": format!("loop-{i}"), "seq_id": seq + 3}),
                    ),
                ];
                seq += 3;
                for (path, body) in bodies {
                    if c.try_call(path, &body).is_none() {
                        return i;
                    }
                }
            }
            unreachable!()
        })
    };
    std::thread::sleep(Duration::from_millis(400));
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let rounds = hammer.join().unwrap();
    assert!(rounds > 0, "the kill came during the loop");

    let (mut child, url) = serve(&model, &data_dir);
    let c = Client::new(&url, KEY);
    let (_, listed) = c.get(&format!("/api/v1/training_runs/{}/checkpoints", t.model_id));
    let listed: Vec<String> = listed["checkpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["tinker_path"].as_str().unwrap().to_string())
        .collect();
    assert!(
        listed.contains(&state) && listed.contains(&sampler),
        "{listed:?}"
    );
    let session = c.session();
    // Every listed checkpoint is whole: it loads.
    let mut probe = Trainer::new(&c, &session, 1, 1);
    let whole = listed.iter().filter(|u| u.contains("/weights/"));
    for uri in whole {
        probe.load_state(uri, true);
    }
    assert!(
        listed.len() > 3,
        "the kill came after some loop checkpoints: {listed:?}"
    );
    let mut r = Trainer::new(&c, &session, 0, 99);
    r.load_state(&state, true);
    r.step(data(2), 1e-2);
    assert_eq!(
        r.forward_loss(data(2)),
        expected,
        "identical optimizer state"
    );
    assert_eq!(
        sample(&c, &session, 1, &sampler),
        sampled,
        "same samples as before"
    );
    child.kill().unwrap();
    child.wait().unwrap();
    let _ = std::fs::remove_dir_all(root);
}
