//! The device backend's fused CUDA kernels: RMSNorm, RoPE, SwiGLU, the causal softmax
//! and the output log-softmax, each with its backward, the AdamW step with its gradient
//! norm, a decode step's attention for many sequences in one launch, and the LoRA deltas
//! of a multi-adapter batch in two (SGMV), for f32 tensors on a CUDA device.
//!
//! They compute what the candle composites of [`super::ops`] compute, in one or two
//! passes over memory instead of one kernel per elementwise step (the composite RMSNorm
//! alone is seven launches and as many intermediate tensors). `kernels.cu` is compiled to
//! PTX by the crate's build script (compute capability 7.5, which every GPU since Turing
//! JITs) and loaded once per device through candle's module cache; launches go through
//! `cudarc` on the device's stream, as candle's own kernels do.
//!
//! Every function takes tensors of the documented shapes, makes them contiguous, and
//! returns fresh contiguous tensors; the ops of [`super::ops`] call them only where
//! [`super::Backend::cuda`] says so. `server/tests/cuda_kernels.rs` holds each kernel to
//! its composite on a GPU.

use std::sync::OnceLock;

use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, DevicePtr, LaunchArgs, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::{bail, DType, Device, Result, Shape, Storage, StorageRef, Tensor, D};

mod lora;
mod optim;
mod pick;

pub use lora::{lora_deltas, lora_deltas_fit, sgmv_enabled, LoraSegment};
pub use optim::{adamw, adamw_many, sum_squares, AdamwStep, AdamwTensors};
pub use pick::{pick_enabled, pick_tokens, PickRow, PICK_MAX_K};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/lathe_kernels.ptx"));
/// The name candle caches the loaded module under, per device.
const MODULE: &str = "lathe_kernels";
/// Threads per block; the row kernels reduce over one row per block.
const THREADS: u32 = 256;

/// Whether the kernels are in use: unless `LATHE_CUDA_FUSED=0` (read once), which runs
/// candle's composites instead, to measure what the kernels gain.
pub fn enabled() -> bool {
    static ENABLED: OnceLock<bool> = OnceLock::new();
    *ENABLED.get_or_init(|| std::env::var("LATHE_CUDA_FUSED").map_or(true, |v| v.trim() != "0"))
}

/// Readies a device just opened with a stream of its own (`Device::new_cuda_with_stream`)
/// for use from several threads: the worker's thread issues optimizer steps, a thread of
/// rayon's pool the passes, and with one stream the device runs them in the order issued
/// (on candle's default, a stream per thread, the two would be unordered, a pass free to
/// read parameters a step had not yet written).
///
/// With one stream there is nothing for cudarc's event tracking to order (it records and
/// waits on events per buffer, for uses across streams, at two driver calls per launch
/// argument and per drop), so it is turned off. cudarc then frees a dropped buffer
/// without making its context current, and keeps a failure there for the context's
/// next call to report: a buffer dropped on a thread where the context was never
/// current would be leaked, and the next operation of any thread (another tenant's
/// decode step) would fail with `CUDA_ERROR_INVALID_CONTEXT`. So the context is made
/// current on every thread of rayon's pool here, and the worker's thread makes it
/// current when it starts ([`make_current`]).
pub fn share_one_stream(device: &Device) -> Result<()> {
    let Device::Cuda(d) = device else {
        return Ok(());
    };
    // SAFETY: every buffer of this device is allocated, used and freed on its one
    // stream (candle's kernels, cuBLAS, cuRAND and Lathe's kernels all take
    // `cuda_stream()`), which orders them; no other stream exists to order them against.
    unsafe { d.cuda_stream().context().disable_event_tracking() };
    rayon::broadcast(|_| make_current(device))
        .into_iter()
        .collect::<Result<Vec<()>>>()?;
    Ok(())
}

/// Makes `device`'s CUDA context current on the calling thread; nothing for another
/// device. A thread that may drop the device's tensors calls it first (see
/// [`share_one_stream`]).
pub fn make_current(device: &Device) -> Result<()> {
    if let Device::Cuda(d) = device {
        d.cuda_stream().context().bind_to_thread().w()?;
    }
    Ok(())
}

