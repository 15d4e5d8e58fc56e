//! The LoRA deltas of a stacked projection (q/k/v or gate/up: one frozen weight whose
//! output columns are split into parts, each its own LoRA target) off the CPU fast path,
//! a few products per segment for all parts together.
//!
//! For one adapter the parts' `A`s are stacked by rows, `A_s = [A_p]` (`(K, in)`, `K` the
//! parts' ranks added up), and their `B`s placed block-diagonally, `B_s` (`(out, K)`:
//! part `p`'s `B` at its output columns' rows and its rank's columns, zeros elsewhere), so
//! that `y = base + s (x A_sᵀ) B_sᵀ` is every part's delta at once. Done part by part
//! instead, each delta is added to a column slice of `base` and the backward pass copies
//! a column slice of `dy` per part: on a GPU those strided copies and adds took longer
//! than the frozen product itself. The zero blocks cost `parts` times the delta's
//! products, which at LoRA ranks are small beside the frozen one, and add nothing to a
//! sum of finite values (a NaN or an infinity in one part's `u` or `dy` now reaches the
//! other parts too, which a part's own non-finite values make moot anyway).
//!
//! The stacks are built in the factors' dtype (an adapter read from a PEFT file may be
//! bf16 beside f32 activations: the products convert, as [`matmul_t`] does), once per
//! adapter per call.
//!
//! Each part's cache is the columns of `u = x A_sᵀ` that are its own (unscaled, as
//! [`super::lora::lora_forward`] keeps them), so either path's backward takes either
//! path's caches.

use candle_core::{Result, Tensor};

use super::backend::Backend;
use super::lora::{Adapter, AdapterGrads, LoraCache, Segment, Target};
use super::ops;
use super::weights::matmul_t;

/// One adapter's factors for the parts of a stacked projection.
struct Stack {
    /// `A_s`, `(K, in)`.
    a: Tensor,
    /// `B_s`, `(out, K)`.
    b: Tensor,
    /// Per part: its first output column, its width, and, where the adapter trains it,
    /// its target with its rank's first column in `K` and the rank.
    parts: Vec<PartSlot>,
}

#[derive(Clone, Copy)]
struct PartSlot {
    col: usize,
    width: usize,
    factors: Option<(Target, usize, usize)>,
}

impl Stack {
    /// The stack of `adapter`'s pairs for `parts`, `None` where it trains none of them.
    fn of(parts: &[(Target, usize)], adapter: &Adapter) -> Result<Option<Stack>> {
        let mut slots = Vec::with_capacity(parts.len());
        let (mut col, mut k) = (0, 0);
        for &(target, width) in parts {
            let factors = match adapter.pairs.get(&target) {
                Some(p) => {
                    let r = p.a.dim(0)?;
                    k += r;
                    Some((target, k - r, r))
                }
                None => None,
            };
            slots.push(PartSlot {
                col,
                width,
                factors,
            });
            col += width;
        }
        let Some(like) = slots
            .iter()
            .find_map(|s| s.factors.map(|(t, _, _)| &adapter.pairs[&t].b))
        else {
            return Ok(None);
        };
        let (dtype, dev) = (like.dtype(), like.device());
        let zeros = |rows: usize, cols: usize| Tensor::zeros((rows, cols), dtype, dev);
        let mut a_rows = Vec::new();
        let mut b_rows = Vec::with_capacity(slots.len());
        for slot in &slots {
            let Some((target, off, r)) = slot.factors else {
                b_rows.push(zeros(slot.width, k)?);
                continue;
            };
            let pair = &adapter.pairs[&target];
            a_rows.push(pair.a.clone());
            let mut cols = Vec::with_capacity(3);
            if off > 0 {
                cols.push(zeros(slot.width, off)?);
            }
            cols.push(pair.b.clone());
            if off + r < k {
                cols.push(zeros(slot.width, k - off - r)?);
            }
            b_rows.push(cat(&cols, 1)?);
        }
        Ok(Some(Stack {
            a: cat(&a_rows, 0)?,
            b: cat(&b_rows, 0)?,
            parts: slots,
        }))
    }
}

/// `Tensor::cat`, without a copy for one piece.
fn cat(pieces: &[Tensor], dim: usize) -> Result<Tensor> {
    match pieces {
        [one] => Ok(one.clone()),
        _ => Tensor::cat(pieces, dim),
    }
}

