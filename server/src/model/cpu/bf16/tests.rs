//! The bf16 kernels against f64 references.
//!
//! Two references, two bounds (with `u = 2⁻⁸`, the unit roundoff of bf16's 8 significant
//! bits, and `ε = 2⁻²⁴`, f32's):
//! - the exact product of the *rounded* operands, `Σ ã b̃` in f64. The kernels differ from
//!   it only by f32 accumulation: at most `k ε Σ |ã b̃|` (each partial sum rounds once;
//!   the order differs between kernels, the bound does not);
//! - the exact product of the f32 operands. Rounding each operand to bf16 changes each
//!   term by at most `(2u + u²) |a b|`, so `|Σ ã b̃ - Σ a b| ≤ (2u + u²) Σ |a b|`, plus the
//!   accumulation term above. This is the tolerance every bf16 training check derives
//!   from.

use super::*;
use crate::model::cpu::gemm::{Mat, MatMut};
use crate::model::cpu::warm::Warm;

const U: f64 = 1.0 / 256.0;
const EPS: f64 = 1.0 / 16_777_216.0;

fn data(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32
        })
        .collect()
}

fn widen(x: f32) -> f64 {
    f64::from(half::bf16::from_bits(round_bf16(x)).to_f32())
}

/// Checks `gemm` with `kernel` on an `(m, k) x (k, n)` product, written into a column
/// block of a wider output (with and without accumulation).
fn check(kernel: Kernel, m: usize, k: usize, n: usize) {
    let a = data(m * k, 1 + m as u64);
    let w = data(n * k, 2 + n as u64); // (n, k): the product is a wᵀ
    let packed = PackedWeight::new(&w, n, k);
    let (wide, col) = (n + 7, 3);
    for accumulate in [false, true] {
        let mut out = vec![0.25f32; m * wide];
        {
            let mut full = MatMut::new(&mut out, m, wide, wide);
            let mut dst = full.block(0, m, col, n);
            gemm(
                kernel,
                &mut dst,
                Mat::new(&a, m, k),
                &packed.forward,
                accumulate,
            );
        }
        for i in 0..m {
            for j in 0..wide {
                let got = f64::from(out[i * wide + j]);
                let base = if accumulate { 0.25 } else { 0.0 };
                if !(col..col + n).contains(&j) {
                    assert_eq!(got, 0.25, "({i},{j}) outside the block was written");
                    continue;
                }
                let jj = j - col;
                let (mut rounded, mut abs_rounded, mut exact, mut abs_exact) = (0.0, 0.0, 0.0, 0.0);
                for p in 0..k {
                    let (x, y) = (a[i * k + p], w[jj * k + p]);
                    rounded += widen(x) * widen(y);
                    abs_rounded += (widen(x) * widen(y)).abs();
                    exact += f64::from(x) * f64::from(y);
                    abs_exact += (f64::from(x) * f64::from(y)).abs();
                }
                let acc_bound = (k as f64 + 2.0) * EPS * (abs_rounded + base) + 1e-30;
                assert!(
                    (got - base - rounded).abs() <= acc_bound,
                    "{kernel:?} {m}x{k}x{n} ({i},{jj}): {got} vs {} (bound {acc_bound})",
                    rounded + base
                );
                let bf16_bound = (2.0 * U + U * U) * abs_exact + acc_bound;
                assert!((got - base - exact).abs() <= bf16_bound);
            }
        }
    }
}

/// `got` (row-major `(m, n)`) is the f64 product of the rounded `a (m, k)` and
/// `b (k, n)`, to 1e-5.
fn assert_rounded_product(
    got: &[f32],
    (m, k, n): (usize, usize, usize),
    a: impl Fn(usize, usize) -> f32,
    b: impl Fn(usize, usize) -> f32,
) {
    for i in 0..m {
        for j in 0..n {
            let want: f64 = (0..k).map(|q| widen(a(i, q)) * widen(b(q, j))).sum();
            let diff = (f64::from(got[i * n + j]) - want).abs();
            assert!(diff < 1e-5, "({i}, {j}): {} vs {want}", got[i * n + j]);
        }
    }
}

const SHAPES: [(usize, usize, usize); 9] = [
    (1, 1, 1),
    // Few rows and many columns: a decode step's product, split by columns.
    (3, 64, 300),
    (8, 96, 520),
    (5, 31, 17),
    (33, 33, 33),
    (40, 70, 100),
    (130, 64, 45),
    (300, 96, 40),
    (64, 200, 65),
];

