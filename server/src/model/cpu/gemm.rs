//! A safe wrapper over the `gemm` crate's strided f32 product, for the CPU training path.
//!
//! candle's `matmul` always allocates a fresh output and cannot add into an existing
//! one, so a frozen projection plus its LoRA delta costs three allocations and an extra
//! pass over the output. With `gemm` directly, the delta `s (x Aᵀ) Bᵀ` is accumulated
//! into the frozen product in place, and column slices of a stacked output (q/k/v,
//! gate/up) are read and written through strides, without copies.

use candle_core::{Result, Storage, Tensor};
use gemm::Parallelism;
use rayon::prelude::*;

/// A read-only strided matrix: element `(i, j)` is `data[i * rs + j * cs]`.
#[derive(Debug, Clone, Copy)]
pub struct Mat<'a> {
    data: &'a [f32],
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

impl<'a> Mat<'a> {
    /// A row-major `(rows, cols)` matrix. Panics if `data` is too short.
    pub fn new(data: &'a [f32], rows: usize, cols: usize) -> Self {
        Self::strided(data, rows, cols, cols, 1)
    }

    /// A matrix with explicit strides. Panics if `data` is too short for them.
    pub fn strided(data: &'a [f32], rows: usize, cols: usize, rs: usize, cs: usize) -> Self {
        assert!(
            fits(data.len(), rows, cols, rs, cs),
            "matrix {rows}x{cols} (strides {rs},{cs}) outside a buffer of {}",
            data.len()
        );
        Self {
            data,
            rows,
            cols,
            rs,
            cs,
        }
    }

    /// Rows `start..start + len`.
    pub fn rows(self, start: usize, len: usize) -> Self {
        assert!(start + len <= self.rows, "rows out of range");
        let off = (start * self.rs).min(self.data.len());
        Self::strided(&self.data[off..], len, self.cols, self.rs, self.cs)
    }

    /// Columns `start..start + len`.
    pub fn cols(self, start: usize, len: usize) -> Self {
        assert!(start + len <= self.cols, "columns out of range");
        let off = (start * self.cs).min(self.data.len());
        Self::strided(&self.data[off..], self.rows, len, self.rs, self.cs)
    }

    /// `(rows, cols)`.
    pub fn shape(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    /// Element `(i, j)`. Panics outside the matrix.
    pub fn at(&self, i: usize, j: usize) -> f32 {
        assert!(
            i < self.rows && j < self.cols,
            "({i}, {j}) outside the matrix"
        );
        self.data[i * self.rs + j * self.cs]
    }

    /// Row `i` as a slice, when its elements are contiguous (`cs == 1`).
    pub fn row(&self, i: usize) -> Option<&'a [f32]> {
        assert!(i < self.rows, "row {i} outside the matrix");
        (self.cs == 1 || self.cols <= 1).then(|| &self.data[i * self.rs..i * self.rs + self.cols])
    }

    /// The transpose (a view: strides swap).
    pub fn t(self) -> Self {
        Self {
            data: self.data,
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
        }
    }
}

/// A writable strided matrix.
#[derive(Debug)]
pub struct MatMut<'a> {
    data: &'a mut [f32],
    rows: usize,
    cols: usize,
    rs: usize,
}

impl<'a> MatMut<'a> {
    /// A row-major `(rows, cols)` matrix with row stride `rs` (at least `cols`). Panics if
    /// `data` is too short.
    pub fn new(data: &'a mut [f32], rows: usize, cols: usize, rs: usize) -> Self {
        assert!(
            rs >= cols && fits(data.len(), rows, cols, rs, 1),
            "matrix {rows}x{cols} (row stride {rs}) outside a buffer of {}",
            data.len()
        );
        Self {
            data,
            rows,
            cols,
            rs,
        }
    }

    /// `(rows, cols)`.
    pub fn shape(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    /// The buffer's first element (element `(i, j)` is at offset `i * row_stride + j`).
    pub fn as_mut_ptr(&mut self) -> *mut f32 {
        self.data.as_mut_ptr()
    }

    /// Elements between the starts of consecutive rows.
    pub fn row_stride(&self) -> usize {
        self.rs
    }

    /// The `cols` elements of row `i`.
    pub fn row_mut(&mut self, i: usize) -> &mut [f32] {
        assert!(i < self.rows, "row {i} outside the matrix");
        &mut self.data[i * self.rs..i * self.rs + self.cols]
    }

    /// The matrix cut into consecutive blocks of `block` rows (the last may be shorter),
    /// each with the index of its first row.
    pub fn row_blocks(&mut self, block: usize) -> Vec<(usize, MatMut<'_>)> {
        assert!(block > 0, "empty row blocks");
        let (rows, cols, rs) = (self.rows, self.cols, self.rs);
        let mut rest = &mut self.data[..];
        let mut out = Vec::with_capacity(rows.div_ceil(block));
        for start in (0..rows).step_by(block) {
            let len = block.min(rows - start);
            let take = (len * rs).min(rest.len());
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(take);
            out.push((start, MatMut::new(head, len, cols, rs)));
            rest = tail;
        }
        out
    }

    /// Rows `start..start + len` and columns `col..col + width`.
    pub fn block(&mut self, start: usize, len: usize, col: usize, width: usize) -> MatMut<'_> {
        assert!(
            start + len <= self.rows && col + width <= self.cols,
            "block out of range"
        );
        let off = (start * self.rs + col).min(self.data.len());
        MatMut::new(&mut self.data[off..], len, width, self.rs)
    }
}

