//! bf16 products with f32 accumulation for the frozen base weights, as PyTorch's bf16
//! autocast computes a matmul: both operands are rounded to bf16 (round to nearest
//! even), every product of two bf16 values is exact in f32, and the sums are kept in f32.
//! Unlike autocast, only these products are bf16: attention, the LoRA products and every
//! other operation stay f32.
//!
//! The right-hand side is a frozen weight, packed once ([`PackedB`]) into the layout both
//! kernels read: panels of 16 output columns whose rows hold pairs of consecutive `k`
//! ("VNNI" order). The left-hand side (activations or gradients) is rounded to bf16 at
//! each call. The kernel is chosen at run time ([`kernel`]):
//! - [`Kernel::Amx`]: Intel AMX tiles (`TDPBF16PS`, a 16 x 16 x 32 product per
//!   instruction), on Sapphire Rapids and later;
//! - [`Kernel::Avx512Bf16`]: `VDPBF16PS` pair dot products, on CPUs with AVX512-BF16 but
//!   no AMX (AMD Zen 4 and later, Cooper Lake);
//! - neither: the caller keeps the f32 path.
//!
//! Hand-written because no maintained Rust crate offers a bf16 product on AMX tiles or
//! `VDPBF16PS` (the `gemm` crate computes bf16 by widening to f32).

use std::sync::OnceLock;

use rayon::prelude::*;

use super::gemm::{Mat, MatMut};

#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod avx512;
pub mod blocks;
mod pack;
pub mod panels;
#[cfg(test)]
mod tests;

pub use pack::{round_bf16, PackedB};

/// Output columns per panel of a packed operand (one AMX tile's width, one zmm of f32).
pub const PANEL: usize = 16;
/// The reduction depth is padded to a multiple of this (one AMX tile's depth in bf16).
pub const K_BLOCK: usize = 32;
/// Rows of the left-hand side handled per kernel call (two AMX tiles, four AVX-512
/// micro-tiles); the rounded left-hand side is padded to a multiple of this.
pub const M_BLOCK: usize = 32;

/// A bf16 product kernel the CPU has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kernel {
    /// AMX tiles.
    Amx,
    /// AVX512-BF16 dot products.
    Avx512Bf16,
}

impl Kernel {
    /// A short name for logs and benchmark output.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Amx => "amx",
            Kernel::Avx512Bf16 => "avx512_bf16",
        }
    }
}

/// The fastest bf16 kernel this CPU (and OS) supports, detected once; `None` when it has
/// neither AMX nor AVX512-BF16. For AMX this also asks Linux for permission to use the
/// tile registers, which every process must do once.
pub fn kernel() -> Option<Kernel> {
    available().first().copied()
}

/// Every bf16 kernel this CPU supports, fastest first (detected once). The environment
/// variable `LATHE_BF16_KERNEL` changes what the process uses, for benchmarks and
/// comparisons: `avx512_bf16` (or `amx`) puts that kernel first where the CPU has it,
/// `none` leaves none (bf16 then stays f32, as on a CPU without a kernel).
pub fn available() -> &'static [Kernel] {
    static KERNELS: OnceLock<Vec<Kernel>> = OnceLock::new();
    KERNELS.get_or_init(|| {
        let detected = detect();
        match std::env::var("LATHE_BF16_KERNEL") {
            Ok(choice) => chosen(detected, choice.trim()),
            Err(_) => detected,
        }
    })
}

/// `detected` as `LATHE_BF16_KERNEL=choice` asks (see [`available`]); an unknown name or
/// a kernel this CPU lacks leaves it as it is, with a warning.
fn chosen(mut detected: Vec<Kernel>, choice: &str) -> Vec<Kernel> {
    if choice == "none" {
        return Vec::new();
    }
    match detected.iter().position(|k| k.name() == choice) {
        Some(i) => {
            let k = detected.remove(i);
            detected.insert(0, k);
        }
        None => tracing::warn!(
            choice,
            available = ?detected.iter().map(|k| k.name()).collect::<Vec<_>>(),
            "LATHE_BF16_KERNEL names no bf16 kernel this CPU has; ignored"
        ),
    }
    detected
}

