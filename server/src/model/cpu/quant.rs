//! Block-quantized copies of frozen weight matrices, for decoding.
//!
//! Decoding one token reads every weight once, so its speed is set by how many bytes the
//! weights take. Two formats, both in blocks of 32 along the input dimension:
//!
//! - **Q4_1** (4-bit codes `q`, one f32 scale `d` and minimum `m` per block, weight
//!   `q * d + m`): used only when it reproduces the f32 weights *bit for bit*. That is the
//!   case for every projection of a Q4_1 GGUF file (the default model): the trainer's f32
//!   weights were dequantized from exactly such blocks, and [`QuantMatrix::new`] recovers
//!   them from the f32 values, so nothing has to be carried over from the file. It reads
//!   0.625 bytes per weight.
//! - **Q8** (8-bit codes, one f32 scale per block; GGML's Q8_0 without the f16 scale):
//!   the fallback for everything else. It is exact for weights that came from Q8_0 blocks
//!   (the default model's embedding) and an approximation otherwise.
//!
//! [`QuantMatrix::exact`] says which: when every decode matrix is exact, decoding
//! multiplies by the trainer's own weights and the sampler needs no rescoring pass.
//! Activations stay f32 in both (GGML also quantizes them to 8 bits), except under
//! `--precision bf16` on a CPU with a bf16 kernel (AMX or AVX512-BF16), where a product
//! rounds weights and activations to bf16 and sums as the trainer's does
//! ([`BlockArith::Bf16`]).

use candle_core::{DType, Result, Tensor};
use half::f16;
use rayon::prelude::*;

use super::bf16::blocks::{self, TileRows};
use super::bf16::Kernel;
#[cfg(target_arch = "x86_64")]
use super::kernels::prefetch_lines;
use super::kernels::{from_transposed, grain, with};
use super::transpose::transpose;
use super::warm::{Trickle, Warm};

/// Block length of both formats, along the input dimension.
pub const BLOCK: usize = 32;
const HALF: usize = BLOCK / 2;

/// Fewest weight rows handed to one thread at a time.
const ROW_CHUNK: usize = 64;

#[derive(Debug, Clone)]
enum Blocks {
    /// Per block: 16 bytes, byte `j` holding element `j` (low nibble) and `j + 16` (high
    /// nibble), as GGML lays out Q4_1; plus the scale and the minimum.
    Q41 {
        nibbles: Vec<u8>,
        scales: Vec<f32>,
        mins: Vec<f32>,
    },
    /// Per block: 32 signed codes and a scale.
    Q8 { quants: Vec<i8>, scales: Vec<f32> },
}

/// The arithmetic of a block-quantized product.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum BlockArith {
    /// f32 activations times the block weights, f32 sums: with exact blocks, the
    /// trainer's f32 products up to f32 rounding.
    #[default]
    F32,
    /// Weights and activations rounded to bf16, f32 sums in the order of the trainer's
    /// bf16 product with this kernel: with exact blocks, the trainer's
    /// `--precision bf16` products bit for bit ([`blocks`]). Only where
    /// [`blocks::usable`] holds for the kernel, and for up to [`blocks::MAX_ROWS`]
    /// activation rows.
    Bf16(Kernel),
}

/// One block of 32 weights of a [`QuantMatrix`] row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum QuantBlock {
    /// Weight `j` is `codes[j] as f32 * scale + min` (a multiply, then an add); `scale`
    /// and `min` are f16 values.
    Q41 {
        codes: [u8; BLOCK],
        scale: f32,
        min: f32,
    },
    /// Weight `j` is `codes[j] as f32 * scale`.
    Q8 { codes: [i8; BLOCK], scale: f32 },
}

/// A frozen `(rows, cols)` weight matrix in a block-quantized format, multiplied with few
/// f32 activation rows at a time.
#[derive(Debug, Clone)]
pub struct QuantMatrix {
    blocks: Blocks,
    rows: usize,
    cols: usize,
    exact: bool,
}

impl QuantMatrix {
    /// Q4_1 when that reproduces `w` exactly, Q8 otherwise. `cols` must be a multiple
    /// of 32.
    pub fn new(w: &Tensor) -> Result<Self> {
        let (rows, cols, data) = Self::data(w)?;
        match q41_exact(&data) {
            Some(blocks) => Ok(Self {
                blocks,
                rows,
                cols,
                exact: true,
            }),
            None => Ok(Self::q8_from(&data, rows, cols)),
        }
    }

