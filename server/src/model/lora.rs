//! LoRA adapters and the `Linear` seam where they attach: `y = W x + (alpha/r) B (A x)`.
//!
//! A batch may hold rows of several adapters. Rows are grouped into contiguous
//! [`Segment`]s, one adapter each; the frozen base matmul runs once over all rows and each
//! segment adds its own low-rank delta. The backward pass mirrors that, so each adapter's
//! gradient is exactly what it would get alone.

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor};
use rand::{rngs::StdRng, Rng, SeedableRng};

use super::backend::Backend;
use super::config::ModelConfig;
use super::cpu::gemm::{Mat, MatMut};
use super::cpu::lora_rows;
use super::ops;
use super::weights::matmul_t;
use super::ModelError;

/// The LoRA alpha Lathe uses for every adapter. Tinker does not send one on the wire, so
/// it is a server constant, recorded in each checkpoint's `adapter_config.json`.
pub const LORA_ALPHA: f64 = 32.0;

/// Largest rank accepted.
pub const MAX_RANK: usize = 256;

/// A projection inside a decoder block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Proj {
    /// Attention query.
    Q,
    /// Attention key.
    K,
    /// Attention value.
    V,
    /// Attention output.
    O,
    /// MLP gate.
    Gate,
    /// MLP up.
    Up,
    /// MLP down.
    Down,
}

impl Proj {
    /// All projections, in the order PEFT lists them.
    pub const ALL: [Proj; 7] = [
        Proj::Q,
        Proj::K,
        Proj::V,
        Proj::O,
        Proj::Gate,
        Proj::Up,
        Proj::Down,
    ];

    /// The Hugging Face module name (`q_proj`, ...).
    pub fn module_name(self) -> &'static str {
        match self {
            Proj::Q => "q_proj",
            Proj::K => "k_proj",
            Proj::V => "v_proj",
            Proj::O => "o_proj",
            Proj::Gate => "gate_proj",
            Proj::Up => "up_proj",
            Proj::Down => "down_proj",
        }
    }

    fn parent(self) -> &'static str {
        match self {
            Proj::Q | Proj::K | Proj::V | Proj::O => "self_attn",
            _ => "mlp",
        }
    }

    fn is_attn(self) -> bool {
        self.parent() == "self_attn"
    }

    /// `(out, in)` of this projection.
    pub fn dims(self, cfg: &ModelConfig) -> (usize, usize) {
        let (d, f) = (cfg.hidden_size, cfg.intermediate_size);
        match self {
            Proj::Q => (cfg.q_dim(), d),
            Proj::K | Proj::V => (cfg.kv_dim(), d),
            Proj::O => (d, cfg.q_dim()),
            Proj::Gate | Proj::Up => (f, d),
            Proj::Down => (d, f),
        }
    }
}

/// Where an adapter pair attaches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Target {
    /// A projection of decoder block `layer`.
    Layer(usize, Proj),
    /// The output projection.
    LmHead,
}

impl Target {
    /// The PEFT module path, e.g. `base_model.model.model.layers.0.self_attn.q_proj`.
    pub fn peft_module(self) -> String {
        match self {
            Target::Layer(i, p) => format!(
                "base_model.model.model.layers.{i}.{}.{}",
                p.parent(),
                p.module_name()
            ),
            Target::LmHead => "base_model.model.lm_head".to_string(),
        }
    }

    /// Parses a PEFT module path back (the inverse of [`Target::peft_module`]).
    pub fn from_peft_module(path: &str) -> Option<Self> {
        if path == "base_model.model.lm_head" {
            return Some(Target::LmHead);
        }
        let rest = path.strip_prefix("base_model.model.model.layers.")?;
        let mut parts = rest.split('.');
        let layer = parts.next()?.parse().ok()?;
        let parent = parts.next()?;
        let name = parts.next()?;
        if parts.next().is_some() {
            return None;
        }
        let proj = Proj::ALL
            .into_iter()
            .find(|p| p.module_name() == name && p.parent() == parent)?;
        Some(Target::Layer(layer, proj))
    }

