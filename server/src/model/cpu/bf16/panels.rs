//! Block-quantized frozen weights in the `VDPBF16PS` kernel's panel order, for the
//! few-row products of decoding under `--precision bf16` on a CPU with AVX512-BF16 and
//! no AMX.
//!
//! One decoded token multiplies one activation row by every weight once, so a single
//! stream's speed is set by the bytes the weights take: 2 per weight in the trainer's packed bf16 panels
//! ([`super::PackedB`]). The default model's weights are Q4_1 blocks exactly (and its
//! head Q8 blocks, see [`QuantMatrix`]), so the same weights fit in 0.625 bytes (4-bit
//! codes, f16 scale and minimum per block) or 1.125 (8-bit codes, f32 scale).
//!
//! The trainer's kernel sums each output in one `VDPBF16PS` lane: from zero, over the
//! pairs `(2p, 2p + 1)` of the reduction in order, each step adding the bf16 products of
//! the pair's activation and weights. Here the codes are laid out so that one load gives,
//! for 16 output columns (a panel, the lanes), the codes of one pair; the kernel forms
//! those weights exactly as the f32 weights were dequantized (`q * d + m`), rounds them
//! to bf16 as the packing does, and runs the same instruction on the same lanes in the
//! same order. The outputs are the trainer's bit for bit, which a test checks against
//! [`super::gemm`]. A decode step of several streams forms each weight once for all its
//! rows.

use half::f16;
use rayon::prelude::*;

use super::super::quant::{QuantBlock, QuantMatrix, BLOCK};
use super::super::warm::{Trickle, Warm};
use super::PANEL;

/// Most activation rows of one [`QuantPanels::product`].
pub const MAX_ROWS: usize = 8;

/// Pairs of the reduction per block.
const PAIRS: usize = BLOCK / 2;
/// Bytes of one (panel, block) record of 4-bit codes: 16 bytes for each pair, then the
/// rows' f16 scales and f16 minimums. Byte `t` of a pair holds in its low nibble the
/// code of row `t / 2` and in its high nibble that of row `8 + t / 2`, each at column
/// `2p + t % 2`: widened to 16 lanes and split into nibbles, the codes are then in the
/// order of the pair words of rows 0-7 and of rows 8-15, which one rounding instruction
/// packs into the 16 lanes' pairs.
const Q41_RECORD: usize = PAIRS * PANEL + 2 * PANEL * 2;
/// Bytes of one (panel, block) record of 8-bit codes: 32 bytes for each pair, byte `t`
/// the code of row `t / 2` at column `2p + t % 2` (rows 0-7, then 8-15 from byte 16),
/// then the rows' f32 scales.
const Q8_RECORD: usize = PAIRS * 2 * PANEL + PANEL * 4;

/// The codes' format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    Q41,
    Q8,
}

/// A `(rows, cols)` weight matrix of exact Q4_1 or Q8 blocks in panel order.
#[derive(Debug, Clone)]
pub struct QuantPanels {
    rows: usize,
    cols: usize,
    format: Format,
    /// Records by panel, then by block.
    data: Vec<u8>,
}

impl QuantPanels {
    /// `q`'s weights in panel order, when its blocks reproduce the f32 weights exactly
    /// (otherwise its products would not be the trainer's).
    pub fn new(q: &QuantMatrix) -> Option<Self> {
        let (rows, cols) = q.shape();
        if !q.exact() || rows == 0 || cols == 0 {
            return None;
        }
        let nb = cols / BLOCK;
        // An even number: the kernel takes panels in pairs.
        let panels = rows.div_ceil(PANEL).next_multiple_of(2);
        let format = match q.block(0, 0) {
            QuantBlock::Q41 { .. } => Format::Q41,
            QuantBlock::Q8 { .. } => Format::Q8,
        };
        let record = match format {
            Format::Q41 => Q41_RECORD,
            Format::Q8 => Q8_RECORD,
        };
        let mut data = vec![0u8; panels * nb * record];
        data.par_chunks_mut(nb * record)
            .enumerate()
            .for_each(|(panel, records)| {
                for (b, rec) in records.chunks_exact_mut(record).enumerate() {
                    // Rows past the matrix stay zero: zero weights, outputs dropped.
                    for j in 0..PANEL.min(rows.saturating_sub(panel * PANEL)) {
                        write_row(rec, j, q.block(panel * PANEL + j, b));
                    }
                }
            });
        Some(Self {
            rows,
            cols,
            format,
            data,
        })
    }

