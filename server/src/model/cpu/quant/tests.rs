//! The block-quantized products against candle's dequantized f32 products.

use super::*;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Device;

use crate::model::cpu::warm::Warm;
use crate::model::test_util::{max_abs_diff, uniform_matrix as randn};

/// `w` through GGML's quantizer and back: what a GGUF file of that type holds.
fn through(w: &Tensor, dtype: GgmlDType) -> Tensor {
    QTensor::quantize(w, dtype)
        .unwrap()
        .dequantize(&Device::Cpu)
        .unwrap()
}

fn products_match(q: &QuantMatrix, w: &Tensor, tol: f64) {
    let (_, k) = w.dims2().unwrap();
    for m in [1, 3, 8, 9, 16] {
        let arith = BlockArith::F32;
        let x = randn(m, k, 10 + m as u64);
        let want = x.matmul(&w.t().unwrap()).unwrap();
        let got = q.matmul_t(&x, arith, None).unwrap();
        assert_eq!(got.dims(), want.dims());
        assert!(
            max_abs_diff(&got, &want) < tol,
            "{} m={m} {arith:?}",
            q.format()
        );
        let xs: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
        let host = q.matmul_t_host(&xs, m, arith, None).unwrap();
        let via_tensor: Vec<f32> = got.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(host, via_tensor);
        // Warming other memory during the product changes no bit.
        let regions: [&[f32]; 2] = [&xs, &host];
        let warmed = q
            .matmul_t_host_warming(&xs, m, arith, None, Warm::new(&regions))
            .unwrap();
        assert_eq!(warmed, host, "{} m={m}, warming", q.format());
    }
}

#[test]
fn weights_from_q4_1_blocks_are_recovered_exactly() {
    let w = through(&randn(150, 96, 3), GgmlDType::Q4_1);
    let q = QuantMatrix::new(&w).unwrap();
    assert_eq!(q.format(), "q4_1");
    assert!(q.exact());
    // Same weights, different summation order: f32 rounding only.
    products_match(&q, &w, 1e-5);
}

#[test]
fn other_weights_fall_back_to_q8_and_say_whether_it_is_exact() {
    let w = randn(100, 64, 3);
    let q = QuantMatrix::new(&w).unwrap();
    assert_eq!(q.format(), "q8");
    assert!(!q.exact());
    // 8-bit weights: error about |x| * |w| / 127 per term, summed over 64.
    products_match(&q, &w, 0.1);
    // Weights from Q8_0 blocks (the default model's embedding) are reproduced.
    let w = through(&randn(100, 64, 4), GgmlDType::Q8_0);
    let q = QuantMatrix::new(&w).unwrap();
    assert_eq!(q.format(), "q8");
    assert!(q.exact());
    products_match(&q, &w, 1e-5);
    assert!(QuantMatrix::new(&randn(2, 30, 1)).is_err());
}

#[test]
fn near_misses_are_not_taken_for_q4_1() {
    let w = through(&randn(4, 64, 5), GgmlDType::Q4_1);
    let mut v: Vec<f32> = w.flatten_all().unwrap().to_vec1().unwrap();
    // One weight one f32 step off its code is no longer Q4_1.
    v[77] = f32::from_bits(v[77].to_bits() + 1);
    let w = Tensor::from_vec(v, (4, 64), &Device::Cpu).unwrap();
    assert_eq!(QuantMatrix::new(&w).unwrap().format(), "q8");
    // A constant block is exact (scale 0), and NaN is never.
    let flat = Tensor::full(0.25f32, (2, 32), &Device::Cpu).unwrap();
    assert!(QuantMatrix::new(&flat).unwrap().exact());
    assert_eq!(QuantMatrix::new(&flat).unwrap().format(), "q4_1");
    let nan = Tensor::full(f32::NAN, (1, 32), &Device::Cpu).unwrap();
    assert!(!QuantMatrix::new(&nan).unwrap().exact());
}

#[test]
fn portable_kernels_match_the_avx512_ones() {
    // The paths used on CPUs without AVX-512 (this machine always takes AVX-512).
    // One row and several rows take different AVX-512 paths.
    let (k, n) = (64, 5);
    for (m, w) in [1, 3].into_iter().flat_map(|m| {
        [
            (m, randn(n, k, 9)),
            (m, through(&randn(n, k, 9), GgmlDType::Q4_1)),
        ]
    }) {
        let x = randn(m, k, 10);
        let xs: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
        let q = QuantMatrix::new(&w).unwrap();
        let mut yt = vec![0f32; n * m];
        match &q.blocks {
            Blocks::Q8 { quants, scales } => q8_rows_generic(&xs, m, k, quants, scales, &mut yt),
            Blocks::Q41 {
                nibbles,
                scales,
                mins,
            } => q41_rows_generic(&xs, m, k, nibbles, scales, mins, &mut yt),
        }
        let generic = from_transposed(yt, n, m).unwrap();
        assert!(max_abs_diff(&generic, &q.matmul_t(&x, BlockArith::F32, None).unwrap()) < 1e-5);
    }
}