    /// `(out, in)` of the adapted matrix.
    pub fn dims(self, cfg: &ModelConfig) -> (usize, usize) {
        match self {
            Target::Layer(_, p) => p.dims(cfg),
            Target::LmHead => (cfg.vocab_size, cfg.hidden_size),
        }
    }
}

/// Which parts of the model an adapter trains, and its rank (Tinker's LoRA config).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoraSpec {
    /// Rank r.
    pub rank: usize,
    /// q, k, v, o.
    pub train_attn: bool,
    /// gate, up, down.
    pub train_mlp: bool,
    /// lm_head.
    pub train_unembed: bool,
}

impl LoraSpec {
    /// The targets this spec adapts, in a fixed order.
    pub fn targets(&self, cfg: &ModelConfig) -> Vec<Target> {
        let mut out = Vec::new();
        for layer in 0..cfg.num_hidden_layers {
            for p in Proj::ALL {
                if (p.is_attn() && self.train_attn) || (!p.is_attn() && self.train_mlp) {
                    out.push(Target::Layer(layer, p));
                }
            }
        }
        if self.train_unembed {
            out.push(Target::LmHead);
        }
        out
    }

    /// Rejects rank 0, ranks above [`MAX_RANK`] and adapters that train nothing.
    pub fn validate(&self) -> Result<(), ModelError> {
        if self.rank == 0 || self.rank > MAX_RANK {
            return Err(ModelError::Lora(format!(
                "rank must be between 1 and {MAX_RANK}, got {}",
                self.rank
            )));
        }
        if !(self.train_attn || self.train_mlp || self.train_unembed) {
            return Err(ModelError::Lora(
                "at least one of train_attn, train_mlp, train_unembed must be set".into(),
            ));
        }
        Ok(())
    }

    /// PEFT's `target_modules` names.
    pub fn target_module_names(&self) -> Vec<String> {
        let mut names: Vec<String> = Proj::ALL
            .into_iter()
            .filter(|p| (p.is_attn() && self.train_attn) || (!p.is_attn() && self.train_mlp))
            .map(|p| p.module_name().to_string())
            .collect();
        if self.train_unembed {
            names.push("lm_head".into());
        }
        names
    }
}

/// The two factors of one adapted projection.
#[derive(Debug, Clone)]
pub struct LoraPair {
    /// `(r, in)`.
    pub a: Tensor,
    /// `(out, r)`.
    pub b: Tensor,
}

/// A LoRA adapter: factors for every target of its spec.
#[derive(Debug, Clone)]
pub struct Adapter {
    /// Rank and targets.
    pub spec: LoraSpec,
    /// LoRA alpha; the delta is scaled by `alpha / rank`.
    pub alpha: f64,
    /// The factors, by target.
    pub pairs: BTreeMap<Target, LoraPair>,
}

impl Adapter {
    /// A fresh adapter: `A` drawn from PEFT's default (Kaiming-uniform, bound
    /// `1/sqrt(in)`) with a seeded generator, `B` zero, so it starts as a no-op.
    pub fn new(
        cfg: &ModelConfig,
        spec: LoraSpec,
        seed: u64,
        dtype: DType,
        device: &Device,
    ) -> Result<Self, ModelError> {
        spec.validate()?;
        let mut rng = StdRng::seed_from_u64(seed);
        let mut pairs = BTreeMap::new();
        for target in spec.targets(cfg) {
            let (out, inp) = target.dims(cfg);
            let bound = 1.0 / (inp as f64).sqrt();
            let a: Vec<f64> = (0..spec.rank * inp)
                .map(|_| rng.random_range(-bound..bound))
                .collect();
            let a = Tensor::from_vec(a, (spec.rank, inp), device)?.to_dtype(dtype)?;
            let b = Tensor::zeros((out, spec.rank), dtype, device)?;
            pairs.insert(target, LoraPair { a, b });
        }
        Ok(Self {
            spec,
            alpha: LORA_ALPHA,
            pairs,
        })
    }

    /// The factor `alpha / rank` applied to `B A x`.
    pub fn scale(&self) -> f64 {
        self.alpha / self.spec.rank as f64
    }

