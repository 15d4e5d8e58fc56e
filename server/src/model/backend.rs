//! The seam between the decoder's definition and the code that computes it.
//!
//! The decoder block, attention, the LoRA delta and their backward passes are written
//! once (`transformer/`, [`super::ops`], [`super::adapted`]); each operation asks the
//! model's [`Backend`] whether the CPU fast paths may run it or candle's tensor ops must.
//!
//! - [`Backend::Cpu`]: the fused kernels ([`super::cpu::kernels`]), `gemm` products with the
//!   LoRA deltas added in place ([`super::adapted`]), bf16 tiles, the host KV cache and
//!   decode step ([`super::cpu::decode_step`]) and the block-quantized decode weights. They
//!   read candle's CPU storage directly, so they apply only to f32 and f64 CPU tensors;
//!   anything else falls through to the candle ops.
//! - [`Backend::Device`]: candle's ops on whatever device holds the weights, and on a GPU
//!   Lathe's fused CUDA kernels ([`super::cuda`], with the `cuda` feature) in place of the
//!   composites of RMSNorm, RoPE, SwiGLU and the softmaxes. This is what a GPU runs; on
//!   candle's CPU device it is the reference the fast paths are held to
//!   (`server/tests/backends.rs`).
//!
//! The backend is chosen once, when the model is built ([`Backend::for_device`]), and
//! every operation of that model uses it.

use std::fmt;
use std::str::FromStr;

use candle_core::{DType, Device, Tensor};

use super::cpu::kernels;

/// Which implementation computes a model's operations. See the module docs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Backend {
    /// The CPU fast paths wherever the tensors allow them.
    #[default]
    Cpu,
    /// candle's tensor ops on the weights' device.
    Device,
}

impl Backend {
    /// The backend for weights on `device`: the fast paths on the CPU, candle's ops
    /// elsewhere.
    pub fn for_device(device: &Device) -> Self {
        if device.is_cpu() {
            Backend::Cpu
        } else {
            Backend::Device
        }
    }

    /// Whether the fused CPU kernels may run on `t` (f32 or f64 on the CPU).
    pub fn fused(self, t: &Tensor) -> bool {
        self == Backend::Cpu && kernels::supported(t)
    }

    /// Whether Lathe's fused CUDA kernels ([`super::cuda`]) may run on `t`: f32 on a GPU,
    /// on the device backend, unless `LATHE_CUDA_FUSED=0` asks for candle's composites
    /// (to measure what the kernels gain).
    #[cfg(feature = "cuda")]
    pub fn cuda(self, t: &Tensor) -> bool {
        self == Backend::Device && super::cuda::enabled() && super::cuda::supported(t)
    }

    /// Whether the f32 host paths (gemm, the few-rows kernels, the host KV cache and
    /// decode step, bf16 tiles) may run on `t`.
    pub fn host_f32(self, t: &Tensor) -> bool {
        self == Backend::Cpu && t.device().is_cpu() && t.dtype() == DType::F32
    }
}

/// A device named on the command line: `cpu`, `cuda` (the first GPU) or `cuda:N`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DeviceSpec {
    /// The host CPU, with the fast paths.
    #[default]
    Cpu,
    /// CUDA device `N`.
    Cuda(usize),
}

impl FromStr for DeviceSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" => Ok(DeviceSpec::Cuda(0)),
            other => match other.strip_prefix("cuda:") {
                Some(n) => n.parse().map(DeviceSpec::Cuda).map_err(|_| {
                    format!("`{s}`: the device ordinal must be a number, as in cuda:0")
                }),
                None => Err(format!("`{s}`: expected cpu, cuda or cuda:N")),
            },
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Cpu => f.write_str("cpu"),
            DeviceSpec::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// A device that cannot be opened.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// This binary was built without the `cuda` feature.
    #[error(
        "{0}: this build of Lathe has no CUDA support (build it with `--features cuda`; \
         see scripts/setup-cuda)"
    )]
    NotBuilt(DeviceSpec),
    /// The driver could not open the device (no GPU, no driver, ordinal out of range).
    #[error("{device}: the CUDA device cannot be opened: {reason}")]
    Unavailable {
        /// The device asked for.
        device: DeviceSpec,
        /// The driver's words.
        reason: String,
    },
}

