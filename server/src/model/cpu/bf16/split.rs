//! Block-quantized weights times a few f32 activation rows on AMX tiles, to f32
//! rounding: the decode step's frozen products in the default f32 precision.
//!
//! AMX multiplies bf16 values only. Two facts let it compute f32 products anyway:
//! - a block's codes are small integers (Q4_1: 0 to 15, Q8: -128 to 127), exact in bf16,
//!   and its weights are `code * d + m` (Q8: `code * s`), so a weight row times an
//!   activation row is `sum over blocks of d (x . codes) + m (sum of x)`: only the codes
//!   go through the tiles, each block's scale and minimum apply after;
//! - an f32 value is exactly the sum of three bf16 values: its 24 significant bits,
//!   eight at a time, each part cut (towards zero) from what the previous parts leave.
//!   So `x . codes` is the sum of three tile products, every one of whose terms is exact
//!   in f32.
//!
//! The tiles sum a block's terms in f32 and the blocks are combined in f32, so a product
//! differs from the f32 kernels' (`cpu::quant`) only by f32 rounding in another order
//! (tested against f64 in `bf16::tests`). The weights' own rounding (`code * d + m` may
//! round in f32) is not reproduced: the exact weight is used, a difference of the same
//! order. Parts whose exponent falls below f32's normal range (an activation under
//! 2^-110 in magnitude) are flushed by the tiles, an error far below that rounding.
//!
//! Per weight the vector units only widen a code to bf16 once, whatever the number of
//! activation rows, and scale each block's sums; the f32 kernels do a multiply-add per
//! weight per row. Hand-written for the reason the rest of this module is.

use std::sync::OnceLock;

use super::blocks::usable;

/// Weights per block along the input dimension.
const BLOCK: usize = 32;
/// Weight rows per tile.
const GROUP: usize = 16;
/// bf16 parts per activation.
const PARTS: usize = 3;
/// Most activation rows one product takes (one tile's 16 columns).
pub const MAX_ROWS: usize = 16;

/// Whether f32 decode products of a few rows go through these kernels: where
/// [`usable`] holds, unless the environment sets `LATHE_CPU_TILES=0` (then the f32
/// kernels take them, for comparison).
pub fn enabled() -> bool {
    static ENABLED: OnceLock<bool> = OnceLock::new();
    *ENABLED.get_or_init(|| usable() && std::env::var("LATHE_CPU_TILES").as_deref() != Ok("0"))
}

/// Up to [`MAX_ROWS`] f32 activation rows of `k` columns, each cut into three bf16
/// parts laid out as right-hand tiles (for each block of 32 columns and each part, 16
/// pair rows of one pair word per activation row), and each row's sum over each block.
pub struct SplitRows {
    words: Vec<u32>,
    /// `(blocks, m)`: row `j`'s sum over block `b` at `b * m + j`.
    sums: Vec<f32>,
    m: usize,
    blocks: usize,
}

impl SplitRows {
    /// Splits and lays out `m` rows (`xs` is `(m, k)`, row-major). Panics unless
    /// `1 <= m <= MAX_ROWS`, `k` is a positive multiple of 32, `xs` holds `m * k` values
    /// and [`usable`] holds.
    pub fn new(xs: &[f32], m: usize, k: usize) -> Self {
        assert!(
            (1..=MAX_ROWS).contains(&m),
            "{m} rows: a split tile product takes 1 to {MAX_ROWS}"
        );
        assert!(
            k > 0 && k.is_multiple_of(BLOCK),
            "{k} columns: not whole blocks"
        );
        assert_eq!(xs.len(), m * k, "activations are not {m} x {k}");
        assert!(usable(), "this CPU cannot run the tile kernels");
        let blocks = k / BLOCK;
        let mut rows = Self {
            words: vec![0u32; blocks * PARTS * GROUP * m],
            sums: vec![0f32; blocks * m],
            m,
            blocks,
        };
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `usable` holds (AVX-512 F, BW and BF16); shapes checked above.
        unsafe {
            tiles::split_rows(&mut rows, xs, k)
        };
        rows
    }

    /// Activation rows.
    pub fn rows(&self) -> usize {
        self.m
    }
}

/// Q4_1 weight rows times `x` to f32 rounding: `out` is `(rows, x.rows())`. The blocks
/// as [`super::blocks::q41`] takes them. Panics if the slices disagree.
pub fn q41(x: &SplitRows, nibbles: &[u8], d: &[f32], mn: &[f32], out: &mut [f32]) {
    let rows = d.len() / x.blocks;
    assert!(
        d.len() == rows * x.blocks && mn.len() == d.len() && nibbles.len() == d.len() * 16,
        "Q4_1 blocks disagree with {rows} rows of {} blocks",
        x.blocks
    );
    assert_eq!(out.len(), rows * x.m, "output is not {rows} x {}", x.m);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `SplitRows::new` checked `usable`; the slices were checked above.
    unsafe {
        tiles::q41(x, nibbles, d, mn, out)
    }
}

