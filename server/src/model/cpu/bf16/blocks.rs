//! Block-quantized weights times a few activation rows in bf16 on AMX tiles: the decode
//! step's frozen products under `--precision bf16` where the trainer's kernel is
//! [`Kernel::Amx`], computed as the trainer computes them.
//!
//! A decode step multiplies a few rows (one per live sequence) by every frozen weight,
//! which the decode weights hold in blocks of 32 along the input (Q4_1 or Q8, see
//! `cpu::quant`). Under `--precision bf16` the trainer multiplies by the f32 weights
//! rounded to bf16, with its activations rounded too and f32 sums ([`super::gemm`]).
//! These kernels compute those same products from the blocks:
//! - each block of 32 weights is dequantized as the f32 weights were (the same multiply
//!   and add), so its rounding to bf16 is the packed weight's;
//! - the activation rows are rounded as the trainer rounds its left-hand side and laid
//!   out as pair rows ([`TileRows`]);
//! - the sums take the trainer's steps in the trainer's order: `TDPBF16PS` over the same
//!   32-deep blocks, starting from zero or, for a projection with a bias (Qwen2's
//!   q/k/v), from the bias, as the trainer's tiles do. The trainer's tiles hold
//!   activations on the left and weights on the right, these the other way round.
//!
//! A tile product's element sums the same products of two bf16 values (exact in f32
//! unless they underflow, which both sides flush alike) in the same positions whichever
//! operand is which, so with exact blocks decoding reproduces the trainer's products bit
//! for bit (`tests::decode_blocks_reproduce_the_trainers_products`).
//!
//! The f32 decode kernels do one multiply-add per weight per row; here one instruction
//! multiplies a block of weights into up to 16 rows (32 with a second tile), and the
//! vector work is the dequantization, once per weight whatever the number of rows.
//! With the trainer's `VDPBF16PS` kernel (AVX512-BF16 without AMX) decoding uses the
//! trainer's packed products instead (`DecodeMode::on`): computing them from the
//! blocks, whose lanes had to be transposed to the trainer's, was slower.
//! Hand-written for the reason the rest of this module is.

use super::pack::round_row;
use super::Kernel;

/// Weights per block along the input dimension: one weight-tile row of bf16.
const BLOCK: usize = 32;
/// Weight rows per tile.
const GROUP: usize = 16;
/// Activation rows per right-hand tile (16 pair words of 4 bytes: a full tile row).
const TILE_COLS: usize = 16;
/// Most activation rows one product takes (two right-hand tiles).
pub const MAX_ROWS: usize = 2 * TILE_COLS;

/// Whether this CPU runs these kernels with `kernel` (the trainer's): AMX tiles with
/// the permission to use them, and AVX2, AVX-512 F and BW and AVX512-BF16 for the
/// dequantization. Never for [`Kernel::Avx512Bf16`] (see the module's doc).
pub fn usable(kernel: Kernel) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        kernel == Kernel::Amx
            && super::available().contains(&kernel)
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = kernel;
        false
    }
}

/// Up to [`MAX_ROWS`] activation rows of `k` columns, rounded to bf16 as the trainer
/// rounds its left-hand side, in the right-hand tile layout: for each block of 32
/// columns, the tile of the first 16 rows (16 pair rows, each holding one pair word per
/// activation row), then the tile of the rest.
pub struct TileRows {
    words: Vec<u32>,
    m: usize,
    blocks: usize,
}