#[test]
fn every_kernel_this_cpu_has_equals_the_rounded_product_up_to_f32_accumulation() {
    if available().is_empty() {
        eprintln!("this CPU has no bf16 kernel: only the packing is checked here");
    }
    for &kernel in available() {
        for (m, k, n) in SHAPES {
            check(kernel, m, k, n);
        }
    }
}

/// A product of few rows computes the same bits on one thread as split across threads
/// by columns (a decode step's) or by rows, written or accumulated.
#[test]
fn a_product_computes_the_same_bits_however_the_threads_split_it() {
    let pool = |threads| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
    };
    let (k, n) = (96, 700);
    let w = data(n * k, 7);
    let packed = PackedWeight::new(&w, n, k);
    for &kernel in available() {
        for m in [1, 2, 8, 9, 31, 200] {
            let a = data(m * k, 8 + m as u64);
            for accumulate in [false, true] {
                let product = |threads| {
                    let mut out = data(m * n, 9);
                    pool(threads).install(|| {
                        gemm(
                            kernel,
                            &mut MatMut::new(&mut out, m, n, n),
                            Mat::new(&a, m, k),
                            &packed.forward,
                            accumulate,
                        )
                    });
                    out
                };
                let one = product(1);
                for threads in [2, 3] {
                    let split = product(threads);
                    assert!(
                        one.iter()
                            .zip(&split)
                            .all(|(x, y)| x.to_bits() == y.to_bits()),
                        "{kernel:?}: {m} rows on {threads} threads differ from one thread"
                    );
                }
            }
        }
    }
}

#[test]
fn the_input_gradient_packing_is_the_transpose_of_the_forward_one() {
    let (out, inp) = (37, 45);
    let w = data(out * inp, 9);
    let p = PackedWeight::new(&w, out, inp);
    assert_eq!((p.forward.k(), p.forward.n()), (inp, out));
    assert_eq!((p.input_grad.k(), p.input_grad.n()), (out, inp));
    assert_eq!(p.forward.k_padded() % K_BLOCK, 0);
    assert_eq!(p.forward.panels() % 2, 0);
    for o in 0..out {
        for i in 0..inp {
            let want = widen(w[o * inp + i]) as f32;
            assert_eq!(p.forward.get(i, o), want);
            assert_eq!(p.input_grad.get(o, i), want);
        }
    }
    // Padding is zero.
    assert_eq!(p.forward.get(inp, 0), 0.0);
    assert_eq!(p.forward.get(0, out), 0.0);
    // And dy W through a kernel matches the f64 product of the rounded operands.
    for &kernel in available() {
        let m = 70;
        let dy = data(m * out, 10);
        let mut dx = vec![0f32; m * inp];
        gemm(
            kernel,
            &mut MatMut::new(&mut dx, m, inp, inp),
            Mat::new(&dy, m, out),
            &p.input_grad,
            false,
        );
        assert_rounded_product(
            &dx,
            (m, out, inp),
            |r, o| dy[r * out + o],
            |o, i| w[o * inp + i],
        );
    }
}

#[test]
fn both_roundings_agree_to_nearest_even_on_every_kind_of_value() {
    let mut row: Vec<f32> = data(1000, 3).iter().map(|x| x * 1e3).collect();
    row.extend([
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::MIN_POSITIVE / 4.0,
        f32::MAX,
        1.0 + 1.0 / 256.0,           // a tie: stays at 1.0 (even)
        1.0 + 3.0 / 256.0,           // a tie: rounds up to the even neighbour
        f32::from_bits(0x3f80_8001), // just above a tie: rounds up
    ]);
    for len in [row.len(), 33, 32, 31, 1] {
        let src = &row[row.len() - len..];
        let pairs = len.div_ceil(32) * 16;
        // A dirty buffer: every word must be overwritten.
        let lhs =
            pack::Lhs::round_into(vec![u32::MAX; 4096], Mat::new(src, 1, len), 0, 1, pairs * 2);
        for (i, v) in src.iter().enumerate() {
            let word = lhs.data[i / 2];
            let bits = if i % 2 == 0 {
                word & 0xffff
            } else {
                word >> 16
            };
            assert_eq!(bits as u16, round_bf16(*v), "{v} at {i} of {len}");
        }
        assert!(lhs.data[len.div_ceil(2)..].iter().all(|&w| w == 0));
        if len % 2 == 1 {
            assert_eq!(lhs.data[len / 2] >> 16, 0, "the padding half is zero");
        }
    }
    assert_eq!(
        round_bf16(f32::MIN_POSITIVE / 4.0),
        0,
        "subnormals become zero"
    );
    assert_eq!(round_bf16(-f32::MIN_POSITIVE / 4.0), 0x8000);
    assert_eq!(round_bf16(1.0 + 1.0 / 256.0), round_bf16(1.0));
    assert_eq!(round_bf16(1.0 + 3.0 / 256.0), round_bf16(1.0 + 4.0 / 256.0));
    assert!(half::bf16::from_bits(round_bf16(f32::NAN)).is_nan());
}