/// `y` (the frozen product of `x`, `(n, out)`) plus every segment's deltas for every part
/// of `parts`, and each part's cache. The segments tile the rows of `x` in order.
pub fn forward(
    be: Backend,
    x: &Tensor,
    y: Tensor,
    parts: &[(Target, usize)],
    segs: &[Segment],
    adapters: &[&Adapter],
) -> Result<(Tensor, Vec<LoraCache>)> {
    let mut caches: Vec<LoraCache> = vec![vec![None; segs.len()]; parts.len()];
    let mut deltas = Vec::with_capacity(segs.len());
    let mut stacks = Stacks::new(parts, adapters);
    for (si, seg) in segs.iter().enumerate() {
        let Some((stack, adapter)) = stacks.of(seg)? else {
            deltas.push((seg, None));
            continue;
        };
        let u = matmul_t(be, &x.narrow(0, seg.start, seg.len)?, &stack.a)?; // (len, K)
        let delta = matmul_t(be, &(&u * adapter.scale())?, &stack.b)?; // (len, out)
        for (p, slot) in stack.parts.iter().enumerate() {
            if let Some((_, off, r)) = slot.factors {
                caches[p][si] = Some(u.narrow(1, off, r)?);
            }
        }
        deltas.push((seg, Some(delta)));
    }
    let Some(delta) = rows_of(&deltas, &y)? else {
        return Ok((y, caches));
    };
    Ok((ops::add(be, &y, &delta)?, caches))
}

/// Backward of [`forward`]: accumulates each adapter's `dA`, `dB` of every part into
/// `grads` and returns `dx` (the frozen input gradient, `(n, in)`) plus every segment's
/// `s (dy B_s) A_s`. `dy` is `(n, out)`.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    be: Backend,
    x: &Tensor,
    dy: &Tensor,
    dx: Tensor,
    parts: &[(Target, usize)],
    segs: &[Segment],
    adapters: &[&Adapter],
    caches: &[LoraCache],
    grads: &mut [AdapterGrads],
) -> Result<Tensor> {
    let mut extras = Vec::with_capacity(segs.len());
    let mut stacks = Stacks::new(parts, adapters);
    for (si, seg) in segs.iter().enumerate() {
        let Some((stack, adapter)) = stacks.of(seg)? else {
            extras.push((seg, None));
            continue;
        };
        let mut us = Vec::with_capacity(parts.len());
        for (p, slot) in stack.parts.iter().enumerate() {
            if slot.factors.is_some() {
                match caches.get(p).and_then(|c| c.get(si)).cloned().flatten() {
                    Some(u) => us.push(u),
                    None => {
                        candle_core::bail!("LoRA backward: no cache for part {p} of segment {si}")
                    }
                }
            }
        }
        let u = cat(&us, 1)?; // (len, K)
        let s = adapter.scale();
        let dys = dy.narrow(0, seg.start, seg.len)?;
        let xs = x.narrow(0, seg.start, seg.len)?;
        // y = s u B_sᵀ with u = x A_sᵀ.
        let du = (ops::matmul(&dys, &stack.b)? * s)?; // (len, K)
        let db = (ops::matmul(&dys.t()?, &u)? * s)?; // (out, K); part blocks are its dB
        let da = ops::matmul(&du.t()?, &xs)?; // (K, in)
        let ai = seg.adapter.expect("a segment with a stack has an adapter");
        for slot in &stack.parts {
            if let Some((target, off, r)) = slot.factors {
                grads[ai].accumulate(
                    target,
                    da.narrow(0, off, r)?.contiguous()?,
                    db.narrow(0, slot.col, slot.width)?
                        .narrow(1, off, r)?
                        .contiguous()?,
                )?;
            }
        }
        extras.push((seg, Some(ops::matmul(&du, &stack.a)?)));
    }
    let Some(extra) = rows_of(&extras, &dx)? else {
        return Ok(dx);
    };
    ops::add(be, &dx, &extra)
}

/// Each adapter's stack for `parts`, built on first use: the segments of one adapter
/// share it.
struct Stacks<'a> {
    parts: &'a [(Target, usize)],
    adapters: &'a [&'a Adapter],
    built: Vec<Option<Option<Stack>>>,
}