impl TileRows {
    /// Rounds and lays out `m` rows (`xs` is `(m, k)`, row-major). Panics unless
    /// `1 <= m <= MAX_ROWS`, `k` is a multiple of 32 and `xs` holds `m * k` values.
    pub fn new(xs: &[f32], m: usize, k: usize) -> Self {
        assert!(
            (1..=MAX_ROWS).contains(&m),
            "{m} rows: a tile product takes 1 to {MAX_ROWS}"
        );
        assert!(
            k > 0 && k.is_multiple_of(BLOCK),
            "{k} columns: not whole blocks"
        );
        assert_eq!(xs.len(), m * k, "activations are not {m} x {k}");
        let blocks = k / BLOCK;
        let (first, _) = tile_widths(m);
        let mut words = vec![0u32; blocks * GROUP * m];
        let mut row = vec![0u32; k / 2];
        for (j, x) in xs.chunks_exact(k).enumerate() {
            round_row(x, &mut row);
            // The tile this row is a column of: its offset in a block and its width.
            let (offset, width, col) = if j < TILE_COLS {
                (0, first, j)
            } else {
                (GROUP * first, m - TILE_COLS, j - TILE_COLS)
            };
            for (b, pairs) in row.chunks_exact(GROUP).enumerate() {
                let tile = &mut words[b * GROUP * m + offset..];
                for (p, &word) in pairs.iter().enumerate() {
                    tile[p * width + col] = word;
                }
            }
        }
        Self { words, m, blocks }
    }

    /// Activation rows.
    pub fn rows(&self) -> usize {
        self.m
    }
}

/// The widths (activation rows) of the two right-hand tiles of an `m`-row product.
fn tile_widths(m: usize) -> (usize, usize) {
    (m.min(TILE_COLS), m.saturating_sub(TILE_COLS))
}

/// Q4_1 weight rows times `x` with `kernel`, plus `bias` (one per weight row) if given:
/// `out` is `(rows, x.rows())`, one weight row's outputs together. The bias enters the
/// sums where the trainer's product with `kernel` puts it (see the module's doc). Block
/// `i` (row `i / blocks`, block `i % blocks`) has 16 bytes of codes at `nibbles[16 i..]`
/// (byte `j`: element `j` in the low nibble, `j + 16` in the high one, as GGML lays them
/// out), scale `d[i]` and minimum `mn[i]`; each weight is `code * d + m`, as the
/// dequantizer computes it.
///
/// Panics if the slices disagree or [`usable`] does not hold for `kernel`.
pub fn q41(
    kernel: Kernel,
    x: &TileRows,
    nibbles: &[u8],
    d: &[f32],
    mn: &[f32],
    bias: Option<&[f32]>,
    out: &mut [f32],
) {
    let rows = d.len() / x.blocks;
    assert!(
        d.len() == rows * x.blocks && mn.len() == d.len() && nibbles.len() == d.len() * 16,
        "Q4_1 blocks disagree with {rows} rows of {} blocks",
        x.blocks
    );
    check(kernel, x, rows, bias, out);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `usable` holds and the slices were checked above.
    unsafe {
        simd::q41(kernel, x, nibbles, d, mn, bias, out)
    }
}

/// Q8 weight rows (block `i`: 32 signed codes at `quants[32 i..]`, scale `s[i]`, each
/// weight `code * s`) times `x`, as [`q41`].
pub fn q8(
    kernel: Kernel,
    x: &TileRows,
    quants: &[i8],
    s: &[f32],
    bias: Option<&[f32]>,
    out: &mut [f32],
) {
    let rows = s.len() / x.blocks;
    assert!(
        s.len() == rows * x.blocks && quants.len() == s.len() * BLOCK,
        "Q8 blocks disagree with {rows} rows of {} blocks",
        x.blocks
    );
    check(kernel, x, rows, bias, out);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: as in `q41`.
    unsafe {
        simd::q8(kernel, x, quants, s, bias, out)
    }
}

