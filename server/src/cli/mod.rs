//! Subcommands of the `lathe` binary.

pub mod bench;
pub mod bench_serve;
pub mod bench_wire;
pub mod generate;
pub mod serve;

use lathe_server::model::{LoadedModel, Precision};

/// Loads `spec`, fetching the default model first if it is missing.
pub fn load_model(spec: &str) -> anyhow::Result<LoadedModel> {
    Ok(lathe_server::embedded::load_model(spec)?)
}

/// `--precision`: the element type of the base model's products in training and
/// prefill.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PrecisionArg {
    /// f32 products.
    F32,
    /// bf16 products with f32 accumulation (AMX or AVX512-BF16; f32 on a CPU with
    /// neither).
    Bf16,
}

impl From<PrecisionArg> for Precision {
    fn from(p: PrecisionArg) -> Self {
        match p {
            PrecisionArg::F32 => Precision::F32,
            PrecisionArg::Bf16 => Precision::Bf16,
        }
    }
}

/// [`load_model`], then sets the precision of its products; returns the model and the
/// precision in effect.
pub fn load_model_in(spec: &str, precision: PrecisionArg) -> anyhow::Result<LoadedModel> {
    let mut model = load_model(spec)?;
    let asked = Precision::from(precision);
    let got = model.transformer.set_precision(asked)?;
    if got != asked {
        eprintln!("note: --precision {asked} is not available on this CPU; using {got}");
    }
    Ok(model)
}
