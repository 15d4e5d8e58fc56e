//! One decode step on the CPU over plain `f32` buffers.
//!
//! A decode step advances every live sequence by one token. Each projection is then a
//! product of a few rows with a weight matrix, and all other work is on vectors of the
//! hidden width. Run through candle, such a step is several hundred small tensor ops per
//! layer group. Each op allocates, and each LoRA segment narrows, multiplies and
//! concatenates. That overhead cost more than the weight reads themselves: about 18 of
//! the 30 ms a token took on SmolLM2-135M.
//!
//! Here the step is straight loops over `Vec<f32>`:
//! - the frozen projections go through the decode weights' few-rows kernels (the only
//!   parallel part);
//! - each row gets its own adapter's `B (A x)`;
//! - RMSNorm, RoPE, SwiGLU and the residual adds are plain loops on the row;
//! - attention appends to the same host KV caches that the prefill filled.
//!
//! Around the products, each row's arithmetic is the trainer's in the same order
//! (`kernels::rms_rows`, `lora_rows`, the shared attention rows, `row_loops::swiglu`),
//! so where the products are the trainer's too (bf16 precision) a step's logits are the
//! trainer's bit for bit; tests check both.

use candle_core::{DType, Tensor};
use rayon::prelude::*;

use super::decode_weights::DecodeWeights;
use super::kernels;
use super::lora_rows;
use super::warm::Warm;
use crate::model::backend::Backend;
use crate::model::kv::{self, HostQkv, KvCache};
use crate::model::lora::{Adapter, Proj, Target};
use crate::model::transformer::{Frozen, SeqSpan, Transformer};
use crate::model::ModelError;

/// One adapted projection in host form: `y += scale * B (A x)`.
struct HostLora {
    /// `(r, in)`, row-major.
    a: Vec<f32>,
    /// `B^T`, `(r, out)`: row `j` is added to `y` with weight `u_j`, a vectorised axpy.
    bt: Vec<f32>,
    scale: f32,
}

impl HostLora {
    fn new(a: &Tensor, b: &Tensor, scale: f64) -> candle_core::Result<Self> {
        Ok(Self {
            a: a.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?,
            bt: b.to_dtype(DType::F32)?.t()?.flatten_all()?.to_vec1()?,
            scale: scale as f32,
        })
    }

    /// Adds the adapter's delta for input row `x` to output row `y`, as training adds it
    /// ([`lora_rows`]).
    fn apply(&self, x: &[f32], y: &mut [f32]) {
        let r = self.bt.len() / y.len().max(1);
        // Ranks up to 64 (the usual ones) without an allocation per row and site.
        let mut small = [0f32; 64];
        let mut large = Vec::new();
        let u = if r <= small.len() {
            &mut small[..r]
        } else {
            large.resize(r, 0f32);
            &mut large[..]
        };
        lora_rows::add_delta_row(&self.a, &self.bt, self.scale, x, y, u);
    }
}

/// An adapter's factors in host form, by layer and projection. Built once per adapter
/// and kept while sequences decode with it (copying the factors costs a few MB).
pub struct HostAdapter {
    layers: Vec<[Option<HostLora>; 7]>,
    head: Option<HostLora>,
}

impl HostAdapter {
    /// `a`'s factors for `model`'s layers.
    pub fn new(model: &Transformer, a: &Adapter) -> Result<Self, ModelError> {
        Ok(Self::copy(a, model.config.num_hidden_layers)?)
    }

    fn copy(a: &Adapter, layers: usize) -> candle_core::Result<Self> {
        let scale = a.scale();
        let pair = |t: Target| -> candle_core::Result<Option<HostLora>> {
            a.pairs
                .get(&t)
                .map(|p| HostLora::new(&p.a, &p.b, scale))
                .transpose()
        };
        let layers = (0..layers)
            .map(|l| {
                let mut out: [Option<HostLora>; 7] = Default::default();
                for p in Proj::ALL {
                    out[p as usize] = pair(Target::Layer(l, p))?;
                }
                Ok(out)
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Self {
            layers,
            head: pair(Target::LmHead)?,
        })
    }

    /// The factors that apply at `site`, if the adapter trains it.
    fn lora(&self, site: Site) -> Option<&HostLora> {
        match site {
            Site::Layer(l, p) => self.layers[l][p as usize].as_ref(),
            Site::Head => self.head.as_ref(),
        }
    }
}

/// One row's outputs at several sites, to add that row's adapter deltas to.
type SiteOutputs<'a> = Vec<(Site, &'a mut [f32])>;