/// The checks both kernels share: the output's and the bias's lengths, and the CPU.
fn check(kernel: Kernel, x: &TileRows, rows: usize, bias: Option<&[f32]>, out: &[f32]) {
    assert_eq!(out.len(), rows * x.m, "output is not {rows} x {}", x.m);
    if let Some(b) = bias {
        assert_eq!(b.len(), rows, "{} biases for {rows} rows", b.len());
    }
    assert!(
        usable(kernel),
        "this CPU cannot run the bf16 block kernels with {}",
        kernel.name()
    );
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::asm;
    use std::arch::x86_64::*;

    use super::super::amx::{TileConfig, Tiles};
    use super::{tile_widths, Kernel, TileRows, BLOCK, GROUP, TILE_COLS};

    /// Blocks of a group's weights staged at once: 16 rows of 8 blocks are 8 KiB.
    const SPAN_BLOCKS: usize = 8;
    use crate::model::cpu::kernels::prefetch_lines;

    /// # Safety
    /// [`super::usable`]; the slices as [`super::q41`] checks them.
    #[target_feature(enable = "avx2,avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn q41(
        kernel: Kernel,
        x: &TileRows,
        nibbles: &[u8],
        d: &[f32],
        mn: &[f32],
        bias: Option<&[f32]>,
        out: &mut [f32],
    ) {
        let nb = x.blocks;
        let iota = _mm512_setr_ps(
            0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15.,
        );
        // Block `b` of weight row `o` as 32 bf16 words, in element order.
        let block = |o: usize, b: usize| {
            let i = o * nb + b;
            // The block's 16 possible weights, formed as the dequantizer forms them, rounded
            // (to nearest even) and repeated in both halves of a 32-word table, so that
            // a low nibble indexes it without masking (the permute reads five index bits).
            let f = _mm512_add_ps(
                _mm512_mul_ps(iota, _mm512_set1_ps(d[i])),
                _mm512_set1_ps(mn[i]),
            );
            let table = _mm512_broadcast_i64x4(std::mem::transmute::<__m256bh, __m256i>(
                _mm512_cvtneps_pbh(f),
            ));
            // SAFETY: block i's 16 bytes end at 16 (i + 1) <= nibbles.len().
            let bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(
                nibbles.as_ptr().add(i * 16).cast::<__m128i>(),
            ));
            let codes = _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(bytes),
                _mm256_srli_epi16::<4>(bytes),
            );
            _mm512_permutexvar_epi16(codes, table)
        };
        let bytes = |o: usize, b: usize| nibbles.as_ptr().wrapping_add((o * nb + b) * 16);
        let stream = Stream {
            bytes,
            block_bytes: 16,
        };
        match kernel {
            Kernel::Amx => product_t(x, d.len() / nb, bias, out, block, stream),
            Kernel::Avx512Bf16 => unreachable!("`usable` holds for AMX alone"),
        }
    }

    /// # Safety
    /// [`super::usable`]; the slices as [`super::q8`] checks them.
    #[target_feature(enable = "avx2,avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn q8(
        kernel: Kernel,
        x: &TileRows,
        quants: &[i8],
        s: &[f32],
        bias: Option<&[f32]>,
        out: &mut [f32],
    ) {
        let nb = x.blocks;
        let block = |o: usize, b: usize| {
            let i = o * nb + b;
            let scale = _mm512_set1_ps(s[i]);
            // SAFETY: block i's 32 codes end at 32 (i + 1) <= quants.len().
            let half = |at: usize| {
                let codes = _mm_loadu_si128(quants.as_ptr().add(at).cast::<__m128i>());
                _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes)), scale)
            };
            // The second operand fills the low half.
            std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(
                half(i * BLOCK + 16),
                half(i * BLOCK),
            ))
        };
        let bytes = |o: usize, b: usize| quants.as_ptr().wrapping_add((o * nb + b) * BLOCK).cast();
        let stream = Stream {
            bytes,
            block_bytes: BLOCK,
        };
        match kernel {
            Kernel::Amx => product_t(x, s.len() / nb, bias, out, block, stream),
            Kernel::Avx512Bf16 => unreachable!("`usable` holds for AMX alone"),
        }
    }

    /// `out` `(rows, m)` = weight rows times `x`, with `block(o, b)` giving block `b` of
    /// weight row `o` in bf16. Each group of 16 weight rows is dequantized into a
    /// row-major staging buffer, whose 64-byte columns are the weight tiles, then
    /// multiplied by every block's right-hand tiles into one or two accumulator tiles.
    ///
    /// # Safety
    /// [`super::usable`]; `block(o, b)` valid for `o < rows`, `b < x.blocks`;
    /// `out.len() == rows * x.m`.
    #[target_feature(enable = "avx2,avx512f,avx512bw,avx512bf16")]
    #[inline]
    unsafe fn product_t(
        x: &TileRows,
        rows: usize,
        bias: Option<&[f32]>,
        out: &mut [f32],
        block: impl Fn(usize, usize) -> __m512i,
        stream: Stream<impl Fn(usize, usize) -> *const u8>,
    ) {
        let (m, nb) = (x.m, x.blocks);
        let (w0, w1) = tile_widths(m);
        let bytes = |w: usize| (4 * w) as u16;
        let second = if w1 > 0 { (16, bytes(w1)) } else { (0, 0) };
        // tmm0/tmm1 accumulate, tmm2 holds weights, tmm3/tmm4 activations.
        let config =
            TileConfig::with(&[(16, bytes(w0)), second, (16, 64), (16, bytes(w0)), second]);
        // SAFETY: the caller guarantees AMX (`usable`).
        let _tiles = unsafe { Tiles::configure_as(&config) };
        // A group's weights are staged a span of blocks at a time, so the staging stays
        // in the first-level cache however wide the rows.
        let span = nb.min(SPAN_BLOCKS);
        let mut staging = vec![0u32; GROUP * span * 16];
        let mut edge = [0f32; GROUP * 2 * TILE_COLS];
        // Where each group's accumulators start: its rows' biases, or zero.
        let mut seed = vec![0f32; GROUP * m];
        for g in (0..rows).step_by(GROUP) {
            let n = (rows - g).min(GROUP);
            if let Some(bias) = bias {
                for (r, row) in seed.chunks_exact_mut(m).enumerate() {
                    row.fill(if r < n { bias[g + r] } else { 0.0 });
                }
            }
            // A whole group's outputs are rows g..g + 16 of `out`; a partial one goes
            // through `edge` and is clipped.
            let c = if n == GROUP {
                out.as_mut_ptr().add(g * m)
            } else {
                edge.as_mut_ptr()
            };
            for first in (0..nb).step_by(span) {
                let len = span.min(nb - first);
                for r in 0..GROUP {
                    // The next group's weights of this span, a group's work ahead: one
                    // row after another, the hardware's prefetchers fall behind.
                    if g + GROUP + r < rows {
                        stream.prefetch(g + GROUP + r, first, len);
                    }
                    let dst = staging.as_mut_ptr().add(r * span * 16);
                    for i in 0..len {
                        let v = if r < n {
                            block(g + r, first + i)
                        } else {
                            _mm512_setzero_si512()
                        };
                        // SAFETY: row r's i-th staged block is words 16 i .. 16 i + 16
                        // of its span * 16.
                        _mm512_storeu_si512(dst.add(i * 16).cast(), v);
                    }
                }
                // After the first span the accumulators continue from what the last
                // one stored: the same steps in the same order, the sums exact f32.
                let from = if first == 0 {
                    seed.as_ptr()
                } else {
                    c.cast_const()
                };
                // SAFETY: `staging` holds 16 rows of 64 span bytes (span tiles of 64
                // bytes side by side); `x.words` holds nb blocks of 16 m words (from
                // block `first` on, `len` of them), the first tile 16 rows of w0 words,
                // the second 16 rows of w1 after it; `from` and `c` have 16 rows of m
                // floats.
                unsafe {
                    multiply(
                        staging.as_ptr(),
                        64 * span,
                        x.words.as_ptr().add(first * GROUP * m),
                        w0,
                        w1,
                        len,
                        from,
                        c,
                        4 * m,
                    )
                };
            }
            if n < GROUP {
                out[g * m..(g + n) * m].copy_from_slice(&edge[..n * m]);
            }
        }
    }

    /// Where a weight row's blocks are in memory: `bytes(o, b)` is block `b` of row `o`
    /// (blocks of a row are contiguous), `block_bytes` long.
    pub(super) struct Stream<F> {
        bytes: F,
        block_bytes: usize,
    }

    impl<F: Fn(usize, usize) -> *const u8> Stream<F> {
        /// Asks for the cache lines of blocks `first..first + len` of row `o`.
        #[inline]
        fn prefetch(&self, o: usize, first: usize, len: usize) {
            prefetch_lines((self.bytes)(o, first), len * self.block_bytes);
        }
    }

    /// The accumulator tiles from `seed` through `nb` steps (one weight tile at `a`,
    /// advancing 64 bytes, and one or two activation tiles at `b`, advancing a block),
    /// stored at `c`; `seed` and `c` have rows `c_stride` bytes apart, the second tile
    /// 16 floats on.
    ///
    /// # Safety
    /// Tiles configured by [`product_t`]; the buffers as described there.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    unsafe fn multiply(
        a: *const u32,
        a_stride: usize,
        b: *const u32,
        w0: usize,
        w1: usize,
        nb: usize,
        seed: *const f32,
        c: *mut f32,
        c_stride: usize,
    ) {
        let block_bytes = 4 * GROUP * (w0 + w1);
        if w1 == 0 {
            asm!(
                "tileloadd tmm0, [{s0} + {sc}]",
                "2:",
                "tileloadd tmm2, [{a} + {sa}]",
                "tileloadd tmm3, [{b} + {sb}]",
                "tdpbf16ps tmm0, tmm2, tmm3",
                "add {a}, 64",
                "add {b}, {step}",
                "dec {n}",
                "jnz 2b",
                "tilestored [{c} + {sc}], tmm0",
                a = inout(reg) a => _,
                sa = in(reg) a_stride,
                b = inout(reg) b => _,
                sb = in(reg) 4 * w0,
                step = in(reg) block_bytes,
                n = inout(reg) nb => _,
                s0 = in(reg) seed,
                c = in(reg) c,
                sc = in(reg) c_stride,
                out("tmm0") _, out("tmm2") _, out("tmm3") _,
                options(nostack),
            );
        } else {
            asm!(
                "tileloadd tmm0, [{s0} + {sc}]",
                // The second tile starts 16 floats (64 bytes) on.
                "tileloadd tmm1, [{s0} + {sc} + 64]",
                "2:",
                "tileloadd tmm2, [{a} + {sa}]",
                "tileloadd tmm3, [{b0} + {sb0}]",
                "tdpbf16ps tmm0, tmm2, tmm3",
                "tileloadd tmm4, [{b1} + {sb1}]",
                "tdpbf16ps tmm1, tmm2, tmm4",
                "add {a}, 64",
                "add {b0}, {step}",
                "add {b1}, {step}",
                "dec {n}",
                "jnz 2b",
                "tilestored [{c0} + {sc}], tmm0",
                "tilestored [{c0} + {sc} + 64], tmm1",
                a = inout(reg) a => _,
                sa = in(reg) a_stride,
                b0 = inout(reg) b => _,
                sb0 = in(reg) 4 * w0,
                b1 = inout(reg) b.add(GROUP * w0) => _,
                sb1 = in(reg) 4 * w1,
                step = in(reg) block_bytes,
                n = inout(reg) nb => _,
                s0 = in(reg) seed,
                c0 = in(reg) c,
                sc = in(reg) c_stride,
                out("tmm0") _, out("tmm1") _, out("tmm2") _, out("tmm3") _, out("tmm4") _,
                options(nostack),
            );
        }
    }
}
