//! The decoder (Llama, Qwen2, Qwen3) with LoRA at every projection: a forward pass over a
//! packed multi-adapter batch that can keep a tape, and the matching backward pass that
//! returns per-adapter LoRA gradients.
//!
//! Sequences are packed row after row (no padding): the projections run over all rows at
//! once, attention runs per sequence. Rows of one adapter are contiguous ([`Segment`]).
//!
//! This file holds the model and its weights; the passes are split by job: `forward`
//! (training and scoring), `head` (the output head in row chunks), `backward`, `cached`
//! (decoding against KV caches) and `precision` (bf16 products). Every operation runs on
//! the model's [`Backend`].

use candle_core::{DType, Device, Tensor};

use super::adapted::{self, Projection};
use super::backend::Backend;
pub use super::batch::{PackedBatch, SeqSpan};
use super::config::ModelConfig;
use super::cpu::bf16::Bf16Ref;
use super::cpu::decode_weights::{DecodeLayer, DecodeLinear, DecodeWeights};
use super::kv::{self, KvCache};
use super::lora::{lora_forward, Adapter, AdapterGrads, LoraCache, Proj, Segment, Target};
pub use super::ops::TopK;
use super::ops::{self, AttnSaved, RmsSaved, Rope};
use super::weights::{BaseWeights, LayerWeights};
use super::ModelError;

mod backward;
mod cached;
mod forward;
mod head;
mod precision;
use head::HeadChunk;
use precision::Bf16Weights;
pub use precision::Frozen;

/// Stacks each block's q/k/v and gate/up weights and points the separate weights at row
/// ranges of the stacks.
fn stack_projections(
    cfg: &ModelConfig,
    w: &mut BaseWeights,
) -> Result<Vec<FusedLayer>, ModelError> {
    let mut out = Vec::with_capacity(w.layers.len());
    for l in &mut w.layers {
        let qkv = Tensor::cat(&[&l.q_proj.weight, &l.k_proj.weight, &l.v_proj.weight], 0)?;
        let qkv_bias = match (&l.q_proj.bias, &l.k_proj.bias, &l.v_proj.bias) {
            (Some(q), Some(k), Some(v)) => Some(Tensor::cat(&[q, k, v], 0)?),
            _ => None,
        };
        let gate_up = Tensor::cat(&[&l.gate_proj.weight, &l.up_proj.weight], 0)?;
        let (qd, kvd, f) = (cfg.q_dim(), cfg.kv_dim(), cfg.intermediate_size);
        l.q_proj.weight = qkv.narrow(0, 0, qd)?;
        l.k_proj.weight = qkv.narrow(0, qd, kvd)?;
        l.v_proj.weight = qkv.narrow(0, qd + kvd, kvd)?;
        l.gate_proj.weight = gate_up.narrow(0, 0, f)?;
        l.up_proj.weight = gate_up.narrow(0, f, f)?;
        out.push(FusedLayer {
            qkv,
            qkv_bias,
            gate_up,
        });
    }
    Ok(out)
}

/// The LoRA target and output width of each part of a block's projections.
struct BlockTargets {
    qkv: [(Target, usize); 3],
    o: [(Target, usize); 1],
    gate_up: [(Target, usize); 2],
    down: [(Target, usize); 1],
}

impl BlockTargets {
    fn new(cfg: &ModelConfig, layer: usize) -> Self {
        let part = |p: Proj, width: usize| (Target::Layer(layer, p), width);
        let (qd, kvd, d, f) = (
            cfg.q_dim(),
            cfg.kv_dim(),
            cfg.hidden_size,
            cfg.intermediate_size,
        );
        Self {
            qkv: [part(Proj::Q, qd), part(Proj::K, kvd), part(Proj::V, kvd)],
            o: [part(Proj::O, d)],
            gate_up: [part(Proj::Gate, f), part(Proj::Up, f)],
            down: [part(Proj::Down, d)],
        }
    }
}

/// A block's four frozen projections (q/k/v and gate/up stacked) with their targets.
struct BlockProjections<'a> {
    qkv: Projection<'a>,
    o: Projection<'a>,
    gate_up: Projection<'a>,
    down: Projection<'a>,
}

/// The frozen decoder.
#[derive(Debug, Clone)]
pub struct Transformer {
    /// Hyper-parameters.
    pub config: ModelConfig,
    /// Frozen weights in the Hugging Face layout.
    pub weights: BaseWeights,
    rope: Rope,
    /// Block-quantized copies for decoding, built on first use.
    decode: std::sync::OnceLock<DecodeWeights>,
    /// Per block, q/k/v and gate/up weights stacked so each group is one matmul.
    fused: Vec<FusedLayer>,
    /// The frozen weights packed for bf16 products ([`Transformer::set_precision`]).
    bf16: Option<std::sync::Arc<Bf16Weights>>,
    /// What computes the operations ([`Transformer::set_backend`]).
    backend: Backend,
}

