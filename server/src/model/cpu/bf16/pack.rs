//! The operand layouts the bf16 kernels read, and the clipped write of their results.
//!
//! A bf16 pair (elements `2p` and `2p + 1` of a row or column, the first in the low half)
//! is stored as one `u32`: that is the order both `TDPBF16PS` and `VDPBF16PS` multiply in.

use super::super::gemm::{Mat, MatMut};
use super::{K_BLOCK, M_BLOCK, PANEL};

/// `x` rounded to bf16 (to nearest, ties to even), as its bit pattern. Subnormal inputs
/// become zero of the same sign, as `VCVTNEPS2BF16` makes them (the vector rounding
/// of the activations), so that both roundings agree on every input.
pub fn round_bf16(x: f32) -> u16 {
    if x.is_subnormal() {
        return if x.is_sign_negative() { 0x8000 } else { 0 };
    }
    half::bf16::from_f32(x).to_bits()
}

/// Two bf16 bit patterns as one pair word, `lo` first in memory.
fn pair(lo: u16, hi: u16) -> u32 {
    u32::from(lo) | (u32::from(hi) << 16)
}

/// A `(k, n)` right-hand side in bf16, packed into panels of [`PANEL`] columns. Panel
/// `j`'s pair row `p` holds, for each of its 16 columns, the pair `(k = 2p, k = 2p + 1)`;
/// the rows of a panel are contiguous, so a [`K_BLOCK`]-deep slab of a panel is one
/// contiguous 1 KiB AMX tile. `k` is padded with zeros to a multiple of [`K_BLOCK`] and
/// `n` to an even number of panels (the kernels work on two panels at a time).
#[derive(Debug, Clone)]
pub struct PackedB {
    k: usize,
    n: usize,
    k_padded: usize,
    panels: usize,
    data: Vec<u32>,
}

impl PackedB {
    /// Packs the `(k, n)` matrix whose element `(i, j)` is `at(i, j)`.
    pub fn new(k: usize, n: usize, at: impl Fn(usize, usize) -> f32 + Sync) -> Self {
        let k_padded = k.div_ceil(K_BLOCK) * K_BLOCK;
        let panels = n.div_ceil(2 * PANEL) * 2;
        let pairs = k_padded / 2;
        let value = |i: usize, j: usize| {
            if i < k && j < n {
                round_bf16(at(i, j))
            } else {
                0
            }
        };
        let mut data = vec![0u32; panels * pairs * PANEL];
        use rayon::prelude::*;
        data.par_chunks_mut(pairs * PANEL)
            .enumerate()
            .for_each(|(panel, slab)| {
                for (p, row) in slab.chunks_exact_mut(PANEL).enumerate() {
                    for (c, word) in row.iter_mut().enumerate() {
                        let j = panel * PANEL + c;
                        *word = pair(value(2 * p, j), value(2 * p + 1, j));
                    }
                }
            });
        Self {
            k,
            n,
            k_padded,
            panels,
            data,
        }
    }

    /// Rows of the matrix (the reduction depth).
    pub fn k(&self) -> usize {
        self.k
    }

    /// Columns of the matrix.
    pub fn n(&self) -> usize {
        self.n
    }

    /// `k` rounded up to a multiple of [`K_BLOCK`].
    pub fn k_padded(&self) -> usize {
        self.k_padded
    }

    /// Panels of [`PANEL`] columns (an even number).
    pub fn panels(&self) -> usize {
        self.panels
    }

    /// Panel `j`: `k_padded / 2` pair rows of [`PANEL`] words.
    pub fn panel(&self, j: usize) -> &[u32] {
        let len = self.k_padded / 2 * PANEL;
        &self.data[j * len..(j + 1) * len]
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.data.len() * 4
    }

    /// Element `(i, j)` as f32 (exact: the stored bf16 widened). For tests.
    #[cfg(test)]
    pub fn get(&self, i: usize, j: usize) -> f32 {
        let word = self.panel(j / PANEL)[i / 2 * PANEL + j % PANEL];
        let bits = if i.is_multiple_of(2) {
            word & 0xffff
        } else {
            word >> 16
        };
        half::bf16::from_bits(bits as u16).to_f32()
    }
}

/// Rows of a left-hand side rounded to bf16 as pair words, `pairs` words per row (`k`
/// padded to a multiple of [`K_BLOCK`] with zeros), and the row count padded with zero
/// rows to a multiple of [`M_BLOCK`].
pub struct Lhs {
    /// Row-major pair words.
    pub data: Vec<u32>,
    /// Pair words per row.
    pub pairs: usize,
    /// Rows held, a multiple of [`M_BLOCK`].
    pub rows: usize,
}