    /// Output columns (the weight's rows).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input columns (the reduction).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    /// `x Wᵀ (+ bias)` for `m` rows `x` (`(m, cols)`, row-major; at most [`MAX_ROWS`]),
    /// `(m, rows)`, as the trainer's bf16 product computes it: `x` rounded to bf16, each
    /// output's sum started from zero and the bias added after.
    ///
    /// Panics unless the CPU has AVX-512 F and BW and AVX512-BF16 ([`usable`]) and the
    /// sizes agree.
    pub fn product(&self, x: &[f32], m: usize, bias: Option<&[f32]>) -> Vec<f32> {
        self.product_warming(x, m, bias, Warm::NONE)
    }

    /// [`QuantPanels::product`], pulling `warm` toward the caches while it computes (the
    /// kernel is bound by its arithmetic, even for one row).
    pub fn product_warming(
        &self,
        x: &[f32],
        m: usize,
        bias: Option<&[f32]>,
        warm: Warm<'_>,
    ) -> Vec<f32> {
        assert!(
            usable(),
            "bf16 panel products need AVX-512 BW and AVX512-BF16"
        );
        assert!((1..=MAX_ROWS).contains(&m), "1 to {MAX_ROWS} rows, not {m}");
        assert_eq!(x.len(), m * self.cols, "{m} rows of {} columns", self.cols);
        assert!(
            bias.is_none_or(|b| b.len() == self.rows),
            "one bias per row"
        );
        let pairs = self.cols / 2;
        let mut words = vec![0u32; m * pairs];
        for (row, out) in x.chunks_exact(self.cols).zip(words.chunks_exact_mut(pairs)) {
            super::pack::round_row(row, out);
        }
        let nb = self.cols / BLOCK;
        let record = match self.format {
            Format::Q41 => Q41_RECORD,
            Format::Q8 => Q8_RECORD,
        };
        let panels = self.rows.div_ceil(PANEL).next_multiple_of(2);
        // Two tasks per thread, whole panel pairs each (the kernel's unit); each task
        // writes its columns of every row into its own buffer.
        let per_task = panels
            .div_ceil(2 * rayon::current_num_threads())
            .next_multiple_of(2);
        let chunk = per_task * nb * record;
        let tasks = self.data.len().div_ceil(chunk);
        let parts: Vec<Vec<f32>> = self
            .data
            .par_chunks(chunk)
            .enumerate()
            .map(|(task, records)| {
                let width = records.len() / (nb * record) * PANEL;
                let mut part = vec![0f32; m * width];
                // One step per record pair the kernel reads.
                let warm = warm.share(task, tasks, records.len() / record / 2);
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `usable()` was asserted above; `records` holds whole panel
                // pairs of `nb` records, `words` `m` rows of `pairs = nb * 16` words and
                // `part` `m` rows of `width` values.
                unsafe {
                    let task = kernel::Task {
                        records,
                        nb,
                        x: &words,
                        pairs,
                        out: &mut part,
                        stride: width,
                        warm: &warm,
                    };
                    kernel::product(self.format, m, task)
                };
                #[cfg(not(target_arch = "x86_64"))]
                let _ = warm;
                part
            })
            .collect();
        let mut y = Vec::with_capacity(m * self.rows);
        for r in 0..m {
            let mut col = 0;
            for part in &parts {
                let width = part.len() / m;
                let take = width.min(self.rows - col.min(self.rows));
                let row = &part[r * width..r * width + take];
                match bias {
                    Some(b) => y.extend(row.iter().zip(&b[col..col + take]).map(|(v, b)| b + v)),
                    None => y.extend_from_slice(row),
                }
                col += take;
            }
        }
        y
    }
}

