//! Causal attention on the host over the keys each query can see, instead of over every
//! key: the forward and backward passes of [`crate::model::ops::attention_stacked`].
//!
//! candle's batched `matmul` multiplies the whole `(queries, keys)` square, and the
//! causal mask then throws the upper half away: at 128 tokens or more, half of every
//! attention product of a training step is work whose result is zeroed. Here the forward
//! pass runs each query row over its visible keys with [`probabilities_row`] and
//! [`weighted_row`], the definition that prefill and decoding use too (so a sampled
//! token's log-probability is the trainer's bit for bit); the backward pass runs blocks
//! of [`QUERY_BLOCK`] queries through the gemm crate's products ([`super::gemm`]) over
//! the keys up to each block's last query. Masked probabilities are written as zeros
//! rather than computed. The layouts are those of `attention_stacked`: `qg (batches, group * tq,
//! hd)` (row `g * tq + i` is query `i` of the group's head `g`), `kh` and `vh`
//! `(batches, tk, hd)`, probabilities `(batches, group * tq, tk)`; query `i` sits at
//! position `tk - tq + i` and sees keys `0..=tk - tq + i`.

use rayon::prelude::*;

use multiversion::multiversion;

use super::gemm::{gemm, Mat, MatMut};
use super::row_loops;
use super::vector_math::{dot, dots, exp_f32, row_max, sum};

/// Queries per block of the backward pass: the gemm crate's largest row tile, so that
/// each block's products run its fastest kernel; smaller blocks would waste less of the
/// diagonal block but multiply less efficiently.
pub const QUERY_BLOCK: usize = 64;

/// The shapes of one call: `batches` independent `(group * tq, hd)` query sets, each
/// against its own `tk` keys and values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Independent batches (sequences times key-value heads).
    pub batches: usize,
    /// Query heads per key-value head.
    pub group: usize,
    /// Queries per head.
    pub tq: usize,
    /// Keys (at least `tq`: the cached prefix, then the queries' own).
    pub tk: usize,
    /// Head width.
    pub hd: usize,
}

impl Shape {
    fn rows(&self) -> usize {
        self.group * self.tq
    }

    /// Keys visible to query `i`: those up to its position.
    fn visible(&self, i: usize) -> usize {
        self.tk - self.tq + i + 1
    }

    /// The query blocks of one head: `(first query, queries, keys visible to the last)`.
    fn blocks(&self) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        (0..self.tq).step_by(QUERY_BLOCK).map(|i0| {
            let len = QUERY_BLOCK.min(self.tq - i0);
            (i0, len, self.visible(i0 + len - 1))
        })
    }

    fn check(&self, q: usize, k: usize, v: usize) {
        let s = self;
        assert!(
            s.tq <= s.tk,
            "attention: {} queries after {} keys",
            s.tq,
            s.tk
        );
        assert_eq!(q, s.batches * s.rows() * s.hd, "attention: query size");
        assert_eq!(k, s.batches * s.tk * s.hd, "attention: key size");
        assert_eq!(v, s.batches * s.tk * s.hd, "attention: value size");
    }
}

