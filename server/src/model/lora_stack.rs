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
//! products, which at LoRA ranks are small beside the frozen one; exact zeros change no
//! sum.
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
    fn of(parts: &[(Target, usize)], adapter: &Adapter, like: &Tensor) -> Result<Option<Stack>> {
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
        if k == 0 {
            return Ok(None);
        }
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
    for (si, seg) in segs.iter().enumerate() {
        let adapter = seg.adapter.map(|i| adapters[i]);
        let Some((stack, adapter)) = stack_of(parts, adapter, x)? else {
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
    for (si, seg) in segs.iter().enumerate() {
        let adapter = seg.adapter.map(|i| adapters[i]);
        let Some((stack, adapter)) = stack_of(parts, adapter, x)? else {
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

/// The stack of a segment's adapter, with the adapter; `None` for the base model's rows
/// and an adapter that trains none of `parts`.
fn stack_of<'a>(
    parts: &[(Target, usize)],
    adapter: Option<&'a Adapter>,
    like: &Tensor,
) -> Result<Option<(Stack, &'a Adapter)>> {
    let Some(adapter) = adapter else {
        return Ok(None);
    };
    Ok(Stack::of(parts, adapter, like)?.map(|s| (s, adapter)))
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

    /// The stacked deltas and gradients equal each part's own (the reference: one
    /// [`lora_forward`] / [`lora_backward`] per column slice) in f64, for a batch of an
    /// adapter on q and v only, base-model rows, and an adapter on all three parts.
    #[test]
    fn stacked_parts_equal_each_part_alone() {
        let cfg = tiny_config(Arch::Qwen2);
        let (d, qd, kvd) = (cfg.hidden_size, cfg.q_dim(), cfg.kv_dim());
        let parts = [
            (Target::Layer(0, Proj::Q), qd),
            (Target::Layer(0, Proj::K), kvd),
            (Target::Layer(0, Proj::V), kvd),
        ];
        let out = qd + 2 * kvd;
        let adapter = |seed: u64, drop_k: bool| {
            let spec = LoraSpec {
                rank: 3,
                train_attn: true,
                train_mlp: false,
                train_unembed: false,
            };
            let mut a = Adapter::new(&cfg, spec, seed, DType::F64, &Device::Cpu).unwrap();
            for (i, p) in a.pairs.values_mut().enumerate() {
                p.b = uniform(p.b.dims(), 0.5, seed * 100 + i as u64);
            }
            if drop_k {
                a.pairs.remove(&Target::Layer(0, Proj::K));
            }
            a
        };
        let (qv_only, all) = (adapter(1, true), adapter(2, false));
        let adapters = [&qv_only, &all];
        let segs = [
            Segment {
                start: 0,
                len: 4,
                adapter: Some(0),
            },
            Segment {
                start: 4,
                len: 2,
                adapter: None,
            },
            Segment {
                start: 6,
                len: 5,
                adapter: Some(1),
            },
        ];
        let n = 11;
        let (x, base, dy, dx0) = (
            uniform(&[n, d], 1.0, 3),
            uniform(&[n, out], 1.0, 4),
            uniform(&[n, out], 1.0, 5),
            uniform(&[n, d], 1.0, 6),
        );
        let be = Backend::Device;
        let (y, caches) = forward(be, &x, base.clone(), &parts, &segs, &adapters).unwrap();
        let mut grads = vec![AdapterGrads::default(); 2];
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

        let (mut ys, mut want_dx) = (Vec::new(), dx0);
        let mut want = vec![AdapterGrads::default(); 2];
        let mut col = 0;
        for (p, &(target, width)) in parts.iter().enumerate() {
            let slice = base.narrow(1, col, width).unwrap();
            let (yp, cache) = lora_forward(be, &x, slice, target, &segs, &adapters).unwrap();
            for (got, want) in caches[p].iter().zip(&cache) {
                match (got, want) {
                    (Some(g), Some(w)) => assert!(max_abs_diff(g, w) < 1e-12),
                    (g, w) => assert_eq!(g.is_some(), w.is_some(), "part {p}'s caches"),
                }
            }
            ys.push(yp);
            let dyp = dy.narrow(1, col, width).unwrap().contiguous().unwrap();
            if let Some(extra) =
                lora_backward(&x, &dyp, target, &segs, &adapters, &cache, &mut want).unwrap()
            {
                want_dx = (want_dx + extra).unwrap();
            }
            col += width;
        }
        assert!(max_abs_diff(&y, &Tensor::cat(&ys, 1).unwrap()) < 1e-12);
        assert!(max_abs_diff(&dx, &want_dx) < 1e-12);
        // The base model's rows keep the frozen product and input gradient exactly.
        assert_eq!(
            max_abs_diff(&y.narrow(0, 4, 2).unwrap(), &base.narrow(0, 4, 2).unwrap()),
            0.0
        );
        assert_eq!(grads[0].pairs.len(), 2, "q and v, not k");
        assert_eq!(grads[1].pairs.len(), 3);
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
}
