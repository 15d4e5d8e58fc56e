//! The LoRA deltas of a packed multi-adapter batch in two launches per projection
//! (SGMV, as Punica and S-LoRA batch many adapters): `lora_shrink_f32` and
//! `lora_expand_f32` of `kernels.cu`.

use std::sync::OnceLock;

use candle_core::cuda_backend::cudarc::driver::{CudaView, DevicePtr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, DType, Result, Tensor};

use super::{
    alloc, device, enabled, expect, input, row_count, run, tensor, Input, MODULE, PTX, THREADS,
};

/// Whether the segmented LoRA deltas ([`lora_deltas`]) are in use: with the fused
/// kernels, unless `LATHE_CUDA_SGMV=0` (read once) asks for the per-segment products,
/// to measure what they gain.
pub fn sgmv_enabled() -> bool {
    static ENABLED: OnceLock<bool> = OnceLock::new();
    enabled()
        && *ENABLED
            .get_or_init(|| std::env::var("LATHE_CUDA_SGMV").map_or(true, |v| v.trim() != "0"))
}

/// Whether [`lora_deltas`] takes `parts` parts of rank `r` over `width` columns: its
/// grids stay within CUDA's 65,535 blocks along y, and the staged row of `u` within a
/// block's 48 KiB of shared memory.
pub fn lora_deltas_fit(parts: usize, r: usize, width: usize) -> bool {
    let warps = (THREADS / 32) as usize;
    parts * r.div_ceil(warps) <= 65_535
        && width.div_ceil(THREADS as usize) <= 65_535
        && parts * r <= 12_000
}

/// One segment of a packed batch for [`lora_deltas`]: rows `start..start + len`, its
/// adapter's LoRA scale, and each part's factors `(A (r, d), B (w_p, r))`, `None` where
/// the adapter has none for that part or the rows carry no adapter.
pub struct LoraSegment<'a> {
    pub start: usize,
    pub len: usize,
    pub scale: f32,
    pub pairs: Vec<Option<(&'a Tensor, &'a Tensor)>>,
}