/// `device`'s free and total memory in bytes, as the driver reports them now; `None`
/// for another device.
pub fn memory(device: &Device) -> Result<Option<(u64, u64)>> {
    match device {
        Device::Cuda(d) => {
            let (free, total) = d.cuda_stream().context().mem_get_info().w()?;
            Ok(Some((free as u64, total as u64)))
        }
        _ => Ok(None),
    }
}

/// Whether the kernels take `t`: f32 on a CUDA device.
pub fn supported(t: &Tensor) -> bool {
    t.device().is_cuda() && t.dtype() == DType::F32
}

/// A contiguous tensor's storage, read-locked for the length of a launch.
struct Input<'a> {
    storage: StorageRef<'a>,
    offset: usize,
    len: usize,
}

impl Input<'_> {
    fn view<T: CudaDType>(&self) -> Result<CudaView<'_, T>> {
        match &*self.storage {
            Storage::Cuda(s) => Ok(s
                .as_cuda_slice::<T>()?
                .slice(self.offset..self.offset + self.len)),
            _ => bail!("a fused CUDA kernel was given a tensor that is not on a CUDA device"),
        }
    }
}

fn input(t: &Tensor) -> Result<Input<'_>> {
    let (storage, layout) = t.storage_and_layout();
    if !layout.is_contiguous() {
        bail!("a fused CUDA kernel was given a non-contiguous tensor");
    }
    Ok(Input {
        storage,
        offset: layout.start_offset(),
        len: layout.shape().elem_count(),
    })
}

fn device(t: &Tensor) -> Result<CudaDevice> {
    match t.device() {
        Device::Cuda(d) => Ok(d.clone()),
        _ => bail!("a fused CUDA kernel was given a tensor that is not on a CUDA device"),
    }
}

/// `len` uninitialised f32s on `dev`, every one of which the kernel about to run writes.
fn alloc(dev: &CudaDevice, len: usize) -> Result<CudaSlice<f32>> {
    // SAFETY: each caller launches a kernel that writes all `len` elements before the
    // slice is read.
    unsafe { dev.alloc::<f32>(len.max(1)) }
}

fn tensor(dev: &CudaDevice, slice: CudaSlice<f32>, shape: impl Into<Shape>) -> Tensor {
    let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(slice, dev.clone()));
    Tensor::from_storage(storage, shape, BackpropOp::none(), false)
}

