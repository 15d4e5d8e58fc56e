//! The optimizer's kernels: the gradient norm and the AdamW step. An adapter has hundreds
//! of small parameters (420 for SmolLM2's seven projections), so both run over all of
//! them in one launch, each tensor found through a table of device pointers, instead of
//! one launch per tensor.

use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaView, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, Result, Tensor};

use super::{alloc, device, elements, expect, input, run, tensor, Input, MODULE, PTX, THREADS};

/// Most tensors one launch takes: a CUDA grid's second dimension.
const MAX_TENSORS: usize = 65_535;

/// `sum(x^2)` over every element of `tensors` (f32, on one GPU), accumulated in f64: one
/// launch, one block per tensor, and one copy back.
pub fn sum_squares(tensors: &[&Tensor]) -> Result<f64> {
    let Some(first) = tensors.first() else {
        return Ok(0.0);
    };
    if tensors.len() > MAX_TENSORS {
        bail!("sum_squares: {} tensors in one launch", tensors.len());
    }
    let dev = device(first)?;
    let stream = dev.cuda_stream();
    let contiguous: Vec<Tensor> = tensors
        .iter()
        .map(|t| {
            expect(t, t.dims(), "sum_squares", first.device())?;
            t.contiguous()
        })
        .collect::<Result<_>>()?;
    let inputs: Vec<Input<'_>> = contiguous.iter().map(input).collect::<Result<_>>()?;
    let views: Vec<CudaView<'_, f32>> = inputs
        .iter()
        .map(|i| i.view::<f32>())
        .collect::<Result<_>>()?;
    // The pointers stay valid while the views (and their storage locks) live, past the
    // launch; the guards record the buffers' use on the stream when dropped.
    let mut guards = Vec::with_capacity(views.len());
    let mut ptrs = Vec::with_capacity(views.len());
    for v in &views {
        let (p, g) = v.device_ptr(&stream);
        ptrs.push(p);
        guards.push(g);
    }
    let lens: Vec<i64> = contiguous.iter().map(|t| t.elem_count() as i64).collect();
    let ptrs = stream.clone_htod(&ptrs).w()?;
    let lens = stream.clone_htod(&lens).w()?;
    let mut partial = dev.alloc_zeros::<f64>(tensors.len())?;
    let func = dev.get_or_load_custom_func("sum_squares_many_f32", MODULE, PTX)?;
    let mut b = func.builder();
    b.arg(&ptrs).arg(&lens).arg(&mut partial);
    run(
        b,
        LaunchConfig {
            grid_dim: (tensors.len() as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        },
    )?;
    drop(guards);
    let host = stream.clone_dtoh(&partial).w()?;
    Ok(host.iter().sum())
}

/// The scalars of one AdamW step (see `train::adamw`), in the f32 the update computes in.
#[derive(Clone, Copy, Debug)]
pub struct AdamwStep {
    /// Gradient factor from clipping (1 when not clipped).
    pub grad_scale: f32,
    /// `1 - lr * weight_decay`.
    pub decay: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// `sqrt(1 - beta2^t)`.
    pub bc2_sqrt: f32,
    /// Added to the denominator.
    pub eps: f32,
    /// `lr / (1 - beta1^t)`.
    pub step_size: f32,
}

impl AdamwStep {
    fn push<'a>(&'a self, b: &mut candle_core::cuda_backend::cudarc::driver::LaunchArgs<'a>) {
        b.arg(&self.grad_scale)
            .arg(&self.decay)
            .arg(&self.beta1)
            .arg(&self.beta2);
        b.arg(&self.bc2_sqrt).arg(&self.eps).arg(&self.step_size);
    }
}

/// One AdamW step of `param` with `grad` and moments `m`, `v` (f32, on one GPU, one
/// shape): the new `(param, m, v)`, in fresh tensors. The reference for [`adamw_many`].
pub fn adamw(
    param: &Tensor,
    grad: &Tensor,
    m: &Tensor,
    v: &Tensor,
    s: &AdamwStep,
) -> Result<(Tensor, Tensor, Tensor)> {
    let shape = param.shape().clone();
    for t in [grad, m, v] {
        expect(t, shape.dims(), "adamw", param.device())?;
    }
    let (param, grad, m, v) = (
        param.contiguous()?,
        grad.contiguous()?,
        m.contiguous()?,
        v.contiguous()?,
    );
    let n = shape.elem_count();
    let dev = device(&param)?;
    let (p_out, m_out, v_out) = (alloc(&dev, n)?, alloc(&dev, n)?, alloc(&dev, n)?);
    let (pi, gi, mi, vi) = (input(&param)?, input(&grad)?, input(&m)?, input(&v)?);
    let (pv, gv, mv, vv) = (
        pi.view::<f32>()?,
        gi.view::<f32>()?,
        mi.view::<f32>()?,
        vi.view::<f32>()?,
    );
    let n64 = n as i64;
    let func = dev.get_or_load_custom_func("adamw_f32", MODULE, PTX)?;
    let mut b = func.builder();
    b.arg(&pv)
        .arg(&gv)
        .arg(&mv)
        .arg(&vv)
        .arg(&p_out)
        .arg(&m_out)
        .arg(&v_out)
        .arg(&n64);
    s.push(&mut b);
    run(b, elements(n))?;
    Ok((
        tensor(&dev, p_out, shape.clone()),
        tensor(&dev, m_out, shape.clone()),
        tensor(&dev, v_out, shape),
    ))
}