    fn data(w: &Tensor) -> Result<(usize, usize, Vec<f32>)> {
        let (rows, cols) = w.dims2()?;
        if !cols.is_multiple_of(BLOCK) {
            candle_core::bail!(
                "block quantization needs a multiple of {BLOCK} columns, got {cols}"
            );
        }
        Ok((
            rows,
            cols,
            w.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?,
        ))
    }

    fn q8_from(data: &[f32], rows: usize, cols: usize) -> Self {
        let mut quants = vec![0i8; data.len()];
        let mut scales = vec![0f32; data.len() / BLOCK];
        quants
            .par_chunks_mut(BLOCK)
            .zip(scales.par_iter_mut())
            .zip(data.par_chunks(BLOCK))
            .for_each(|((q, s), x)| {
                let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
                *s = amax / 127.0;
                let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
                for (qi, &xi) in q.iter_mut().zip(x) {
                    *qi = (xi * inv).round() as i8;
                }
            });
        // The kernel forms each weight as `q * scale`, as GGML dequantizes Q8_0.
        let exact = quants
            .par_chunks(BLOCK)
            .zip(scales.par_iter())
            .zip(data.par_chunks(BLOCK))
            .all(|((q, &s), x)| q.iter().zip(x).all(|(&qi, &xi)| qi as f32 * s == xi));
        Self {
            blocks: Blocks::Q8 { quants, scales },
            rows,
            cols,
            exact,
        }
    }

    /// Whether the quantized weights equal the f32 weights they were made from, bit for
    /// bit (products then differ from f32 ones only in summation order).
    pub fn exact(&self) -> bool {
        self.exact
    }

    /// Weight rows and columns.
    pub fn shape(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    /// Block `b` (columns `32 b ..`) of weight row `row`: its 32 codes in column order and
    /// how they dequantize.
    pub fn block(&self, row: usize, b: usize) -> QuantBlock {
        let nb = self.cols / BLOCK;
        let i = row * nb + b;
        match &self.blocks {
            Blocks::Q41 {
                nibbles,
                scales,
                mins,
            } => {
                let packed = &nibbles[i * HALF..(i + 1) * HALF];
                QuantBlock::Q41 {
                    codes: std::array::from_fn(|j| {
                        if j < HALF {
                            packed[j] & 0xf
                        } else {
                            packed[j - HALF] >> 4
                        }
                    }),
                    scale: scales[i],
                    min: mins[i],
                }
            }
            Blocks::Q8 { quants, scales } => QuantBlock::Q8 {
                codes: quants[i * BLOCK..(i + 1) * BLOCK]
                    .try_into()
                    .expect("a block"),
                scale: scales[i],
            },
        }
    }

    /// `"q4_1"` or `"q8"`.
    pub fn format(&self) -> &'static str {
        match self.blocks {
            Blocks::Q41 { .. } => "q4_1",
            Blocks::Q8 { .. } => "q8",
        }
    }

    /// `x W^T` for f32 `x (m, cols)` with few rows.
    pub fn matmul_t(&self, x: &Tensor, arith: BlockArith, bias: Option<&[f32]>) -> Result<Tensor> {
        let (m, k) = x.dims2()?;
        if k != self.cols {
            candle_core::bail!(
                "quantized matmul: input has {k} columns, weight {}",
                self.cols
            );
        }
        let yt = with::<f32, _>(x, |xs| self.product_t(xs, m, arith, bias, Warm::NONE))?;
        from_transposed(yt, self.rows, m)
    }

    /// [`QuantMatrix::matmul_t`] over a plain `(m, cols)` buffer; returns `(m, rows)`.
    pub fn matmul_t_host(
        &self,
        xs: &[f32],
        m: usize,
        arith: BlockArith,
        bias: Option<&[f32]>,
    ) -> Result<Vec<f32>> {
        self.matmul_t_host_warming(xs, m, arith, bias, Warm::NONE)
    }