/// One block per row.
fn rows(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A grid-stride launch over `total` elements.
fn elements(total: usize) -> LaunchConfig {
    let blocks = total.div_ceil(THREADS as usize).clamp(1, 1 << 16) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Launches a kernel whose arguments are pushed, unless the launch would have no blocks.
fn run(mut args: LaunchArgs<'_>, cfg: LaunchConfig) -> Result<()> {
    if cfg.grid_dim.0 == 0 || cfg.grid_dim.1 == 0 {
        return Ok(());
    }
    // SAFETY: each caller pushes the argument list of its kernel in kernels.cu, with
    // slices of the lengths its shapes imply.
    unsafe { args.launch(cfg) }.w()?;
    Ok(())
}

/// Rows and width of a tensor whose last dim is the row.
fn rows_of(t: &Tensor) -> Result<(usize, usize)> {
    let d = t.dim(D::Minus1)?;
    Ok((t.elem_count() / d.max(1), d))
}

/// Checks that `t` has `dims` and lives on `dev`. The kernels index by the shapes they
/// are given, so a mismatch that candle would broadcast or refuse would read or write
/// out of bounds instead.
fn expect(t: &Tensor, dims: &[usize], what: &str, dev: &Device) -> Result<()> {
    if t.dims() != dims {
        bail!("{what}: expected a tensor of {dims:?}, got {:?}", t.dims());
    }
    if !t.device().same_device(dev) {
        bail!(
            "{what}: on {:?}, not {:?}",
            t.device().location(),
            dev.location()
        );
    }
    Ok(())
}

fn row_count(n: usize) -> Result<usize> {
    if n > i32::MAX as usize {
        bail!("{n} rows are more than a CUDA grid holds");
    }
    Ok(n)
}

/// RMSNorm over the last dim: `(x * rstd * weight, rstd (rows,))`.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    let (x, weight) = (x.contiguous()?, weight.contiguous()?);
    let (n, d) = rows_of(&x)?;
    expect(&weight, &[d], "rms_norm weight", x.device())?;
    let dev = device(&x)?;
    let (y, rstd) = (alloc(&dev, n * d)?, alloc(&dev, n)?);
    let (xi, wi) = (input(&x)?, input(&weight)?);
    let (xv, wv) = (xi.view::<f32>()?, wi.view::<f32>()?);
    let (d64, eps32) = (d as i64, eps as f32);
    let func = dev.get_or_load_custom_func("rms_norm_f32", MODULE, PTX)?;
    let mut b = func.builder();
    b.arg(&xv).arg(&wv).arg(&y).arg(&rstd).arg(&d64).arg(&eps32);
    run(b, rows(row_count(n)?))?;
    Ok((tensor(&dev, y, x.shape().clone()), tensor(&dev, rstd, n)))
}

/// RMSNorm's input gradient from `dy`, the input `x`, the weight and `rstd`.
pub fn rms_norm_backward(
    dy: &Tensor,
    x: &Tensor,
    weight: &Tensor,
    rstd: &Tensor,
) -> Result<Tensor> {
    let (dy, x, weight, rstd) = (
        dy.contiguous()?,
        x.contiguous()?,
        weight.contiguous()?,
        rstd.contiguous()?,
    );
    let (n, d) = rows_of(&x)?;
    expect(&dy, x.dims(), "rms_norm_backward dy", x.device())?;
    expect(&weight, &[d], "rms_norm_backward weight", x.device())?;
    expect(&rstd, &[n], "rms_norm_backward rstd", x.device())?;
    let dev = device(&x)?;
    let dx = alloc(&dev, n * d)?;
    let (dyi, xi, wi, ri) = (input(&dy)?, input(&x)?, input(&weight)?, input(&rstd)?);
    let (dyv, xv, wv, rv) = (
        dyi.view::<f32>()?,
        xi.view::<f32>()?,
        wi.view::<f32>()?,
        ri.view::<f32>()?,
    );
    let d64 = d as i64;
    let func = dev.get_or_load_custom_func("rms_norm_backward_f32", MODULE, PTX)?;
    let mut b = func.builder();
    b.arg(&dyv).arg(&xv).arg(&wv).arg(&rv).arg(&dx).arg(&d64);
    run(b, rows(row_count(n)?))?;
    Ok(tensor(&dev, dx, x.shape().clone()))
}

/// Rotate-half RoPE of `x (n, heads, head_dim)` by `cos`/`sin (n, head_dim/2)`; `sign`
/// -1 rotates back (the backward pass).
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor, sign: f32) -> Result<Tensor> {
    let (x, cos, sin) = (x.contiguous()?, cos.contiguous()?, sin.contiguous()?);
    let (n, heads, hd) = x.dims3()?;
    if hd % 2 != 0 {
        bail!("rope: odd head width {hd}");
    }
    expect(&cos, &[n, hd / 2], "rope cos", x.device())?;
    expect(&sin, &[n, hd / 2], "rope sin", x.device())?;
    let dev = device(&x)?;
    let y = alloc(&dev, n * heads * hd)?;
    let (xi, ci, si) = (input(&x)?, input(&cos)?, input(&sin)?);
    let (xv, cv, sv) = (xi.view::<f32>()?, ci.view::<f32>()?, si.view::<f32>()?);
    let (n64, h64, hd64) = (n as i64, heads as i64, hd as i64);
    let func = dev.get_or_load_custom_func("rope_f32", MODULE, PTX)?;
    let mut b = func.builder();
    b.arg(&xv)
        .arg(&cv)
        .arg(&sv)
        .arg(&y)
        .arg(&n64)
        .arg(&h64)
        .arg(&hd64)
        .arg(&sign);
    run(b, elements(n * heads * hd / 2))?;
    Ok(tensor(&dev, y, (n, heads, hd)))
}

