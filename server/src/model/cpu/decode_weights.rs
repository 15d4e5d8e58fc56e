//! Quantized copies of the frozen weights for decoding.
//!
//! Decoding one token reads every weight once; in f32 that is 540 MB per token for
//! SmolLM2-135M, which memory bandwidth caps at about 20 tokens/s on two cores. The
//! decode weights are block-quantized ([`super::quant`]): Q4_1 where that reproduces the
//! f32 weights exactly (every projection of a Q4_1 GGUF, such as the default model), Q8
//! otherwise. When every matrix is exact ([`DecodeWeights::exact`]) decoding computes the
//! trainer's own function; when not, the sampler rescores the chosen tokens with the f32
//! weights, so the log-probabilities it reports are the trainer's either way (see
//! `sample::running`). Projections whose input width is not a multiple of 32 stay f32.

use candle_core::{DType, Tensor};

use super::kernels;
use super::quant::{BlockArith, QuantMatrix, BLOCK};
use super::warm::Warm;
use crate::model::backend::Backend;
use crate::model::transformer::StackedWeights;
use crate::model::weights::{matmul_t, matmul_t_host, BaseWeights, FrozenLinear};
use crate::model::ModelError;

/// Most rows multiplied by exact block weights in bf16 (the tile kernels' limit): up to
/// this many (a short prompt) their kernels beat the trainer's product, beyond it the
/// compute-bound trainer's product is faster (ARCHITECTURE.md has the measurements).
pub const EXACT_ROWS: usize = 32;

/// Most rows multiplied by exact block weights in f32 (prompts prefilled together):
/// about where the trainer's f32 product (which repacks the weights on every call, and
/// is slow on some shapes) catches up with the block kernels; past it the trainer's
/// product takes the rows (`lathe bench gemm`'s `decode_products` compares the two;
/// ARCHITECTURE.md).
pub const EXACT_F32_ROWS: usize = 128;

// Every bf16 product the block weights take fits the bf16 tile kernels.
const _: () = assert!(
    EXACT_ROWS <= super::bf16::blocks::MAX_ROWS
        && kernels::FEW_ROWS <= super::bf16::blocks::MAX_ROWS
);

/// A projection for decoding: block-quantized when its shape allows, beside the f32
/// weight it was made from, which takes the products the block weights do not (more
/// rows than [`DecodeLinear::quantizes`] allows, a width that is not whole blocks).
#[derive(Debug, Clone)]
pub struct DecodeLinear {
    quant: Option<QuantMatrix>,
    f32: FrozenLinear,
    /// The bias as a plain buffer for [`DecodeLinear::forward_host`], copied once.
    bias_host: Option<Vec<f32>>,
}

impl DecodeLinear {
    fn new(l: &FrozenLinear) -> Result<Self, ModelError> {
        let w = &l.weight;
        let eligible =
            w.dims()[1].is_multiple_of(BLOCK) && w.device().is_cpu() && w.dtype() == DType::F32;
        Ok(Self {
            quant: if eligible {
                Some(QuantMatrix::new(w)?)
            } else {
                None
            },
            f32: l.clone(),
            bias_host: l
                .bias
                .as_ref()
                .map(|b| b.to_dtype(DType::F32)?.to_vec1())
                .transpose()?,
        })
    }

    /// Whether decoding through this projection multiplies by the f32 weights exactly.
    pub fn exact(&self) -> bool {
        self.quant.as_ref().is_none_or(QuantMatrix::exact)
    }

