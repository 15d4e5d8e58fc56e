//! With the `cuda` feature, compiles Lathe's own CUDA kernels
//! (`src/model/cuda/kernels.cu`) to PTX in `OUT_DIR`, which `model::cuda` embeds. The
//! compiler is `$NVCC`, else `nvcc` on the `PATH`, else `$CUDA_HOME/bin/nvcc`
//! (`eval "$(scripts/setup-cuda --env)"` sets all three).

use std::path::PathBuf;
use std::process::Command;

const SOURCE: &str = "src/model/cuda/kernels.cu";
/// The oldest virtual architecture CUDA 13 compiles for: the PTX JITs on every GPU
/// since Turing.
const ARCH: &str = "compute_75";

fn main() {
    println!("cargo:rerun-if-changed={SOURCE}");
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let ptx = out.join("lathe_kernels.ptx");
    let nvcc = nvcc();
    let status = Command::new(&nvcc)
        .args(["--ptx", "-O3", &format!("-arch={ARCH}"), "-o"])
        .arg(&ptx)
        .arg(SOURCE)
        .status()
        .unwrap_or_else(|e| {
            panic!(
                "could not run {} ({e}): the `cuda` feature needs a CUDA toolkit; \
                 `eval \"$(scripts/setup-cuda --env)\"` installs one",
                nvcc.display()
            )
        });
    assert!(status.success(), "{} failed on {SOURCE}", nvcc.display());
}

fn nvcc() -> PathBuf {
    if let Some(nvcc) = std::env::var_os("NVCC") {
        return nvcc.into();
    }
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|dir| dir.join("nvcc"))
        .find(|p| p.is_file());
    on_path
        .or_else(|| std::env::var_os("CUDA_HOME").map(|h| PathBuf::from(h).join("bin/nvcc")))
        .unwrap_or_else(|| "nvcc".into())
}
