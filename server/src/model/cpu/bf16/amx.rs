//! The AMX kernel: a 32 x 32 output block lives in four f32 accumulator tiles for the
//! whole reduction; each 32-deep step loads two 16-row tiles of the left-hand side and
//! two 16-column tiles of the packed right-hand side and issues four `TDPBF16PS`, so every
//! tile loaded is used twice.
//!
//! Stable Rust has no AMX intrinsics, so the instructions are written as inline assembly.
//! The decode kernels (`blocks.rs`) are the only other users of the tile registers, and
//! follow the same rule: each call loads its own tile configuration and releases the
//! tiles before returning.

use std::arch::asm;
use std::arch::x86_64::__cpuid_count;

use super::pack::{Lhs, Output, PackedB};
use super::{K_BLOCK, M_BLOCK, PANEL};

/// Whether the CPU has AMX-BF16 tiles, the OS saves their state, and Linux granted this
/// process the right to use them.
pub(super) fn usable() -> bool {
    // CPUID.(7,0).EDX: bit 22 AMX-BF16, bit 24 AMX-TILE.
    let leaf7 = __cpuid_count(7, 0);
    if leaf7.edx & (1 << 22) == 0 || leaf7.edx & (1 << 24) == 0 {
        return false;
    }
    // CPUID.1.ECX bit 27: the OS enabled XSAVE (and so XGETBV).
    if __cpuid_count(1, 0).ecx & (1 << 27) == 0 {
        return false;
    }
    // XCR0 bits 17 (tile configuration) and 18 (tile data): the OS manages the state.
    // SAFETY: XGETBV exists because the OS enabled XSAVE (checked above).
    let xcr0 = unsafe { std::arch::x86_64::_xgetbv(0) };
    xcr0 & (0b11 << 17) == 0b11 << 17 && request_permission()
}

/// Linux hands out the large tile-data state only to processes that ask
/// (`ARCH_REQ_XCOMP_PERM`); the grant covers every thread of the process.
#[cfg(target_os = "linux")]
fn request_permission() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with these arguments only changes this process's permissions.
    unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
    }
}

#[cfg(not(target_os = "linux"))]
fn request_permission() -> bool {
    false
}

/// A 64-byte tile configuration (palette 1): each tile's rows and bytes per row.
#[repr(C, align(64))]
pub(super) struct TileConfig([u8; 64]);

impl TileConfig {
    /// All eight tiles 16 rows of 64 bytes.
    fn all_full() -> Self {
        Self::with(&[(16, 64); 8])
    }

    /// Tile `t` gets `shapes[t]` = (rows, bytes per row); tiles past the list stay
    /// unconfigured (using one then faults).
    pub(super) fn with(shapes: &[(u8, u16)]) -> Self {
        assert!(shapes.len() <= 8, "eight tiles at most");
        let mut c = [0u8; 64];
        c[0] = 1; // palette
        for (t, &(rows, bytes)) in shapes.iter().enumerate() {
            assert!(
                rows <= 16 && bytes <= 64,
                "a tile holds 16 rows of 64 bytes"
            );
            c[16 + 2 * t..18 + 2 * t].copy_from_slice(&bytes.to_le_bytes());
            c[48 + t] = rows;
        }
        Self(c)
    }
}

/// Releases the tiles when dropped, so that a panic cannot leave them configured.
pub(super) struct Tiles;

impl Tiles {
    /// # Safety
    /// The CPU must support AMX and the process must hold the tile-data permission.
    unsafe fn configure() -> Self {
        // SAFETY: as this function's own contract.
        unsafe { Self::configure_as(&TileConfig::all_full()) }
    }

    /// Loads `cfg` (zeroing every tile).
    ///
    /// # Safety
    /// The CPU must support AMX and the process must hold the tile-data permission.
    pub(super) unsafe fn configure_as(cfg: &TileConfig) -> Self {
        // SAFETY: a palette-1 configuration within the tile limits (`TileConfig::with`);
        // the caller guarantees AMX.
        unsafe { asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly)) };
        Tiles
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        // SAFETY: tiles were configured by `configure` or `configure_as`.
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }
}