/// Whether a `rows x cols` matrix with these strides lies within `len` elements.
fn fits(len: usize, rows: usize, cols: usize, rs: usize, cs: usize) -> bool {
    rows == 0 || cols == 0 || (rows - 1) * rs + (cols - 1) * cs < len
}

/// Runs `f` with the data of each (contiguous, CPU f32) tensor.
pub fn with_slices<R>(ts: &[&Tensor], f: impl FnOnce(&[&[f32]]) -> Result<R>) -> Result<R> {
    let ts: Vec<Tensor> = ts.iter().map(|t| t.contiguous()).collect::<Result<_>>()?;
    let guards: Vec<_> = ts.iter().map(|t| t.storage_and_layout()).collect();
    let mut slices = Vec::with_capacity(ts.len());
    for (t, (storage, layout)) in ts.iter().zip(&guards) {
        let Storage::Cpu(cpu) = &**storage else {
            candle_core::bail!("expected a CPU tensor");
        };
        let start = layout.start_offset();
        slices.push(&cpu.as_slice::<f32>()?[start..start + t.elem_count()]);
    }
    f(&slices)
}

/// Below this many multiply-adds, waking the other threads costs more than it saves.
const PARALLEL_WORK: usize = 1 << 20;

/// Fewest rows per thread for splitting a product by rows.
const MIN_SPLIT_ROWS: usize = 64;

/// `dst = beta * lhs * rhs`, or `dst += beta * lhs * rhs` with `accumulate`.
pub fn gemm(dst: &mut MatMut<'_>, lhs: Mat<'_>, rhs: Mat<'_>, beta: f32, accumulate: bool) {
    assert_eq!(lhs.cols, rhs.rows, "inner dimensions differ");
    assert_eq!(
        (dst.rows, dst.cols),
        (lhs.rows, rhs.cols),
        "output shape differs"
    );
    let (m, n, k) = (dst.rows, dst.cols, lhs.cols);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for r in 0..m {
                dst.data[r * dst.rs..r * dst.rs + n].fill(0.0);
            }
        }
        return;
    }
    if m == 1 && n > 1 {
        // The gemm crate takes a product of one row as a matrix-vector product, which sums
        // in another order than its blocked kernel does for two rows or more, so a row's
        // numbers would depend on how many rows share its product (a one-token datum
        // alone in its pass against beside others). Two rows, the second a copy, keep the
        // blocked kernel.
        let row: Vec<f32> = (0..k).map(|j| lhs.at(0, j)).collect();
        let two = [row.as_slice(), row.as_slice()].concat();
        let mut out = vec![0f32; 2 * n];
        if accumulate {
            out[..n].copy_from_slice(&dst.data[..n]);
        }
        product(
            &mut MatMut::new(&mut out, 2, n, n),
            Mat::new(&two, 2, k),
            rhs,
            beta,
            accumulate,
            Parallelism::None,
        );
        dst.data[..n].copy_from_slice(&out[..n]);
        return;
    }
    let threads = rayon::current_num_threads();
    if m * n * k >= PARALLEL_WORK && threads > 1 && m >= threads * MIN_SPLIT_ROWS {
        // Row blocks on separate threads, each a single-threaded product: measured
        // 15-25 % faster than gemm's own threading for the backward pass's shapes on
        // two cores, and never slower.
        let block = m.div_ceil(threads);
        let rs = dst.rs;
        let (cols, lhs_block) = (dst.cols, |r: usize| {
            lhs.rows(r * block, block.min(m - r * block))
        });
        let mut rest = &mut dst.data[..];
        let mut parts = Vec::with_capacity(threads);
        for r in 0..m.div_ceil(block) {
            let rows = block.min(m - r * block);
            let take = (rows * rs).min(rest.len());
            let (head, tail) = rest.split_at_mut(take);
            parts.push((MatMut::new(head, rows, cols, rs), lhs_block(r)));
            rest = tail;
        }
        parts
            .into_par_iter()
            .for_each(|(mut d, l)| product(&mut d, l, rhs, beta, accumulate, Parallelism::None));
        return;
    }
    let parallelism = if m * n * k >= PARALLEL_WORK {
        Parallelism::Rayon(0)
    } else {
        Parallelism::None
    };
    product(dst, lhs, rhs, beta, accumulate, parallelism);
}

