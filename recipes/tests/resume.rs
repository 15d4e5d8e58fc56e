//! Resuming is exact: a run stopped after its last saved step (by `--steps` or by
//! `kill -9`) and resumed with `--resume` ends with the same adapter weights, bit for bit,
//! and the same `metrics.jsonl` as the run that went straight through.
//!
//! Bit for bit holds because every random choice derives from `--seed` and the step, the
//! checkpoints hold the adapters and Adam's moments and step count in f32 exactly, and the
//! server's numbers for a datum or a sampled sequence do not depend on what else shares
//! its pass.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use common::tiny_model;

mod common;

const BIN: &str = env!("CARGO_BIN_EXE_multi_agent_math");

/// The recipe's command line on the tiny model: the supervised objective, which trains
/// at every step (a random tiny model earns the same reward on every sample, so RL would
/// leave its weights alone).
fn recipe(model: &Path, steps: usize, extra: &[&str]) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.args(["--model", model.to_str().unwrap()])
        .args(["--steps", &steps.to_string()])
        .args(["--batch", "2", "--eval-size", "4", "--eval-every", "1"])
        .args(extra)
        .env_remove("TINKER_BASE_URL")
        .env_remove("LATHE_BASE_URL");
    cmd
}

fn run(mut cmd: Command) {
    let status = cmd.status().unwrap();
    assert!(status.success(), "{cmd:?} failed");
}

/// Every adapter tensor of the final sampler checkpoints of a run that ended at `steps`,
/// by session label and tensor name.
fn final_adapters(out: &Path, steps: usize) -> BTreeMap<String, Vec<f32>> {
    let mut found = BTreeMap::new();
    let suffix = format!("-s{steps:06}-");
    let mut stack = vec![out.join("server-data")];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.file_name().unwrap() == "adapter_model.safetensors" {
                let text = path.to_string_lossy().to_string();
                let Some(name) = text
                    .split('/')
                    .skip_while(|p| *p != "sampler_weights")
                    .nth(1)
                else {
                    continue;
                };
                if let Some(at) = name.find(&suffix) {
                    let label = &name[at + suffix.len()..];
                    let tensors = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
                    for (t, v) in tensors {
                        let v: Tensor = v.flatten_all().unwrap();
                        found.insert(format!("{label}/{t}"), v.to_vec1::<f32>().unwrap());
                    }
                }
            }
        }
    }
    assert!(
        !found.is_empty(),
        "no final adapter under {}",
        out.display()
    );
    found
}

fn metrics(out: &Path) -> String {
    std::fs::read_to_string(out.join("metrics.jsonl")).unwrap()
}

fn state(out: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(out.join("state.json")).unwrap()).unwrap()
}