impl<'a> Stacks<'a> {
    fn new(parts: &'a [(Target, usize)], adapters: &'a [&'a Adapter]) -> Self {
        Stacks {
            parts,
            adapters,
            built: (0..adapters.len()).map(|_| None).collect(),
        }
    }

    /// The stack of a segment's adapter, with the adapter; `None` for the base model's
    /// rows and an adapter that trains none of the parts.
    fn of(&mut self, seg: &Segment) -> Result<Option<(&Stack, &'a Adapter)>> {
        let Some(i) = seg.adapter else {
            return Ok(None);
        };
        let adapter = self.adapters[i];
        if self.built[i].is_none() {
            self.built[i] = Some(Stack::of(self.parts, adapter)?);
        }
        Ok(self.built[i]
            .as_ref()
            .and_then(Option::as_ref)
            .map(|s| (s, adapter)))
    }
}

/// The segments' row blocks as one tensor shaped like `like` (zeros for the rows of a
/// segment without one); `None` where no segment has one.
fn rows_of(blocks: &[(&Segment, Option<Tensor>)], like: &Tensor) -> Result<Option<Tensor>> {
    if blocks.iter().all(|(_, b)| b.is_none()) {
        return Ok(None);
    }
    let cols = like.dim(1)?;
    let pieces = blocks
        .iter()
        .map(|(seg, b)| match b {
            Some(b) => Ok(b.clone()),
            None => Tensor::zeros((seg.len, cols), like.dtype(), like.device()),
        })
        .collect::<Result<Vec<_>>>()?;
    let rows: usize = pieces.iter().map(|p| p.dim(0)).sum::<Result<usize>>()?;
    if rows != like.dim(0)? {
        candle_core::bail!(
            "LoRA deltas: the segments cover {rows} of {} rows",
            like.dim(0)?
        );
    }
    cat(&pieces, 0).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::lora::{lora_backward, lora_forward, LoraSpec, Proj};
    use crate::model::test_util::{max_abs_diff, uniform};
    use crate::model::tiny::tiny_config;
    use crate::model::Arch;
    use candle_core::{DType, Device};

    /// An adapter of rank 3 on attention with random (not zero) `B`, in f64; `k_rank`
    /// narrows its k pair to that rank, `drop_k` removes it.
    fn adapter(seed: u64, attn: bool, k_rank: Option<usize>, drop_k: bool) -> Adapter {
        let cfg = tiny_config(Arch::Qwen2);
        let spec = LoraSpec {
            rank: 3,
            train_attn: attn,
            train_mlp: !attn,
            train_unembed: false,
        };
        let mut a = Adapter::new(&cfg, spec, seed, DType::F64, &Device::Cpu).unwrap();
        for (i, p) in a.pairs.values_mut().enumerate() {
            p.b = uniform(p.b.dims(), 0.5, seed * 100 + i as u64);
        }
        let k = Target::Layer(0, Proj::K);
        if let (Some(r), Some(p)) = (k_rank, a.pairs.get_mut(&k)) {
            p.a = p.a.narrow(0, 0, r).unwrap().contiguous().unwrap();
            p.b = p.b.narrow(1, 0, r).unwrap().contiguous().unwrap();
        }
        if drop_k {
            a.pairs.remove(&k);
        }
        a
    }

    fn qkv() -> [(Target, usize); 3] {
        let cfg = tiny_config(Arch::Qwen2);
        [
            (Target::Layer(0, Proj::Q), cfg.q_dim()),
            (Target::Layer(0, Proj::K), cfg.kv_dim()),
            (Target::Layer(0, Proj::V), cfg.kv_dim()),
        ]
    }

    /// Each part alone, the reference: one [`lora_forward`] / [`lora_backward`] per
    /// column slice, as the deltas were computed before the stacks.
    fn part_by_part(
        x: &Tensor,
        base: &Tensor,
        dy: &Tensor,
        dx0: &Tensor,
        parts: &[(Target, usize)],
        segs: &[Segment],
        adapters: &[&Adapter],
    ) -> (Tensor, Vec<LoraCache>, Tensor, Vec<AdapterGrads>) {
        let (mut ys, mut caches, mut dx) = (Vec::new(), Vec::new(), dx0.clone());
        let mut grads = vec![AdapterGrads::default(); adapters.len()];
        let mut col = 0;
        for &(target, width) in parts {
            let slice = base.narrow(1, col, width).unwrap();
            let be = Backend::Device;
            let (yp, cache) = lora_forward(be, x, slice, target, segs, adapters).unwrap();
            let dyp = dy.narrow(1, col, width).unwrap().contiguous().unwrap();
            if let Some(extra) =
                lora_backward(x, &dyp, target, segs, adapters, &cache, &mut grads).unwrap()
            {
                dx = (dx + extra).unwrap();
            }
            ys.push(yp);
            caches.push(cache);
            col += width;
        }
        (Tensor::cat(&ys, 1).unwrap(), caches, dx, grads)
    }

    /// The stacked deltas and gradients equal each part's own in f64, for a batch of: an
    /// adapter on q and v only, base-model rows, an adapter whose k pair has a smaller
    /// rank than its q and v, the first adapter again, and an adapter on the MLP alone
    /// (none of these parts).
    #[test]
    fn stacked_parts_equal_each_part_alone() {
        let cfg = tiny_config(Arch::Qwen2);
        let d = cfg.hidden_size;
        let parts = qkv();
        let out: usize = parts.iter().map(|p| p.1).sum();
        let (qv_only, mixed_ranks, mlp_only) = (
            adapter(1, true, None, true),
            adapter(2, true, Some(2), false),
            adapter(3, false, None, false),
        );
        let adapters = [&qv_only, &mixed_ranks, &mlp_only];
        let seg = |start, len, adapter| Segment {
            start,
            len,
            adapter,
        };
        let segs = [
            seg(0, 4, Some(0)),
            seg(4, 2, None),
            seg(6, 5, Some(1)),
            seg(11, 3, Some(0)),
            seg(14, 2, Some(2)),
        ];
        let n = 16;
        let (x, base, dy, dx0) = (
            uniform(&[n, d], 1.0, 3),
            uniform(&[n, out], 1.0, 4),
            uniform(&[n, out], 1.0, 5),
            uniform(&[n, d], 1.0, 6),
        );
        let be = Backend::Device;
        let (y, caches) = forward(be, &x, base.clone(), &parts, &segs, &adapters).unwrap();
        let mut grads = vec![AdapterGrads::default(); 3];
        let dx = backward(
            be,
            &x,
            &dy,
            dx0.clone(),
            &parts,
            &segs,
            &adapters,
            &caches,
            &mut grads,
        )
        .unwrap();
        let (want_y, want_caches, want_dx, want) =
            part_by_part(&x, &base, &dy, &dx0, &parts, &segs, &adapters);
        for (p, (got, want)) in caches.iter().zip(&want_caches).enumerate() {
            for (g, w) in got.iter().zip(want) {
                match (g, w) {
                    (Some(g), Some(w)) => assert!(max_abs_diff(g, w) < 1e-12),
                    (g, w) => assert_eq!(g.is_some(), w.is_some(), "part {p}'s caches"),
                }
            }
        }
        assert!(max_abs_diff(&y, &want_y) < 1e-12);
        assert!(max_abs_diff(&dx, &want_dx) < 1e-12);
        // The base model's rows (and the MLP adapter's) keep the frozen product and input
        // gradient exactly.
        for (start, len) in [(4, 2), (14, 2)] {
            let rows = |t: &Tensor| t.narrow(0, start, len).unwrap();
            assert_eq!(max_abs_diff(&rows(&y), &rows(&base)), 0.0);
            assert_eq!(max_abs_diff(&rows(&dx), &rows(&dx0)), 0.0);
        }
        assert_eq!(grads[0].pairs.len(), 2, "q and v, not k");
        assert_eq!(grads[1].pairs.len(), 3);
        assert!(grads[2].is_empty());
        let k = Target::Layer(0, Proj::K);
        assert_eq!(grads[1].pairs[&k].0.dims(), &[2, d], "k's dA has k's rank");
        for (got, want) in grads.iter().zip(&want) {
            assert_eq!(got.pairs.len(), want.pairs.len());
            for (t, (da, db)) in &want.pairs {
                let (ga, gb) = &got.pairs[t];
                assert!(
                    max_abs_diff(da, ga) < 1e-12 && max_abs_diff(db, gb) < 1e-12,
                    "{t:?}"
                );
            }
        }
    }

    /// Factors in bf16 (as a PEFT file may hold them) beside f32 activations: the stacks
    /// keep the factors' dtype and the products convert, as each part's own path does.
    #[test]
    fn bf16_factors_beside_f32_activations() {
        let cfg = tiny_config(Arch::Qwen2);
        let parts = qkv();
        let out: usize = parts.iter().map(|p| p.1).sum();
        let ad = adapter(4, true, None, false).to_dtype(DType::BF16).unwrap();
        let segs = [Segment {
            start: 0,
            len: 5,
            adapter: Some(0),
        }];
        let f32s = |t: Tensor| t.to_dtype(DType::F32).unwrap();
        let x = f32s(uniform(&[5, cfg.hidden_size], 1.0, 7));
        let base = f32s(uniform(&[5, out], 1.0, 8));
        let (y, _) = forward(Backend::Device, &x, base.clone(), &parts, &segs, &[&ad]).unwrap();
        assert_eq!(y.dtype(), DType::F32);
        let mut want = Vec::new();
        let mut col = 0;
        for &(target, width) in &parts {
            let slice = base.narrow(1, col, width).unwrap();
            want.push(
                lora_forward(Backend::Device, &x, slice, target, &segs, &[&ad])
                    .unwrap()
                    .0,
            );
            col += width;
        }
        let want = Tensor::cat(&want, 1).unwrap();
        let to64 = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
        assert!(max_abs_diff(&to64(&y), &to64(&want)) < 1e-2);
        assert!(
            max_abs_diff(&to64(&y), &to64(&base)) > 1e-2,
            "the deltas were added"
        );
    }
}