/// The forward pass: `(o, p)`, the output `(batches, group * tq, hd)` and the
/// probabilities `(batches, group * tq, tk)` (zero at masked keys), from `q`, `k`, `v`
/// in the module's layouts, the scores scaled by `scale`. Each query row is
/// [`probabilities_row`] and [`weighted_row`], as in prefill and decoding. Panics when
/// the slices' sizes are not the shape's or `tq > tk` (the caller builds both from one
/// tensor shape).
pub fn forward(q: &[f32], k: &[f32], v: &[f32], s: Shape, scale: f32) -> (Vec<f32>, Vec<f32>) {
    s.check(q.len(), k.len(), v.len());
    let (tq, tk, hd) = (s.tq, s.tk, s.hd);
    let mut o = vec![0f32; s.batches * s.rows() * hd];
    let mut p = vec![0f32; s.batches * s.rows() * tk];
    if o.is_empty() || p.is_empty() {
        return (o, p);
    }
    // One chunk per (batch, head): its `tq` rows of `o` and `p`.
    o.par_chunks_mut(tq * hd)
        .zip(p.par_chunks_mut(tq * tk))
        .enumerate()
        .for_each(|(bh, (oh, ph))| {
            let b = bh / s.group;
            let qh = &q[bh * tq * hd..(bh + 1) * tq * hd];
            let kb = &k[b * tk * hd..(b + 1) * tk * hd];
            let vb = &v[b * tk * hd..(b + 1) * tk * hd];
            let rows = ph.chunks_exact_mut(tk).zip(qh.chunks_exact(hd));
            for (i, (pr, qr)) in rows.enumerate() {
                probabilities_row(qr, kb, hd, scale, &mut pr[..s.visible(i)]);
            }
            weighted_rows(ph, tk, |i| s.visible(i), vb, hd, oh);
        });
    (o, p)
}

/// One query's attention probabilities over the first `p.len()` keys, written to `p`:
/// scores `dot_lanes(q, k_j) * scale` (key `j` being the `q.len()` values of `keys` from
/// `j * stride`), then `e^(score - max)` over their [`sum`]. The one definition that
/// training, prefill and decoding share, so that a sampled token's log-probability is
/// the trainer's bit for bit. Panics when `keys` is too short.
#[multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2+fma"))]
pub fn probabilities_row(q: &[f32], keys: &[f32], stride: usize, scale: f32, p: &mut [f32]) {
    dots(q, keys, stride, p);
    p.iter_mut().for_each(|s| *s *= scale);
    let max = row_max(p);
    p.iter_mut().for_each(|s| *s = exp_f32(*s - max));
    let total = sum(p);
    p.iter_mut().for_each(|s| *s /= total);
}

/// `o = sum_j p_j v_j` in order of `j` (each step one fused multiply-add), value `j`
/// being the `o.len()` values of `values` from `j * stride`: an attention output row,
/// shared as [`probabilities_row`] is. Panics when `values` is too short.
#[multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2+fma"))]
pub fn weighted_row(p: &[f32], values: &[f32], stride: usize, o: &mut [f32]) {
    let hd = o.len();
    o.fill(0.0);
    for (j, &w) in p.iter().enumerate() {
        let vj = &values[j * stride..j * stride + hd];
        for (x, &y) in o.iter_mut().zip(vj) {
            *x = w.mul_add(y, *x);
        }
    }
}

/// [`weighted_row`] of every row of `p` (rows `tk` apart, row `i` reaching
/// `visible(i)` keys, non-decreasing) into the `hd`-wide rows of `o`, from values `hd`
/// wide and contiguous: bit for bit the same, four rows at a time sharing each value
/// row's loads where the head width is 64.
#[multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2+fma"))]
fn weighted_rows(
    p: &[f32],
    tk: usize,
    visible: impl Fn(usize) -> usize,
    values: &[f32],
    hd: usize,
    o: &mut [f32],
) {
    const HD: usize = 64;
    assert!(
        hd > 0 && o.len().is_multiple_of(hd),
        "weighted_rows: rows of {hd}"
    );
    let rows = o.len() / hd;
    let mut i = 0;
    if hd == HD {
        while i + 4 <= rows {
            let vis: [usize; 4] = std::array::from_fn(|r| visible(i + r));
            let mut acc = [[0f32; HD]; 4];
            for j in 0..vis[0] {
                let vj: &[f32; HD] = values[j * HD..(j + 1) * HD].try_into().expect("a row");
                for (r, a) in acc.iter_mut().enumerate() {
                    let w = p[(i + r) * tk + j];
                    for d in 0..HD {
                        a[d] = w.mul_add(vj[d], a[d]);
                    }
                }
            }
            for (r, a) in acc.iter_mut().enumerate() {
                for j in vis[0]..vis[r] {
                    let vj: &[f32; HD] = values[j * HD..(j + 1) * HD].try_into().expect("a row");
                    let w = p[(i + r) * tk + j];
                    for d in 0..HD {
                        a[d] = w.mul_add(vj[d], a[d]);
                    }
                }
                o[(i + r) * HD..(i + r + 1) * HD].copy_from_slice(a);
            }
            i += 4;
        }
    }
    for r in i..rows {
        let pr = &p[r * tk..r * tk + visible(r)];
        weighted_row(pr, values, hd, &mut o[r * hd..(r + 1) * hd]);
    }
}