    /// Number of trainable parameters.
    pub fn num_params(&self) -> usize {
        self.pairs
            .values()
            .map(|p| p.a.elem_count() + p.b.elem_count())
            .sum()
    }

    /// A copy in another element type.
    pub fn to_dtype(&self, dtype: DType) -> candle_core::Result<Self> {
        self.map(|t| t.to_dtype(dtype))
    }

    /// A copy on another device.
    pub fn to_device(&self, device: &Device) -> candle_core::Result<Self> {
        self.map(|t| t.to_device(device))
    }

    /// A copy with `f` applied to every factor.
    fn map(&self, f: impl Fn(&Tensor) -> candle_core::Result<Tensor>) -> candle_core::Result<Self> {
        let pairs = self
            .pairs
            .iter()
            .map(|(t, p)| {
                Ok((
                    *t,
                    LoraPair {
                        a: f(&p.a)?,
                        b: f(&p.b)?,
                    },
                ))
            })
            .collect::<candle_core::Result<_>>()?;
        Ok(Self {
            spec: self.spec,
            alpha: self.alpha,
            pairs,
        })
    }
}

/// Gradients of one adapter, by target, accumulated until the optimizer step.
#[derive(Debug, Clone, Default)]
pub struct AdapterGrads {
    /// `(dA, dB)` for each target that received a gradient.
    pub pairs: BTreeMap<Target, (Tensor, Tensor)>,
}

impl AdapterGrads {
    /// Adds `(da, db)` to the gradient of `target`.
    pub fn accumulate(
        &mut self,
        target: Target,
        da: Tensor,
        db: Tensor,
    ) -> candle_core::Result<()> {
        match self.pairs.get_mut(&target) {
            Some((a, b)) => {
                *a = (&*a + da)?;
                *b = (&*b + db)?;
            }
            None => {
                self.pairs.insert(target, (da, db));
            }
        }
        Ok(())
    }

    /// Adds every gradient of `other` into `self`.
    pub fn merge(&mut self, other: AdapterGrads) -> candle_core::Result<()> {
        for (t, (da, db)) in other.pairs {
            self.accumulate(t, da, db)?;
        }
        Ok(())
    }

    /// Whether nothing has been accumulated.
    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }
}

/// A run of contiguous rows of a batch that use one adapter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// First row.
    pub start: usize,
    /// Number of rows.
    pub len: usize,
    /// Index into the batch's adapter list; `None` runs the base model alone.
    pub adapter: Option<usize>,
}

/// What the LoRA forward of one projection keeps for its backward: `u = x A^T` of each
/// segment that has a pair for this target.
pub type LoraCache = Vec<Option<Tensor>>;

/// Adds each segment's low-rank delta to `base` (the frozen projection of `x`).
pub fn lora_forward(
    be: Backend,
    x: &Tensor,
    base: Tensor,
    target: Target,
    segments: &[Segment],
    adapters: &[&Adapter],
) -> candle_core::Result<(Tensor, LoraCache)> {
    let pair_of = |s: &Segment| {
        s.adapter.and_then(|i| {
            adapters[i]
                .pairs
                .get(&target)
                .map(|p| (p, adapters[i].scale()))
        })
    };
    if segments.iter().all(|s| pair_of(s).is_none()) {
        return Ok((base, vec![None; segments.len()]));
    }
    #[cfg(feature = "cuda")]
    if let Some((y, mut caches)) =
        lora_forward_sgmv(be, x, &base, &[(target, base.dim(1)?)], segments, adapters)?
    {
        return Ok((y, caches.pop().expect("one part")));
    }
    let host = |t: &Tensor| be.host_f32(t);
    let on_host = host(x)
        && host(&base)
        && segments
            .iter()
            .filter_map(pair_of)
            .all(|(p, _)| host(&p.a) && host(&p.b));
    if on_host {
        return lora_forward_host(x, &base, segments, pair_of);
    }
    let out_dim = base.dims()[1];
    let mut cache = Vec::with_capacity(segments.len());
    let mut deltas = Vec::with_capacity(segments.len());
    for seg in segments {
        match pair_of(seg) {
            Some((pair, scale)) => {
                let xs = x.narrow(0, seg.start, seg.len)?;
                let u = matmul_t(be, &xs, &pair.a)?;
                // Scaled at rank width, not at the output's.
                deltas.push(matmul_t(be, &(&u * scale)?, &pair.b)?);
                cache.push(Some(u));
            }
            None => {
                deltas.push(Tensor::zeros(
                    (seg.len, out_dim),
                    base.dtype(),
                    base.device(),
                )?);
                cache.push(None);
            }
        }
    }
    let delta = if deltas.len() == 1 {
        deltas.pop().expect("one delta")
    } else {
        Tensor::cat(&deltas, 0)?
    };
    Ok((base.add(&delta)?, cache))
}