/// The LoRA deltas of every segment of a packed batch, for every part of a stacked
/// projection (q/k/v, gate/up, or one part), in two launches (SGMV, as Punica and
/// S-LoRA batch many adapters): `base` is `(n, W)`, its columns the parts of `widths`
/// in order; returns `y = base + scale · u_p B_pᵀ` on each segment's rows and part `p`'s
/// columns (`base` alone where there are no factors), `(n, W)`, and `u`, `(n, parts ·
/// r)`, whose columns `p r .. (p + 1) r` are `x A_pᵀ` (zero where there are no
/// factors). `x` is `(n, d)`; every pair has the same rank `r`, and segments lie within
/// the `n` rows (they need not cover them). This is what `lora::lora_forward` computes
/// part by part and segment by segment with a few launches each.
pub fn lora_deltas(
    x: &Tensor,
    base: &Tensor,
    widths: &[usize],
    segments: &[LoraSegment<'_>],
) -> Result<(Tensor, Tensor)> {
    let (n, d) = x.dims2()?;
    let parts = widths.len();
    let w: usize = widths.iter().sum();
    expect(base, &[n, w], "lora_deltas base", x.device())?;
    let Some(r) = segments
        .iter()
        .flat_map(|s| &s.pairs)
        .find_map(|p| p.map(|(a, _)| a.dim(0)))
        .transpose()?
    else {
        bail!("lora_deltas: no segment carries factors");
    };
    if r == 0 || parts == 0 {
        bail!("lora_deltas: rank {r}, {parts} parts");
    }
    let mut owners = vec![None; n];
    for (si, s) in segments.iter().enumerate() {
        let end = s.start.checked_add(s.len).filter(|&e| e <= n);
        let Some(end) = end else {
            bail!(
                "lora_deltas: segment {}..+{} outside {n} rows",
                s.start,
                s.len
            );
        };
        if s.pairs.len() != parts {
            bail!(
                "lora_deltas: {} factor pairs for {parts} parts",
                s.pairs.len()
            );
        }
        for (pair, &wp) in s.pairs.iter().zip(widths) {
            if let Some((a, b)) = pair {
                expect(a, &[r, d], "lora_deltas A", x.device())?;
                expect(b, &[wp, r], "lora_deltas B", x.device())?;
                if a.dtype() != DType::F32 || b.dtype() != DType::F32 {
                    bail!("lora_deltas: LoRA factors must be f32");
                }
            }
        }
        owners[s.start..end].fill(Some(si));
    }
    if n == 0 {
        // CUDA allocates no empty buffers, so there would be no `u` to return.
        bail!("lora_deltas: a batch of no rows");
    }
    let (x, base) = (x.contiguous()?, base.contiguous()?);
    // Each segment's factors, part by part (segment si's part p at si * parts + p), made
    // contiguous.
    let factors: Vec<Option<(Tensor, Tensor)>> = segments
        .iter()
        .flat_map(|s| &s.pairs)
        .map(|p| {
            p.map(|(a, b)| Ok((a.contiguous()?, b.contiguous()?)))
                .transpose()
        })
        .collect::<Result<_>>()?;
    let dev = device(&x)?;
    let stream = dev.cuda_stream();
    let inputs: Vec<Option<(Input<'_>, Input<'_>)>> = factors
        .iter()
        .map(|p| {
            p.as_ref()
                .map(|(a, b)| Ok((input(a)?, input(b)?)))
                .transpose()
        })
        .collect::<Result<_>>()?;
    let views: Vec<Option<(CudaView<'_, f32>, CudaView<'_, f32>)>> = inputs
        .iter()
        .map(|p| {
            p.as_ref()
                .map(|(a, b)| Ok((a.view::<f32>()?, b.view::<f32>()?)))
                .transpose()
        })
        .collect::<Result<_>>()?;
    // The pointers stay valid while the views (and their storage locks) live, past the
    // launches; the guards record the factors' use on the stream when dropped.
    let mut guards = Vec::new();
    let mut ptrs: Vec<(u64, u64)> = Vec::with_capacity(views.len());
    for p in &views {
        ptrs.push(match p {
            Some((a, b)) => {
                let (ap, ag) = a.device_ptr(&stream);
                let (bp, bg) = b.device_ptr(&stream);
                guards.push(ag);
                guards.push(bg);
                (ap, bp)
            }
            None => (0, 0),
        });
    }
    // One table, one copy: A pointers by part, B pointers by part, each row's scale (its
    // f32 bits), then the parts' first columns and the width.
    let mut table = vec![0u64; 2 * parts * n + n + parts + 1];
    for (i, owner) in owners.iter().enumerate() {
        if let Some(si) = *owner {
            for (p, &(ap, bp)) in ptrs[si * parts..(si + 1) * parts].iter().enumerate() {
                table[p * n + i] = ap;
                table[(parts + p) * n + i] = bp;
            }
            table[2 * parts * n + i] = u64::from(segments[si].scale.to_bits());
        }
    }
    let mut col = 0;
    for (p, &wp) in widths.iter().enumerate() {
        table[2 * parts * n + n + p] = col as u64;
        col += wp;
    }
    table[2 * parts * n + n + parts] = w as u64;
    let table = stream.clone_htod(&table).w()?;
    let u = alloc(&dev, n * parts * r)?;
    let y = alloc(&dev, n * w)?;
    let (xi, bi) = (input(&x)?, input(&base)?);
    let (xv, basev) = (xi.view::<f32>()?, bi.view::<f32>()?);
    let (n64, p64, d64, r64) = (n as i64, parts as i64, d as i64, r as i64);
    let warps = (THREADS / 32) as usize;
    let shrink = dev.get_or_load_custom_func("lora_shrink_f32", MODULE, PTX)?;
    let mut b = shrink.builder();
    b.arg(&xv)
        .arg(&table)
        .arg(&u)
        .arg(&n64)
        .arg(&p64)
        .arg(&d64)
        .arg(&r64);
    let shrink_blocks = parts * r.div_ceil(warps);
    let expand_blocks = w.div_ceil(THREADS as usize);
    if !lora_deltas_fit(parts, r, w) {
        bail!("lora_deltas: {parts} parts of rank {r} over {w} columns exceed a CUDA grid or a block's shared memory");
    }
    run(
        b,
        LaunchConfig {
            grid_dim: (row_count(n)? as u32, shrink_blocks as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        },
    )?;
    let expand = dev.get_or_load_custom_func("lora_expand_f32", MODULE, PTX)?;
    let mut b = expand.builder();
    b.arg(&basev)
        .arg(&u)
        .arg(&table)
        .arg(&y)
        .arg(&n64)
        .arg(&p64)
        .arg(&r64);
    run(
        b,
        LaunchConfig {
            grid_dim: (row_count(n)? as u32, expand_blocks as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: (parts * r * std::mem::size_of::<f32>()) as u32,
        },
    )?;
    drop(guards);
    Ok((tensor(&dev, y, (n, w)), tensor(&dev, u, (n, parts * r))))
}