fn detect() -> Vec<Kernel> {
    let mut out = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        if amx::usable() {
            out.push(Kernel::Amx);
        }
        if avx512::usable() {
            out.push(Kernel::Avx512Bf16);
        }
    }
    out
}

/// A frozen `(out, in)` weight packed for both products a training step needs: the
/// forward `x Wᵀ` and the input gradient `dy W`. Two bf16 copies: as many bytes as the
/// f32 weight, which the model keeps too.
#[derive(Debug, Clone)]
pub struct PackedWeight {
    /// `Wᵀ`: `k = in`, `n = out`.
    pub forward: PackedB,
    /// `W`: `k = out`, `n = in`.
    pub input_grad: PackedB,
}

impl PackedWeight {
    /// Packs a row-major `(out, in)` weight.
    pub fn new(w: &[f32], out: usize, inp: usize) -> Self {
        assert_eq!(w.len(), out * inp, "weight is not {out} x {inp}");
        Self {
            forward: PackedB::new(inp, out, |k, n| w[n * inp + k]),
            input_grad: PackedB::new(out, inp, |k, n| w[k * inp + n]),
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.forward.bytes() + self.input_grad.bytes()
    }

    /// Packs an `(out, in)` f32 tensor.
    pub fn from_tensor(w: &candle_core::Tensor) -> candle_core::Result<Self> {
        let (out, inp) = w.dims2()?;
        let data: Vec<f32> = w
            .to_dtype(candle_core::DType::F32)?
            .flatten_all()?
            .to_vec1()?;
        Ok(Self::new(&data, out, inp))
    }
}

/// Rows per thread below which splitting a product across threads costs more than it
/// saves.
const MIN_ROWS_PER_THREAD: usize = 64;

/// `dst = a b`, or `dst += a b` with `accumulate`, in bf16 with f32 accumulation, where
/// `a` is `(m, k)` f32 (rounded to bf16 here) and `b` is a packed `(k, n)`. Panics if the
/// shapes disagree or if this CPU lacks `kernel` (see [`available`]).
pub fn gemm(kernel: Kernel, dst: &mut MatMut<'_>, a: Mat<'_>, b: &PackedB, accumulate: bool) {
    assert!(
        available().contains(&kernel),
        "this CPU has no {} kernel",
        kernel.name()
    );
    let (m, n) = dst.shape();
    assert_eq!(a.shape(), (m, b.k()), "lhs is not {m} x {}", b.k());
    assert_eq!(
        n,
        b.n(),
        "output has {n} columns, the packed operand {}",
        b.n()
    );
    if m == 0 || n == 0 {
        return;
    }
    let threads = rayon::current_num_threads();
    let all = 0..b.panels();
    if threads > 1 && m >= 2 * MIN_ROWS_PER_THREAD {
        // Row blocks (whole M_BLOCKs) on separate threads; each rounds its own rows and
        // reads all of `b`.
        let block = m.div_ceil(threads).div_ceil(M_BLOCK) * M_BLOCK;
        dst.row_blocks(block)
            .into_par_iter()
            .for_each(|(start, mut d)| run(kernel, &mut d, a, start, b, accumulate, all.clone()));
    } else if threads > 1 && kernel == Kernel::Avx512Bf16 && b.panels() >= 4 * threads {
        by_columns(kernel, dst, a, b, accumulate, threads);
    } else {
        run(kernel, dst, a, 0, b, accumulate, all);
    }
}

/// A product of few rows (a decode step's) on several threads: the panels split into
/// two parts per thread (so that a thread whose core is busy elsewhere can be helped),
/// each part's columns computed into its own buffer, then written (or added) to `dst`.
/// Every output is the same chain as in one call ([`avx512::product`]).
fn by_columns(
    kernel: Kernel,
    dst: &mut MatMut<'_>,
    a: Mat<'_>,
    b: &PackedB,
    accumulate: bool,
    threads: usize,
) {
    let (m, n) = dst.shape();
    let pairs = b.panels() / 2;
    let per_part = pairs.div_ceil(2 * threads);
    let parts: Vec<(usize, usize, Vec<f32>)> = (0..pairs)
        .step_by(per_part)
        .collect::<Vec<_>>()
        .into_par_iter()
        .map(|first| {
            let panels = 2 * first..(2 * (first + per_part)).min(b.panels());
            // Every panel pair starts inside the `n` columns (`n` pads to whole pairs).
            let col0 = panels.start * PANEL;
            let width = (panels.end * PANEL).min(n) - col0;
            let mut part = vec![0f32; m * width];
            run(
                kernel,
                &mut MatMut::new(&mut part, m, width, width),
                a,
                0,
                b,
                false,
                panels,
            );
            (col0, width, part)
        })
        .collect();
    for (col0, width, part) in parts {
        for (r, src) in part.chunks_exact(width).enumerate() {
            let out = &mut dst.row_mut(r)[col0..col0 + width];
            if accumulate {
                out.iter_mut().zip(src).for_each(|(o, s)| *o += s);
            } else {
                out.copy_from_slice(src);
            }
        }
    }
}

/// One thread's share: `dst` holds rows `row0..row0 + dst.rows` of the product, and
/// the columns of `panels` (all of them for [`Kernel::Amx`]).
fn run(
    kernel: Kernel,
    dst: &mut MatMut<'_>,
    a: Mat<'_>,
    row0: usize,
    b: &PackedB,
    accumulate: bool,
    panels: std::ops::Range<usize>,
) {
    thread_local! {
        /// Each thread's rounded rows, kept between products.
        static BUFFER: std::cell::Cell<Vec<u32>> = const { std::cell::Cell::new(Vec::new()) };
    }
    let buffer = BUFFER.take();
    let lhs = pack::Lhs::round_into(buffer, a, row0, dst.shape().0, b.k_padded());
    let mut out = pack::Output::new(dst, accumulate);
    match kernel {
        #[cfg(target_arch = "x86_64")]
        Kernel::Amx => {
            assert_eq!(panels, 0..b.panels(), "the AMX kernel takes every panel");
            // SAFETY: `gemm` checked that this CPU supports the kernel.
            unsafe { amx::product(&mut out, &lhs, b) }
        }
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Kernel::Avx512Bf16 => unsafe { avx512::product(&mut out, &lhs, b, panels) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => unreachable!("no bf16 kernel exists off x86_64"),
    }
    if lhs.data.capacity() <= KEEP_BUFFER_WORDS {
        BUFFER.set(lhs.data);
    }
}

/// Largest rounded left-hand side (in words, 16 MiB) each thread keeps for its next
/// product; a larger one (the output head's input gradient of a large vocabulary) is
/// allocated per product.
const KEEP_BUFFER_WORDS: usize = 4 << 20;

/// The element type of the frozen base weights' products in training, prefill and
/// decoding, as it is in effect (what `--precision` resolves to, see
/// [`PrecisionChoice`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// f32 products.
    #[default]
    F32,
    /// bf16 products with f32 accumulation (AMX or AVX512-BF16; f32 on a CPU with
    /// neither).
    Bf16,
}

/// What `--precision` asks for (`lathe serve`, `lathe generate`, `lathe bench` and the
/// recipes): one [`Precision`], or `auto`, the one this machine trains fastest in while
/// its sampler decodes exactly what it trains.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum PrecisionChoice {
    /// bf16 on a CPU with AMX tiles, f32 otherwise (see [`PrecisionChoice::resolve`]).
    #[default]
    Auto,
    /// f32 products.
    F32,
    /// bf16 products with f32 accumulation (AMX or AVX512-BF16; f32 on a CPU with
    /// neither).
    Bf16,
}