/// One parameter of [`adamw_many`]: `(param, grad, m, v)`, f32 of one shape.
pub type AdamwTensors<'a> = (&'a Tensor, &'a Tensor, &'a Tensor, &'a Tensor);

/// [`adamw`] of many parameters (on one GPU) in one launch: each one's new `(param, m,
/// v)`, in order, the same numbers [`adamw`] gives, each in its own allocation (a view
/// into a buffer shared by all would make every copy of one parameter to the host copy
/// the whole buffer, as candle copies a view's storage whole).
pub fn adamw_many(
    items: &[AdamwTensors<'_>],
    s: &AdamwStep,
) -> Result<Vec<(Tensor, Tensor, Tensor)>> {
    let Some(&(first, ..)) = items.first() else {
        return Ok(Vec::new());
    };
    if items.len() > MAX_TENSORS {
        bail!("adamw: {} tensors in one launch", items.len());
    }
    let dev = device(first)?;
    let stream = dev.cuda_stream();
    let mut contiguous = Vec::with_capacity(items.len());
    for &(p, g, m, v) in items {
        for t in [g, m, v] {
            expect(t, p.dims(), "adamw", first.device())?;
        }
        contiguous.push([
            p.contiguous()?,
            g.contiguous()?,
            m.contiguous()?,
            v.contiguous()?,
        ]);
    }
    let lens: Vec<usize> = contiguous.iter().map(|c| c[0].elem_count()).collect();
    // The new param, m and v of every parameter; the kernel writes every element.
    let mut outs: Vec<[CudaSlice<f32>; 3]> = lens
        .iter()
        .map(|&n| Ok([alloc(&dev, n)?, alloc(&dev, n)?, alloc(&dev, n)?]))
        .collect::<Result<_>>()?;
    {
        let inputs: Vec<Input<'_>> = contiguous
            .iter()
            .flatten()
            .map(input)
            .collect::<Result<_>>()?;
        let views: Vec<CudaView<'_, f32>> = inputs
            .iter()
            .map(|i| i.view::<f32>())
            .collect::<Result<_>>()?;
        // The pointers stay valid while the views (and their storage locks) and the
        // outputs live, past the launch; the guards record the buffers' use on the
        // stream when dropped.
        let mut read_guards = Vec::with_capacity(views.len());
        let mut write_guards = Vec::with_capacity(3 * outs.len());
        // Seven pointers per parameter: param, grad, m, v, then its new param, m, v.
        let mut ptrs = Vec::with_capacity(7 * items.len());
        for (ins, out) in views.chunks_exact(4).zip(&mut outs) {
            for v in ins {
                let (p, g) = v.device_ptr(&stream);
                ptrs.push(p);
                read_guards.push(g);
            }
            for o in out.iter_mut() {
                let (p, g) = o.device_ptr_mut(&stream);
                ptrs.push(p);
                write_guards.push(g);
            }
        }
        let lens64: Vec<i64> = lens.iter().map(|&n| n as i64).collect();
        let ptrs = stream.clone_htod(&ptrs).w()?;
        let lens64 = stream.clone_htod(&lens64).w()?;
        let longest = lens.iter().copied().max().unwrap_or(0);
        let func = dev.get_or_load_custom_func("adamw_many_f32", MODULE, PTX)?;
        let mut b = func.builder();
        b.arg(&ptrs).arg(&lens64);
        s.push(&mut b);
        run(
            b,
            LaunchConfig {
                grid_dim: (
                    longest.div_ceil(THREADS as usize).clamp(1, 1024) as u32,
                    items.len() as u32,
                    1,
                ),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            },
        )?;
        drop(write_guards);
        drop(read_guards);
    }
    Ok(outs
        .into_iter()
        .zip(&contiguous)
        .map(|([p, m, v], c)| {
            let shape = c[0].shape();
            (
                tensor(&dev, p, shape.clone()),
                tensor(&dev, m, shape.clone()),
                tensor(&dev, v, shape.clone()),
            )
        })
        .collect())
}
