//! AdamW with explicit state, step for step what `torch.optim.AdamW` does (decoupled
//! weight decay, bias correction), with optional global-norm clipping as
//! `torch.nn.utils.clip_grad_norm_`. The state is plain tensors, so it saves and loads
//! bit-exactly next to the adapter.

use std::collections::BTreeMap;

use candle_core::{DType, Tensor};
use lathe_sdk::types::AdamParams;

#[cfg(feature = "cuda")]
use crate::model::cuda;
use crate::model::{Adapter, AdapterGrads, Backend, Target};

use super::TrainError;

/// First and second moments of one parameter tensor.
#[derive(Debug, Clone)]
pub struct Moments {
    /// `exp_avg`.
    pub m: Tensor,
    /// `exp_avg_sq`.
    pub v: Tensor,
}

/// Optimizer state of one adapter.
#[derive(Debug, Clone, Default)]
pub struct AdamState {
    /// Steps taken (for bias correction).
    pub step: u64,
    /// Moments of `(A, B)` by target.
    pub moments: BTreeMap<Target, (Moments, Moments)>,
}

/// What one step reports.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepReport {
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Whether clipping scaled the gradient.
    pub clipped: bool,
    /// The step number just taken.
    pub step: u64,
}

/// Checks that the hyper-parameters are finite and in range.
pub fn validate(p: &AdamParams) -> Result<(), TrainError> {
    let all = [
        ("learning_rate", p.learning_rate),
        ("beta1", p.beta1),
        ("beta2", p.beta2),
        ("eps", p.eps),
        ("weight_decay", p.weight_decay),
        ("grad_clip_norm", p.grad_clip_norm),
    ];
    for (name, v) in all {
        // The update runs in f32: a value finite in f64 but not in f32 is not finite.
        if !(v as f32).is_finite() {
            return Err(TrainError::Input(format!("{name} must be finite, got {v}")));
        }
        if v < 0.0 {
            return Err(TrainError::Input(format!(
                "{name} must not be negative, got {v}"
            )));
        }
    }
    if p.beta1 >= 1.0 || p.beta2 >= 1.0 {
        return Err(TrainError::Input("beta1 and beta2 must be below 1".into()));
    }
    // A parameter whose gradient and second moment are still zero (every LoRA A before
    // its B has moved) is updated by 0 / (0 + eps): eps must be a positive f32, or the
    // adapter turns to NaN.
    if (p.eps as f32) < f32::MIN_POSITIVE {
        return Err(TrainError::Input(format!(
            "eps must be positive (at least {:e}), got {}",
            f32::MIN_POSITIVE,
            p.eps
        )));
    }
    Ok(())
}

/// Global L2 norm of all gradients, summed in f64 wherever they live (f32 gradients on a
/// GPU in one pass of Lathe's kernel, with one copy back, not one per tensor).
pub fn global_norm(grads: &AdapterGrads) -> Result<f64, TrainError> {
    #[cfg(feature = "cuda")]
    {
        let all: Vec<&Tensor> = grads.pairs.values().flat_map(|(a, b)| [a, b]).collect();
        if !all.is_empty() && cuda::enabled() && all.iter().all(|t| cuda::supported(t)) {
            return Ok(cuda::sum_squares(&all)?.sqrt());
        }
    }
    let mut sq = 0.0f64;
    for (da, db) in grads.pairs.values() {
        for g in [da, db] {
            sq += if g.device().is_cpu() && g.dtype() == DType::F32 {
                let v: Vec<f32> = g.flatten_all()?.to_vec1()?;
                v.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>()
            } else {
                g.to_dtype(DType::F64)?
                    .sqr()?
                    .sum_all()?
                    .to_scalar::<f64>()?
            };
        }
    }
    Ok(sq.sqrt())
}

/// The scalars of one step, shared by every parameter.
struct Coefs {
    /// Gradient factor from clipping (1 when not clipped).
    grad_scale: f64,
    /// `1 - lr * weight_decay`.
    decay: f64,
    beta1: f64,
    beta2: f64,
    /// `sqrt(1 - beta2^t)`.
    bc2_sqrt: f64,
    eps: f64,
    /// `lr / (1 - beta1^t)`.
    step_size: f64,
}