/// Where an adapter's factors apply: a block's projection, or the LM head.
#[derive(Debug, Clone, Copy)]
enum Site {
    Layer(usize, Proj),
    Head,
}

/// Per-block vectors of the base model in host form, copied once per decoder.
struct HostBlock {
    /// RMSNorm weights before attention and before the MLP.
    input: Vec<f32>,
    post: Vec<f32>,
    /// Qwen3's per-head q/k norm weights.
    q: Option<Vec<f32>>,
    k: Option<Vec<f32>>,
    /// The stacked q/k/v bias (Qwen2), for f32 decoding.
    qkv_bias: Option<Vec<f32>>,
}

fn host(t: &Tensor) -> candle_core::Result<Vec<f32>> {
    t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()
}

/// A model and a set of adapters in host form, ready for host decode steps. Building
/// one copies the norm weights (a few KB); the adapters are built once by the caller.
pub struct HostDecoder<'m> {
    model: &'m Transformer,
    /// The block-quantized decode weights; `None` decodes with the f32 weights.
    dec: Option<&'m DecodeWeights>,
    adapters: Vec<&'m HostAdapter>,
    blocks: Vec<HostBlock>,
    final_norm: Vec<f32>,
}

/// One row of a decode step: the sequence's newest token, its adapter and its position.
#[derive(Debug, Clone, Copy)]
pub struct StepRow {
    /// Token id.
    pub token: u32,
    /// Index into the decoder's adapters; `None` is the base model.
    pub adapter: Option<usize>,
    /// Position of the token in its sequence (the cache's length).
    pub position: usize,
}

impl<'m> HostDecoder<'m> {
    /// Whether decode steps of `model` run on the host: the model is on the CPU backend
    /// in f32.
    pub fn applies(model: &Transformer) -> bool {
        model.backend() == Backend::Cpu
            && model.device().is_cpu()
            && model.weights.dtype() == DType::F32
    }

    /// A decoder for `model` with `adapters`, using the block-quantized decode weights when
    /// `quantized` and the trainer's own products otherwise
    /// ([`Transformer::frozen_product_host`]: f32, or bf16 in bf16 precision); `None` when the model is not on the CPU
    /// in `f32` (callers then use [`Transformer::forward_cached`]).
    pub fn new(
        model: &'m Transformer,
        adapters: Vec<&'m HostAdapter>,
        quantized: bool,
    ) -> Result<Option<Self>, ModelError> {
        let w = &model.weights;
        if !Self::applies(model) {
            return Ok(None);
        }
        let blocks = w
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| {
                Ok(HostBlock {
                    qkv_bias: model.stacked(i).qkv_bias.map(host).transpose()?,
                    input: host(&l.input_layernorm)?,
                    post: host(&l.post_attention_layernorm)?,
                    q: l.q_norm.as_ref().map(host).transpose()?,
                    k: l.k_norm.as_ref().map(host).transpose()?,
                })
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Some(Self {
            model,
            dec: if quantized {
                Some(model.decode_weights()?)
            } else {
                None
            },
            adapters,
            blocks,
            final_norm: host(&w.norm)?,
        }))
    }