impl PrecisionChoice {
    /// The precision asked for, `auto` decided for a model on `backend`: bf16 on the CPU
    /// backend where the CPU has AMX tiles and the decode kernels that reproduce the
    /// tiles' products (there bf16 trains fastest and decodes fastest with several
    /// streams, and the sampler's logprobs are the trainer's bit for bit); f32 on a CPU
    /// with AVX512-BF16 alone (one stream decodes slower in bf16 there, and a recipe
    /// missed its criterion) or with neither, and on a device backend (bf16 there narrows
    /// the stored weights for good, decodes slower than f32 on the GPUs measured, and no
    /// recipe has been run to its criterion in it).
    pub fn resolve(self, backend: crate::model::backend::Backend) -> Precision {
        match self {
            PrecisionChoice::F32 => Precision::F32,
            PrecisionChoice::Bf16 => Precision::Bf16,
            PrecisionChoice::Auto => {
                let cpu = backend == crate::model::backend::Backend::Cpu;
                if cpu && kernel() == Some(Kernel::Amx) && blocks::usable(Kernel::Amx) {
                    Precision::Bf16
                } else {
                    Precision::F32
                }
            }
        }
    }
}

impl PrecisionChoice {
    /// The precision a model on `backend` computes in when `self` is asked for:
    /// [`PrecisionChoice::resolve`], and on the CPU backend f32 for bf16 where this CPU
    /// has no bf16 kernel, as [`crate::model::Transformer::set_precision`] falls back.
    pub fn in_effect(self, backend: crate::model::backend::Backend) -> Precision {
        match self.resolve(backend) {
            Precision::Bf16
                if backend == crate::model::backend::Backend::Cpu && kernel().is_none() =>
            {
                Precision::F32
            }
            p => p,
        }
    }
}