    /// [`QuantMatrix::matmul_t_host`], pulling `warm` toward the caches while the f32
    /// kernels compute several rows (where they are compute-bound; one row's product is
    /// bound by the weight reads, and a prefetch would only compete with them).
    pub fn matmul_t_host_warming(
        &self,
        xs: &[f32],
        m: usize,
        arith: BlockArith,
        bias: Option<&[f32]>,
        warm: Warm<'_>,
    ) -> Result<Vec<f32>> {
        if xs.len() != m * self.cols {
            candle_core::bail!(
                "quantized matmul: {} inputs for {m} rows of {}",
                xs.len(),
                self.cols
            );
        }
        Ok(transpose(
            self.product_t(xs, m, arith, bias, warm)?,
            self.rows,
            m,
        ))
    }

    /// `(rows, m)`: the products plus `bias` (one per weight row), one weight row's
    /// outputs together. The f32 kernels add the bias after the sums; the bf16 kernels
    /// take it where the trainer's bf16 product with the same kernel does (the tiles
    /// start from it, the AVX512-BF16 pairs add it after).
    fn product_t(
        &self,
        xs: &[f32],
        m: usize,
        arith: BlockArith,
        bias: Option<&[f32]>,
        warm: Warm<'_>,
    ) -> Result<Vec<f32>> {
        let k = self.cols;
        if let Some(b) = bias.filter(|b| b.len() != self.rows) {
            candle_core::bail!("{} biases for {} weight rows", b.len(), self.rows);
        }
        if m == 0 {
            return Ok(Vec::new());
        }
        let nb = k / BLOCK;
        // The activations rounded and laid out for the tiles, or `None` for the f32 kernels.
        let tiles = match arith {
            BlockArith::F32 => None,
            BlockArith::Bf16(kernel) if !blocks::usable(kernel) => candle_core::bail!(
                "this CPU cannot run bf16 block products with {}",
                kernel.name()
            ),
            BlockArith::Bf16(kernel) if m <= blocks::MAX_ROWS => {
                Some((kernel, TileRows::new(xs, m, k)))
            }
            BlockArith::Bf16(_) => candle_core::bail!(
                "bf16 block products take 1 to {} rows; asked for {m}",
                blocks::MAX_ROWS
            ),
        };
        let chunk = chunk_rows(self.rows);
        let mut yt = vec![0f32; self.rows * m];
        let out = yt.par_chunks_mut(chunk * m).enumerate();
        // Task `i`'s output chunk and the biases of its rows.
        let rows_of =
            |i: usize, out: &[f32]| bias.map(|b| &b[i * chunk..i * chunk + out.len() / m]);
        // Task `i`'s share of `warm`, one step per weight row it computes.
        let tasks = self.rows.div_ceil(chunk);
        let share = |i: usize, out: &[f32]| {
            if m > 1 {
                warm.share(i, tasks, out.len() / m)
            } else {
                Trickle::none()
            }
        };
        match &self.blocks {
            Blocks::Q8 { quants, scales } => out
                .zip(
                    quants
                        .par_chunks(chunk * k)
                        .zip(scales.par_chunks(chunk * nb)),
                )
                .with_min_len(grain(chunk * k))
                .for_each(|((i, out), (q, s))| {
                    let bias = rows_of(i, out);
                    match &tiles {
                        Some((kernel, x)) => blocks::q8(*kernel, x, q, s, bias, out),
                        None => {
                            q8_rows(xs, m, k, q, s, out, &share(i, out));
                            add_row_bias(out, m, bias);
                        }
                    }
                }),
            Blocks::Q41 {
                nibbles,
                scales,
                mins,
            } => out
                .zip(
                    nibbles.par_chunks(chunk * k / 2).zip(
                        scales
                            .par_chunks(chunk * nb)
                            .zip(mins.par_chunks(chunk * nb)),
                    ),
                )
                // Half the bytes of Q8 per weight, so twice the weights per thread.
                .with_min_len(grain(chunk * k / 2))
                .for_each(|((i, out), (q, (d, mn)))| {
                    let bias = rows_of(i, out);
                    match &tiles {
                        Some((kernel, x)) => blocks::q41(*kernel, x, q, d, mn, bias, out),
                        None => {
                            q41_rows(xs, m, k, q, d, mn, out, &share(i, out));
                            add_row_bias(out, m, bias);
                        }
                    }
                }),
        }
        Ok(yt)
    }
}