impl Lhs {
    /// Rounds rows `start..start + len` of `a`, padding `k` to `k_padded`, into `data`'s
    /// memory (whatever it holds is overwritten, so a buffer kept between calls costs
    /// neither an allocation nor a clearing pass).
    pub fn round_into(
        mut data: Vec<u32>,
        a: Mat<'_>,
        start: usize,
        len: usize,
        k_padded: usize,
    ) -> Self {
        let (_, k) = a.shape();
        let pairs = k_padded / 2;
        let rows = len.div_ceil(M_BLOCK) * M_BLOCK;
        if data.len() < rows * pairs {
            data.resize(rows * pairs, 0);
        }
        data.truncate(rows * pairs);
        data[len * pairs..].fill(0);
        for (r, out) in data.chunks_exact_mut(pairs).take(len).enumerate() {
            match a.row(start + r) {
                Some(row) => {
                    round_row(row, out);
                    out[row.len().div_ceil(2)..].fill(0);
                }
                None => {
                    for (p, word) in out.iter_mut().enumerate() {
                        let v = |i: usize| {
                            if i < k {
                                round_bf16(a.at(start + r, i))
                            } else {
                                0
                            }
                        };
                        *word = pair(v(2 * p), v(2 * p + 1));
                    }
                }
            }
        }
        Self { data, pairs, rows }
    }
}

/// Rounds a contiguous row into pair words (the row may be shorter than `out` holds; the
/// rest stays zero).
pub(super) fn round_row(row: &[f32], out: &mut [u32]) {
    #[cfg(target_arch = "x86_64")]
    if super::avx512::usable() {
        // SAFETY: the CPU has AVX512-F and AVX512-BF16 (checked just above).
        unsafe { super::avx512::round_row(row, out) };
        return;
    }
    let mut chunks = row.chunks_exact(2);
    for (word, two) in out.iter_mut().zip(&mut chunks) {
        *word = pair(round_bf16(two[0]), round_bf16(two[1]));
    }
    if let [last] = chunks.remainder() {
        out[row.len() / 2] = pair(round_bf16(*last), 0);
    }
}

/// Where a kernel's results go: the rows and columns of `dst` that exist (the padded rows
/// and columns of a block are dropped), added to it with `accumulate` and written over it
/// otherwise.
///
/// Every access goes through one raw pointer taken from `dst` when the `Output` is made,
/// so the pointers [`Output::tile`] hands to the AMX kernel stay valid while it writes
/// other blocks through [`Output::put`]; `dst` stays borrowed meanwhile.
pub struct Output<'d> {
    base: *mut f32,
    rows: usize,
    cols: usize,
    stride: usize,
    accumulate: bool,
    _dst: std::marker::PhantomData<&'d mut [f32]>,
}

impl<'d> Output<'d> {
    /// Wraps `dst`.
    pub fn new(dst: &'d mut MatMut<'_>, accumulate: bool) -> Self {
        let (rows, cols) = dst.shape();
        Self {
            base: dst.as_mut_ptr(),
            rows,
            cols,
            stride: dst.row_stride(),
            accumulate,
            _dst: std::marker::PhantomData,
        }
    }

    /// Rows of the output.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Whether results are added to the output (rather than written over it).
    pub fn accumulates(&self) -> bool {
        self.accumulate
    }

    /// Where the `16 x 16` block at `(row, col)` lies in the output, when all of it does:
    /// a pointer to its first element and the row stride in bytes. The pointer is valid
    /// for 16 rows of 16 `f32` at that stride while `self` lives.
    pub fn tile(&self, row: usize, col: usize) -> Option<(*mut f32, usize)> {
        if row + 16 > self.rows || col + 16 > self.cols {
            return None;
        }
        // `MatMut` holds every element of its shape at this stride, so the block's
        // elements, up to `(row + 15) * stride + col + 15`, are in its buffer.
        Some((
            self.base.wrapping_add(row * self.stride + col),
            self.stride * std::mem::size_of::<f32>(),
        ))
    }

    /// Row `r`'s columns `col..col + width` (checked against the output's shape).
    fn row_mut(&mut self, r: usize, col: usize, width: usize) -> &mut [f32] {
        assert!(
            r < self.rows && col + width <= self.cols,
            "outside the output"
        );
        // SAFETY: inside the shape (asserted), hence inside the buffer `MatMut` checked;
        // `&mut self` makes this the only reference made through `base` at a time.
        unsafe { std::slice::from_raw_parts_mut(self.base.add(r * self.stride + col), width) }
    }

    /// The existing values of the `16 x 16` block at `(row, col)`, clipped to the output
    /// (zero outside it), into `block`: the starting point of an accumulating edge tile.
    pub fn get(&mut self, row: usize, col: usize, block: &mut [f32; 256]) {
        block.fill(0.0);
        if row >= self.rows || col >= self.cols {
            return;
        }
        let width = 16.min(self.cols - col);
        for r in 0..16.min(self.rows - row) {
            let src = self.row_mut(row + r, col, width);
            block[r * 16..r * 16 + width].copy_from_slice(src);
        }
    }

    /// Writes the `rows x ld` block `block` (row stride `ld`) at `(row, col)`, clipped to
    /// the output; with `add`, adds it to what is there.
    pub fn put(
        &mut self,
        row: usize,
        col: usize,
        block: &[f32],
        ld: usize,
        rows: usize,
        add: bool,
    ) {
        if row >= self.rows || col >= self.cols {
            return;
        }
        let width = ld.min(self.cols - col);
        for r in 0..rows.min(self.rows - row) {
            let src = &block[r * ld..r * ld + width];
            let out = self.row_mut(row + r, col, width);
            if add {
                out.iter_mut().zip(src).for_each(|(o, s)| *o += s);
            } else {
                out.copy_from_slice(src);
            }
        }
    }
}