/// The stacked projections of one block. The separate `q_proj`, ... weights of
/// [`BaseWeights`] are row ranges (views) of these, so stacking costs no memory.
#[derive(Debug, Clone)]
struct FusedLayer {
    /// `(q_dim + 2 kv_dim, hidden)`.
    qkv: Tensor,
    /// Stacked q/k/v biases (Qwen2).
    qkv_bias: Option<Tensor>,
    /// `(2 intermediate, hidden)`.
    gate_up: Tensor,
}

impl FusedLayer {
    fn view(&self) -> StackedWeights<'_> {
        StackedWeights {
            qkv: &self.qkv,
            qkv_bias: self.qkv_bias.as_ref(),
            gate_up: &self.gate_up,
        }
    }
}

/// A block's stacked projections: q/k/v `(q_dim + 2 kv_dim, hidden)` with its bias, and
/// gate/up `(2 intermediate, hidden)`.
pub struct StackedWeights<'a> {
    /// q, k and v, stacked by rows.
    pub qkv: &'a Tensor,
    /// Their stacked biases (Qwen2).
    pub qkv_bias: Option<&'a Tensor>,
    /// gate and up, stacked by rows.
    pub gate_up: &'a Tensor,
}

/// One LoRA cache per part of a projection (see [`adapted::forward`]).
type PartCaches = Vec<LoraCache>;

struct LayerTape {
    norm1: RmsSaved,
    x1: Tensor,
    lqkv: PartCaches,
    q_norm: Option<RmsSaved>,
    k_norm: Option<RmsSaved>,
    attn: Vec<AttnSaved>,
    attn_out: Tensor,
    lo: PartCaches,
    norm2: RmsSaved,
    x2: Tensor,
    lgu: PartCaches,
    /// The stacked `[gate | up]` projection output.
    gate_up: Tensor,
    act: Tensor,
    ldown: PartCaches,
}

/// A forward pass up to the output head.
struct Hidden {
    xf: Tensor,
    norm: RmsSaved,
    tapes: Vec<LayerTape>,
    cos: Tensor,
    sin: Tensor,
}

/// Everything the backward pass needs from a forward pass.
pub struct Tape {
    layers: Vec<LayerTape>,
    norm: RmsSaved,
    xf: Tensor,
    head: Vec<HeadChunk>,
    targets: Tensor,
    cos: Tensor,
    sin: Tensor,
    segments: Vec<Segment>,
    n_adapters: usize,
}

impl Transformer {
    /// Wraps checked weights, precomputing the RoPE tables.
    pub fn new(config: ModelConfig, mut weights: BaseWeights) -> Result<Self, ModelError> {
        config.validate()?;
        weights.check_shapes(&config)?;
        let fused = stack_projections(&config, &mut weights)?;
        // Narrowed matrices have no CPU fast paths: candle's ops run them anywhere.
        let backend = match weights.matrix_dtype() == weights.dtype() {
            true => Backend::for_device(weights.device()),
            false => Backend::Device,
        };
        let rope = Rope::new(
            config.head_dim,
            config.rope_theta,
            config.max_position_embeddings.max(1),
            weights.dtype(),
            weights.device(),
        )?;
        Ok(Self {
            config,
            weights,
            rope,
            decode: std::sync::OnceLock::new(),
            fused,
            bf16: None,
            backend,
        })
    }

    /// Whether the quantized decode weights have been built (they are built on first use
    /// only: a server decoding with the f32 weights never pays for them).
    pub fn has_decode_weights(&self) -> bool {
        self.decode.get().is_some()
    }

    /// The quantized decode weights, built on first call.
    pub fn decode_weights(&self) -> Result<&DecodeWeights, ModelError> {
        if let Some(d) = self.decode.get() {
            return Ok(d);
        }
        let start = std::time::Instant::now();
        let stacks: Vec<StackedWeights<'_>> = self.fused.iter().map(FusedLayer::view).collect();
        let built = DecodeWeights::new(&self.weights, &stacks)?;
        tracing::info!(
            formats = %built.summary(),
            exact = built.exact(),
            seconds = format!("{:.2}", start.elapsed().as_secs_f64()),
            "decode weights built"
        );
        Ok(self.decode.get_or_init(|| built))
    }

    /// A copy in another dtype (f64 for gradient checks), on the same backend.
    pub fn to_dtype(&self, dtype: DType) -> Result<Self, ModelError> {
        let mut copy = Self::new(self.config.clone(), self.weights.to_dtype(dtype)?)?;
        copy.set_backend(self.backend)?;
        Ok(copy)
    }