/// The product itself, shapes already checked.
fn product(
    dst: &mut MatMut<'_>,
    lhs: Mat<'_>,
    rhs: Mat<'_>,
    beta: f32,
    accumulate: bool,
    parallelism: Parallelism,
) {
    let (m, n, k) = (dst.rows, dst.cols, lhs.cols);
    // SAFETY: every pointer comes from a slice that `Mat::strided` / `MatMut::new`
    // checked holds all `(rows, cols)` elements at the given strides, and `dst` is
    // borrowed mutably, so it aliases neither input.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.data.as_mut_ptr(),
            1,
            dst.rs as isize,
            accumulate,
            lhs.data.as_ptr(),
            lhs.cs as isize,
            lhs.rs as isize,
            rhs.data.as_ptr(),
            rhs.cs as isize,
            rhs.rs as isize,
            1.0,
            beta,
            false,
            false,
            false,
            parallelism,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
        let mut out = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
            }
        }
        out
    }

    fn data(len: usize, seed: u32) -> Vec<f32> {
        (0..len)
            .map(|i| {
                ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 97) as f32 / 97.0 - 0.5
            })
            .collect()
    }

    /// A row's numbers do not depend on how many rows share its product: one row alone,
    /// among 20, and among 301 (split across threads), bit for bit, plain and
    /// accumulating (widths of a real model's projections: the gemm crate's own kernel
    /// for products of at most 256 outputs sums differently, and no real projection is
    /// that narrow).
    #[test]
    fn a_rows_product_is_the_same_bits_alone_and_among_others() {
        let (k, n) = (300, 576);
        let b = data(k * n, 5);
        for m in [20, 301] {
            let a = data(m * k, 6);
            for accumulate in [false, true] {
                let mut all = data(m * n, 7);
                gemm(
                    &mut MatMut::new(&mut all, m, n, n),
                    Mat::new(&a, m, k),
                    Mat::new(&b, k, n),
                    0.5,
                    accumulate,
                );
                for r in [0, m / 2, m - 1] {
                    let mut one = data(m * n, 7)[r * n..(r + 1) * n].to_vec();
                    gemm(
                        &mut MatMut::new(&mut one, 1, n, n),
                        Mat::new(&a[r * k..(r + 1) * k], 1, k),
                        Mat::new(&b, k, n),
                        0.5,
                        accumulate,
                    );
                    assert!(
                        one == all[r * n..(r + 1) * n],
                        "row {r} of {m}, accumulate {accumulate}"
                    );
                }
            }
        }
    }

    /// 37 rows: one product; 301 rows: split into row blocks across threads.
    #[test]
    fn products_match_a_naive_loop_for_transposes_blocks_and_accumulation() {
        for m in [37, 301] {
            check_products(m);
        }
    }

    fn check_products(m: usize) {
        let (k, n) = (300, 45);
        let a = data(m * k, 1);
        let b = data(k * n, 2);
        let want = naive(&a, &b, m, k, n);
        // Plain.
        let mut out = vec![7.0; m * n];
        gemm(
            &mut MatMut::new(&mut out, m, n, n),
            Mat::new(&a, m, k),
            Mat::new(&b, k, n),
            1.0,
            false,
        );
        for (x, y) in out.iter().zip(&want) {
            assert!((x - y).abs() < 1e-4);
        }
        // rhs given as its transpose's view; accumulate with a factor.
        let bt: Vec<f32> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
        gemm(
            &mut MatMut::new(&mut out, m, n, n),
            Mat::new(&a, m, k),
            Mat::new(&bt, n, k).t(),
            0.5,
            true,
        );
        for (x, y) in out.iter().zip(&want) {
            assert!((x - 1.5 * y).abs() < 1e-4);
        }
        // A block of columns of a wider output, from a column block of a wider lhs.
        let wide = 3 * n;
        let mut out = vec![1.0; m * wide];
        let aw = [a.clone(), a.clone()].concat(); // (m, 2k) after reshaping below
        let a2: Vec<f32> = (0..m)
            .flat_map(|i| {
                let row = &aw[i * k..(i + 1) * k];
                row.iter().chain(row).copied().collect::<Vec<_>>()
            })
            .collect();
        let mut dst = MatMut::new(&mut out, m, wide, wide);
        gemm(
            &mut dst.block(0, m, n, n),
            Mat::new(&a2, m, 2 * k).cols(k, k),
            Mat::new(&b, k, n),
            1.0,
            true,
        );
        for i in 0..m {
            for j in 0..wide {
                let v = out[i * wide + j];
                let expect = if (n..2 * n).contains(&j) {
                    1.0 + want[i * n + j - n]
                } else {
                    1.0
                };
                assert!((v - expect).abs() < 1e-4, "({i},{j}) {v} vs {expect}");
            }
        }
    }

    #[test]
    #[should_panic(expected = "outside a buffer")]
    fn a_view_larger_than_its_buffer_is_refused() {
        let v = vec![0.0; 10];
        let _ = Mat::new(&v, 3, 4);
    }
}