#[test]
fn a_strided_left_hand_side_is_read_through_its_strides() {
    let (m, k, n) = (50, 40, 20);
    let at = data(k * m, 4); // stored (k, m); the lhs is its transpose
    let w = data(n * k, 5);
    let p = PackedWeight::new(&w, n, k);
    for &kernel in available() {
        let mut out = vec![0f32; m * n];
        gemm(
            kernel,
            &mut MatMut::new(&mut out, m, n, n),
            Mat::new(&at, k, m).t(),
            &p.forward,
            false,
        );
        assert_rounded_product(&out, (m, k, n), |i, q| at[q * m + i], |q, j| w[j * k + q]);
    }
}

/// The trainer's bf16 product of `m` rows `x` with `packed` on `kernel`, its sums
/// taking `bias` as the trainer's projections do.
fn trainers_product(
    kernel: Kernel,
    packed: &PackedWeight,
    x: &[f32],
    m: usize,
    bias: Option<&[f32]>,
) -> Vec<f32> {
    let (k, n) = (packed.forward.k(), packed.forward.n());
    let mut out: Vec<f32> = match bias {
        Some(b) => (0..m).flat_map(|_| b.iter().copied()).collect(),
        None => vec![0f32; m * n],
    };
    gemm(
        kernel,
        &mut MatMut::new(&mut out, m, n, n),
        Mat::new(x, m, k),
        &packed.forward,
        bias.is_some(),
    );
    out
}

/// `got` and `want` hold the same f32 values bit for bit.
fn assert_same_bits(got: &[f32], want: &[f32], label: &str) {
    assert_eq!(got.len(), want.len(), "{label}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.to_bits(), w.to_bits(), "{label}: element {i}: {g} vs {w}");
    }
}

/// The decode weights' bf16 block products (Q4_1 and Q8 blocks, `BlockArith::Bf16`)
/// equal the trainer's bf16 product of the same f32 weights with the same kernel, bit
/// for bit, for every kernel this CPU has: for one row (a stream), a decode step's few
/// rows, one and two tiles (or accumulators) of rows, partial groups of weight rows and
/// several threads' chunks, with and without a bias. More rows than the kernels take are
/// refused.
#[test]
fn decode_blocks_reproduce_the_trainers_products() {
    use crate::model::cpu::quant::{BlockArith, QuantMatrix};
    use candle_core::quantized::{GgmlDType, QTensor};
    let kernels: Vec<Kernel> = available()
        .iter()
        .copied()
        .filter(|&k| blocks::usable(k))
        .collect();
    if kernels.is_empty() {
        eprintln!("this CPU has no bf16 kernel: the decode block kernels are not run");
        return;
    }
    for kernel in kernels {
        for (dtype, format) in [(GgmlDType::Q4_1, "q4_1"), (GgmlDType::Q8_0, "q8")] {
            for (rows, k) in [(40, 64), (200, 160), (16, 32), (24, 576), (13, 96)] {
                let w = candle_core::Tensor::from_vec(
                    data(rows * k, 7 + rows as u64),
                    (rows, k),
                    &candle_core::Device::Cpu,
                )
                .unwrap();
                let w = QTensor::quantize(&w, dtype)
                    .unwrap()
                    .dequantize(&candle_core::Device::Cpu)
                    .unwrap();
                let q = QuantMatrix::new(&w).unwrap();
                assert_eq!((q.format(), q.exact()), (format, true));
                let wf: Vec<f32> = w.flatten_all().unwrap().to_vec1().unwrap();
                let packed = PackedWeight::new(&wf, rows, k);
                let bias = data(rows, 17);
                let arith = BlockArith::Bf16(kernel);
                for m in (1..=9).chain([16, 17, 32]) {
                    let x = data(m * k, 3 + m as u64);
                    // With a bias (Qwen2's q/k/v), as the trainer's product takes it.
                    for bias in [None, Some(bias.as_slice())] {
                        let got = q.matmul_t_host(&x, m, arith, bias).unwrap();
                        let want = trainers_product(kernel, &packed, &x, m, bias);
                        assert_same_bits(
                            &got,
                            &want,
                            &format!(
                                "{} {format} {rows}x{k}, {m} rows, bias {}",
                                kernel.name(),
                                bias.is_some()
                            ),
                        );
                    }
                }
                let x = data(33 * k, 5);
                let refused = q.matmul_t_host(&x, 33, arith, None).unwrap_err();
                assert!(refused.to_string().contains("1 to 32 rows"), "{refused}");
            }
        }
    }
}

