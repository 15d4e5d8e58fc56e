//! Every recipe end to end on a tiny model (fast): it runs, writes its metrics and
//! summary, and reports its mode.

use std::path::Path;
use std::process::Command;

use common::{tiny_model, tiny_model_with_context};

mod common;

fn run_recipe(bin: &str, model: &Path, out: &Path, extra: &[&str]) -> serde_json::Value {
    let status = Command::new(bin)
        .args([
            "--model",
            model.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ])
        .args([
            "--steps",
            "2",
            "--eval-size",
            "4",
            "--eval-every",
            "1",
            "--batch",
            "2",
        ])
        .args(extra)
        .env_remove("TINKER_BASE_URL")
        .env_remove("LATHE_BASE_URL")
        .status()
        .unwrap();
    assert!(status.success(), "{bin} {extra:?} failed");
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    assert!(metrics.lines().count() >= 4, "{metrics}");
    let mut checked = 0;
    for line in metrics.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        if let Some(agents) = v.get("agents") {
            for a in agents.as_object().unwrap().values() {
                // null when a step had no sampled token to check
                if let Some(r) = a["ratio_mean"].as_f64() {
                    assert!((r - 1.0).abs() < 0.01, "trainer and sampler disagree: {r}");
                    checked += 1;
                }
            }
        }
    }
    assert!(checked > 0, "no ratio_mean was measured: {metrics}");
    serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap()
}

#[test]
fn multi_agent_math_runs_in_every_mode() {
    let root = std::env::temp_dir().join(format!("lathe-recipes-{}", std::process::id()));
    let model = tiny_model(&root.join("model"));
    let bin = env!("CARGO_BIN_EXE_multi_agent_math");
    let s = run_recipe(bin, &model, &root.join("two"), &[]);
    assert_eq!(s["mode"], "two-agent");
    assert_eq!(s["checkpoints"].as_object().unwrap().len(), 2);
    let s = run_recipe(bin, &model, &root.join("limit"), &["--max-sessions", "1"]);
    assert_eq!(s["mode"], "fallback");
    assert!(
        s["fallback_reason"].as_str().unwrap().contains("capacity")
            || s["fallback_reason"].as_str().unwrap().contains("limit")
    );
    let s = run_recipe(
        bin,
        &model,
        &root.join("rl"),
        &["--objective", "rl", "--force-fallback"],
    );
    assert_eq!(
        (s["mode"].as_str(), s["objective"].as_str()),
        (Some("fallback"), Some("rl"))
    );
    let _ = std::fs::remove_dir_all(root);
}

#[test]
fn actor_verifier_runs_with_two_agents_alone_and_in_fallback() {
    let root = std::env::temp_dir().join(format!("lathe-recipes-av-{}", std::process::id()));
    let model = tiny_model(&root.join("model"));
    let bin = env!("CARGO_BIN_EXE_actor_verifier");
    let drilled = ["--group", "2", "--verifier-drills", "1"];
    let s = run_recipe(bin, &model, &root.join("two"), &drilled);
    assert_eq!(s["mode"], "two-agent");
    assert_eq!(s["checkpoints"].as_object().unwrap().len(), 2);
    assert!(s["held_out"]["drills: verifier accuracy"]["after"].is_number());
    // The summary records the recipe's flags and the common ones that change a step.
    let settings = &s["settings"];
    assert_eq!(
        (
            settings["verifier_drills"].as_u64(),
            settings["group"].as_u64()
        ),
        (Some(1), Some(2))
    );
    assert_eq!(
        (settings["seed"].as_u64(), settings["batch"].is_u64()),
        (Some(0), true)
    );
    assert!(settings.get("out").is_none() && settings.get("steps").is_none());
    let s = run_recipe(
        bin,
        &model,
        &root.join("single"),
        &["--group", "2", "--single-agent"],
    );
    assert_eq!(s["mode"], "single-agent");
    let s = run_recipe(
        bin,
        &model,
        &root.join("limit"),
        &["--group", "2", "--max-sessions", "1", "--loss", "ppo"],
    );
    assert_eq!(s["mode"], "fallback");
    let _ = std::fs::remove_dir_all(root);
}

#[test]
fn solve_rewrite_select_runs() {
    let root = std::env::temp_dir().join(format!("lathe-recipes-srs-{}", std::process::id()));
    let model = tiny_model(&root.join("model"));
    let bin = env!("CARGO_BIN_EXE_solve_rewrite_select");
    let s = run_recipe(bin, &model, &root.join("run"), &["--num-parallel", "2"]);
    assert_eq!(s["mode"], "shared-policy");
    assert_eq!(s["num_parallel"], 2);
    assert_eq!(s["settings"]["num_parallel"], 2);
    let _ = std::fs::remove_dir_all(root);
}