impl std::fmt::Display for PrecisionChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PrecisionChoice::Auto => "auto",
            PrecisionChoice::F32 => "f32",
            PrecisionChoice::Bf16 => "bf16",
        })
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
        })
    }
}

/// A packed frozen weight and the kernel that multiplies with it.
#[derive(Debug, Clone, Copy)]
pub struct Bf16Ref<'a> {
    /// The kernel (one this CPU has).
    pub kernel: Kernel,
    /// The weight.
    pub weight: &'a PackedWeight,
}

/// `x Wᵀ` for an `(m, in)` f32 CPU tensor, in bf16.
pub fn matmul_t(
    x: &candle_core::Tensor,
    w: Bf16Ref<'_>,
) -> candle_core::Result<candle_core::Tensor> {
    product(x, w.kernel, &w.weight.forward)
}

/// `dy W` for an `(m, out)` f32 CPU tensor, in bf16.
pub fn input_grad(
    dy: &candle_core::Tensor,
    w: Bf16Ref<'_>,
) -> candle_core::Result<candle_core::Tensor> {
    product(dy, w.kernel, &w.weight.input_grad)
}

fn product(
    a: &candle_core::Tensor,
    kernel: Kernel,
    b: &PackedB,
) -> candle_core::Result<candle_core::Tensor> {
    let (m, k) = a.dims2()?;
    if k != b.k() {
        candle_core::bail!(
            "bf16 product: lhs has {k} columns, the weight {} rows",
            b.k()
        );
    }
    let n = b.n();
    let mut out = vec![0f32; m * n];
    super::gemm::with_slices(&[a], |s| {
        gemm(
            kernel,
            &mut MatMut::new(&mut out, m, n, n),
            Mat::new(s[0], m, k),
            b,
            false,
        );
        Ok(())
    })?;
    candle_core::Tensor::from_vec(out, (m, n), a.device())
}