/// [`lora_forward`] on the host in f32: every row through [`lora_rows`], as the fused
/// projections and the decode step compute it.
fn lora_forward_host<'p>(
    x: &Tensor,
    base: &Tensor,
    segments: &[Segment],
    pair_of: impl Fn(&Segment) -> Option<(&'p LoraPair, f64)>,
) -> candle_core::Result<(Tensor, LoraCache)> {
    let (rows, d_in) = x.dims2()?;
    let d_out = base.dim(1)?;
    let xs: Vec<f32> = x.flatten_all()?.to_vec1()?;
    let mut y: Vec<f32> = base.flatten_all()?.to_vec1()?;
    let mut cache = Vec::with_capacity(segments.len());
    for seg in segments {
        let Some((pair, scale)) = pair_of(seg) else {
            cache.push(None);
            continue;
        };
        let r = pair.a.dim(0)?;
        let a: Vec<f32> = pair.a.flatten_all()?.to_vec1()?;
        let b: Vec<f32> = pair.b.flatten_all()?.to_vec1()?;
        let mut u = vec![0f32; seg.len * r];
        let xm = Mat::new(&xs, rows, d_in).rows(seg.start, seg.len);
        let mut ym = MatMut::new(&mut y, rows, d_out, d_out);
        lora_rows::add_deltas(
            &a,
            &lora_rows::transposed(&b, d_out, r),
            scale as f32,
            xm,
            &mut ym.block(seg.start, seg.len, 0, d_out),
            &mut u,
        );
        cache.push(Some(Tensor::from_vec(u, (seg.len, r), x.device())?));
    }
    Ok((Tensor::from_vec(y, (rows, d_out), x.device())?, cache))
}

/// Most rows a segment may have for [`lora_forward_sgmv`]: each row reads its adapter's
/// factors whole, which beats a few launches per segment for the short segments of a
/// decode step, not a cuBLAS product over a long segment of a training pass or prefill.
#[cfg(feature = "cuda")]
const SGMV_MAX_SEGMENT_ROWS: usize = 16;

/// [`lora_forward`] for every part of a stacked projection (`parts`: each target with
/// its width, the columns of `base` in order) in two CUDA launches for every segment
/// together ([`super::cuda::lora_deltas`]), where the kernels take the tensors, the
/// segments tile the rows in order, none is longer than [`SGMV_MAX_SEGMENT_ROWS`], and
/// every factor pair of the batch has the same rank; `None` where not. Returns the
/// output and each part's cache.
#[cfg(feature = "cuda")]
pub(crate) fn lora_forward_sgmv(
    be: Backend,
    x: &Tensor,
    base: &Tensor,
    parts: &[(Target, usize)],
    segments: &[Segment],
    adapters: &[&Adapter],
) -> candle_core::Result<Option<(Tensor, Vec<LoraCache>)>> {
    use super::cuda::{lora_deltas, LoraSegment};
    if !(be.cuda(x) && be.cuda(base) && super::cuda::sgmv_enabled()) {
        return Ok(None);
    }
    let pair_of =
        |s: &Segment, target: Target| s.adapter.and_then(|i| adapters[i].pairs.get(&target));
    let mut rank = None;
    let mut next = 0;
    let mut segs = Vec::with_capacity(segments.len());
    for s in segments {
        if s.start != next || s.len > SGMV_MAX_SEGMENT_ROWS {
            return Ok(None);
        }
        next += s.len;
        let mut pairs = Vec::with_capacity(parts.len());
        for &(target, _) in parts {
            let pair = pair_of(s, target);
            if let Some(p) = pair {
                let r = p.a.dim(0)?;
                if *rank.get_or_insert(r) != r || !be.cuda(&p.a) || !be.cuda(&p.b) {
                    return Ok(None);
                }
            }
            pairs.push(pair.map(|p| (&p.a, &p.b)));
        }
        let scale = s.adapter.map_or(0.0, |i| adapters[i].scale()) as f32;
        segs.push(LoraSegment {
            start: s.start,
            len: s.len,
            scale,
            pairs,
        });
    }
    let Some(r) = rank else {
        return Ok(None);
    };
    let widths: Vec<usize> = parts.iter().map(|&(_, w)| w).collect();
    if next != x.dim(0)? || !super::cuda::lora_deltas_fit(parts.len(), r, widths.iter().sum()) {
        return Ok(None);
    }
    let (y, u) = lora_deltas(x, base, &widths, &segs)?;
    let caches = parts
        .iter()
        .enumerate()
        .map(|(p, &(target, _))| {
            segments
                .iter()
                .map(|s| {
                    pair_of(s, target)
                        .map(|_| u.narrow(0, s.start, s.len)?.narrow(1, p * r, r))
                        .transpose()
                })
                .collect::<candle_core::Result<LoraCache>>()
        })
        .collect::<candle_core::Result<_>>()?;
    Ok(Some((y, caches)))
}

