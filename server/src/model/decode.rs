//! Quantized copies of the frozen weights for decoding.
//!
//! Decoding one token reads every weight once; in f32 that is 540 MB per token for
//! SmolLM2-135M, which memory bandwidth caps at about 20 tokens/s on two cores. Q8_0
//! (8-bit blocks of 32 with an f16 scale) reads a quarter of that. The sampler uses these
//! weights to choose tokens and then rescores the chosen tokens with the f32 trainer
//! weights, so the log-probabilities it reports are exactly the trainer's (see
//! `sample::decode`). Projections whose input width is not a multiple of 32 stay f32.

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Module, Tensor};

use super::weights::{BaseWeights, FrozenLinear};
use super::ModelError;

/// A projection for decoding: Q8_0 when its shape allows, else the f32 weight.
#[derive(Debug, Clone)]
pub struct DecodeLinear {
    matmul: QMatMul,
    bias: Option<Tensor>,
}

impl DecodeLinear {
    fn new(l: &FrozenLinear) -> Result<Self, ModelError> {
        Ok(Self {
            matmul: quantize(&l.weight)?,
            bias: l.bias.clone(),
        })
    }

    /// `x W^T + b` with the decode weights.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = self.matmul.forward(&x.contiguous()?)?;
        match &self.bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}

fn quantize(w: &Tensor) -> Result<QMatMul, ModelError> {
    let in_dim = w.dims()[1];
    if in_dim % GgmlDType::Q8_0.block_size() != 0 || !w.device().is_cpu() {
        return Ok(QMatMul::Tensor(w.clone()));
    }
    Ok(QMatMul::from_qtensor(QTensor::quantize(
        w,
        GgmlDType::Q8_0,
    )?)?)
}

/// The seven projections of one block, in [`super::Proj::ALL`] order.
pub type DecodeLayer = [DecodeLinear; 7];

/// Quantized weights of the whole model.
#[derive(Debug, Clone)]
pub struct DecodeWeights {
    /// Per block.
    pub layers: Vec<DecodeLayer>,
    /// Output projection.
    pub lm_head: DecodeLinear,
}

impl DecodeWeights {
    /// Quantizes `w` (about a quarter of its f32 size).
    pub fn new(w: &BaseWeights) -> Result<Self, ModelError> {
        let layers = w
            .layers
            .iter()
            .map(|l| {
                Ok([
                    DecodeLinear::new(&l.q_proj)?,
                    DecodeLinear::new(&l.k_proj)?,
                    DecodeLinear::new(&l.v_proj)?,
                    DecodeLinear::new(&l.o_proj)?,
                    DecodeLinear::new(&l.gate_proj)?,
                    DecodeLinear::new(&l.up_proj)?,
                    DecodeLinear::new(&l.down_proj)?,
                ])
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        let lm_head = DecodeLinear::new(&FrozenLinear {
            weight: w.lm_head().clone(),
            bias: None,
        })?;
        Ok(Self { layers, lm_head })
    }
}
