//! The AMX kernel: a 32 x 32 output block lives in four f32 accumulator tiles for the
//! whole reduction; each 32-deep step loads two 16-row tiles of the left-hand side and
//! two 16-column tiles of the packed right-hand side and issues four `TDPBF16PS`, so every
//! tile loaded is used twice.
//!
//! Stable Rust has no AMX intrinsics, so the instructions are written as inline assembly.
//! Nothing else in the program uses the tile registers; each call loads its own tile
//! configuration and releases the tiles before returning.

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

/// The 64-byte tile configuration (palette 1): all eight tiles 16 rows of 64 bytes.
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

impl TileConfig {
    fn all_full() -> Self {
        let mut c = [0u8; 64];
        c[0] = 1; // palette
        for t in 0..8 {
            c[16 + 2 * t] = 64; // bytes per row (u16, little-endian)
            c[48 + t] = 16; // rows
        }
        Self(c)
    }
}

/// Releases the tiles when dropped, so that a panic cannot leave them configured.
struct Tiles;

impl Tiles {
    /// # Safety
    /// The CPU must support AMX and the process must hold the tile-data permission.
    unsafe fn configure() -> Self {
        let cfg = TileConfig::all_full();
        // SAFETY: a valid palette-1 configuration; the caller guarantees AMX.
        unsafe { asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly)) };
        Tiles
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        // SAFETY: tiles were configured by `configure`.
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }
}

/// The instruction `$pre tmmN $post` for accumulator tile `$t` (0 to 3): tile registers
/// must be named literally.
macro_rules! with_tile {
    ($t:expr, $pre:literal, $post:literal, $($args:tt)*) => {
        match $t {
            0 => asm!(concat!($pre, "tmm0", $post), $($args)*),
            1 => asm!(concat!($pre, "tmm1", $post), $($args)*),
            2 => asm!(concat!($pre, "tmm2", $post), $($args)*),
            _ => asm!(concat!($pre, "tmm3", $post), $($args)*),
        }
    };
}

/// All of `lhs`'s rows times `b`, written to `out`.
///
/// Accumulator tile `t` covers rows `16 (t / 2)` and panel `t % 2` of a 32 x 32 block.
/// A tile wholly inside the output is loaded from it (when accumulating) and stored
/// straight back; a tile on the output's edge goes through a buffer and is clipped.
/// The accumulators live in the tile registers between the `asm!` blocks below: nothing
/// else in this program uses tile registers, and no code between the blocks can.
///
/// # Safety
/// The CPU must support AMX-BF16 and the process must hold the tile-data permission
/// ([`usable`]).
pub(super) unsafe fn product(out: &mut Output<'_, '_>, lhs: &Lhs, b: &PackedB) {
    debug_assert_eq!(lhs.pairs * 2, b.k_padded());
    debug_assert_eq!(lhs.rows % M_BLOCK, 0);
    debug_assert_eq!(b.panels() % 2, 0);
    let steps = b.k_padded() / K_BLOCK;
    if steps == 0 {
        return;
    }
    let row_bytes = lhs.pairs * 4;
    let accumulate = out.accumulates();
    // SAFETY: the caller guarantees AMX.
    let _tiles = unsafe { Tiles::configure() };
    let mut edge = [[0f32; 256]; 4];
    for jp in (0..b.panels()).step_by(2) {
        let (p0, p1) = (b.panel(jp), b.panel(jp + 1));
        for ib in (0..lhs.rows).step_by(M_BLOCK) {
            let a = &lhs.data[ib * lhs.pairs..(ib + M_BLOCK) * lhs.pairs];
            let place = |t: usize| (ib + 16 * (t / 2), (jp + t % 2) * PANEL);
            let mut direct = [None; 4];
            for (t, d) in direct.iter_mut().enumerate() {
                let (row, col) = place(t);
                *d = out.tile(row, col);
                // SAFETY: `tile` checked that 16 rows of 16 f32 at this stride are in
                // the output; the tiles are configured 16 x 64 bytes.
                unsafe {
                    match *d {
                        Some((ptr, stride)) if accumulate => with_tile!(
                            t,
                            "tileloadd ",
                            ", [{p} + {s}]",
                            p = in(reg) ptr,
                            s = in(reg) stride,
                            options(nostack, readonly)
                        ),
                        _ => with_tile!(t, "tilezero ", "", options(nostack, nomem)),
                    }
                }
            }
            // SAFETY: `a` holds 32 rows of `row_bytes`, each `steps` tiles of 64 bytes
            // wide; each panel holds `steps` contiguous 1 KiB tiles. The asm reads only
            // those.
            unsafe {
                asm!(
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
                    a0 = inout(reg) a.as_ptr() => _,
                    a1 = inout(reg) a.as_ptr().add(16 * lhs.pairs) => _,
                    b0 = inout(reg) p0.as_ptr() => _,
                    b1 = inout(reg) p1.as_ptr() => _,
                    n = inout(reg) steps => _,
                    sa = in(reg) row_bytes,
                    sb = in(reg) 64usize,
                    options(nostack, readonly),
                );
            }
            for t in 0..4 {
                let (ptr, stride) = match direct[t] {
                    Some(d) => d,
                    None => (edge[t].as_mut_ptr(), 64),
                };
                // SAFETY: `ptr` is a checked output tile or a 16 x 16 buffer.
                unsafe {
                    with_tile!(
                        t,
                        "tilestored [{p} + {s}], ",
                        "",
                        p = in(reg) ptr,
                        s = in(reg) stride,
                        options(nostack)
                    )
                };
                if direct[t].is_none() {
                    let (row, col) = place(t);
                    out.put(row, col, &edge[t], PANEL, 16);
                }
            }
        }
    }
}