/// The panel copies of Q4_1 and Q8 blocks (`panels::QuantPanels`) give the trainer's
/// `VDPBF16PS` product of the same f32 weights bit for bit: 1 to 8 rows, an odd number
/// of panels and a partial one (padded), several threads' parts, with and without a
/// bias, weights whose blocks are constant (scale 0), and inexact blocks are refused.
#[test]
fn panel_copies_reproduce_the_trainers_avx512_bf16_products() {
    use crate::model::cpu::quant::QuantMatrix;
    use candle_core::quantized::{GgmlDType, QTensor};
    if !panels::usable() || !available().contains(&Kernel::Avx512Bf16) {
        eprintln!("this CPU lacks AVX512-BF16 or AVX-512 BW: the panel kernels are not run");
        return;
    }
    let device = candle_core::Device::Cpu;
    for (dtype, format) in [(GgmlDType::Q4_1, "q4_1"), (GgmlDType::Q8_0, "q8")] {
        for (rows, k) in [
            (40, 64),
            (200, 160),
            (16, 32),
            (24, 576),
            (13, 96),
            (96, 1536),
        ] {
            let mut values = data(rows * k, 7 + rows as u64);
            // A constant block (Q4_1 scale 0) in the first row.
            values[..32].fill(0.125);
            let w = candle_core::Tensor::from_vec(values, (rows, k), &device).unwrap();
            let w = QTensor::quantize(&w, dtype)
                .unwrap()
                .dequantize(&device)
                .unwrap();
            let q = QuantMatrix::new(&w).unwrap();
            assert_eq!((q.format(), q.exact()), (format, true));
            let p = panels::QuantPanels::new(&q).expect("exact blocks");
            let wf: Vec<f32> = w.flatten_all().unwrap().to_vec1().unwrap();
            let packed = PackedWeight::new(&wf, rows, k);
            let bias = data(rows, 17);
            for m in 1..=panels::MAX_ROWS {
                let x = data(m * k, 3 + m as u64);
                for bias in [None, Some(bias.as_slice())] {
                    let got = p.product(&x, m, bias);
                    let want = trainers_product(Kernel::Avx512Bf16, &packed, &x, m, bias);
                    let label = format!("{format} {rows}x{k}, {m} rows, bias {}", bias.is_some());
                    assert_same_bits(&got, &want, &label);
                    // Warming other memory during the product changes no bit.
                    let regions: [&[f32]; 2] = [&wf, &x];
                    let warmed = p.product_warming(&x, m, bias, Warm::new(&regions));
                    assert_same_bits(&warmed, &want, &format!("{label}, warming"));
                }
            }
        }
    }
    // Blocks that only approximate their f32 weights have no panel copy.
    let w = candle_core::Tensor::from_vec(data(16 * 64, 9), (16, 64), &device).unwrap();
    assert!(panels::QuantPanels::new(&QuantMatrix::new(&w).unwrap()).is_none());
}

/// `LATHE_BF16_KERNEL` reorders or empties the detected kernels, and leaves them as they
/// are for a name this CPU lacks.
#[test]
fn the_kernel_choice_reorders_what_the_cpu_has() {
    let both = vec![Kernel::Amx, Kernel::Avx512Bf16];
    assert_eq!(
        chosen(both.clone(), "avx512_bf16"),
        vec![Kernel::Avx512Bf16, Kernel::Amx]
    );
    assert_eq!(chosen(both.clone(), "amx"), both);
    assert_eq!(chosen(both.clone(), "none"), vec![]);
    assert_eq!(
        chosen(vec![Kernel::Avx512Bf16], "amx"),
        vec![Kernel::Avx512Bf16]
    );
    assert_eq!(chosen(both.clone(), "tiles"), both);
}