impl Coefs {
    /// The scalars as the GPU kernels take them, in f32.
    #[cfg(feature = "cuda")]
    fn on_gpu(&self) -> cuda::AdamwStep {
        let f = |x: f64| x as f32;
        cuda::AdamwStep {
            grad_scale: f(self.grad_scale),
            decay: f(self.decay),
            beta1: f(self.beta1),
            beta2: f(self.beta2),
            bc2_sqrt: f(self.bc2_sqrt),
            eps: f(self.eps),
            step_size: f(self.step_size),
        }
    }
}

/// One parameter tensor's update, in torch's order of operations.
fn update(
    be: Backend,
    param: &mut Tensor,
    grad: &Tensor,
    mom: &mut Moments,
    c: &Coefs,
) -> Result<(), TrainError> {
    if [&*param, grad, &mom.m, &mom.v]
        .into_iter()
        .all(|t| be.host_f32(t))
    {
        return update_host(param, grad, mom, c);
    }
    #[cfg(feature = "cuda")]
    if [&*param, grad, &mom.m, &mom.v]
        .into_iter()
        .all(|t| be.cuda(t))
    {
        (*param, mom.m, mom.v) = cuda::adamw(param, grad, &mom.m, &mom.v, &c.on_gpu())?;
        return Ok(());
    }
    let g = (grad * c.grad_scale)?;
    let decayed = (&*param * c.decay)?;
    mom.m = ((&mom.m * c.beta1)? + (&g * (1.0 - c.beta1))?)?;
    mom.v = ((&mom.v * c.beta2)? + (g.sqr()? * (1.0 - c.beta2))?)?;
    let denom = ((mom.v.sqrt()? / c.bc2_sqrt)? + c.eps)?;
    *param = (decayed - ((&mom.m / denom)? * c.step_size)?)?;
    Ok(())
}

/// The step of every parameter in one launch of Lathe's kernel (`cuda::adamw_many`),
/// where the device backend runs on a GPU and every tensor involved is f32 there: an
/// adapter's hundreds of small parameters cost one launch instead of one each. `false`
/// (nothing done) otherwise.
#[cfg(feature = "cuda")]
fn step_on_gpu(
    be: Backend,
    adapter: &mut Adapter,
    state: &mut AdamState,
    grads: &AdapterGrads,
    c: &Coefs,
) -> Result<bool, TrainError> {
    let mut items = Vec::with_capacity(2 * grads.pairs.len());
    for (target, (da, db)) in &grads.pairs {
        let (pair, (ma, mb)) = (&adapter.pairs[target], &state.moments[target]);
        items.push((&pair.a, da, &ma.m, &ma.v));
        items.push((&pair.b, db, &mb.m, &mb.v));
    }
    let on_gpu = |&(p, g, m, v): &cuda::AdamwTensors<'_>| [p, g, m, v].iter().all(|t| be.cuda(t));
    if items.is_empty() || !items.iter().all(on_gpu) {
        return Ok(false);
    }
    let mut updated = cuda::adamw_many(&items, &c.on_gpu())?.into_iter();
    for target in grads.pairs.keys() {
        let pair = adapter
            .pairs
            .get_mut(target)
            .expect("checked by the caller");
        let moments = state.moments.get_mut(target).expect("made by the caller");
        for (param, mom) in [(&mut pair.a, &mut moments.0), (&mut pair.b, &mut moments.1)] {
            let (p, m, v) = updated.next().expect("one result per parameter");
            (*param, mom.m, mom.v) = (p, m, v);
        }
    }
    Ok(true)
}