impl DeviceSpec {
    /// Opens the device. A CUDA device is readied for the threads of rayon's pool that
    /// the call runs beside: call it outside any rayon pool (the global one is used).
    pub fn open(self) -> Result<Device, DeviceError> {
        match self {
            DeviceSpec::Cpu => Ok(Device::Cpu),
            DeviceSpec::Cuda(n) => open_cuda(self, n),
        }
    }
}

#[cfg(feature = "cuda")]
fn open_cuda(spec: DeviceSpec, ordinal: usize) -> Result<Device, DeviceError> {
    // The driver can panic rather than return an error when no GPU is present; either
    // way the caller gets the device's name and the reason. One stream for all of the
    // device's work (see `cuda::share_one_stream`).
    match std::panic::catch_unwind(|| Device::new_cuda_with_stream(ordinal)) {
        Ok(Ok(device)) => match super::cuda::share_one_stream(&device) {
            Ok(()) => Ok(device),
            Err(e) => Err(DeviceError::Unavailable {
                device: spec,
                reason: format!("it cannot be readied for use from several threads: {e}"),
            }),
        },
        Ok(Err(e)) => Err(DeviceError::Unavailable {
            device: spec,
            reason: e.to_string(),
        }),
        Err(panic) => Err(DeviceError::Unavailable {
            device: spec,
            reason: crate::panics::panic_message(panic.as_ref()),
        }),
    }
}

/// Makes `device`'s context current on the calling thread, for a thread that holds and
/// drops device tensors outside rayon's pool (the worker's); nothing on the CPU. See
/// `cuda::make_current` for why.
pub fn make_current(device: &Device) -> candle_core::Result<()> {
    #[cfg(feature = "cuda")]
    super::cuda::make_current(device)?;
    #[cfg(not(feature = "cuda"))]
    let _ = device;
    Ok(())
}

/// `device`'s free and total memory in bytes on a GPU, as the driver reports them now;
/// `None` on the CPU, whose memory `crate::memory::physical_bytes` tells.
pub fn device_memory(device: &Device) -> candle_core::Result<Option<(u64, u64)>> {
    #[cfg(feature = "cuda")]
    return super::cuda::memory(device);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = device;
        Ok(None)
    }
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(spec: DeviceSpec, _ordinal: usize) -> Result<Device, DeviceError> {
    Err(DeviceError::NotBuilt(spec))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_specs_parse_and_print() {
        for (text, spec) in [
            ("cpu", DeviceSpec::Cpu),
            ("CPU", DeviceSpec::Cpu),
            ("cuda", DeviceSpec::Cuda(0)),
            ("cuda:0", DeviceSpec::Cuda(0)),
            ("cuda:3", DeviceSpec::Cuda(3)),
        ] {
            assert_eq!(text.parse::<DeviceSpec>().unwrap(), spec, "{text}");
        }
        assert_eq!(DeviceSpec::Cuda(2).to_string(), "cuda:2");
        for bad in [
            "",
            "tpu",
            "cuda:",
            "cuda:-1",
            "cuda:x",
            "cuda:99999999999999999999",
        ] {
            let err = bad.parse::<DeviceSpec>().unwrap_err();
            assert!(err.contains("cuda"), "{bad}: {err}");
        }
    }

    #[test]
    fn the_cpu_opens_and_takes_the_fast_paths() {
        let device = DeviceSpec::Cpu.open().unwrap();
        assert_eq!(Backend::for_device(&device), Backend::Cpu);
        let t = Tensor::zeros((2, 2), DType::F32, &device).unwrap();
        assert!(Backend::Cpu.fused(&t) && Backend::Cpu.host_f32(&t));
        assert!(!Backend::Device.fused(&t) && !Backend::Device.host_f32(&t));
        let t64 = t.to_dtype(DType::F64).unwrap();
        assert!(Backend::Cpu.fused(&t64) && !Backend::Cpu.host_f32(&t64));
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn asking_for_cuda_without_the_feature_names_the_device() {
        let err = DeviceSpec::Cuda(1).open().unwrap_err().to_string();
        assert!(err.starts_with("cuda:1:"), "{err}");
        assert!(err.contains("--features cuda"), "{err}");
    }
}