/// Writes row `j` of a panel's record for one block.
fn write_row(rec: &mut [u8], j: usize, block: QuantBlock) {
    match block {
        QuantBlock::Q41 { codes, scale, min } => {
            // Rows 0-7 in the low nibbles, 8-15 in the high ones.
            let (t, shift) = (2 * (j % 8), if j < 8 { 0 } else { 4 });
            for p in 0..PAIRS {
                rec[p * PANEL + t] |= codes[2 * p] << shift;
                rec[p * PANEL + t + 1] |= codes[2 * p + 1] << shift;
            }
            let at = PAIRS * PANEL;
            let put = |rec: &mut [u8], i: usize, v: f32| {
                rec[i..i + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
            };
            put(rec, at + 2 * j, scale);
            put(rec, at + 2 * PANEL + 2 * j, min);
        }
        QuantBlock::Q8 { codes, scale } => {
            for p in 0..PAIRS {
                rec[p * 2 * PANEL + 2 * j] = codes[2 * p] as u8;
                rec[p * 2 * PANEL + 2 * j + 1] = codes[2 * p + 1] as u8;
            }
            let at = PAIRS * 2 * PANEL + 4 * j;
            rec[at..at + 4].copy_from_slice(&scale.to_le_bytes());
        }
    }
}

/// Whether this CPU runs [`QuantPanels::product`].
pub fn usable() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[cfg(target_arch = "x86_64")]
mod kernel {
    use std::arch::x86_64::*;

    use super::{Format, Trickle, PAIRS, PANEL, Q41_RECORD, Q8_RECORD};
    use crate::model::cpu::kernels::prefetch_lines;

    /// Records prefetched ahead of the one being read, in each panel's stream.
    const AHEAD: usize = 2;

    /// One task's operands: `records`, panels of `nb` records each (a (panel, block)
    /// record per block), times rows of pair words `x` (`pairs` words each) into `out`
    /// (rows of `stride` values; the panels' 16 outputs each), stepping `warm` once per
    /// block of a panel pair.
    pub(super) struct Task<'a> {
        pub records: &'a [u8],
        pub nb: usize,
        pub x: &'a [u32],
        pub pairs: usize,
        pub out: &'a mut [f32],
        pub stride: usize,
        pub warm: &'a Trickle<'a>,
    }

    /// [`q41`] or [`q8`] for `m` (1 to 8) rows.
    ///
    /// # Safety
    /// As for [`q41`].
    pub(super) unsafe fn product(format: Format, m: usize, task: Task) {
        macro_rules! rows {
            ($($r:literal)*) => {
                match (format, m) {
                    $((Format::Q41, $r) => q41::<$r>(task),
                      (Format::Q8, $r) => q8::<$r>(task),)*
                    _ => unreachable!("1 to 8 rows"),
                }
            };
        }
        rows!(1 2 3 4 5 6 7 8)
    }

    /// A panel's 16 per-row values spread over the lanes of its pair words: each of rows
    /// 0-7 (`upper`: 8-15) twice, once per column of the pair.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn per_word(rows: __m512, upper: bool) -> __m512 {
        let first = if upper { 8 } else { 0 };
        let idx: [i32; 16] = std::array::from_fn(|t| first + t as i32 / 2);
        _mm512_permutexvar_ps(_mm512_loadu_si512(idx.as_ptr().cast()), rows)
    }

    /// The 16 lanes' pair words from the weights of rows 0-7 (`a`) and 8-15 (`b`), each
    /// in pair-word order, rounded as the packing rounds.
    #[target_feature(enable = "avx512f,avx512bf16")]
    #[inline]
    unsafe fn pair_words(a: __m512, b: __m512) -> __m512bh {
        // The second operand fills the low half: rows 0-7's words.
        _mm512_cvtne2ps_pbh(b, a)
    }

    /// A task's panels of records (`record` bytes each) times its `R` rows of pair
    /// words, two panels at a time so that at least two chains of `VDPBF16PS` overlap;
    /// each weight is formed once for all `R` rows. For each block's record
    /// `scales(rec)` reads what its pairs share, and `weights(&scales, rec, p)` forms
    /// pair `p`'s 16 lanes' pair words.
    ///
    /// # Safety
    /// The CPU has AVX-512 F and BW and AVX512-BF16; `records` holds `panels` (even)
    /// panels of `nb` records; `x` holds `R` rows of `pairs >= nb * 16` words; `out`
    /// holds `R` rows of `stride >= panels * 16` values; `scales` and `weights` read
    /// only within the record they are given.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    #[inline]
    unsafe fn run<const R: usize, S>(
        task: Task,
        record: usize,
        scales: impl Fn(*const u8) -> S,
        weights: impl Fn(&S, *const u8, usize) -> __m512bh,
    ) {
        let Task {
            records,
            nb,
            x,
            pairs,
            out,
            stride,
            warm,
        } = task;
        let panels = records.len() / (nb * record);
        assert!(
            panels.is_multiple_of(2)
                && pairs >= nb * PAIRS
                && x.len() >= R * pairs
                && stride >= panels * PANEL
                && out.len() >= (R - 1) * stride + panels * PANEL
        );
        for pp in (0..panels).step_by(2) {
            let mut acc = [[_mm512_setzero_ps(); R]; 2];
            for b in 0..nb {
                let recs = [
                    records.as_ptr().add((pp * nb + b) * record),
                    records.as_ptr().add(((pp + 1) * nb + b) * record),
                ];
                // Each panel's records are one stream, two of them interleaved; the
                // hardware's prefetchers alone left one row's products waiting on them.
                // Past a panel's last record the addresses run into the next panel's
                // first ones: the second panel's into the next pair's, read next; the
                // first panel's into the second's, already read (a wasted hint).
                for r in recs {
                    prefetch_lines(r.wrapping_add(AHEAD * record), record);
                }
                warm.step();
                // Called directly, not through `array::map`: a closure called from a
                // function without these target features is not inlined, and each
                // call then passes its vectors through memory (measured at half the
                // speed of the inlined loop).
                let shared = [scales(recs[0]), scales(recs[1])];
                for p in 0..PAIRS {
                    let w = [
                        weights(&shared[0], recs[0], p),
                        weights(&shared[1], recs[1], p),
                    ];
                    add_products(&mut acc, &w, x, pairs, b * PAIRS + p);
                }
            }
            for (g, panel) in acc.iter().enumerate() {
                for (r, &v) in panel.iter().enumerate() {
                    _mm512_storeu_ps(out.as_mut_ptr().add(r * stride + (pp + g) * PANEL), v);
                }
            }
        }
    }

    /// `acc[g][r] += x[r]'s pair word `p` times panel `g`'s weights `w[g]`.
    // Indices keep the register tile `acc[g][r]` readable.
    #[allow(clippy::needless_range_loop)]
    #[target_feature(enable = "avx512f,avx512bf16")]
    #[inline]
    unsafe fn add_products<const R: usize>(
        acc: &mut [[__m512; R]; 2],
        w: &[__m512bh; 2],
        x: &[u32],
        pairs: usize,
        p: usize,
    ) {
        for r in 0..R {
            let xp: __m512bh =
                std::mem::transmute(_mm512_set1_epi32(*x.get_unchecked(r * pairs + p) as i32));
            for g in 0..2 {
                acc[g][r] = _mm512_dpbf16_ps(acc[g][r], xp, w[g]);
            }
        }
    }

    /// [`run`] over 4-bit records. A weight is `q * d + m` with `q` at most 15 and `d`
    /// an f16 value, so `q * d` has at most 15 significant bits and is exact in f32: a
    /// fused multiply-add rounds once, as the multiply and the add of the dequantizer
    /// round once between them.
    ///
    /// # Safety
    /// As for [`run`].
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn q41<const R: usize>(task: Task) {
        let low = _mm512_set1_epi32(0xf);
        // Each row's scale and minimum, spread over rows 0-7's and 8-15's pair words.
        let scales = |r: *const u8| {
            let rows = |at: usize| _mm512_cvtph_ps(_mm256_loadu_si256(r.add(at).cast()));
            let (d, m) = (rows(PAIRS * PANEL), rows(PAIRS * PANEL + 2 * PANEL));
            [
                per_word(d, false),
                per_word(d, true),
                per_word(m, false),
                per_word(m, true),
            ]
        };
        let weights = |s: &[__m512; 4], r: *const u8, p: usize| {
            let codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(r.add(p * PANEL).cast()));
            let qa = _mm512_cvtepi32_ps(_mm512_and_si512(codes, low));
            let qb = _mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(codes));
            pair_words(
                _mm512_fmadd_ps(qa, s[0], s[2]),
                _mm512_fmadd_ps(qb, s[1], s[3]),
            )
        };
        run::<R, _>(task, Q41_RECORD, scales, weights)
    }

    /// [`run`] over 8-bit records (weights `q * scale`, one rounding).
    ///
    /// # Safety
    /// As for [`run`].
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn q8<const R: usize>(task: Task) {
        let scales = |r: *const u8| {
            let s = _mm512_loadu_ps(r.add(PAIRS * 2 * PANEL).cast());
            [per_word(s, false), per_word(s, true)]
        };
        let weights = |s: &[__m512; 2], r: *const u8, p: usize| {
            let widen = |at: usize| {
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(r.add(at).cast())))
            };
            let at = p * 2 * PANEL;
            pair_words(
                _mm512_mul_ps(widen(at), s[0]),
                _mm512_mul_ps(widen(at + PANEL), s[1]),
            )
        };
        run::<R, _>(task, Q8_RECORD, scales, weights)
    }
}
