//! LoRA deltas row by row on the host: `y += s B (A x)` in one fixed order of operations,
//! shared by training, prefill and decoding so that a row's numbers never depend on which
//! of them computed it, nor on how many rows shared the call.
//!
//! A general product (the gemm crate's) sums in an order that depends on the shapes it is
//! given, so a delta computed for 512 rows of a training pass and for the one row of a
//! decode step could differ in the last bit; in bf16 precision such a bit can round an
//! activation to its neighbouring bf16 value in the next product, and a sampled token's
//! log-probability would then drift from the trainer's. Here every row is `u = A x`
//! through [`dots`] and then `y += (s u_j) Bᵀ_j` for `j` ascending, whatever the caller.

use multiversion::multiversion;
use rayon::prelude::*;

use super::gemm::{Mat, MatMut};
use super::vector_math::dots;

/// Adds one row's delta to `y` and writes `u = A x` (unscaled: what the backward pass
/// keeps). `a` is `A`, `(r, k)`, and `bt` is `Bᵀ`, `(r, n)`, both row-major, with `k`, `n`
/// and `r` the lengths of `x`, `y` and `u`. Panics when the sizes disagree.
pub fn add_delta_row(a: &[f32], bt: &[f32], scale: f32, x: &[f32], y: &mut [f32], u: &mut [f32]) {
    let (k, n, r) = (x.len(), y.len(), u.len());
    assert!(
        a.len() == r * k && bt.len() == r * n,
        "LoRA delta: A of {} and Bᵀ of {} values for rank {r}, {k} inputs, {n} outputs",
        a.len(),
        bt.len()
    );
    dots(x, a, k, u);
    add_up(bt, scale, u, y);
}

/// `y += (s u_j) bt_j` for `j` ascending.
fn add_up(bt: &[f32], scale: f32, u: &[f32], y: &mut [f32]) {
    let n = y.len();
    add_up_columns(bt, n, 0..n, scale, u, y);
}

/// `y += (s u_j) bt_j[cols]` for `j` ascending, `bt` having rows of `n`.
#[multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2+fma"))]
fn add_up_columns(
    bt: &[f32],
    n: usize,
    cols: std::ops::Range<usize>,
    scale: f32,
    u: &[f32],
    y: &mut [f32],
) {
    for (j, &uj) in u.iter().enumerate() {
        let us = uj * scale;
        let row = &bt[j * n + cols.start..j * n + cols.end];
        for (o, &b) in y.iter_mut().zip(row) {
            *o += us * b;
        }
    }
}

/// Output columns per pass of [`add_deltas`] over a block of rows: `r` rows of `Bᵀ` this
/// wide stay in cache while every row of the block adds them, so a wide output (the
/// vocabulary, for an adapted head) reads `Bᵀ` once per block rather than once per row.
const COLUMN_TILE: usize = 1024;

/// [`add_delta_row`] for every row of `x` (contiguous rows) into the same row of `y`, with
/// `u` `(rows, r)`; rows split across the pool's threads. Bit for bit [`add_delta_row`]
/// row by row: each output element still adds its `r` terms in order of `j`.
pub fn add_deltas(
    a: &[f32],
    bt: &[f32],
    scale: f32,
    x: Mat<'_>,
    y: &mut MatMut<'_>,
    u: &mut [f32],
) {
    let (rows, _) = x.shape();
    assert_eq!(
        y.shape().0,
        rows,
        "LoRA deltas: input and output rows differ"
    );
    if rows == 0 {
        return;
    }
    assert_eq!(u.len() % rows, 0, "LoRA deltas: u is not rows x rank");
    let r = u.len() / rows;
    let block = rows.div_ceil(rayon::current_num_threads()).max(1);
    y.row_blocks(block)
        .into_par_iter()
        .zip(u.par_chunks_mut((block * r).max(1)))
        .for_each(|((start, mut yb), ub)| {
            let (len, n) = yb.shape();
            let k = x.shape().1;
            assert!(
                a.len() == r * k && bt.len() == r * n,
                "LoRA deltas: A of {} and Bᵀ of {} values for rank {r}, {k} inputs, {n} outputs",
                a.len(),
                bt.len()
            );
            for i in 0..len {
                let xr = x.row(start + i).expect("LoRA input rows are contiguous");
                dots(xr, a, k, &mut ub[i * r..(i + 1) * r]);
            }
            for c0 in (0..n).step_by(COLUMN_TILE) {
                let c1 = (c0 + COLUMN_TILE).min(n);
                for i in 0..len {
                    add_up_columns(
                        bt,
                        n,
                        c0..c1,
                        scale,
                        &ub[i * r..(i + 1) * r],
                        &mut yb.row_mut(i)[c0..c1],
                    );
                }
            }
        });
}

/// `Bᵀ` of `b` `(n, r)`, row-major.
pub fn transposed(b: &[f32], n: usize, r: usize) -> Vec<f32> {
    assert_eq!(b.len(), n * r, "B is not {n} x {r}");
    let mut bt = vec![0f32; n * r];
    for (i, row) in b.chunks_exact(r.max(1)).enumerate() {
        for (j, &v) in row.iter().enumerate() {
            bt[j * n + i] = v;
        }
    }
    bt
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wave(n: usize, f: f32) -> Vec<f32> {
        (0..n).map(|i| (i as f32 * f).cos() * 0.5).collect()
    }

    /// The deltas of many rows at once are each row's alone, bit for bit (what makes a
    /// decode step's deltas a training pass's), and equal `y + s B (A x)` computed in f64
    /// to f32 rounding.
    #[test]
    fn rows_together_are_each_row_alone_and_the_f64_delta() {
        let (rows, k, n, r, scale) = (37, 70, 45, 5, 0.75f32);
        let (a, b, x) = (wave(r * k, 0.3), wave(n * r, 0.7), wave(rows * k, 0.13));
        let base = wave(rows * n, 0.05);
        let bt = transposed(&b, n, r);
        let mut y = base.clone();
        let mut u = vec![0f32; rows * r];
        add_deltas(
            &a,
            &bt,
            scale,
            Mat::new(&x, rows, k),
            &mut MatMut::new(&mut y, rows, n, n),
            &mut u,
        );
        for i in 0..rows {
            let (xr, mut alone, mut ua) = (
                &x[i * k..(i + 1) * k],
                base[i * n..(i + 1) * n].to_vec(),
                vec![0f32; r],
            );
            add_delta_row(&a, &bt, scale, xr, &mut alone, &mut ua);
            assert_eq!(&y[i * n..(i + 1) * n], alone.as_slice(), "row {i}");
            assert_eq!(&u[i * r..(i + 1) * r], ua.as_slice(), "u of row {i}");
            for o in 0..n {
                let mut want = base[i * n + o] as f64;
                for j in 0..r {
                    let uj: f64 = (0..k).map(|c| a[j * k + c] as f64 * xr[c] as f64).sum();
                    want += scale as f64 * uj * b[o * r + j] as f64;
                }
                assert!((y[i * n + o] as f64 - want).abs() < 1e-5, "row {i} col {o}");
            }
        }
    }
}