    /// `"q4_1"`, `"q8"` or `"f32"`.
    pub fn format(&self) -> &'static str {
        self.quant.as_ref().map_or("f32", QuantMatrix::format)
    }

    /// Whether a product of `m` rows in `arith` goes through the block weights
    /// (otherwise it is the f32 product, and callers may as well take their own f32
    /// path).
    pub fn quantizes(&self, m: usize, arith: BlockArith) -> bool {
        self.quant_for(m, arith).is_some()
    }

    /// The block weights, if they take a product of `m` rows in `arith`.
    fn quant_for(&self, m: usize, arith: BlockArith) -> Option<&QuantMatrix> {
        let limit = |q: &QuantMatrix| match (q.exact(), arith) {
            (true, BlockArith::F32) => EXACT_F32_ROWS,
            (true, BlockArith::Bf16(_)) => EXACT_ROWS,
            (false, _) => kernels::FEW_ROWS,
        };
        self.quant.as_ref().filter(|q| m <= limit(q))
    }

    /// `x W^T + b` with the decode weights, the block weights' products in `arith`.
    pub fn forward(&self, x: &Tensor, arith: BlockArith) -> candle_core::Result<Tensor> {
        match self.quant_for(x.dims()[0], arith) {
            Some(q) => q.matmul_t(x, arith, self.bias_host.as_deref()),
            None => {
                let y = matmul_t(Backend::Cpu, x, &self.f32.weight)?;
                match &self.f32.bias {
                    Some(b) => y.broadcast_add(b),
                    None => Ok(y),
                }
            }
        }
    }

    /// [`DecodeLinear::forward`] over a plain `(m, in)` buffer; returns `(m, out)`.
    pub fn forward_host(
        &self,
        x: &[f32],
        m: usize,
        arith: BlockArith,
    ) -> candle_core::Result<Vec<f32>> {
        self.forward_host_warming(x, m, arith, Warm::NONE)
    }

    /// [`DecodeLinear::forward_host`], pulling `warm` toward the caches while the block
    /// weights' product runs ([`QuantMatrix::matmul_t_host_warming`]).
    pub fn forward_host_warming(
        &self,
        x: &[f32],
        m: usize,
        arith: BlockArith,
        warm: Warm<'_>,
    ) -> candle_core::Result<Vec<f32>> {
        match self.quant_for(m, arith) {
            Some(q) => q.matmul_t_host_warming(x, m, arith, self.bias_host.as_deref(), warm),
            None => {
                let mut y = matmul_t_host(x, m, &self.f32.weight)?;
                if let Some(b) = &self.bias_host {
                    super::decode_step::add_bias(&mut y, b);
                }
                Ok(y)
            }
        }
    }
}

/// One block's decode projections, stacked as the trainer stacks them so a decode step
/// makes four weight passes per block, not seven.
#[derive(Debug, Clone)]
pub struct DecodeLayer {
    /// q, k and v, stacked by rows.
    pub qkv: DecodeLinear,
    /// Attention output.
    pub o: DecodeLinear,
    /// gate and up, stacked by rows.
    pub gate_up: DecodeLinear,
    /// MLP down.
    pub down: DecodeLinear,
}

/// Quantized weights of the whole model.
#[derive(Debug, Clone)]
pub struct DecodeWeights {
    /// Per block.
    pub layers: Vec<DecodeLayer>,
    /// Output projection.
    pub lm_head: DecodeLinear,
}

impl DecodeWeights {
    /// Quantizes `w`, whose blocks' stacked projections are `stacks` (a sixth to a
    /// quarter of their f32 size).
    pub fn new(w: &BaseWeights, stacks: &[StackedWeights<'_>]) -> Result<Self, ModelError> {
        let linear = |weight: &Tensor, bias: Option<&Tensor>| {
            DecodeLinear::new(&FrozenLinear {
                weight: weight.clone(),
                bias: bias.cloned(),
            })
        };
        let layers = w
            .layers
            .iter()
            .zip(stacks)
            .map(|(l, st)| {
                Ok(DecodeLayer {
                    qkv: linear(st.qkv, st.qkv_bias)?,
                    o: DecodeLinear::new(&l.o_proj)?,
                    gate_up: linear(st.gate_up, None)?,
                    down: DecodeLinear::new(&l.down_proj)?,
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        let lm_head = linear(w.lm_head(), None)?;
        Ok(Self { layers, lm_head })
    }

    /// Whether every decode projection multiplies by exactly the trainer's f32 weights,
    /// so decoding needs no f32 rescoring.
    pub fn exact(&self) -> bool {
        self.linears().all(DecodeLinear::exact)
    }

    /// How many projections use each format, e.g. `"q4_1: 120, q8: 1"`, for logs.
    pub fn summary(&self) -> String {
        let mut counts: Vec<(&str, usize)> = Vec::new();
        for l in self.linears() {
            match counts.iter_mut().find(|(f, _)| *f == l.format()) {
                Some((_, n)) => *n += 1,
                None => counts.push((l.format(), 1)),
            }
        }
        counts
            .iter()
            .map(|(f, n)| format!("{f}: {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    }

    fn linears(&self) -> impl Iterator<Item = &DecodeLinear> {
        self.layers
            .iter()
            .flat_map(|l| [&l.qkv, &l.o, &l.gate_up, &l.down])
            .chain([&self.lm_head])
    }
}
