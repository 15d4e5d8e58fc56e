//! The element type of the frozen products: the base weights packed for bf16 (see
//! [`crate::model::cpu::bf16`]) and the switch between f32 and bf16.

use candle_core::DType;

use super::Transformer;
use crate::model::backend::Backend;
use crate::model::cpu::bf16::{self, Bf16Ref, Precision};
use crate::model::ModelError;

/// The frozen weights packed for bf16 products, and the kernel that reads them.
#[derive(Debug)]
pub(super) struct Bf16Weights {
    pub(super) kernel: bf16::Kernel,
    /// Per block: q/k/v, o, gate/up, down.
    pub(super) layers: Vec<[bf16::PackedWeight; 4]>,
    /// The output head.
    pub(super) head: bf16::PackedWeight,
}

impl Transformer {
    /// Chooses the element type of the frozen products of training and prefill, and
    /// returns the one in effect. bf16 needs f32 weights on the CPU and a CPU with a
    /// bf16 kernel (AMX or AVX512-BF16); without one the model stays in f32 (and says
    /// so in the log). Packing the weights takes a moment and holds as many bytes again as the f32
    /// weights (two bf16 layouts of each).
    pub fn set_precision(&mut self, precision: Precision) -> Result<Precision, ModelError> {
        if precision == Precision::F32 {
            self.bf16 = None;
            return Ok(Precision::F32);
        }
        if self.backend != Backend::Cpu || self.weights.dtype() != DType::F32 {
            return Err(ModelError::Input(
                "bf16 precision needs the model's f32 weights on the CPU backend".into(),
            ));
        }
        let Some(kernel) = bf16::kernel() else {
            tracing::warn!(
                "this CPU has neither AMX nor AVX512-BF16: the base model's products stay in f32"
            );
            self.bf16 = None;
            return Ok(Precision::F32);
        };
        let start = std::time::Instant::now();
        let pack = bf16::PackedWeight::from_tensor;
        let layers = self
            .fused
            .iter()
            .zip(&self.weights.layers)
            .map(|(f, w)| {
                Ok([
                    pack(&f.qkv)?,
                    pack(&w.o_proj.weight)?,
                    pack(&f.gate_up)?,
                    pack(&w.down_proj.weight)?,
                ])
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let packed = Bf16Weights {
            kernel,
            layers,
            head: pack(self.weights.lm_head())?,
        };
        let bytes: usize = packed.head.bytes()
            + packed
                .layers
                .iter()
                .flatten()
                .map(|p| p.bytes())
                .sum::<usize>();
        tracing::info!(
            kernel = kernel.name(),
            mib = bytes >> 20,
            seconds = format!("{:.2}", start.elapsed().as_secs_f64()),
            "base weights packed for bf16 products"
        );
        self.bf16 = Some(std::sync::Arc::new(packed));
        Ok(Precision::Bf16)
    }

    /// The element type of the frozen products of training and prefill.
    pub fn precision(&self) -> Precision {
        if self.bf16.is_some() {
            Precision::Bf16
        } else {
            Precision::F32
        }
    }

    /// The packed output head, in bf16 precision.
    pub(super) fn bf16_head(&self) -> Option<Bf16Ref<'_>> {
        self.bf16.as_ref().map(|b| Bf16Ref {
            kernel: b.kernel,
            weight: &b.head,
        })
    }
}
