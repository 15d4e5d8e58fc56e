//! Token choice on the device: `pick_tokens_f32` of `kernels.cu`, one block per
//! sequence, copying back only each token and its log-probability.

use std::sync::OnceLock;

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, Result, Tensor};

use super::{device, enabled, input, row_count, run, MODULE, PTX};

/// Whether decode steps pick their tokens on the GPU ([`pick_tokens`]): with the fused
/// kernels, unless `LATHE_CUDA_PICK=0` (read once) asks for the host's picks, to
/// measure what they gain.
pub fn pick_enabled() -> bool {
    static ENABLED: OnceLock<bool> = OnceLock::new();
    enabled()
        && *ENABLED
            .get_or_init(|| std::env::var("LATHE_CUDA_PICK").map_or(true, |v| v.trim() != "0"))
}

/// Most tokens [`pick_tokens`] ranks for top-k (one pass over the row per token).
pub const PICK_MAX_K: usize = 64;
/// Threads of [`pick_tokens`]'s block per row (the kernel's `PICK_THREADS` and its
/// launch bound).
const PICK_THREADS: u32 = 1024;

/// How [`pick_tokens`] picks one row's token: what `sample::logits::Picker::pick` does
/// with the same uniform draw.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PickRow {
    /// `1 / temperature`; 0 picks the most likely token.
    pub inv_temperature: f64,
    /// Rank only this many most likely tokens (at most [`PICK_MAX_K`]); `None` walks the
    /// whole vocabulary in id order (then `top_p` must be 1).
    pub top_k: Option<usize>,
    /// The nucleus mass, among the top-k.
    pub top_p: f64,
    /// The uniform draw in `[0, 1)` the pick walks to.
    pub u: f64,
}

/// Picks one token from each row of `logits` (`(n, vocab)`, f32) on the device and
/// copies back only the tokens and their log-probabilities (`log_softmax(row)[token]`):
/// two numbers per row instead of the row.
pub fn pick_tokens(logits: &Tensor, rows: &[PickRow]) -> Result<Vec<(u32, f32)>> {
    let (n, vocab) = logits.dims2()?;
    if rows.len() != n {
        bail!("pick_tokens: {} picks for {n} rows", rows.len());
    }
    if n == 0 {
        return Ok(Vec::new());
    }
    if vocab == 0 || vocab > u32::MAX as usize {
        bail!("pick_tokens: a vocabulary of {vocab}");
    }
    let mut params = Vec::with_capacity(4 * n);
    for r in rows {
        let k = match r.top_k {
            Some(k) if (1..=PICK_MAX_K).contains(&k) && k < vocab => k,
            None if r.top_p >= 1.0 => 0,
            Some(k) if k >= vocab && r.top_p >= 1.0 => 0,
            _ => bail!("pick_tokens: top-k {:?} with top-p {}", r.top_k, r.top_p),
        };
        let valid = r.inv_temperature >= 0.0
            && r.inv_temperature.is_finite()
            && (0.0..1.0).contains(&r.u)
            && r.top_p > 0.0
            && r.top_p <= 1.0;
        if !valid {
            bail!("pick_tokens: {r:?}");
        }
        params.extend([r.inv_temperature, k as f64, r.top_p, r.u]);
    }
    let logits = logits.contiguous()?;
    let dev = device(&logits)?;
    let stream = dev.cuda_stream();
    let params = stream.clone_htod(&params).w()?;
    // SAFETY: the kernel writes both numbers of every row.
    let out = unsafe { dev.alloc::<f64>(2 * n) }?;
    let li = input(&logits)?;
    let lv = li.view::<f32>()?;
    let vocab64 = vocab as i64;
    let func = dev.get_or_load_custom_func("pick_tokens_f32", MODULE, PTX)?;
    let mut b = func.builder();
    b.arg(&lv).arg(&params).arg(&out).arg(&vocab64);
    run(
        b,
        LaunchConfig {
            grid_dim: (row_count(n)? as u32, 1, 1),
            block_dim: (PICK_THREADS, 1, 1),
            shared_mem_bytes: 0,
        },
    )?;
    let out = stream.clone_dtoh(&out).w()?;
    Ok(out
        .chunks_exact(2)
        .map(|p| (p[0] as u32, p[1] as f32))
        .collect())
}