/// `silu(gate) * up` of the stacked `gate_up (n, 2f)`: `(n, f)`.
pub fn swiglu(gate_up: &Tensor) -> Result<Tensor> {
    let gate_up = gate_up.contiguous()?;
    let (n, f2) = gate_up.dims2()?;
    if f2 % 2 != 0 {
        bail!("swiglu: odd stacked width {f2}");
    }
    let f = f2 / 2;
    let dev = device(&gate_up)?;
    let y = alloc(&dev, n * f)?;
    let gi = input(&gate_up)?;
    let gv = gi.view::<f32>()?;
    let (n64, f64_) = (n as i64, f as i64);
    let func = dev.get_or_load_custom_func("swiglu_f32", MODULE, PTX)?;
    let mut b = func.builder();
    b.arg(&gv).arg(&y).arg(&n64).arg(&f64_);
    run(b, elements(n * f))?;
    Ok(tensor(&dev, y, (n, f)))
}

/// The gradient `[dgate | dup] (n, 2f)` of [`swiglu`] from `dy (n, f)`.
pub fn swiglu_backward(dy: &Tensor, gate_up: &Tensor) -> Result<Tensor> {
    let (dy, gate_up) = (dy.contiguous()?, gate_up.contiguous()?);
    let (n, f2) = gate_up.dims2()?;
    if f2 % 2 != 0 {
        bail!("swiglu_backward: odd stacked width {f2}");
    }
    let f = f2 / 2;
    expect(&dy, &[n, f], "swiglu_backward dy", gate_up.device())?;
    let dev = device(&gate_up)?;
    let dgu = alloc(&dev, n * f2)?;
    let (di, gi) = (input(&dy)?, input(&gate_up)?);
    let (dv, gv) = (di.view::<f32>()?, gi.view::<f32>()?);
    let (n64, f64_) = (n as i64, f as i64);
    let func = dev.get_or_load_custom_func("swiglu_backward_f32", MODULE, PTX)?;
    let mut b = func.builder();
    b.arg(&dv).arg(&gv).arg(&dgu).arg(&n64).arg(&f64_);
    run(b, elements(n * f))?;
    Ok(tensor(&dev, dgu, (n, f2)))
}

/// Causal softmax of the unscaled `scores (.., group*tq, tk)`: row `g*tq + i` is query `i`
/// at position `tk - tq + i`; `softmax(scale * s)` over the keys it sees, 0 beyond.
pub fn causal_softmax(scores: &Tensor, tq: usize, scale: f64) -> Result<Tensor> {
    let scores = scores.contiguous()?;
    let (n, tk) = rows_of(&scores)?;
    if tq == 0 || tq > tk || n % tq != 0 {
        bail!("causal softmax: {n} rows of {tk} keys do not hold queries of {tq}");
    }
    let dev = device(&scores)?;
    let p = alloc(&dev, n * tk)?;
    let si = input(&scores)?;
    let sv = si.view::<f32>()?;
    let (tq64, tk64, scale32) = (tq as i64, tk as i64, scale as f32);
    let func = dev.get_or_load_custom_func("causal_softmax_f32", MODULE, PTX)?;
    let mut b = func.builder();
    b.arg(&sv).arg(&p).arg(&tq64).arg(&tk64).arg(&scale32);
    run(b, rows(row_count(n)?))?;
    Ok(tensor(&dev, p, scores.shape().clone()))
}

/// The gradient of the scaled scores from the softmax `p` and its gradient `dp`:
/// `scale * p * (dp - sum(dp * p))` per row.
pub fn softmax_backward(p: &Tensor, dp: &Tensor, scale: f64) -> Result<Tensor> {
    let (p, dp) = (p.contiguous()?, dp.contiguous()?);
    let (n, cols) = rows_of(&p)?;
    expect(&dp, p.dims(), "softmax_backward dp", p.device())?;
    let dev = device(&p)?;
    let ds = alloc(&dev, n * cols)?;
    let (pi, di) = (input(&p)?, input(&dp)?);
    let (pv, dv) = (pi.view::<f32>()?, di.view::<f32>()?);
    let (c64, scale32) = (cols as i64, scale as f32);
    let func = dev.get_or_load_custom_func("softmax_backward_f32", MODULE, PTX)?;
    let mut b = func.builder();
    b.arg(&pv).arg(&dv).arg(&ds).arg(&c64).arg(&scale32);
    run(b, rows(row_count(n)?))?;
    Ok(tensor(&dev, ds, p.shape().clone()))
}