/// Backward of [`lora_forward`]: accumulates `dA`, `dB` into `grads` (one entry per
/// adapter) and returns the LoRA part of the input gradient, if any.
pub fn lora_backward(
    x: &Tensor,
    dy: &Tensor,
    target: Target,
    segments: &[Segment],
    adapters: &[&Adapter],
    cache: &LoraCache,
    grads: &mut [AdapterGrads],
) -> candle_core::Result<Option<Tensor>> {
    if cache.iter().all(Option::is_none) {
        return Ok(None);
    }
    let in_dim = x.dims()[1];
    let mut dxs = Vec::with_capacity(segments.len());
    for (seg, u) in segments.iter().zip(cache) {
        let (Some(u), Some(ai)) = (u, seg.adapter) else {
            dxs.push(Tensor::zeros((seg.len, in_dim), x.dtype(), x.device())?);
            continue;
        };
        let adapter = adapters[ai];
        let pair = &adapter.pairs[&target];
        let scale = adapter.scale();
        let xs = x.narrow(0, seg.start, seg.len)?;
        let dys = dy.narrow(0, seg.start, seg.len)?;
        // y = s * u B^T, u = x A^T
        let db = (ops::matmul(&dys.t()?, u)? * scale)?;
        let du = (ops::matmul(&dys, &pair.b)? * scale)?;
        let da = ops::matmul(&du.t()?, &xs)?;
        dxs.push(ops::matmul(&du, &pair.a)?);
        grads[ai].accumulate(target, da, db)?;
    }
    let dx = if dxs.len() == 1 {
        dxs.pop().expect("one gradient")
    } else {
        Tensor::cat(&dxs, 0)?
    };
    Ok(Some(dx))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peft_module_names_round_trip() {
        for t in [
            Target::Layer(3, Proj::Q),
            Target::Layer(0, Proj::Down),
            Target::Layer(12, Proj::Gate),
            Target::LmHead,
        ] {
            assert_eq!(Target::from_peft_module(&t.peft_module()), Some(t));
        }
        assert_eq!(
            Target::Layer(0, Proj::O).peft_module(),
            "base_model.model.model.layers.0.self_attn.o_proj"
        );
        assert_eq!(
            Target::from_peft_module("base_model.model.model.layers.0.mlp.q_proj"),
            None
        );
    }

    #[test]
    fn spec_validation_names_the_problem() {
        let spec = LoraSpec {
            rank: 0,
            train_attn: true,
            train_mlp: true,
            train_unembed: false,
        };
        assert!(spec.validate().unwrap_err().to_string().contains("rank"));
        let spec = LoraSpec {
            rank: 4,
            train_attn: false,
            train_mlp: false,
            train_unembed: false,
        };
        assert!(spec.validate().is_err());
    }
}