    /// Advances every row's sequence by its token, appending to `caches` (one per row,
    /// prefilled on the host), and returns the next-token logits, `(rows, vocab)`.
    pub fn step(
        &self,
        rows: &[StepRow],
        caches: &mut [&mut KvCache],
    ) -> Result<Vec<f32>, ModelError> {
        let cfg = &self.model.config;
        let m = rows.len();
        if m == 0 || caches.len() != m {
            return Err(ModelError::Input(
                "a decode step needs one KV cache per row".into(),
            ));
        }
        for r in rows {
            if r.token as usize >= cfg.vocab_size {
                return Err(ModelError::Input(format!(
                    "token id {} is out of range for a vocabulary of {}",
                    r.token, cfg.vocab_size
                )));
            }
            if r.position >= self.model.max_seq_len() {
                return Err(ModelError::Input(format!(
                    "sequence of {} tokens exceeds the context limit of {}",
                    r.position + 1,
                    self.model.max_seq_len()
                )));
            }
            if r.adapter.is_some_and(|a| a >= self.adapters.len()) {
                return Err(ModelError::Input("adapter index out of range".into()));
            }
        }
        let (hq, hkv, hd) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let eps = cfg.rms_norm_eps as f32;
        let tokens: Vec<u32> = rows.iter().map(|r| r.token).collect();
        let positions: Vec<u32> = rows.iter().map(|r| r.position as u32).collect();
        let mut h = host(
            &self
                .model
                .weights
                .embed_tokens
                .index_select(&Tensor::new(tokens.as_slice(), self.model.device())?, 0)?,
        )?;
        let (cos, sin) = self.model.rope_rows(&positions)?;
        let spans: Vec<SeqSpan> = rows
            .iter()
            .enumerate()
            .map(|(i, r)| SeqSpan {
                start: i,
                len: 1,
                adapter: r.adapter,
            })
            .collect();
        let mut attn = vec![0f32; m * hq * hd];
        for (li, block) in self.blocks.iter().enumerate() {
            let x1 = kernels::rms_rows(&h, &block.input, eps);
            let [mut q, mut k, v] = self.stacked(
                &x1,
                rows,
                li,
                [(Proj::Q, hq * hd), (Proj::K, hkv * hd), (Proj::V, hkv * hd)],
            )?;
            if let (Some(qn), Some(kn)) = (&block.q, &block.k) {
                q = kernels::rms_rows(&q, qn, eps);
                k = kernels::rms_rows(&k, kn, eps);
            }
            rope_rows(&mut q, hq, hd, &cos, &sin);
            rope_rows(&mut k, hkv, hd, &cos, &sin);
            let new = HostQkv {
                q: &q,
                k: &k,
                v: &v,
                kv_dim: hkv * hd,
            };
            kv::attend_host(li, new, &spans, caches, hq, &mut attn)?;
            let o = self.project(&attn, rows, li, Proj::O)?;
            add_into(&mut h, &o);
            let x2 = kernels::rms_rows(&h, &block.post, eps);
            let f = cfg.intermediate_size;
            let [gate, up] = self.stacked(&x2, rows, li, [(Proj::Gate, f), (Proj::Up, f)])?;
            let act = kernels::swiglu_rows(&gate, &up);
            let down = self.project(&act, rows, li, Proj::Down)?;
            add_into(&mut h, &down);
        }
        let xf = kernels::rms_rows(&h, &self.final_norm, eps);
        let head = self.dec.map(|dec| &dec.lm_head);
        let mut logits = match head.filter(|l| l.quantizes(m, self.model.block_arith())) {
            Some(l) => l.forward_host(&xf, m, self.model.block_arith())?,
            None => self.model.frozen_product_host(Frozen::Head, &xf, m, None)?,
        };
        self.add_deltas(&xf, rows, vec![(Site::Head, &mut logits)]);
        Ok(logits)
    }

    /// `x` through block `layer`'s stacked projections (`parts` in row order with their
    /// widths: q/k/v or gate/up) in one weight pass, split into the parts, each with
    /// every row's own adapter delta.
    fn stacked<const N: usize>(
        &self,
        x: &[f32],
        rows: &[StepRow],
        layer: usize,
        parts: [(Proj, usize); N],
    ) -> Result<[Vec<f32>; N], ModelError> {
        let m = rows.len();
        let gate_up = parts[0].0 == Proj::Gate;
        let arith = self.model.block_arith();
        let linear = self.dec.map(|dec| {
            let l = &dec.layers[layer];
            if gate_up {
                &l.gate_up
            } else {
                &l.qkv
            }
        });
        let regions = self.factors(rows, &parts.map(|(p, _)| Site::Layer(layer, p)));
        let y = match linear.filter(|l| l.quantizes(m, arith)) {
            Some(l) => l.forward_host_warming(x, m, arith, Warm::new(&regions))?,
            None => {
                let w = if gate_up {
                    Frozen::GateUp(layer)
                } else {
                    Frozen::Qkv(layer)
                };
                let bias = self.blocks[layer].qkv_bias.as_deref().filter(|_| !gate_up);
                let warm = Warm::new(&regions);
                self.model
                    .frozen_product_host_warming(w, x, m, bias, warm)?
            }
        };
        let width: usize = parts.iter().map(|(_, w)| w).sum();
        let mut out: [Vec<f32>; N] = std::array::from_fn(|i| Vec::with_capacity(m * parts[i].1));
        for yr in y.chunks_exact(width) {
            let mut start = 0;
            for ((_, w), o) in parts.iter().zip(out.iter_mut()) {
                o.extend_from_slice(&yr[start..start + w]);
                start += w;
            }
        }
        let sites = parts
            .iter()
            .zip(out.iter_mut())
            .map(|((p, _), o)| (Site::Layer(layer, *p), o.as_mut_slice()))
            .collect();
        self.add_deltas(x, rows, sites);
        Ok(out)
    }