/// Log-probabilities of `targets (n, k)` (u32) under `logits (n, V)`:
/// `(lp (n, k), lse (n,))`. A target outside the vocabulary gets NaN.
pub fn logprobs_at(logits: &Tensor, targets: &Tensor) -> Result<(Tensor, Tensor)> {
    let (logits, targets) = (
        logits.contiguous()?,
        targets.to_dtype(DType::U32)?.contiguous()?,
    );
    let (n, v) = logits.dims2()?;
    let k = targets.dim(1)?;
    expect(&targets, &[n, k], "logprobs_at targets", logits.device())?;
    let dev = device(&logits)?;
    let (lp, lse) = (alloc(&dev, n * k)?, alloc(&dev, n)?);
    let (li, ti) = (input(&logits)?, input(&targets)?);
    let (lv, tv) = (li.view::<f32>()?, ti.view::<u32>()?);
    let (v64, k64) = (v as i64, k as i64);
    let func = dev.get_or_load_custom_func("logprobs_at_f32", MODULE, PTX)?;
    let mut b = func.builder();
    b.arg(&lv).arg(&tv).arg(&lp).arg(&lse).arg(&v64).arg(&k64);
    run(b, rows(row_count(n)?))?;
    Ok((tensor(&dev, lp, (n, k)), tensor(&dev, lse, n)))
}

/// Gradient of [`logprobs_at`] w.r.t. the logits from `d (n, k)`:
/// `scatter(d at targets) - softmax * sum_k d`.
pub fn logprobs_at_backward(
    logits: &Tensor,
    lse: &Tensor,
    targets: &Tensor,
    d: &Tensor,
) -> Result<Tensor> {
    let (logits, lse) = (logits.contiguous()?, lse.contiguous()?);
    let (targets, d) = (targets.to_dtype(DType::U32)?.contiguous()?, d.contiguous()?);
    let (n, v) = logits.dims2()?;
    let k = targets.dim(1)?;
    expect(
        &targets,
        &[n, k],
        "logprobs_at_backward targets",
        logits.device(),
    )?;
    expect(&d, &[n, k], "logprobs_at_backward d", logits.device())?;
    if lse.elem_count() != n || !lse.device().same_device(logits.device()) {
        bail!("logprobs_at_backward: lse of {:?} for {n} rows", lse.dims());
    }
    let dev = device(&logits)?;
    let dl = alloc(&dev, n * v)?;
    let (li, si, ti, di) = (input(&logits)?, input(&lse)?, input(&targets)?, input(&d)?);
    let (lv, sv, tv, dv) = (
        li.view::<f32>()?,
        si.view::<f32>()?,
        ti.view::<u32>()?,
        di.view::<f32>()?,
    );
    let (v64, k64) = (v as i64, k as i64);
    let func = dev.get_or_load_custom_func("logprobs_at_backward_f32", MODULE, PTX)?;
    let mut b = func.builder();
    b.arg(&lv)
        .arg(&sv)
        .arg(&tv)
        .arg(&dv)
        .arg(&dl)
        .arg(&v64)
        .arg(&k64);
    run(b, rows(row_count(n)?))?;
    Ok(tensor(&dev, dl, (n, v)))
}

/// The most keys [`decode_attention`] attends to: its scores live in shared memory, which
/// holds 48 KiB per block without opting in to more.
pub const DECODE_MAX_KEYS: usize = 12_000;