/// Adds `bias[o]` to weight row `o`'s `m` outputs in `out` (`(rows, m)`).
fn add_row_bias(out: &mut [f32], m: usize, bias: Option<&[f32]>) {
    if let Some(bias) = bias {
        for (row, b) in out.chunks_exact_mut(m).zip(bias) {
            row.iter_mut().for_each(|y| *y += b);
        }
    }
}

/// Weight rows per parallel task: two tasks per thread (enough for work stealing to
/// even out a core that is busy elsewhere), of at least 64 rows. Every task is a hand-off
/// between threads; with a fixed 64 rows per task they cost a quarter of a decode step's
/// products.
fn chunk_rows(rows: usize) -> usize {
    let per_task = rows.div_ceil(2 * rayon::current_num_threads());
    // Whole groups of 16 rows for the tile kernels.
    per_task.max(ROW_CHUNK).next_multiple_of(16)
}

/// Q4_1 blocks that reproduce `data` exactly, or `None`.
fn q41_exact(data: &[f32]) -> Option<Blocks> {
    let blocks: Option<Vec<(f32, f32, [u8; HALF])>> =
        data.par_chunks(BLOCK).map(q41_block_exact).collect();
    let blocks = blocks?;
    let mut nibbles = Vec::with_capacity(data.len() / 2);
    let mut scales = Vec::with_capacity(blocks.len());
    let mut mins = Vec::with_capacity(blocks.len());
    for (d, m, q) in blocks {
        scales.push(d);
        mins.push(m);
        nibbles.extend_from_slice(&q);
    }
    Some(Blocks::Q41 {
        nibbles,
        scales,
        mins,
    })
}

/// Recovers one GGML Q4_1 block (f16 scale `d` and minimum `m`, codes 0..=15) whose
/// dequantization `q as f32 * d + m` (as GGML and candle compute it, unfused) gives
/// exactly `w`. GGML's quantizer stores the block minimum as `m` (so the smallest weight
/// has code 0 and equals `m`) and gives the largest code 15, so `d` is the f16 value
/// nearest `(max - min) / 15`, up to rounding: the nearest few f16 values are tried.
fn q41_block_exact(w: &[f32]) -> Option<(f32, f32, [u8; HALF])> {
    let (lo, hi) = w
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &v| {
            (a.min(v), b.max(v))
        });
    if !lo.is_finite() || !hi.is_finite() || f16::from_f32(lo).to_f32() != lo {
        return None;
    }
    if lo == hi {
        return Some((0.0, lo, [0; HALF]));
    }
    let estimate = f16::from_f32((hi - lo) / 15.0).to_bits();
    for step in [0i32, 1, -1, 2, -2] {
        let bits = u16::try_from(i32::from(estimate) + step).ok()?;
        let d = f16::from_bits(bits).to_f32();
        if !(d.is_finite() && d > 0.0) {
            continue;
        }
        let code = |v: f32| -> Option<u8> {
            let q = ((v - lo) / d).round();
            let reproduced = (0.0..=15.0).contains(&q) && q * d + lo == v;
            reproduced.then_some(q as u8)
        };
        let mut packed = [0u8; HALF];
        let ok = (0..HALF).all(|j| match (code(w[j]), code(w[j + HALF])) {
            (Some(a), Some(b)) => {
                packed[j] = a | (b << 4);
                true
            }
            _ => false,
        });
        if ok {
            return Some((d, lo, packed));
        }
    }
    None
}

/// Whether this CPU has vectorised block-quantized kernels. Without AVX-512 they fall
/// back to portable code that is slower than the f32 path (README: measured on an
/// AVX2-only machine), so callers choosing a decode path should prefer f32 then.
pub fn has_fast_kernels() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `(rows, m)` products of `xs` with Q8 weight rows, stepping `warm` once per weight row
/// (the AVX-512 kernels; the portable ones do not warm).
fn q8_rows(xs: &[f32], m: usize, k: usize, q: &[i8], s: &[f32], out: &mut [f32], warm: &Trickle) {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU supports AVX-512F, checked just above.
            return unsafe { q8_rows_avx512(xs, m, k, q, s, out, warm) };
        }
    }
    let _ = warm;
    q8_rows_generic(xs, m, k, q, s, out)
}

