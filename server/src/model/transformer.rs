//! The decoder (Llama, Qwen2, Qwen3) with LoRA at every projection: a forward pass over a
//! packed multi-adapter batch that can keep a tape, and the matching backward pass that
//! returns per-adapter LoRA gradients.
//!
//! Sequences are packed row after row (no padding): the projections run over all rows at
//! once, attention runs per sequence. Rows of one adapter are contiguous ([`Segment`]).

use candle_core::{DType, Device, Tensor};

use super::adapted::{self, Projection};
use super::backend::Backend;
pub use super::batch::{PackedBatch, SeqSpan};
use super::bf16::Bf16Ref;
use super::config::ModelConfig;
use super::decode::{DecodeLayer, DecodeLinear, DecodeWeights};
use super::kv::{self, KvCache};
use super::lora::{lora_forward, Adapter, AdapterGrads, LoraCache, Proj, Segment, Target};
pub use super::ops::TopK;
use super::ops::{self, AttnSaved, RmsSaved, Rope};
use super::weights::{matmul_t, BaseWeights, LayerWeights};
use super::ModelError;

mod head;
mod precision;
use head::HeadChunk;
use precision::Bf16Weights;

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
    seqs: Vec<SeqSpan>,
    segments: Vec<Segment>,
    n_adapters: usize,
}

