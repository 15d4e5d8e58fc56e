//! Reordering a product's outputs: the block kernels write `(n, m)`, one weight row's
//! outputs together, and callers want `(m, n)`.

use rayon::prelude::*;

/// `(n, m)` to `(m, n)`, row-major. The input goes a tile of rows at a time (about
/// 16 KiB, so it stays in the first-level cache) and every output row takes its values
/// from the tile in order; threads split the output rows. A prompt's products have
/// outputs of megabytes, which a transpose one value at a time (a cache miss for every
/// write) or one output row at a time (the whole input read per row) spent longer
/// reordering than the product took to compute.
pub(super) fn transpose(yt: Vec<f32>, n: usize, m: usize) -> Vec<f32> {
    if m <= 1 || n == 0 {
        return yt;
    }
    let tile = (4096 / m).max(8);
    let mut y = vec![0f32; n * m];
    // Small outputs (a decode step's) are not worth a hand-off between threads.
    let parts = if n * m < PARALLEL_TRANSPOSE {
        1
    } else {
        rayon::current_num_threads()
    };
    let rows_per_part = m.div_ceil(parts);
    let part = |(p, ys): (usize, &mut [f32])| {
        let first = p * rows_per_part;
        for start in (0..n).step_by(tile) {
            let end = (start + tile).min(n);
            for (i, row) in ys.chunks_exact_mut(n).enumerate() {
                let column = yt[start * m + first + i..].iter().step_by(m);
                row[start..end]
                    .iter_mut()
                    .zip(column)
                    .for_each(|(y, &v)| *y = v);
            }
        }
    };
    if parts == 1 {
        part((0, &mut y));
    } else {
        y.par_chunks_mut(rows_per_part * n)
            .enumerate()
            .for_each(part);
    }
    y
}

/// Outputs from which [`transpose`] splits its work across threads.
const PARALLEL_TRANSPOSE: usize = 1 << 16;

#[cfg(test)]
mod tests {
    use super::*;

    /// Every shape the tiles and the split across threads can leave ragged: one row, a
    /// tile's width and one more, outputs below and above the parallel threshold.
    #[test]
    fn transpose_moves_every_value_to_its_place() {
        for (n, m) in [
            (1, 1),
            (5, 1),
            (1, 7),
            (33, 8),
            (9, 513),
            (4096, 17),
            (3072, 128),
        ] {
            let yt: Vec<f32> = (0..n * m).map(|v| v as f32).collect();
            let y = transpose(yt, n, m);
            for i in 0..m {
                for o in 0..n {
                    assert_eq!(
                        y[i * n + o],
                        (o * m + i) as f32,
                        "n {n} m {m} at ({i}, {o})"
                    );
                }
            }
        }
    }
}