/// AVX-512 version: each block of 32 weights is widened to f32 and scaled once, then
/// multiplied into the activation rows ([`products_avx512`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn q8_rows_avx512(
    xs: &[f32],
    m: usize,
    k: usize,
    q: &[i8],
    s: &[f32],
    out: &mut [f32],
    warm: &Trickle,
) {
    use std::arch::x86_64::*;
    let nb = k / BLOCK;
    let rows = s.len() / nb;
    // Block `b` of weight row `o` as two vectors, each weight `q * scale` as GGML forms it.
    // SAFETY: row o's block b is elements (o * nb + b) * 32 .. + 32 of `q`, whose length
    // is rows * k.
    let weights = |o: usize, b: usize| {
        let i = o * nb + b;
        let sv = _mm512_set1_ps(s[i]);
        let widen = |at: usize| {
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                q.as_ptr().add(at) as *const __m128i
            )))
        };
        (
            _mm512_mul_ps(widen(i * BLOCK), sv),
            _mm512_mul_ps(widen(i * BLOCK + HALF), sv),
        )
    };
    let ahead = |o: usize| {
        if o < rows {
            prefetch_lines(q.as_ptr().wrapping_add(o * k).cast(), k);
        }
        warm.step();
    };
    products_avx512(xs, m, k, rows, out, weights, ahead)
}

/// `(rows, m)` products of `m` activation rows with `rows` weight rows, `weights(o, b)`
/// giving block `b` of row `o` as two vectors and `ahead(o)` prefetching row `o` (if
/// there is one): [`one_row_avx512`] for one activation row, else [`Tile::run`] over up
/// to eight activation rows at a time.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn products_avx512(
    xs: &[f32],
    m: usize,
    k: usize,
    rows: usize,
    out: &mut [f32],
    weights: impl Fn(usize, usize) -> (std::arch::x86_64::__m512, std::arch::x86_64::__m512),
    ahead: impl Fn(usize),
) {
    if m == 1 {
        return one_row_avx512(xs, rows, k / BLOCK, out, weights, ahead);
    }
    let tile = Tile { xs, m, k, rows };
    let mut first = 0;
    while first < m {
        let r = (m - first).min(8);
        // The row count is a constant inside, so the accumulators stay in registers.
        match r {
            2 => tile.run::<2>(first, out, &weights, &ahead),
            3 => tile.run::<3>(first, out, &weights, &ahead),
            4 => tile.run::<4>(first, out, &weights, &ahead),
            5 => tile.run::<5>(first, out, &weights, &ahead),
            6 => tile.run::<6>(first, out, &weights, &ahead),
            7 => tile.run::<7>(first, out, &weights, &ahead),
            8 => tile.run::<8>(first, out, &weights, &ahead),
            _ => tile.run::<1>(first, out, &weights, &ahead),
        }
        first += r;
    }
}

/// The activation rows and shape of a several-rows product with `(rows, m)` outputs.
#[cfg(target_arch = "x86_64")]
struct Tile<'a> {
    xs: &'a [f32],
    m: usize,
    k: usize,
    rows: usize,
}