    /// A copy on `device`, on that device's backend ([`Backend::for_device`]; the device
    /// backend for bf16-narrowed matrices).
    pub fn to_device(&self, device: &Device) -> Result<Self, ModelError> {
        Self::new(self.config.clone(), self.weights.to_device(device)?)
    }

    /// The backend computing this model's operations.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// Computes with `backend` from now on. The CPU backend needs the weights on the
    /// CPU, not narrowed to bf16. The device backend has no bf16 tiles: choosing it
    /// returns the frozen products to f32 (see [`Transformer::set_precision`]).
    pub fn set_backend(&mut self, backend: Backend) -> Result<(), ModelError> {
        if backend == Backend::Cpu && !self.device().is_cpu() {
            return Err(ModelError::Input(format!(
                "the CPU backend needs the weights on the CPU, not on {:?}",
                self.device().location()
            )));
        }
        if backend == Backend::Cpu && self.weights.matrix_dtype() != self.weights.dtype() {
            return Err(ModelError::Input(
                "the CPU backend needs the base weights in the activations' type; \
                 load the model again"
                    .into(),
            ));
        }
        if backend == Backend::Device {
            self.bf16 = None;
        }
        self.backend = backend;
        Ok(())
    }

    /// Block `layer`'s stacked projections (the f32 weights the trainer uses).
    pub fn stacked(&self, layer: usize) -> StackedWeights<'_> {
        self.fused[layer].view()
    }

    /// The RoPE `(cos, sin)` rows of `positions`, each `(n, head_dim / 2)` row-major.
    pub fn rope_rows(&self, positions: &[u32]) -> Result<(Vec<f32>, Vec<f32>), ModelError> {
        let idx = Tensor::new(positions, self.device())?;
        let (cos, sin) = self.rope.gather(&idx)?;
        let host = |t: Tensor| -> candle_core::Result<Vec<f32>> {
            t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()
        };
        Ok((host(cos)?, host(sin)?))
    }

    /// Longest sequence (prompt plus generation) the model accepts.
    pub fn max_seq_len(&self) -> usize {
        self.rope.max_len()
    }

    /// Device of the weights.
    pub fn device(&self) -> &Device {
        self.weights.device()
    }

    fn check_batch(&self, batch: &PackedBatch, adapters: &[&Adapter]) -> Result<(), ModelError> {
        for s in &batch.seqs {
            if let Some(a) = s.adapter {
                if a >= adapters.len() {
                    return Err(ModelError::Input(format!("adapter index {a} out of range")));
                }
            }
        }
        let max_tok = batch.tokens.max(0)?.to_scalar::<u32>()? as usize;
        if max_tok >= self.config.vocab_size {
            return Err(ModelError::Input(format!(
                "token id {max_tok} is out of range for a vocabulary of {}",
                self.config.vocab_size
            )));
        }
        let max_pos = batch.positions.max(0)?.to_scalar::<u32>()? as usize;
        if max_pos >= self.max_seq_len() {
            return Err(ModelError::Input(format!(
                "sequence of {} tokens exceeds the context limit of {}",
                max_pos + 1,
                self.max_seq_len()
            )));
        }
        Ok(())
    }

    /// Block `index`'s projections, over the stacked weights; `few_rows` as in
    /// [`Projection::few_rows`].
    fn projections<'a>(
        &'a self,
        index: usize,
        t: &'a BlockTargets,
        few_rows: bool,
    ) -> BlockProjections<'a> {
        let (f, w) = (&self.fused[index], &self.weights.layers[index]);
        let packed = |i: usize| {
            self.bf16.as_ref().map(|b| Bf16Ref {
                kernel: b.kernel,
                weight: &b.layers[index][i],
            })
        };
        BlockProjections {
            qkv: Projection {
                weight: &f.qkv,
                bias: f.qkv_bias.as_ref(),
                parts: &t.qkv,
                bf16: packed(0),
                backend: self.backend,
                few_rows,
            },
            o: Projection {
                weight: &w.o_proj.weight,
                bias: w.o_proj.bias.as_ref(),
                parts: &t.o,
                bf16: packed(1),
                backend: self.backend,
                few_rows,
            },
            gate_up: Projection {
                weight: &f.gate_up,
                bias: None,
                parts: &t.gate_up,
                bf16: packed(2),
                backend: self.backend,
                few_rows,
            },
            down: Projection {
                weight: &w.down_proj.weight,
                bias: w.down_proj.bias.as_ref(),
                parts: &t.down,
                bf16: packed(3),
                backend: self.backend,
                few_rows,
            },
        }
    }
}
