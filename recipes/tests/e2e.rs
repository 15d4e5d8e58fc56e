//! Every recipe end to end on a tiny model (fast): it runs, writes its metrics and
//! summary, and reports its mode.

use std::path::Path;
use std::process::Command;

use lathe_server::model::tiny::write_hf_dir;
use lathe_server::model::Arch;

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
    for line in metrics.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        if let Some(agents) = v.get("agents") {
            for a in agents.as_object().unwrap().values() {
                let r = a["ratio_mean"].as_f64().unwrap();
                assert!((r - 1.0).abs() < 0.01, "trainer and sampler disagree: {r}");
            }
        }
    }
    serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap()
}

#[test]
fn multi_agent_math_runs_in_every_mode() {
    let root = std::env::temp_dir().join(format!("lathe-recipes-{}", std::process::id()));
    let model = root.join("model");
    write_hf_dir(&model, Arch::Llama, 4).unwrap();
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