/// Q8 weight rows times `x` to f32 rounding, as [`q41`]; the blocks as
/// [`super::blocks::q8`] takes them.
pub fn q8(x: &SplitRows, quants: &[i8], s: &[f32], out: &mut [f32]) {
    let rows = s.len() / x.blocks;
    assert!(
        s.len() == rows * x.blocks && quants.len() == s.len() * BLOCK,
        "Q8 blocks disagree with {rows} rows of {} blocks",
        x.blocks
    );
    assert_eq!(out.len(), rows * x.m, "output is not {rows} x {}", x.m);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: as in `q41`.
    unsafe {
        tiles::q8(x, quants, s, out)
    }
}

#[cfg(target_arch = "x86_64")]
mod tiles {
    use std::arch::asm;
    use std::arch::x86_64::*;

    use super::super::amx::{TileConfig, Tiles};
    use super::{SplitRows, BLOCK, GROUP, PARTS};

    /// Fills `rows` from `xs` (`(rows.m, k)`).
    ///
    /// # Safety
    /// AVX-512 F, BW and BF16; `xs.len() == rows.m * k`, `k == 32 rows.blocks`.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn split_rows(rows: &mut SplitRows, xs: &[f32], k: usize) {
        let (m, blocks) = (rows.m, rows.blocks);
        let high = _mm512_set1_epi32(0xffff_0000u32 as i32);
        // The top eight significant bits of each lane (cut towards zero): a bf16 value.
        let cut = |v: __m512| _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), high));
        let mut part = [[0u32; 16]; PARTS];
        for (j, x) in xs.chunks_exact(k).enumerate() {
            for b in 0..blocks {
                // SAFETY: block b's 32 values end at 32 (b + 1) <= k.
                let lo = _mm512_loadu_ps(x.as_ptr().add(b * BLOCK));
                let hi = _mm512_loadu_ps(x.as_ptr().add(b * BLOCK + 16));
                rows.sums[b * m + j] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
                let (mut rest_lo, mut rest_hi) = (lo, hi);
                for words in part.iter_mut() {
                    let (p_lo, p_hi) = (cut(rest_lo), cut(rest_hi));
                    rest_lo = _mm512_sub_ps(rest_lo, p_lo);
                    rest_hi = _mm512_sub_ps(rest_hi, p_hi);
                    // Exact: each part has at most eight significant bits. The second
                    // operand fills the low half, so word p pairs elements 2p and 2p + 1.
                    let packed = _mm512_cvtne2ps_pbh(p_hi, p_lo);
                    _mm512_storeu_si512(
                        words.as_mut_ptr().cast(),
                        std::mem::transmute::<__m512bh, __m512i>(packed),
                    );
                }
                for (p, words) in part.iter().enumerate() {
                    let tile = &mut rows.words[(b * PARTS + p) * GROUP * m..];
                    for (r, &w) in words.iter().enumerate() {
                        tile[r * m + j] = w;
                    }
                }
            }
        }
    }

    /// # Safety
    /// AMX and AVX-512 F, BW and BF16; the slices as [`super::q41`] checks them.
    #[target_feature(enable = "avx2,avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn q41(
        x: &SplitRows,
        nibbles: &[u8],
        d: &[f32],
        mn: &[f32],
        out: &mut [f32],
    ) {
        let nb = x.blocks;
        let iota = _mm512_setr_ps(
            0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15.,
        );
        // bf16 of 0..16, in both halves, so a low nibble indexes it without masking.
        let table = std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(iota, iota));
        let codes = |o: usize, b: usize| {
            // SAFETY: block (o, b)'s 16 bytes end at 16 (o nb + b + 1) <= nibbles.len().
            let bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(
                nibbles.as_ptr().add((o * nb + b) * 16).cast::<__m128i>(),
            ));
            let idx = _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(bytes),
                _mm256_srli_epi16::<4>(bytes),
            );
            _mm512_permutexvar_epi16(idx, table)
        };
        let scale = |o: usize, b: usize| (d[o * nb + b], mn[o * nb + b]);
        product_t(x, d.len() / nb, out, codes, scale)
    }

    /// # Safety
    /// AMX and AVX-512 F, BW and BF16; the slices as [`super::q8`] checks them.
    #[target_feature(enable = "avx2,avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn q8(x: &SplitRows, quants: &[i8], s: &[f32], out: &mut [f32]) {
        let nb = x.blocks;
        let codes = |o: usize, b: usize| {
            let at = (o * nb + b) * BLOCK;
            // SAFETY: block (o, b)'s 32 codes end at at + 32 <= quants.len().
            let half = |i: usize| {
                let c = _mm_loadu_si128(quants.as_ptr().add(i).cast::<__m128i>());
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c))
            };
            // Exact: every code has at most eight significant bits.
            std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(half(at + 16), half(at)))
        };
        let scale = |o: usize, b: usize| (s[o * nb + b], 0.0);
        product_t(x, s.len() / nb, out, codes, scale)
    }

    /// `out` `(rows, m)` = weight rows times `x`: `codes(o, b)` gives block `b` of weight
    /// row `o` as 32 bf16 codes and `scale(o, b)` its scale and minimum. Each group of 16
    /// weight rows has its codes widened into a row-major staging buffer (its 64-byte
    /// columns are the weight tiles); every block's three part products land in one
    /// accumulator tile, stored per block; then each row sums its blocks' scaled results.
    ///
    /// # Safety
    /// AMX and AVX-512 F, BW and BF16; `codes` and `scale` valid for `o < rows`,
    /// `b < x.blocks`; `out.len() == rows * x.m`.
    #[target_feature(enable = "avx2,avx512f,avx512bw,avx512bf16")]
    #[inline]
    unsafe fn product_t(
        x: &SplitRows,
        rows: usize,
        out: &mut [f32],
        codes: impl Fn(usize, usize) -> __m512i,
        scale: impl Fn(usize, usize) -> (f32, f32),
    ) {
        let (m, nb) = (x.m, x.blocks);
        let k = nb * BLOCK;
        let width = (4 * m) as u16;
        // tmm0 accumulates, tmm1 holds codes, tmm2 one part of the activations.
        let config = TileConfig::with(&[(16, width), (16, 64), (16, width)]);
        // SAFETY: the caller guarantees AMX.
        let _tiles = unsafe { Tiles::configure_as(&config) };
        let mut staging = vec![0u32; GROUP * k / 2];
        // Each block's 16 x m tile of code products.
        let mut blocks = vec![0f32; nb * GROUP * m];
        let lanes: __mmask16 = if m == 16 { !0 } else { (1 << m) - 1 };
        for g in (0..rows).step_by(GROUP) {
            let n = (rows - g).min(GROUP);
            for r in 0..GROUP {
                let dst = staging.as_mut_ptr().add(r * k / 2);
                for b in 0..nb {
                    let v = if r < n {
                        codes(g + r, b)
                    } else {
                        _mm512_setzero_si512()
                    };
                    // SAFETY: row r's block b is words 16 b .. 16 b + 16 of its k / 2.
                    _mm512_storeu_si512(dst.add(b * 16).cast(), v);
                }
            }
            // SAFETY: `staging` holds 16 rows of 2k bytes; `x.words` nb blocks of three
            // 16 x m word tiles; `blocks` nb tiles of 16 x m floats.
            unsafe {
                multiply(
                    staging.as_ptr(),
                    2 * k,
                    x.words.as_ptr(),
                    m,
                    nb,
                    blocks.as_mut_ptr(),
                )
            };
            for r in 0..n {
                let mut acc = _mm512_setzero_ps();
                for b in 0..nb {
                    let (ds, mins) = scale(g + r, b);
                    // SAFETY: tile b's row r and block b's sums hold m floats.
                    let c = _mm512_maskz_loadu_ps(lanes, blocks.as_ptr().add((b * GROUP + r) * m));
                    let sums = _mm512_maskz_loadu_ps(lanes, x.sums.as_ptr().add(b * m));
                    acc = _mm512_fmadd_ps(_mm512_set1_ps(ds), c, acc);
                    acc = _mm512_fmadd_ps(_mm512_set1_ps(mins), sums, acc);
                }
                // SAFETY: output row g + r holds m floats.
                _mm512_mask_storeu_ps(out.as_mut_ptr().add((g + r) * m), lanes, acc);
            }
        }
    }

    /// For each of `nb` blocks: the accumulator from zero through the three part
    /// products of the codes' tile at `a` (advancing 64 bytes; rows `a_stride` bytes
    /// apart) and the activations' part tiles at `b`, stored at `c` (advancing one 16 x m
    /// tile).
    ///
    /// # Safety
    /// Tiles configured by [`product_t`]; the buffers as described there.
    #[inline]
    unsafe fn multiply(
        a: *const u32,
        a_stride: usize,
        b: *const u32,
        m: usize,
        nb: usize,
        c: *mut f32,
    ) {
        let tile = 64 * m; // bytes of a 16 x m tile
        asm!(
            "2:",
            "tilezero tmm0",
            "tileloadd tmm1, [{a} + {sa}]",
            "tileloadd tmm2, [{b} + {sb}]",
            "tdpbf16ps tmm0, tmm1, tmm2",
            "add {b}, {tile}",
            "tileloadd tmm2, [{b} + {sb}]",
            "tdpbf16ps tmm0, tmm1, tmm2",
            "add {b}, {tile}",
            "tileloadd tmm2, [{b} + {sb}]",
            "tdpbf16ps tmm0, tmm1, tmm2",
            "add {b}, {tile}",
            "tilestored [{c} + {sb}], tmm0",
            "add {c}, {tile}",
            "add {a}, 64",
            "dec {n}",
            "jnz 2b",
            a = inout(reg) a => _,
            sa = in(reg) a_stride,
            b = inout(reg) b => _,
            sb = in(reg) 4 * m,
            tile = in(reg) tile,
            c = inout(reg) c => _,
            n = inout(reg) nb => _,
            out("tmm0") _, out("tmm1") _, out("tmm2") _,
            options(nostack),
        );
    }
}