/// [`update`] as one loop over plain buffers: through candle it is a dozen tensor ops per
/// parameter, and an adapter has hundreds of small parameters (420 for SmolLM2's seven
/// projections), so per-op overhead dominated the step.
fn update_host(
    param: &mut Tensor,
    grad: &Tensor,
    mom: &mut Moments,
    c: &Coefs,
) -> Result<(), TrainError> {
    let host = |t: &Tensor| -> candle_core::Result<Vec<f32>> { t.flatten_all()?.to_vec1() };
    let (mut p, g, mut m, mut v) = (host(param)?, host(grad)?, host(&mom.m)?, host(&mom.v)?);
    let f = |x: f64| x as f32;
    let (gs, decay, b1, b2) = (f(c.grad_scale), f(c.decay), f(c.beta1), f(c.beta2));
    let (one_b1, one_b2) = (f(1.0 - c.beta1), f(1.0 - c.beta2));
    let (bc2_sqrt, eps, step_size) = (f(c.bc2_sqrt), f(c.eps), f(c.step_size));
    for (((p, &g), m), v) in p.iter_mut().zip(&g).zip(&mut m).zip(&mut v) {
        let g = g * gs;
        *m = *m * b1 + g * one_b1;
        *v = *v * b2 + g * g * one_b2;
        let denom = v.sqrt() / bc2_sqrt + eps;
        *p = *p * decay - *m / denom * step_size;
    }
    let shape = param.dims().to_vec();
    let back = |x: Vec<f32>| Tensor::from_vec(x, shape.as_slice(), param.device());
    mom.m = back(m)?;
    mom.v = back(v)?;
    *param = back(p)?;
    Ok(())
}

/// Applies one AdamW step to `adapter` with the accumulated `grads`, computed as the
/// model's `backend` computes (one loop over plain buffers on the CPU backend; on the
/// device backend Lathe's fused kernel on a GPU, candle's ops elsewhere).
///
/// Targets without a gradient are left alone, as torch skips parameters whose `.grad` is
/// `None`.
pub fn step(
    backend: Backend,
    adapter: &mut Adapter,
    state: &mut AdamState,
    grads: &AdapterGrads,
    p: &AdamParams,
) -> Result<StepReport, TrainError> {
    validate(p)?;
    let grad_norm = global_norm(grads)?;
    let mut scale = 1.0f64;
    let mut clipped = false;
    if p.grad_clip_norm > 0.0 {
        let coef = p.grad_clip_norm / (grad_norm + 1e-6);
        if coef < 1.0 {
            scale = coef;
            clipped = true;
        }
    }
    state.step += 1;
    let t = state.step as i32;
    let bc1 = 1.0 - p.beta1.powi(t);
    let coefs = Coefs {
        grad_scale: scale,
        decay: 1.0 - p.learning_rate * p.weight_decay,
        beta1: p.beta1,
        beta2: p.beta2,
        bc2_sqrt: (1.0 - p.beta2.powi(t)).sqrt(),
        eps: p.eps,
        step_size: p.learning_rate / bc1,
    };
    // Moments for every target first (zeros at its first step).
    for target in grads.pairs.keys() {
        let pair = adapter.pairs.get(target).ok_or_else(|| {
            TrainError::Input(format!("gradient for {target:?}, which the adapter lacks"))
        })?;
        if !state.moments.contains_key(target) {
            let zero = |t: &Tensor| -> candle_core::Result<Moments> {
                Ok(Moments {
                    m: t.zeros_like()?,
                    v: t.zeros_like()?,
                })
            };
            state
                .moments
                .insert(*target, (zero(&pair.a)?, zero(&pair.b)?));
        }
    }
    #[cfg(feature = "cuda")]
    if step_on_gpu(backend, adapter, state, grads, &coefs)? {
        return Ok(StepReport {
            grad_norm,
            clipped,
            step: state.step,
        });
    }
    for (target, (da, db)) in &grads.pairs {
        let pair = adapter.pairs.get_mut(target).expect("checked above");
        let entry = state.moments.get_mut(target).expect("made above");
        update(backend, &mut pair.a, da, &mut entry.0, &coefs)?;
        update(backend, &mut pair.b, db, &mut entry.1, &coefs)?;
    }
    Ok(StepReport {
        grad_norm,
        clipped,
        step: state.step,
    })
}