#[test]
fn half_a_run_resumed_equals_the_whole_run() {
    let root = std::env::temp_dir().join(format!("lathe-resume-{}", std::process::id()));
    let model = tiny_model(&root.join("model"));
    let (straight, halves) = (root.join("straight"), root.join("halves"));
    run(recipe(&model, 4, &["--out", straight.to_str().unwrap()]));
    run(recipe(&model, 2, &["--out", halves.to_str().unwrap()]));
    // A fresh run never overwrites a run's directory.
    let again = recipe(&model, 4, &["--out", straight.to_str().unwrap()])
        .status()
        .unwrap();
    assert!(!again.success(), "a fresh run overwrote a finished one");
    assert_eq!(state(&halves)["completed_steps"], 2);
    let resumed = recipe(&model, 4, &["--resume", halves.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(resumed.status.success());
    let said = String::from_utf8_lossy(&resumed.stderr);
    assert!(!said.contains("other settings"), "{said}");
    assert_eq!(state(&halves)["attempt"], 1);
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(halves.join("summary.json")).unwrap())
            .unwrap();
    assert_eq!(summary["resumed_from_step"], 2);
    assert_eq!(metrics(&halves), metrics(&straight));
    let (a, b) = (final_adapters(&straight, 4), final_adapters(&halves, 4));
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    for (name, x) in &a {
        assert!(x == &b[name], "{name} differs after the resume");
    }
    // A different run would not pass: the seed changes the weights.
    let other = root.join("other");
    run(recipe(
        &model,
        4,
        &["--out", other.to_str().unwrap(), "--seed", "1"],
    ));
    assert_ne!(final_adapters(&other, 4), a);

    // Resuming from a checkpoint URI finds the run's other sessions by name, and goes on
    // exactly too.
    let uri = state(&straight)["checkpoints"][0][1]
        .as_str()
        .unwrap()
        .to_string();
    let s = straight.to_str().unwrap();
    run(recipe(&model, 5, &["--resume", &uri, "--out", s]));
    assert_eq!(state(&straight)["completed_steps"], 5);
    let five = root.join("five");
    run(recipe(&model, 5, &["--out", five.to_str().unwrap()]));
    assert_eq!(metrics(&straight), metrics(&five));
    assert_eq!(final_adapters(&straight, 5), final_adapters(&five, 5));

    // A resume with another flag is warned about, naming the flag.
    let f = five.to_str().unwrap();
    let changed = recipe(&model, 6, &["--resume", f, "--lr", "1e-3"])
        .output()
        .unwrap();
    assert!(changed.status.success());
    let said = String::from_utf8_lossy(&changed.stderr);
    assert!(
        said.contains("other settings") && said.contains("lr: 0.0005 -> 0.001"),
        "{said}"
    );
    let _ = std::fs::remove_dir_all(root);
}

#[test]
fn a_killed_run_resumes_from_its_last_saved_step() {
    let root = std::env::temp_dir().join(format!("lathe-kill-{}", std::process::id()));
    let model = tiny_model(&root.join("model"));
    let steps = 8;
    let (straight, killed) = (root.join("straight"), root.join("killed"));
    // Saves every 3 steps of 8: at 3, 6 and the end.
    let (s, k) = (straight.to_str().unwrap(), killed.to_str().unwrap());
    let every = ["--force-fallback", "--save-every", "3"];
    run(recipe(&model, steps, &[&["--out", s][..], &every].concat()));

    let mut child = recipe(&model, steps, &[&["--out", k][..], &every].concat())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    let saved = loop {
        let done = std::fs::read_to_string(killed.join("state.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .and_then(|s| s["completed_steps"].as_u64());
        if let Some(done) = done.filter(|&d| d >= 3) {
            break done;
        }
        assert!(Instant::now() < deadline, "no state saved within 2 minutes");
        std::thread::sleep(Duration::from_millis(5));
    };
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    assert!(
        (saved as usize) < steps,
        "the run finished before it could be killed"
    );
    run(recipe(
        &model,
        steps,
        &[&["--resume", k][..], &every].concat(),
    ));
    assert_eq!(metrics(&killed), metrics(&straight));
    assert_eq!(
        final_adapters(&killed, steps),
        final_adapters(&straight, steps)
    );
    let _ = std::fs::remove_dir_all(root);
}

#[test]
fn a_run_with_a_queued_learner_resumes_with_its_queue_drained() {
    let root = std::env::temp_dir().join(format!("lathe-resume-q-{}", std::process::id()));
    let model = tiny_model(&root.join("model"));
    let out = root.join("run");
    let dpq = |steps: &str, extra: &[&str]| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_doctor_patient_queue"));
        cmd.args(["--model", model.to_str().unwrap(), "--steps", steps])
            .args(["--batch", "2", "--group", "2", "--max-turns", "2"])
            .args([
                "--patient-batch",
                "3",
                "--eval-size",
                "2",
                "--eval-every",
                "1",
            ])
            .args(["--save-every", "1"])
            .args(extra)
            .env_remove("TINKER_BASE_URL")
            .env_remove("LATHE_BASE_URL");
        cmd
    };
    run(dpq("2", &["--out", out.to_str().unwrap()]));
    let saved = state(&out);
    // Saving drained the queue: every consultation sent was trained on or dropped.
    // (A random tiny model's replies all earn the same reward, so its learner may have
    // nothing to train on; the count is kept either way.)
    let updates = saved["learners"][0]["updates"].as_u64().unwrap();
    assert_eq!(saved["learners"][0]["role"], "patient");
    run(dpq("3", &["--resume", out.to_str().unwrap()]));
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["resumed_from_step"], 2);
    let q = &summary["queues"]["patient"];
    assert_eq!(q["sent"], q["received"]);
    // The resumed learner counts on from the saved updates.
    assert!(q["updates"].as_u64().unwrap() >= updates, "{summary}");
    let lines: Vec<serde_json::Value> = metrics(&out)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // Every consultation sent, before and after the resume, reached the learner's log.
    let received: u64 = lines
        .iter()
        .filter(|v| v["role"] == "patient")
        .map(|v| v["queue/received"].as_u64().unwrap())
        .sum();
    let sent: u64 = lines
        .iter()
        .filter_map(|v| v["agents"]["patient"]["queued"].as_u64())
        .sum();
    assert_eq!((received, sent), (12, 12), "{lines:?}");
    let steps: Vec<u64> = lines.iter().filter_map(|v| v["step"].as_u64()).collect();
    // Steps 1..3 logged once each; the evaluations at 0, 1, 2 and 3 once each.
    assert_eq!(steps, vec![0, 1, 1, 2, 2, 3, 3], "{lines:?}");
    let _ = std::fs::remove_dir_all(root);
}