/// One 32 x 32 output block: `c` holds each accumulator tile's pointer and row stride in
/// bytes (tile `t` covers rows `16 (t / 2)` and panel `t % 2`); the tiles start from
/// what `c` points at (`$init` = `tileloadd`) or from zero (`tilezero`), take `steps`
/// 32-deep products and are stored back through `c`. Tile registers are declared
/// clobbered, so nothing is assumed about them between blocks.
macro_rules! block {
    ($init0:literal, $init1:literal, $init2:literal, $init3:literal,
     $a:expr, $pairs:expr, $p0:expr, $p1:expr, $steps:expr, $c:expr) => {
        asm!(
            "mov {r}, [{c}]", "mov {s}, [{c} + 8]", $init0,
            "mov {r}, [{c} + 16]", "mov {s}, [{c} + 24]", $init1,
            "mov {r}, [{c} + 32]", "mov {s}, [{c} + 40]", $init2,
            "mov {r}, [{c} + 48]", "mov {s}, [{c} + 56]", $init3,
            "2:",
            // Each product starts as soon as its two tiles are in.
            "tileloadd tmm4, [{a0} + {sa}]",
            "tileloadd tmm6, [{b0} + {sb}]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tileloadd tmm7, [{b1} + {sb}]",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tileloadd tmm5, [{a1} + {sa}]",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            "add {a0}, 64",
            "add {a1}, 64",
            "add {b0}, 1024",
            "add {b1}, 1024",
            "dec {n}",
            "jnz 2b",
            "mov {r}, [{c}]", "mov {s}, [{c} + 8]", "tilestored [{r} + {s}], tmm0",
            "mov {r}, [{c} + 16]", "mov {s}, [{c} + 24]", "tilestored [{r} + {s}], tmm1",
            "mov {r}, [{c} + 32]", "mov {s}, [{c} + 40]", "tilestored [{r} + {s}], tmm2",
            "mov {r}, [{c} + 48]", "mov {s}, [{c} + 56]", "tilestored [{r} + {s}], tmm3",
            a0 = inout(reg) $a.as_ptr() => _,
            a1 = inout(reg) $a.as_ptr().add(16 * $pairs) => _,
            b0 = inout(reg) $p0.as_ptr() => _,
            b1 = inout(reg) $p1.as_ptr() => _,
            n = inout(reg) $steps => _,
            sa = in(reg) $pairs * 4,
            sb = in(reg) 64usize,
            c = in(reg) $c.as_ptr(),
            r = out(reg) _,
            s = out(reg) _,
            out("tmm0") _, out("tmm1") _, out("tmm2") _, out("tmm3") _,
            out("tmm4") _, out("tmm5") _, out("tmm6") _, out("tmm7") _,
            options(nostack),
        )
    };
}

/// All of `lhs`'s rows times `b`, written to `out`.
///
/// A tile wholly inside the output is loaded from it (when accumulating) and stored
/// straight back; a tile on the output's edge goes through a buffer and is clipped.
///
/// # Safety
/// The CPU must support AMX-BF16 and the process must hold the tile-data permission
/// ([`usable`]).
pub(super) unsafe fn product(out: &mut Output<'_>, lhs: &Lhs, b: &PackedB) {
    debug_assert_eq!(lhs.pairs * 2, b.k_padded());
    debug_assert_eq!(lhs.rows % M_BLOCK, 0);
    debug_assert_eq!(b.panels() % 2, 0);
    let steps = b.k_padded() / K_BLOCK;
    if steps == 0 {
        return;
    }
    let accumulate = out.accumulates();
    // SAFETY: the caller guarantees AMX.
    let _tiles = unsafe { Tiles::configure() };
    let mut edge = [[0f32; 256]; 4];
    for jp in (0..b.panels()).step_by(2) {
        let (p0, p1) = (b.panel(jp), b.panel(jp + 1));
        for ib in (0..lhs.rows).step_by(M_BLOCK) {
            let a = &lhs.data[ib * lhs.pairs..(ib + M_BLOCK) * lhs.pairs];
            let place = |t: usize| (ib + 16 * (t / 2), (jp + t % 2) * PANEL);
            // Each tile's (pointer, row stride in bytes), as the asm reads them.
            let mut c = [0usize; 8];
            let mut direct = [false; 4];
            for t in 0..4 {
                let (row, col) = place(t);
                let (ptr, stride) = match out.tile(row, col) {
                    Some(d) => {
                        direct[t] = true;
                        d
                    }
                    None => {
                        if accumulate {
                            out.get(row, col, &mut edge[t]);
                        }
                        (edge[t].as_mut_ptr(), 64)
                    }
                };
                c[2 * t] = ptr as usize;
                c[2 * t + 1] = stride;
            }
            // SAFETY: `a` holds 32 rows of `lhs.pairs` words, each `steps` tiles of 64
            // bytes wide; each panel holds `steps` contiguous 1 KiB tiles; each pointer
            // in `c` is an output tile `Output::tile` checked (16 rows of 64 bytes at
            // its stride) or a 16 x 16 buffer with stride 64.
            unsafe {
                if accumulate {
                    block!(
                        "tileloadd tmm0, [{r} + {s}]",
                        "tileloadd tmm1, [{r} + {s}]",
                        "tileloadd tmm2, [{r} + {s}]",
                        "tileloadd tmm3, [{r} + {s}]",
                        a,
                        lhs.pairs,
                        p0,
                        p1,
                        steps,
                        c
                    );
                } else {
                    block!(
                        "tilezero tmm0",
                        "tilezero tmm1",
                        "tilezero tmm2",
                        "tilezero tmm3",
                        a,
                        lhs.pairs,
                        p0,
                        p1,
                        steps,
                        c
                    );
                }
            }
            for t in (0..4).filter(|&t| !direct[t]) {
                let (row, col) = place(t);
                // The buffer started from the output's values, so it replaces them.
                out.put(row, col, &edge[t], PANEL, 16, false);
            }
        }
    }
}