#[cfg(target_arch = "x86_64")]
impl Tile<'_> {
    /// Activation rows `first .. first + R` against every weight row, two weight rows at
    /// a time: each activation load feeds both, and the `2 R` accumulators (one per pair
    /// of rows, a block's two halves chained into it) keep both FMA units busy. With
    /// eight rows this is 1.3-1.7x faster than one weight row at a time with two
    /// accumulators per activation row; three or four weight rows at a time are slower
    /// again (more accumulators than registers).
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn run<const R: usize>(
        &self,
        first: usize,
        out: &mut [f32],
        weights: &impl Fn(usize, usize) -> (std::arch::x86_64::__m512, std::arch::x86_64::__m512),
        ahead: &impl Fn(usize),
    ) {
        let mut o = 0;
        while o + 2 <= self.rows {
            // Two pairs of rows ahead.
            ahead(o + 4);
            ahead(o + 5);
            self.group::<R, 2>(first, o, out, weights);
            o += 2;
        }
        if o < self.rows {
            ahead(o + 4);
            self.group::<R, 1>(first, o, out, weights);
        }
    }

    /// Activation rows `first .. first + R` against weight rows `o .. o + W`.
    // Indices keep the register tile `acc[g][j]` readable.
    #[allow(clippy::needless_range_loop)]
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn group<const R: usize, const W: usize>(
        &self,
        first: usize,
        o: usize,
        out: &mut [f32],
        weights: &impl Fn(usize, usize) -> (std::arch::x86_64::__m512, std::arch::x86_64::__m512),
    ) {
        use std::arch::x86_64::*;
        let (m, k) = (self.m, self.k);
        debug_assert!(first + R <= m && o + W <= self.rows && self.xs.len() >= m * k);
        let x0 = self.xs.as_ptr().add(first * k);
        let mut acc = [[_mm512_setzero_ps(); R]; W];
        for b in 0..k / BLOCK {
            let w: [(__m512, __m512); W] = std::array::from_fn(|g| weights(o + g, b));
            for j in 0..R {
                // SAFETY: activation row first + j < m has k columns, and block b ends
                // at (b + 1) * 32 <= k.
                let x = x0.add(j * k + b * BLOCK);
                let (xl, xh) = (_mm512_loadu_ps(x), _mm512_loadu_ps(x.add(HALF)));
                for g in 0..W {
                    let lo = _mm512_fmadd_ps(w[g].0, xl, acc[g][j]);
                    acc[g][j] = _mm512_fmadd_ps(w[g].1, xh, lo);
                }
            }
        }
        for (g, row) in acc.iter().enumerate() {
            for (j, &a) in row.iter().enumerate() {
                out[(o + g) * m + first + j] = _mm512_reduce_add_ps(a);
            }
        }
    }
}

/// One activation row against `rows` weight rows, `weights(o, b)` giving block `b` of
/// row `o` as two vectors. Four weight rows go through together: they share each
/// activation load, keep eight independent accumulator chains, and their horizontal sums
/// (the main per-row cost when a row is 18 blocks) overlap.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn one_row_avx512(
    x: &[f32],
    rows: usize,
    nb: usize,
    out: &mut [f32],
    weights: impl Fn(usize, usize) -> (std::arch::x86_64::__m512, std::arch::x86_64::__m512),
    ahead: impl Fn(usize),
) {
    use std::arch::x86_64::*;
    const GROUP: usize = 4;
    // SAFETY: block b of the activation row ends at (b + 1) * 32 <= nb * 32, its length.
    let xb = |b: usize| {
        let p = x.as_ptr().add(b * BLOCK);
        (_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(HALF)))
    };
    let mut o = 0;
    while o + GROUP <= rows {
        // Two groups ahead.
        for r in 2 * GROUP..3 * GROUP {
            ahead(o + r);
        }
        let mut acc = [_mm512_setzero_ps(); 2 * GROUP];
        for b in 0..nb {
            let (xl, xh) = xb(b);
            for r in 0..GROUP {
                let (lo, hi) = weights(o + r, b);
                acc[2 * r] = _mm512_fmadd_ps(lo, xl, acc[2 * r]);
                acc[2 * r + 1] = _mm512_fmadd_ps(hi, xh, acc[2 * r + 1]);
            }
        }
        for r in 0..GROUP {
            out[o + r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[2 * r], acc[2 * r + 1]));
        }
        o += GROUP;
    }
    for (o, y) in out.iter_mut().enumerate().take(rows).skip(o) {
        let (mut lo_acc, mut hi_acc) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        for b in 0..nb {
            let ((lo, hi), (xl, xh)) = (weights(o, b), xb(b));
            lo_acc = _mm512_fmadd_ps(lo, xl, lo_acc);
            hi_acc = _mm512_fmadd_ps(hi, xh, hi_acc);
        }
        *y = _mm512_reduce_add_ps(_mm512_add_ps(lo_acc, hi_acc));
    }
}

/// `(rows, m)` products of `xs` with Q4_1 weight rows, stepping `warm` once per weight
/// row (the AVX-512 kernels; the portable ones do not warm).
#[allow(clippy::too_many_arguments)]
fn q41_rows(
    xs: &[f32],
    m: usize,
    k: usize,
    q: &[u8],
    d: &[f32],
    mn: &[f32],
    out: &mut [f32],
    warm: &Trickle,
) {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU supports AVX-512F, checked just above.
            return unsafe { q41_rows_avx512(xs, m, k, q, d, mn, out, warm) };
        }
    }
    let _ = warm;
    q41_rows_generic(xs, m, k, q, d, mn, out)
}