#[test]
fn doctor_patient_queue_terminates_cleanly_in_both_modes() {
    let root = std::env::temp_dir().join(format!("lathe-recipes-dpq-{}", std::process::id()));
    let model = tiny_model(&root.join("model"));
    let bin = env!("CARGO_BIN_EXE_doctor_patient_queue");
    let flags = ["--group", "2", "--patient-batch", "3", "--max-turns", "2"];
    for (dir, extra, mode) in [
        ("two", None, "two-agent"),
        ("fallback", Some("--force-fallback"), "fallback"),
    ] {
        let mut args = flags.to_vec();
        args.extend(extra);
        let s = run_recipe(bin, &model, &root.join(dir), &args);
        assert_eq!(s["mode"], mode);
        // Every dialogue the doctor queued was either trained on or dropped as stale.
        let metrics = std::fs::read_to_string(root.join(dir).join("metrics.jsonl")).unwrap();
        let patient_lines: Vec<serde_json::Value> = metrics
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .filter(|v: &serde_json::Value| v.get("update").is_some() && v["role"] == "patient")
            .collect();
        assert!(
            !patient_lines.is_empty(),
            "the patient never trained: {metrics}"
        );
        let received: u64 = patient_lines
            .iter()
            .map(|v| v["queue/received"].as_u64().unwrap())
            .sum();
        assert_eq!(received, s["queues"]["patient"]["sent"].as_u64().unwrap());
        assert_eq!(
            received,
            s["queues"]["patient"]["received"].as_u64().unwrap()
        );
        for v in &patient_lines {
            assert!(v["queue/depth"].as_u64().unwrap() <= v["queue/capacity"].as_u64().unwrap());
            // Every update drills each of its cases: three questions, four replies each.
            let drills = v["agents"]["patient"]["learner_replies"].as_u64().unwrap();
            assert!(drills > 0 && drills % 12 == 0, "{v}");
        }
    }
    let _ = std::fs::remove_dir_all(root);
}

/// The `kl_base` of every agent record of `metrics` (step lines, or a learner's update
/// lines), in order.
fn kl_records(metrics: &str) -> Vec<(String, Option<f64>, serde_json::Value)> {
    let mut out = Vec::new();
    for line in metrics.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        if v.get("eval").is_some() {
            continue;
        }
        for (name, a) in v["agents"].as_object().into_iter().flatten() {
            if a.get("queued").is_some() {
                continue;
            }
            out.push((name.clone(), a["kl_base"].as_f64(), v.clone()));
        }
    }
    out
}

#[test]
fn a_kl_penalty_starts_from_zero_and_is_logged_per_agent() {
    let root = std::env::temp_dir().join(format!("lathe-recipes-kl-{}", std::process::id()));
    let model = tiny_model(&root.join("model"));
    // Two sessions: each agent's first replies come from its untrained adapter, whose
    // sampled logprobs are the base model's, so the first estimate is zero; a token
    // misaligned between the two would show as a large difference.
    // Every reply is trained on (and so scored), whatever its advantage. The tiny model
    // earns no reward, so the first update's only signal is the penalty itself: in f32
    // the sampler's logprobs differ from the trainer's in the last bits, a penalty that
    // Adam (whose steps do not scale with the gradient) turns into a full step, after
    // which the estimate must follow the moved policy. In bf16 sampler and trainer agree
    // bit for bit, the penalty is exactly zero and nothing would move.
    let bin = env!("CARGO_BIN_EXE_actor_verifier");
    let flags = [
        "--group",
        "2",
        "--keep-zero-adv",
        "--kl-coef",
        "0.1",
        "--lr",
        "0.05",
        "--precision",
        "f32",
    ];
    run_recipe(bin, &model, &root.join("math"), &flags);
    let metrics = std::fs::read_to_string(root.join("math").join("metrics.jsonl")).unwrap();
    let records = kl_records(&metrics);
    assert_eq!(records.len(), 4, "two agents, two steps: {metrics}");
    for (name, kl, line) in &records {
        let kl = kl.unwrap_or_else(|| panic!("{name} has no kl_base: {line}"));
        assert!(kl.is_finite(), "{line}");
        if line["step"] == 1 {
            assert!(kl.abs() < 1e-3, "{name} starts {kl} from the base: {line}");
        }
    }
    // Trained once, the policy has moved away from the base.
    let moved = records.iter().filter(|(_, _, l)| l["step"] == 2);
    assert!(
        moved.clone().any(|(_, kl, _)| kl.unwrap().abs() > 1e-3),
        "{metrics}"
    );
    // Replies cut off by the context, and prompts that fill it (their replies are empty),
    // are not scored: the scoring request needs a token of room.
    // The solver's prompts (about 225 bytes) leave it less room than its 16 tokens, the
    // verifier's fill the context; every reply is trained on.
    let short = tiny_model_with_context(&root.join("short-model"), 236);
    let bin = env!("CARGO_BIN_EXE_actor_verifier");
    let flags = ["--group", "2", "--keep-zero-adv", "--kl-coef", "0.1"];
    run_recipe(bin, &short, &root.join("short"), &flags);
    let metrics = std::fs::read_to_string(root.join("short").join("metrics.jsonl")).unwrap();
    let solver = kl_records(&metrics)
        .into_iter()
        .filter(|(n, ..)| n == "solver");
    assert!(solver.clone().count() == 2, "{metrics}");
    // A queued learner takes the penalty too.
    let bin = env!("CARGO_BIN_EXE_doctor_patient_queue");
    let flags = ["--group", "2", "--patient-batch", "3", "--max-turns", "2"];
    let mut args = flags.to_vec();
    args.extend(["--kl-coef", "0.1"]);
    run_recipe(bin, &model, &root.join("queue"), &args);
    let metrics = std::fs::read_to_string(root.join("queue").join("metrics.jsonl")).unwrap();
    // Every update that trained on a reply has the estimate. (On the tiny model the
    // rewards are often all equal, and then nothing is trained on or scored.)
    let records = kl_records(&metrics);
    for (name, kl, line) in &records {
        if line["agents"][name]["datums"].as_u64().unwrap() > 0 {
            assert!(kl.is_some_and(f64::is_finite), "{name}: {line}");
        }
    }
    assert!(records.iter().any(|(n, ..)| n == "patient"), "{metrics}");
    let _ = std::fs::remove_dir_all(root);
}
