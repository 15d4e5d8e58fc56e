//! The input gradient `dy W` of a frozen projection for a handful of rows.
//!
//! With few rows (a short training request) the product is bound by reading `W`, and
//! gemm first repacks all of `W` into its own layout — a second full pass over the
//! weight, which at 16 rows made the backward pass of SmolLM2 several times slower than
//! the weight reads alone. Here each task streams a contiguous range of weight rows
//! exactly once into its own `(m, in)` accumulators, folding four weight rows in at a
//! time; the tasks' accumulators are summed at the end, in task order.

use std::ops::Range;

use candle_core::{DType, Result, Tensor};
use rayon::prelude::*;

use super::gemm::with_slices;

/// Weight rows per task, at least: fewer would make summing the tasks' accumulators
/// cost more than the rows themselves.
const MIN_ROWS_PER_TASK: usize = 64;

/// `dy W` for `dy (m, out)` and `w (out, in)`, all f32 on the CPU; `(m, in)` row-major.
pub fn dy_w(dy: &[f32], m: usize, w: &Tensor) -> Result<Vec<f32>> {
    let (out_dim, in_dim) = w.dims2()?;
    if dy.len() != m * out_dim || w.dtype() != DType::F32 {
        candle_core::bail!(
            "input gradient: {} values for {m} rows of {out_dim}, weight {:?}",
            dy.len(),
            w.dtype()
        );
    }
    with_slices(&[w], |s| {
        let ws = s[0];
        let tasks = (2 * rayon::current_num_threads())
            .min(out_dim / MIN_ROWS_PER_TASK)
            .max(1);
        let per_task = out_dim.div_ceil(tasks);
        let product = Product {
            dy,
            m,
            w: ws,
            out_dim,
            in_dim,
        };
        let parts: Vec<Vec<f32>> = (0..tasks)
            .into_par_iter()
            .map(|t| {
                let (j0, j1) = (t * per_task, ((t + 1) * per_task).min(out_dim));
                let mut acc = vec![0f32; m * in_dim];
                product.rows(j0..j1, &mut acc);
                acc
            })
            .collect();
        // Summed in task order, never in the order the pool happens to finish or split
        // the tasks: the gradient must not depend on timing (a resumed run repeats a
        // straight one bit for bit).
        let mut parts = parts.into_iter();
        let mut dx = parts.next().unwrap_or_else(|| vec![0f32; m * in_dim]);
        for part in parts {
            dx.iter_mut().zip(&part).for_each(|(x, y)| *x += y);
        }
        Ok(dx)
    })
}

/// One product `dy W`: `dy` is `(m, out)`, `w` is `(out, in)`, both row-major.
#[derive(Clone, Copy)]
struct Product<'a> {
    dy: &'a [f32],
    m: usize,
    w: &'a [f32],
    out_dim: usize,
    in_dim: usize,
}

impl Product<'_> {
    /// Adds weight rows `js` (with `dy`'s matching columns) into `acc (m, in)`.
    fn rows(self, js: Range<usize>, acc: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU supports AVX-512F, checked just above.
                return unsafe { self.rows_avx512(js, acc) };
            }
        }
        self.rows_generic(js, acc)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn rows_avx512(self, js: Range<usize>, acc: &mut [f32]) {
        self.rows_generic(js, acc)
    }

    /// The loop the compiler vectorises for whatever features the caller enabled: four
    /// weight rows at a time, so each accumulator is loaded and stored once per four rows.
    #[inline(always)]
    fn rows_generic(self, js: Range<usize>, acc: &mut [f32]) {
        let Self {
            dy,
            m,
            w,
            out_dim,
            in_dim,
        } = self;
        let row = |j: usize| &w[j * in_dim..(j + 1) * in_dim];
        let mut j = js.start;
        while j + 4 <= js.end {
            let (w0, w1, w2, w3) = (row(j), row(j + 1), row(j + 2), row(j + 3));
            for (i, a) in acc.chunks_exact_mut(in_dim).enumerate().take(m) {
                let d = &dy[i * out_dim + j..i * out_dim + j + 4];
                let (d0, d1, d2, d3) = (d[0], d[1], d[2], d[3]);
                for c in 0..in_dim {
                    a[c] += d0 * w0[c] + d1 * w1[c] + d2 * w2[c] + d3 * w3[c];
                }
            }
            j += 4;
        }
        while j < js.end {
            let w0 = row(j);
            for (i, a) in acc.chunks_exact_mut(in_dim).enumerate().take(m) {
                let d0 = dy[i * out_dim + j];
                for c in 0..in_dim {
                    a[c] += d0 * w0[c];
                }
            }
            j += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn matches_candle_for_odd_shapes_and_every_small_row_count() {
        // 131 weight rows: two tasks, neither a multiple of four rows.
        let (out_dim, in_dim) = (131, 300);
        let w = Tensor::randn(0f32, 1.0, (out_dim, in_dim), &Device::Cpu).unwrap();
        for m in [1, 3, 16] {
            let dy = Tensor::randn(0f32, 1.0, (m, out_dim), &Device::Cpu).unwrap();
            let want: Vec<f32> = dy
                .matmul(&w)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let dys: Vec<f32> = dy.flatten_all().unwrap().to_vec1().unwrap();
            let got = dy_w(&dys, m, &w).unwrap();
            assert_eq!(got.len(), want.len());
            for (g, x) in got.iter().zip(&want) {
                assert!((g - x).abs() < 1e-4, "{g} vs {x} at m = {m}");
            }
        }
        assert!(dy_w(&[0.0; 3], 1, &w).is_err(), "wrong length is refused");
    }
}
