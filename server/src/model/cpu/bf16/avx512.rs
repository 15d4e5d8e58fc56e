//! The AVX512-BF16 kernel: an 8 x 32 output block in sixteen zmm accumulators; each step
//! of the reduction broadcasts one bf16 pair of each of 8 left-hand rows and multiplies
//! it into a pair row of two packed panels with `VDPBF16PS` (16 pair dot products each).
//! Also the rounding of f32 rows to bf16 (`VCVTNEPS2BF16`), which both kernels use.

use std::arch::x86_64::*;

use super::pack::{Lhs, Output, PackedB};
use super::{M_BLOCK, PANEL};

/// Rows per micro-block.
const MR: usize = 8;

/// Whether the CPU has AVX512-F and AVX512-BF16 (and the OS saves zmm state).
pub(super) fn usable() -> bool {
    is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bf16")
}

/// Rounds `row` to bf16 pair words in `out` (to nearest, ties to even); words past the
/// row's end are left as they are.
///
/// # Safety
/// The CPU must support AVX512-F and AVX512-BF16.
#[target_feature(enable = "avx512f,avx512bf16")]
pub(super) unsafe fn round_row(row: &[f32], out: &mut [u32]) {
    assert!(out.len() * 2 >= row.len(), "output too short");
    let mut chunks = row.chunks_exact(32);
    let mut words = out.chunks_exact_mut(16);
    for (src, dst) in (&mut chunks).zip(&mut words) {
        // SAFETY: `src` holds 32 f32 and `dst` 16 u32 (64 bytes each side).
        unsafe {
            let lo = _mm512_loadu_ps(src.as_ptr());
            let hi = _mm512_loadu_ps(src.as_ptr().add(16));
            // The second operand fills the low half of the result.
            let packed: __m512bh = _mm512_cvtne2ps_pbh(hi, lo);
            _mm512_storeu_si512(
                dst.as_mut_ptr().cast(),
                std::mem::transmute::<__m512bh, __m512i>(packed),
            );
        }
    }
    let rest = chunks.remainder();
    let start = row.len() - rest.len();
    for (i, v) in rest.iter().enumerate() {
        let bits = u32::from(super::round_bf16(*v));
        let word = &mut out[(start + i) / 2];
        *word = if i % 2 == 0 {
            (*word & 0xffff_0000) | bits
        } else {
            (*word & 0xffff) | (bits << 16)
        };
    }
    if rest.len() % 2 == 1 {
        out[row.len() / 2] &= 0xffff;
    }
}

/// `lhs`'s rows times panels `panels` of `b` (an even start and end), written to `out`,
/// whose column 0 is the first column of panel `panels.start`. Micro-blocks of padding
/// rows only (past `out`'s rows) are skipped: a decode step's few rows cost one
/// micro-block, not a whole [`M_BLOCK`]. Each output's sum is the same chain whichever
/// rows and panels a call covers, so any split of a product computes the same bits.
///
/// # Safety
/// The CPU must support AVX512-F and AVX512-BF16 ([`usable`]).
pub(super) unsafe fn product(
    out: &mut Output<'_>,
    lhs: &Lhs,
    b: &PackedB,
    panels: std::ops::Range<usize>,
) {
    debug_assert_eq!(lhs.pairs * 2, b.k_padded());
    debug_assert_eq!(lhs.rows % M_BLOCK, 0);
    debug_assert!(
        panels.start.is_multiple_of(2) && panels.end.is_multiple_of(2) && panels.end <= b.panels()
    );
    let add = out.accumulates();
    let rows = out.rows().next_multiple_of(MR).min(lhs.rows);
    let mut acc = [0f32; MR * 2 * PANEL];
    for jp in panels.clone().step_by(2) {
        let (p0, p1) = (b.panel(jp), b.panel(jp + 1));
        for ib in (0..rows).step_by(MR) {
            let a = &lhs.data[ib * lhs.pairs..(ib + MR) * lhs.pairs];
            // SAFETY: the caller guarantees the CPU features.
            unsafe { block(a, lhs.pairs, p0, p1, &mut acc) };
            out.put(ib, (jp - panels.start) * PANEL, &acc, 2 * PANEL, MR, add);
        }
    }
}

/// `acc (8 x 32) = a (8 rows of `pairs` words) x [p0 | p1]`.
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn block(a: &[u32], pairs: usize, p0: &[u32], p1: &[u32], acc: &mut [f32; MR * 32]) {
    assert!(a.len() >= MR * pairs && p0.len() >= pairs * PANEL && p1.len() >= pairs * PANEL);
    let mut c = [[_mm512_setzero_ps(); 2]; MR];
    for p in 0..pairs {
        // SAFETY: the bounds were asserted above.
        unsafe {
            let b0: __m512bh =
                std::mem::transmute(_mm512_loadu_si512(p0.as_ptr().add(p * PANEL).cast()));
            let b1: __m512bh =
                std::mem::transmute(_mm512_loadu_si512(p1.as_ptr().add(p * PANEL).cast()));
            for (r, row) in c.iter_mut().enumerate() {
                let x: __m512bh =
                    std::mem::transmute(_mm512_set1_epi32(*a.get_unchecked(r * pairs + p) as i32));
                row[0] = _mm512_dpbf16_ps(row[0], x, b0);
                row[1] = _mm512_dpbf16_ps(row[1], x, b1);
            }
        }
    }
    for (r, row) in c.iter().enumerate() {
        // SAFETY: `acc` holds 8 rows of 32 f32.
        unsafe {
            _mm512_storeu_ps(acc.as_mut_ptr().add(r * 32), row[0]);
            _mm512_storeu_ps(acc.as_mut_ptr().add(r * 32 + 16), row[1]);
        }
    }
}