/// AVX-512 version. A block's 16 possible weights `q * d + m` are formed once as a
/// 16-lane table (a multiply, then an add: exactly the dequantizer's arithmetic, so the
/// weights are the f32 weights bit for bit), and each code picks its weight with a lane
/// permute, which reads only the low four bits of its index, so the low nibbles need no
/// masking. That takes the work off the port the int-to-float conversions queued on.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn q41_rows_avx512(
    xs: &[f32],
    m: usize,
    k: usize,
    q: &[u8],
    d: &[f32],
    mn: &[f32],
    out: &mut [f32],
    warm: &Trickle,
) {
    use std::arch::x86_64::*;
    let nb = k / BLOCK;
    let rows = d.len() / nb;
    let iota = _mm512_setr_ps(
        0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15.,
    );
    // Block `b` of weight row `o` as two vectors (elements 0..16 and 16..32).
    // SAFETY (all loads): row o's block b is bytes (o * nb + b) * 16 .. + 16 of `q`, whose
    // length is rows * nb * 16; activation row i's block b ends at i * k + (b + 1) * 32
    // <= m * k.
    let weights = |o: usize, b: usize| {
        let i = o * nb + b;
        let codes =
            _mm512_cvtepu8_epi32(_mm_loadu_si128(q.as_ptr().add(i * HALF) as *const __m128i));
        let table = _mm512_add_ps(
            _mm512_mul_ps(iota, _mm512_set1_ps(d[i])),
            _mm512_set1_ps(mn[i]),
        );
        (
            _mm512_permutexvar_ps(codes, table),
            _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), table),
        )
    };
    let ahead = |o: usize| {
        if o < rows {
            prefetch_lines(q.as_ptr().wrapping_add(o * nb * HALF), nb * HALF);
        }
        warm.step();
    };
    products_avx512(xs, m, k, rows, out, weights, ahead)
}

fn q8_rows_generic(xs: &[f32], m: usize, k: usize, q: &[i8], s: &[f32], out: &mut [f32]) {
    let nb = k / BLOCK;
    for (o, (qr, sr)) in q.chunks_exact(k).zip(s.chunks_exact(nb)).enumerate() {
        for (mi, x) in xs.chunks_exact(k).take(m).enumerate() {
            out[o * m + mi] = dot_blocks(x, nb, |b, l| {
                let c = b * BLOCK + l;
                (qr[c] as f32 * sr[b], qr[c + HALF] as f32 * sr[b])
            });
        }
    }
}

fn q41_rows_generic(
    xs: &[f32],
    m: usize,
    k: usize,
    q: &[u8],
    d: &[f32],
    mn: &[f32],
    out: &mut [f32],
) {
    let nb = k / BLOCK;
    for (o, ((qr, dr), mr)) in q
        .chunks_exact(k / 2)
        .zip(d.chunks_exact(nb))
        .zip(mn.chunks_exact(nb))
        .enumerate()
    {
        for (mi, x) in xs.chunks_exact(k).take(m).enumerate() {
            out[o * m + mi] = dot_blocks(x, nb, |b, l| {
                let byte = qr[b * HALF + l];
                let w = |code: u8| code as f32 * dr[b] + mr[b];
                (w(byte & 0x0f), w(byte >> 4))
            });
        }
    }
}

/// `sum x * w` over `nb` blocks, where `weight(b, l)` gives block `b`'s weights `l` and
/// `l + 16`; sixteen partial sums so the compiler can vectorise.
#[inline(always)]
fn dot_blocks(x: &[f32], nb: usize, weight: impl Fn(usize, usize) -> (f32, f32)) -> f32 {
    let mut acc = [0f32; HALF];
    for (b, xb) in x.chunks_exact(BLOCK).take(nb).enumerate() {
        for l in 0..HALF {
            let (lo, hi) = weight(b, l);
            acc[l] = lo.mul_add(xb[l], acc[l]);
            acc[l] = hi.mul_add(xb[l + HALF], acc[l]);
        }
    }
    acc.iter().sum()
}

#[cfg(test)]
mod tests;
