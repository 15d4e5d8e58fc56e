//! The `lathe` binary end to end on a tiny model written as a Hugging Face directory.

use std::process::Command;

use candle_core::{DType, Device};
use lathe_server::model::tiny::write_hf_dir;
use lathe_server::model::{Adapter, Arch, LoadedModel, LoraSpec};
use lathe_server::store::peft;

fn lathe() -> Command {
    Command::new(env!("CARGO_BIN_EXE_lathe"))
}

#[test]
fn generate_runs_with_a_model_directory_and_an_adapter() {
    let root = std::env::temp_dir().join(format!("lathe-cli-{}", std::process::id()));
    let model_dir = root.join("model");
    let adapter_dir = root.join("adapter");
    write_hf_dir(&model_dir, Arch::Qwen3, 3).unwrap();
    std::fs::create_dir_all(&adapter_dir).unwrap();
    let model = LoadedModel::load(model_dir.to_str().unwrap(), &Device::Cpu).unwrap();
    let spec = LoraSpec {
        rank: 2,
        train_attn: true,
        train_mlp: true,
        train_unembed: false,
    };
    let adapter =
        Adapter::new(&model.transformer.config, spec, 1, DType::F32, &Device::Cpu).unwrap();
    peft::save_adapter(&adapter_dir, &adapter, "tiny").unwrap();

    let out = lathe()
        .args(["generate", "--model", model_dir.to_str().unwrap()])
        .args(["--adapter", adapter_dir.to_str().unwrap()])
        .args([
            "--prompt",
            "hello",
            "--max-tokens",
            "5",
            "--temperature",
            "0",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A fresh adapter (B = 0) is the base model: same greedy text without it.
    let base = lathe()
        .args(["generate", "--model", model_dir.to_str().unwrap()])
        .args([
            "--prompt",
            "hello",
            "--max-tokens",
            "5",
            "--temperature",
            "0",
        ])
        .output()
        .unwrap();
    assert!(base.status.success());
    assert_eq!(out.stdout, base.stdout);

    // Bad input gets a clear message and a failing exit status, not a panic.
    let bad = lathe()
        .args([
            "generate",
            "--model",
            root.join("missing").to_str().unwrap(),
            "--prompt",
            "x",
        ])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains("no such model"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    std::fs::remove_dir_all(&root).unwrap();
}

/// A device that is not there is a clear error naming it, before any model is loaded;
/// `--device cpu` is the default and works. (Without the `cuda` feature no CUDA device
/// is there.)
#[cfg(not(feature = "cuda"))]
#[test]
fn a_missing_device_is_a_clear_error_naming_it() {
    let root = std::env::temp_dir().join(format!("lathe-cli-device-{}", std::process::id()));
    let model_dir = root.join("model");
    write_hf_dir(&model_dir, Arch::Llama, 5).unwrap();
    let model = model_dir.to_str().unwrap();
    let generate = |device: &str| {
        lathe()
            .args(["generate", "--model", model, "--device", device])
            .args(["--prompt", "hi", "--max-tokens", "3", "--raw"])
            .output()
            .unwrap()
    };
    let cpu = generate("cpu");
    assert!(
        cpu.status.success(),
        "{}",
        String::from_utf8_lossy(&cpu.stderr)
    );
    for (device, named) in [("cuda:7", "cuda:7"), ("cuda", "cuda:0")] {
        let out = generate(device);
        assert!(!out.status.success(), "{device} ran");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(named), "{device}: {err}");
        assert!(!err.contains("panicked"), "{device}: {err}");
    }
    // A device name that means nothing is refused by the argument parser.
    let out = generate("tpu");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("expected cpu, cuda or cuda:N"), "{err}");
    // `lathe serve` takes the same flag and fails the same way, without binding.
    let out = lathe()
        .args([
            "serve", "--model", model, "--device", "cuda:3", "--port", "0",
        ])
        .args(["--data-dir", root.join("data").to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cuda:3"), "{err}");
    std::fs::remove_dir_all(&root).unwrap();
}