/// The backward pass: `(dq, dk, dv)` in the layouts of `q`, `k`, `v`, from the output's
/// gradient `dout` `(batches, group * tq, hd)` and the forward's `q`, `k`, `v` and
/// probabilities `p`. Panics as [`forward`] does.
pub fn backward(
    dout: &[f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    p: &[f32],
    s: Shape,
    scale: f32,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    s.check(q.len(), k.len(), v.len());
    assert_eq!(
        dout.len(),
        q.len(),
        "attention backward: output gradient size"
    );
    assert_eq!(
        p.len(),
        s.batches * s.rows() * s.tk,
        "attention backward: probabilities"
    );
    let (rows, tk, hd) = (s.rows(), s.tk, s.hd);
    let mut dq = vec![0f32; q.len()];
    let mut dk = vec![0f32; k.len()];
    let mut dv = vec![0f32; v.len()];
    if dq.is_empty() || dk.is_empty() {
        return (dq, dk, dv);
    }
    // One chunk per batch: its heads' query gradients and its keys' and values'.
    dq.par_chunks_mut(rows * hd)
        .zip(dk.par_chunks_mut(tk * hd).zip(dv.par_chunks_mut(tk * hd)))
        .enumerate()
        .for_each(|(b, (dqb, (dkb, dvb)))| {
            let qb = Mat::new(&q[b * rows * hd..(b + 1) * rows * hd], rows, hd);
            let gb = Mat::new(&dout[b * rows * hd..(b + 1) * rows * hd], rows, hd);
            let pb = Mat::new(&p[b * rows * tk..(b + 1) * rows * tk], rows, tk);
            let kb = Mat::new(&k[b * tk * hd..(b + 1) * tk * hd], tk, hd);
            let vb = Mat::new(&v[b * tk * hd..(b + 1) * tk * hd], tk, hd);
            let mut dqm = MatMut::new(dqb, rows, hd, hd);
            let mut dkm = MatMut::new(dkb, tk, hd, hd);
            let mut dvm = MatMut::new(dvb, tk, hd, hd);
            let mut ds = vec![0f32; QUERY_BLOCK.min(s.tq) * tk];
            for g in 0..s.group {
                for (i0, len, keys) in s.blocks() {
                    let r0 = g * s.tq + i0;
                    let (pr, gr, qr) = (
                        pb.rows(r0, len).cols(0, keys),
                        gb.rows(r0, len),
                        qb.rows(r0, len),
                    );
                    // dp = dout vᵀ, then ds = scale p (dp - rowsum(dp p)) in place.
                    let mut dsm = MatMut::new(&mut ds, len, keys, keys);
                    gemm(&mut dsm, gr, vb.rows(0, keys).t(), 1.0, false);
                    for r in 0..len {
                        let prow = pr.row(r).expect("rows of p are contiguous");
                        let drow = dsm.row_mut(r);
                        let dot = dot(prow, drow);
                        row_loops::softmax_grad(drow, prow, dot, scale);
                    }
                    let dsm = Mat::new(&ds[..len * keys], len, keys);
                    gemm(
                        &mut dqm.block(r0, len, 0, hd),
                        dsm,
                        kb.rows(0, keys),
                        1.0,
                        false,
                    );
                    gemm(&mut dkm.block(0, keys, 0, hd), dsm.t(), qr, 1.0, true);
                    gemm(&mut dvm.block(0, keys, 0, hd), pr.t(), gr, 1.0, true);
                }
            }
        });
    (dq, dk, dv)
}

#[cfg(test)]
mod tests {
    use super::QUERY_BLOCK;
    use crate::model::backend::Backend;
    use crate::model::ops::{attention, attention_backward, attention_stacked};
    use crate::model::test_util::{max_abs_diff as diff, uniform};
    use candle_core::{DType, Tensor};

    /// f32 attention on the host, in query blocks over the keys each block sees, equals
    /// the f64 composite (every key, then the mask) to f32 rounding: forward,
    /// probabilities and gradients, with several blocks (the last one partial), a cached
    /// prefix, grouped heads and stacked sequences; and a stacked sequence's numbers are
    /// its own alone, bit for bit.
    #[test]
    fn host_block_attention_matches_the_composite() {
        let f32s = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
        let f64s = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
        let (heads, kv_heads, hd) = (6, 2, 8);
        let (block, t) = (QUERY_BLOCK, 2 * QUERY_BLOCK + 7);
        // (queries, keys, sequences): stacked sequences; cached prefixes, one longer than
        // a block behind a few queries; a single query; a last block of one row.
        let shapes = [
            (t, t, 2),
            (t, t + 5, 1),
            (3, t, 1),
            (1, t, 1),
            (block + 1, block + 1, 2),
        ];
        for (tq, tk, seqs) in shapes {
            let q = uniform(&[seqs * tq, heads * hd], 2.0, 30);
            let k = uniform(&[seqs * tk, kv_heads * hd], 2.0, 31);
            let v = uniform(&[seqs * tk, kv_heads * hd], 2.0, 32);
            let dout = uniform(&[seqs * tq, heads * hd], 2.0, 33);
            let (want, want_saved) =
                attention_stacked(Backend::Device, &q, &k, &v, heads, kv_heads, seqs).unwrap();
            let (q32, k32, v32) = (f32s(&q), f32s(&k), f32s(&v));
            let (got, saved) =
                attention_stacked(Backend::Cpu, &q32, &k32, &v32, heads, kv_heads, seqs).unwrap();
            assert!(diff(&f64s(&got), &want) < 1e-5, "out, tq {tq} tk {tk}");
            assert!(
                diff(&f64s(saved.probabilities()), want_saved.probabilities()) < 1e-6,
                "p, tq {tq} tk {tk}"
            );
            let grads = attention_backward(Backend::Cpu, &f32s(&dout), &saved).unwrap();
            let want = attention_backward(Backend::Device, &dout, &want_saved).unwrap();
            for (name, g, w) in [
                ("dq", &grads.0, &want.0),
                ("dk", &grads.1, &want.1),
                ("dv", &grads.2, &want.2),
            ] {
                assert!(
                    diff(&f64s(g), w) < 1e-5,
                    "{name}, tq {tq} tk {tk}: {}",
                    diff(&f64s(g), w)
                );
            }
            if seqs > 1 {
                let rows = |x: &Tensor, i: usize| x.narrow(0, i * tq, tq).unwrap();
                for i in 0..seqs {
                    let (o1, s1) = attention(
                        Backend::Cpu,
                        &rows(&q32, i),
                        &rows(&k32, i),
                        &rows(&v32, i),
                        heads,
                        kv_heads,
                    )
                    .unwrap();
                    let (dq1, dk1, dv1) =
                        attention_backward(Backend::Cpu, &rows(&f32s(&dout), i), &s1).unwrap();
                    for (got, alone) in [
                        (&got, &o1),
                        (&grads.0, &dq1),
                        (&grads.1, &dk1),
                        (&grads.2, &dv1),
                    ] {
                        assert_eq!(
                            diff(&f64s(&rows(got, i)), &f64s(alone)),
                            0.0,
                            "sequence {i}"
                        );
                    }
                }
            }
        }
    }
}