    /// `x W^T` with the frozen weights of block `layer`'s `o` or `down` projection, plus
    /// each row's own adapter delta.
    fn project(
        &self,
        x: &[f32],
        rows: &[StepRow],
        layer: usize,
        p: Proj,
    ) -> Result<Vec<f32>, ModelError> {
        let m = rows.len();
        let linear = self.dec.map(|dec| {
            let l = &dec.layers[layer];
            if p == Proj::O {
                &l.o
            } else {
                &l.down
            }
        });
        let regions = self.factors(rows, &[Site::Layer(layer, p)]);
        let mut y = match linear.filter(|l| l.quantizes(m, self.model.block_arith())) {
            Some(l) => {
                l.forward_host_warming(x, m, self.model.block_arith(), Warm::new(&regions))?
            }
            None => {
                let w = if p == Proj::O {
                    Frozen::O(layer)
                } else {
                    Frozen::Down(layer)
                };
                let warm = Warm::new(&regions);
                self.model
                    .frozen_product_host_warming(w, x, m, None, warm)?
            }
        };
        self.add_deltas(x, rows, vec![(Site::Layer(layer, p), &mut y)]);
        Ok(y)
    }

    /// The adapter factors that the rows' deltas at `sites` read, each adapter once: what
    /// a product warms for the deltas that follow it ([`super::warm`]; each product
    /// decides whether it can, by how it is bound).
    fn factors(&self, rows: &[StepRow], sites: &[Site]) -> Vec<&[f32]> {
        let mut seen: Vec<usize> = Vec::with_capacity(rows.len());
        let mut out = Vec::new();
        for a in rows.iter().filter_map(|r| r.adapter) {
            if seen.contains(&a) {
                continue;
            }
            seen.push(a);
            for &site in sites {
                if let Some(l) = self.adapters[a].lora(site) {
                    out.extend([l.a.as_slice(), l.bt.as_slice()]);
                }
            }
        }
        out
    }

    /// Adds every row's own adapter delta to the outputs of `sites`, each `(site, y)`
    /// with `y` the `(rows, width)` output of that site for input `x`. Rows run in
    /// parallel: this is per-row work that the shared weight pass cannot take.
    fn add_deltas(&self, x: &[f32], rows: &[StepRow], sites: Vec<(Site, &mut [f32])>) {
        let m = rows.len();
        let k = x.len() / m;
        let mut per_row: Vec<SiteOutputs> =
            (0..m).map(|_| Vec::with_capacity(sites.len())).collect();
        for (site, y) in sites {
            let width = y.len() / m;
            for (row, yr) in per_row.iter_mut().zip(y.chunks_exact_mut(width)) {
                row.push((site, yr));
            }
        }
        let add = |((r, x), outs): ((&StepRow, &[f32]), SiteOutputs)| {
            let Some(a) = r.adapter else { return };
            for (site, y) in outs {
                if let Some(l) = self.adapters[a].lora(site) {
                    l.apply(x, y);
                }
            }
        };
        if m == 1 {
            rows.iter()
                .zip(x.chunks_exact(k))
                .zip(per_row)
                .for_each(add);
        } else {
            rows.par_iter()
                .zip(x.par_chunks(k))
                .zip(per_row)
                .for_each(add);
        }
    }
}

/// Rotate-half RoPE in place on `x`, `(rows, heads, hd)`, with each row's `(cos, sin)`
/// of `hd / 2` entries.
fn rope_rows(x: &mut [f32], heads: usize, hd: usize, cos: &[f32], sin: &[f32]) {
    let half = hd / 2;
    for (i, row) in x.chunks_exact_mut(heads * hd).enumerate() {
        let (c, s) = (
            &cos[i * half..(i + 1) * half],
            &sin[i * half..(i + 1) * half],
        );
        for head in row.chunks_exact_mut(hd) {
            let (x1, x2) = head.split_at_mut(half);
            for j in 0..half {
                let (a, b) = (x1[j], x2[j]);
                x1[j] = a * c[j] - b * s[j];
                x2[j] = b * c[j] + a * s[j];
            }
        }
    }
}

/// Adds `b` to every row of `y`.
pub(crate) fn add_bias(y: &mut [f32], b: &[f32]) {
    for row in y.chunks_exact_mut(b.len()) {
        add_into(row, b);
    }
}

fn add_into(h: &mut [f32], x: &[f32]) {
    for (a, &b) in h.iter_mut().zip(x) {
        *a += b;
    }
}