/// One decode step of attention for `n` sequences of one new token each, in one launch:
/// writes row `len` of each sequence's `(k_buf, v_buf, len)` (`(capacity, kv_heads*hd)`
/// buffers, `len < capacity`) from its row of `k_new` / `v_new` (`(n, kv_heads*hd)`), in
/// place, and returns each query row of `q` (`(n, heads*hd)`) attended to its sequence's
/// rows `0..=len`, `(n, heads*hd)`: what [`super::ops::attention`] computes for a query
/// at the end of its keys.
///
/// The buffers are written in place: each must belong to one sequence's cache alone, as
/// `kv::KvCache` guarantees.
pub fn decode_attention(
    q: &Tensor,
    k_new: &Tensor,
    v_new: &Tensor,
    caches: &[(&Tensor, &Tensor, usize)],
    heads: usize,
    kv_heads: usize,
) -> Result<Tensor> {
    let (n, qd) = q.dims2()?;
    if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) || !qd.is_multiple_of(heads) {
        bail!("decode attention: {heads} heads over {kv_heads} KV heads of width {qd}");
    }
    let hd = qd / heads;
    let kvd = kv_heads * hd;
    expect(k_new, &[n, kvd], "decode_attention new keys", q.device())?;
    expect(v_new, &[n, kvd], "decode_attention new values", q.device())?;
    if caches.len() != n {
        bail!(
            "decode attention: {n} queries, {} caches, new keys {:?}",
            caches.len(),
            k_new.dims()
        );
    }
    let mut most = 0;
    for (k, v, len) in caches {
        let (cap, width) = k.dims2()?;
        expect(v, &[cap, width], "decode_attention value cache", q.device())?;
        expect(k, &[cap, width], "decode_attention key cache", q.device())?;
        if width != kvd || *len >= cap || *len + 1 > DECODE_MAX_KEYS {
            bail!(
                "decode attention: a cache of {:?} holding {len} rows",
                k.dims()
            );
        }
        most = most.max(*len + 1);
    }
    let (q, k_new, v_new) = (q.contiguous()?, k_new.contiguous()?, v_new.contiguous()?);
    let dev = device(&q)?;
    let stream = dev.cuda_stream();
    let buffers: Vec<(Input<'_>, Input<'_>)> = caches
        .iter()
        .map(|(k, v, _)| Ok((input(k)?, input(v)?)))
        .collect::<Result<_>>()?;
    let views: Vec<(CudaView<'_, f32>, CudaView<'_, f32>)> = buffers
        .iter()
        .map(|(k, v)| Ok((k.view::<f32>()?, v.view::<f32>()?)))
        .collect::<Result<_>>()?;
    // The pointers stay valid while the views (and their storage locks) live, past the
    // launch; the guards record the buffers' use on the stream when dropped.
    let mut guards = Vec::with_capacity(2 * n);
    let (mut k_ptrs, mut v_ptrs) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for (k, v) in &views {
        let (kp, kg) = k.device_ptr(&stream);
        let (vp, vg) = v.device_ptr(&stream);
        k_ptrs.push(kp);
        v_ptrs.push(vp);
        guards.push(kg);
        guards.push(vg);
    }
    let lens: Vec<i64> = caches.iter().map(|(_, _, len)| *len as i64).collect();
    let k_ptrs = stream.clone_htod(&k_ptrs).w()?;
    let v_ptrs = stream.clone_htod(&v_ptrs).w()?;
    let lens = stream.clone_htod(&lens).w()?;
    let out = alloc(&dev, n * qd)?;
    let (qi, ki, vi) = (input(&q)?, input(&k_new)?, input(&v_new)?);
    let (qv, kv, vv) = (qi.view::<f32>()?, ki.view::<f32>()?, vi.view::<f32>()?);
    let (h64, kvh64, hd64) = (heads as i64, kv_heads as i64, hd as i64);
    let scale = 1.0 / (hd as f32).sqrt();
    let func = dev.get_or_load_custom_func("decode_attention_f32", MODULE, PTX)?;
    let mut b = func.builder();
    b.arg(&qv)
        .arg(&kv)
        .arg(&vv)
        .arg(&k_ptrs)
        .arg(&v_ptrs)
        .arg(&lens)
        .arg(&out);
    b.arg(&h64).arg(&kvh64).arg(&hd64).arg(&scale);
    let cfg = LaunchConfig {
        grid_dim: (row_count(n)? as u32, heads as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: (most * std::mem::size_of::<f32>()) as u32,
    };
    run(b, cfg)?;
    drop(guards);
    Ok(tensor(&dev, out, (n, qd)))
}