impl Transformer {
    /// Wraps checked weights, precomputing the RoPE tables.
    pub fn new(config: ModelConfig, mut weights: BaseWeights) -> Result<Self, ModelError> {
        config.validate()?;
        weights.check_shapes(&config)?;
        let fused = stack_projections(&config, &mut weights)?;
        let backend = Backend::for_device(weights.device());
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

    /// The backend computing this model's operations.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// Computes with `backend` from now on. The CPU backend needs the weights on the
    /// CPU. The device backend has no bf16 tiles: choosing it returns the frozen
    /// products to f32 (see [`Transformer::set_precision`]).
    pub fn set_backend(&mut self, backend: Backend) -> Result<(), ModelError> {
        if backend == Backend::Cpu && !self.device().is_cpu() {
            return Err(ModelError::Input(format!(
                "the CPU backend needs the weights on the CPU, not on {:?}",
                self.device().location()
            )));
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

    /// Log-probabilities of `targets` (`(rows, k)` u32) at every row of `batch`, and the
    /// tape for [`Transformer::backward`] when `keep_tape` is set.
    pub fn forward_logprobs(
        &self,
        batch: &PackedBatch,
        adapters: &[&Adapter],
        targets: &Tensor,
        keep_tape: bool,
    ) -> Result<(Tensor, Option<Tape>), ModelError> {
        let Hidden {
            xf,
            norm,
            tapes,
            cos,
            sin,
        } = self.hidden(batch, adapters, keep_tape)?;
        let (lp, head) =
            self.head_logprobs(&xf, batch, adapters, targets, keep_tape, 0, &mut Vec::new())?;
        let tape = keep_tape.then(|| Tape {
            layers: tapes,
            norm,
            xf,
            head,
            targets: targets.clone(),
            cos,
            sin,
            seqs: batch.seqs.clone(),
            segments: batch.segments.clone(),
            n_adapters: adapters.len(),
        });
        Ok((lp, tape))
    }

    /// The final norm's output over `batch` (and each layer's tape when `keep_tape`).
    fn hidden(
        &self,
        batch: &PackedBatch,
        adapters: &[&Adapter],
        keep_tape: bool,
    ) -> Result<Hidden, ModelError> {
        self.check_batch(batch, adapters)?;
        let (cos, sin) = self.rope.gather(&batch.positions)?;
        let mut h = self.weights.embed_tokens.index_select(&batch.tokens, 0)?;
        let mut tapes = Vec::new();
        for (i, layer) in self.weights.layers.iter().enumerate() {
            let (next, tape) =
                self.layer_forward(i, layer, &h, batch, adapters, &cos, &sin, None, None)?;
            h = next;
            if keep_tape {
                tapes.push(tape);
            }
        }
        let (xf, norm) = ops::rms_norm(
            self.backend,
            &h,
            &self.weights.norm,
            self.config.rms_norm_eps,
        )?;
        Ok(Hidden {
            xf,
            norm,
            tapes,
            cos,
            sin,
        })
    }

    /// Runs `batch` through the model appending to each sequence's KV cache, and returns
    /// the next-token logits of each sequence's last row, `(seqs, vocab)`. With
    /// `quantized`, the frozen projections use the block-quantized decode weights (a part
    /// of the CPU backend; the device backend decodes with the model's own weights).
    pub fn forward_cached(
        &self,
        batch: &PackedBatch,
        adapters: &[&Adapter],
        caches: &mut [&mut KvCache],
        quantized: bool,
    ) -> Result<Tensor, ModelError> {
        let dec = if quantized && self.backend == Backend::Cpu {
            Some(self.decode_weights()?)
        } else {
            None
        };
        let h = self.cached_hidden(batch, adapters, caches, dec)?;
        self.last_row_logits(&h, batch, adapters, dec)
    }

    /// Like [`Transformer::forward_cached`] with the f32 weights, and also the
    /// log-probabilities of `targets` (`(rows, 1)` u32) at every row: one pass both
    /// prefills prompts and scores them, or scores tokens that continue cached prompts.
    /// Returns `(last-row logits, logprobs)`.
    pub fn forward_cached_logprobs(
        &self,
        batch: &PackedBatch,
        adapters: &[&Adapter],
        caches: &mut [&mut KvCache],
        targets: &Tensor,
    ) -> Result<(Tensor, Tensor), ModelError> {
        let (logits, lp, _) = self.forward_cached_topk(batch, adapters, caches, targets, 0)?;
        Ok((logits, lp))
    }

    /// [`Transformer::forward_cached_logprobs`], also returning the `k` most likely next
    /// tokens of every row with their log-probabilities, most likely first (empty rows
    /// when `k` is 0).
    pub fn forward_cached_topk(
        &self,
        batch: &PackedBatch,
        adapters: &[&Adapter],
        caches: &mut [&mut KvCache],
        targets: &Tensor,
        k: usize,
    ) -> Result<(Tensor, Tensor, Vec<TopK>), ModelError> {
        let h = self.cached_hidden(batch, adapters, caches, None)?;
        let logits = self.last_row_logits(&h, batch, adapters, None)?;
        let (xf, _) = ops::rms_norm(
            self.backend,
            &h,
            &self.weights.norm,
            self.config.rms_norm_eps,
        )?;
        let mut topk = Vec::new();
        let (lp, _) = self.head_logprobs(&xf, batch, adapters, targets, false, k, &mut topk)?;
        Ok((logits, lp, topk))
    }

    /// Next-token logits of each sequence's last row, `(seqs, vocab)`: one head matmul
    /// for all rows, then each row's adapter (rows follow the sequences, which are
    /// grouped by adapter).
    fn last_row_logits(
        &self,
        h: &Tensor,
        batch: &PackedBatch,
        adapters: &[&Adapter],
        dec: Option<&DecodeWeights>,
    ) -> Result<Tensor, ModelError> {
        let last: Vec<u32> = batch
            .seqs
            .iter()
            .map(|s| (s.start + s.len - 1) as u32)
            .collect();
        let idx = Tensor::new(last.as_slice(), h.device())?;
        let h_last = h.index_select(&idx, 0)?;
        let (xf, _) = ops::rms_norm(
            self.backend,
            &h_last,
            &self.weights.norm,
            self.config.rms_norm_eps,
        )?;
        let base = match dec {
            Some(d) => d.lm_head.forward(&xf)?,
            None => matmul_t(self.backend, &xf, self.weights.lm_head())?,
        };
        let mut segs: Vec<Segment> = Vec::new();
        for (i, s) in batch.seqs.iter().enumerate() {
            match segs.last_mut() {
                Some(g) if g.adapter == s.adapter => g.len += 1,
                _ => segs.push(Segment {
                    start: i,
                    len: 1,
                    adapter: s.adapter,
                }),
            }
        }
        let (logits, _) = lora_forward(self.backend, &xf, base, Target::LmHead, &segs, adapters)?;
        Ok(logits)
    }

    /// The residual stream after the last block for every row of `batch`, appending to
    /// the sequences' KV caches.
    fn cached_hidden(
        &self,
        batch: &PackedBatch,
        adapters: &[&Adapter],
        caches: &mut [&mut KvCache],
        dec: Option<&DecodeWeights>,
    ) -> Result<Tensor, ModelError> {
        self.check_batch(batch, adapters)?;
        if caches.len() != batch.seqs.len() {
            return Err(ModelError::Input(
                "one KV cache per sequence is required".into(),
            ));
        }
        let (cos, sin) = self.rope.gather(&batch.positions)?;
        let mut h = self.weights.embed_tokens.index_select(&batch.tokens, 0)?;
        for (i, layer) in self.weights.layers.iter().enumerate() {
            let (next, _) = self.layer_forward(
                i,
                layer,
                &h,
                batch,
                adapters,
                &cos,
                &sin,
                Some(&mut *caches),
                dec.map(|d| &d.layers[i]),
            )?;
            h = next;
        }
        Ok(h)
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

    /// Block `index`'s projections, over the stacked weights.
    fn projections<'a>(&'a self, index: usize, t: &'a BlockTargets) -> BlockProjections<'a> {
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
            },
            o: Projection {
                weight: &w.o_proj.weight,
                bias: w.o_proj.bias.as_ref(),
                parts: &t.o,
                bf16: packed(1),
                backend: self.backend,
            },
            gate_up: Projection {
                weight: &f.gate_up,
                bias: None,
                parts: &t.gate_up,
                bf16: packed(2),
                backend: self.backend,
            },
            down: Projection {
                weight: &w.down_proj.weight,
                bias: w.down_proj.bias.as_ref(),
                parts: &t.down,
                bf16: packed(3),
                backend: self.backend,
            },
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn layer_forward(
        &self,
        index: usize,
        w: &LayerWeights,
        h: &Tensor,
        batch: &PackedBatch,
        adapters: &[&Adapter],
        cos: &Tensor,
        sin: &Tensor,
        caches: Option<&mut [&mut KvCache]>,
        dec: Option<&DecodeLayer>,
    ) -> Result<(Tensor, LayerTape), ModelError> {
        let cfg = &self.config;
        let segs = &batch.segments;
        let targets = BlockTargets::new(cfg, index);
        let BlockProjections {
            qkv,
            o,
            gate_up,
            down,
        } = self.projections(index, &targets);
        let (qd, kvd) = (cfg.q_dim(), cfg.kv_dim());
        // The frozen products come from the f32 weights, or the decode weights when
        // those take this many rows (else the fused f32 path with its LoRA kernels).
        let project = |x: &Tensor,
                       p: &Projection,
                       quantized: Option<&DecodeLinear>|
         -> candle_core::Result<(Tensor, PartCaches)> {
            match quantized.filter(|d| d.quantizes(x.dims()[0])) {
                Some(d) => {
                    adapted::add_deltas(self.backend, x, d.forward(x)?, p.parts, segs, adapters)
                }
                None => adapted::forward(x, p, segs, adapters),
            }
        };
        let n = h.dims()[0];
        let (hq, hkv, hd) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let (x1, norm1) = ops::rms_norm(self.backend, h, &w.input_layernorm, cfg.rms_norm_eps)?;
        let (y, lqkv) = project(&x1, &qkv, dec.map(|d| &d.qkv))?;
        let q = y.narrow(1, 0, qd)?;
        let k = y.narrow(1, qd, kvd)?;
        let v = y.narrow(1, qd + kvd, kvd)?;
        let mut q = q.reshape((n, hq, hd))?;
        let mut k = k.reshape((n, hkv, hd))?;
        let (mut q_norm, mut k_norm) = (None, None);
        if let (Some(qn), Some(kn)) = (&w.q_norm, &w.k_norm) {
            let (qq, sq) = ops::rms_norm(self.backend, &q, qn, cfg.rms_norm_eps)?;
            let (kk, sk) = ops::rms_norm(self.backend, &k, kn, cfg.rms_norm_eps)?;
            (q, k, q_norm, k_norm) = (qq, kk, Some(sq), Some(sk));
        }
        let q = ops::rope(self.backend, &q, cos, sin)?.reshape((n, hq * hd))?;
        let k = ops::rope(self.backend, &k, cos, sin)?.reshape((n, hkv * hd))?;
        let mut saved = Vec::new();
        let attn_out = match caches {
            Some(caches) => kv::cached_attention(
                self.backend,
                index,
                &q,
                &k,
                &v,
                &batch.seqs,
                caches,
                hq,
                hkv,
            )?,
            None => {
                let mut outs = Vec::with_capacity(batch.seqs.len());
                for s in &batch.seqs {
                    let (o, sv) = ops::attention(
                        self.backend,
                        &q.narrow(0, s.start, s.len)?,
                        &k.narrow(0, s.start, s.len)?,
                        &v.narrow(0, s.start, s.len)?,
                        hq,
                        hkv,
                    )?;
                    outs.push(o);
                    saved.push(sv);
                }
                if outs.len() == 1 {
                    outs.pop().expect("one sequence")
                } else {
                    Tensor::cat(&outs, 0)?
                }
            }
        };
        let (o, lo) = project(&attn_out, &o, dec.map(|d| &d.o))?;
        let h2 = ops::add(self.backend, h, &o)?;
        let (x2, norm2) = ops::rms_norm(
            self.backend,
            &h2,
            &w.post_attention_layernorm,
            cfg.rms_norm_eps,
        )?;
        let (gate_up, lgu) = project(&x2, &gate_up, dec.map(|d| &d.gate_up))?;
        let act = ops::swiglu(self.backend, &gate_up)?;
        let (down, ldown) = project(&act, &down, dec.map(|d| &d.down))?;
        let h3 = ops::add(self.backend, &h2, &down)?;
        Ok((
            h3,
            LayerTape {
                norm1,
                x1,
                lqkv,
                q_norm,
                k_norm,
                attn: saved,
                attn_out,
                lo,
                norm2,
                x2,
                lgu,
                gate_up,
                act,
                ldown,
            },
        ))
    }

    /// Backward pass: given `dlp = dLoss/dlogprob` (same shape as the targets), returns
    /// the LoRA gradients of each adapter of the forward pass (in its order).
    pub fn backward(
        &self,
        tape: Tape,
        adapters: &[&Adapter],
        dlp: &Tensor,
    ) -> Result<Vec<AdapterGrads>, ModelError> {
        if adapters.len() != tape.n_adapters {
            return Err(ModelError::Input(
                "backward needs the adapters of the forward pass".into(),
            ));
        }
        let dlogits = |c: &HeadChunk| -> Result<Tensor, ModelError> {
            let d = dlp.narrow(0, c.start, c.len)?.contiguous()?;
            let t = tape.targets.narrow(0, c.start, c.len)?.contiguous()?;
            Ok(ops::logprobs_at_backward(
                self.backend,
                &c.logits,
                &c.lse,
                &t,
                &d,
            )?)
        };
        let mut grads = vec![AdapterGrads::default(); adapters.len()];
        let dxf = self.head_backward(&tape, adapters, dlogits, &mut grads)?;
        self.backward_below_head(tape, adapters, dxf, grads)
    }

    /// The backward pass from the final norm's output gradient down.
    fn backward_below_head(
        &self,
        tape: Tape,
        adapters: &[&Adapter],
        dxf: Tensor,
        mut grads: Vec<AdapterGrads>,
    ) -> Result<Vec<AdapterGrads>, ModelError> {
        let Tape {
            layers,
            norm,
            cos,
            sin,
            seqs,
            segments,
            ..
        } = tape;
        let mut dh = ops::rms_norm_backward(&dxf, &self.weights.norm, &norm)?;
        for (i, lt) in layers.into_iter().enumerate().rev() {
            dh = self.layer_backward(
                i, lt, dh, &seqs, &segments, adapters, &cos, &sin, &mut grads,
            )?;
        }
        Ok(grads)
    }

    #[allow(clippy::too_many_arguments)]
    fn layer_backward(
        &self,
        index: usize,
        t: LayerTape,
        dh: Tensor,
        seqs: &[SeqSpan],
        segs: &[Segment],
        adapters: &[&Adapter],
        cos: &Tensor,
        sin: &Tensor,
        grads: &mut [AdapterGrads],
    ) -> Result<Tensor, ModelError> {
        let cfg = &self.config;
        let w = &self.weights.layers[index];
        let targets = BlockTargets::new(cfg, index);
        let p = self.projections(index, &targets);
        let back = |x: &Tensor,
                    dy: &Tensor,
                    p: &Projection,
                    caches: &[LoraCache],
                    grads: &mut [AdapterGrads]| {
            adapted::backward(x, dy, p, segs, adapters, caches, grads)
        };
        let n = dh.dims()[0];
        let (hq, hkv, hd) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        // MLP
        let dact = back(&t.act, &dh, &p.down, &t.ldown, grads)?;
        let dgu = ops::swiglu_backward(self.backend, &dact, &t.gate_up)?;
        let dx2 = back(&t.x2, &dgu, &p.gate_up, &t.lgu, grads)?;
        let dh2 = ops::add(
            self.backend,
            &dh,
            &ops::rms_norm_backward(&dx2, &w.post_attention_layernorm, &t.norm2)?,
        )?;
        // attention
        let dattn = back(&t.attn_out, &dh2, &p.o, &t.lo, grads)?;
        let (mut dqs, mut dks, mut dvs) = (Vec::new(), Vec::new(), Vec::new());
        for (s, saved) in seqs.iter().zip(&t.attn) {
            let (dq, dk, dv) =
                ops::attention_backward(self.backend, &dattn.narrow(0, s.start, s.len)?, saved)?;
            dqs.push(dq);
            dks.push(dk);
            dvs.push(dv);
        }
        let dq = Tensor::cat(&dqs, 0)?.reshape((n, hq, hd))?;
        let dk = Tensor::cat(&dks, 0)?.reshape((n, hkv, hd))?;
        let dv = Tensor::cat(&dvs, 0)?;
        let mut dq = ops::rope_backward(self.backend, &dq, cos, sin)?;
        let mut dk = ops::rope_backward(self.backend, &dk, cos, sin)?;
        if let (Some(qn), Some(kn), Some(sq), Some(sk)) =
            (&w.q_norm, &w.k_norm, &t.q_norm, &t.k_norm)
        {
            dq = ops::rms_norm_backward(&dq, qn, sq)?;
            dk = ops::rms_norm_backward(&dk, kn, sk)?;
        }
        let dqkv = Tensor::cat(
            &[dq.reshape((n, hq * hd))?, dk.reshape((n, hkv * hd))?, dv],
            1,
        )?;
        let dx1 = back(&t.x1, &dqkv, &p.qkv, &t.lqkv, grads)?;
        Ok(ops::add(
            self.backend,
            &dh2,
            &ops::rms_norm_backward(&dx1, &w.input_layernorm, &t.norm1)?,
        )?)
    }
}
