//! AdamW with explicit state, step for step what `torch.optim.AdamW` does (decoupled
//! weight decay, bias correction), with optional global-norm clipping as
//! `torch.nn.utils.clip_grad_norm_`. The state is plain tensors, so it saves and loads
//! bit-exactly next to the adapter.

use std::collections::BTreeMap;

use candle_core::Tensor;
use lathe_sdk::types::AdamParams;

use crate::model::{Adapter, AdapterGrads, Target};

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
        if !v.is_finite() {
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
    Ok(())
}

/// Global L2 norm of all gradients.
pub fn global_norm(grads: &AdapterGrads) -> Result<f64, TrainError> {
    let mut sq = 0.0f64;
    for (da, db) in grads.pairs.values() {
        for g in [da, db] {
            sq += g
                .sqr()?
                .sum_all()?
                .to_dtype(candle_core::DType::F64)?
                .to_scalar::<f64>()?;
        }
    }
    Ok(sq.sqrt())
}

/// Applies one AdamW step to `adapter` with the accumulated `grads`.
///
/// Targets without a gradient are left alone, as torch skips parameters whose `.grad` is
/// `None`.
pub fn step(
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
    let bc2 = 1.0 - p.beta2.powi(t);
    let step_size = p.learning_rate / bc1;
    let bc2_sqrt = bc2.sqrt();
    for (target, (da, db)) in &grads.pairs {
        let pair = adapter.pairs.get_mut(target).ok_or_else(|| {
            TrainError::Input(format!("gradient for {target:?}, which the adapter lacks"))
        })?;
        let entry = match state.moments.get_mut(target) {
            Some(e) => e,
            None => {
                let zero = |t: &Tensor| -> candle_core::Result<Moments> {
                    Ok(Moments {
                        m: t.zeros_like()?,
                        v: t.zeros_like()?,
                    })
                };
                let fresh = (zero(&pair.a)?, zero(&pair.b)?);
                state.moments.entry(*target).or_insert(fresh)
            }
        };
        for (param, grad, mom) in [
            (&mut pair.a, da, &mut entry.0),
            (&mut pair.b, db, &mut entry.1),
        ] {
            let g = if clipped {
                (grad * scale)?
            } else {
                grad.clone()
            };
            let decayed = if p.weight_decay != 0.0 {
                (&*param * (1.0 - p.learning_rate * p.weight_decay))?
            } else {
                param.clone()
            };
            mom.m = ((&mom.m * p.beta1)? + (&g * (1.0 - p.beta1))?)?;
            mom.v = ((&mom.v * p.beta2)? + (g.sqr()? * (1.0 - p.beta2))?)?;
            let denom = ((mom.v.sqrt()? / bc2_sqrt)? + p.eps)?;
            *param = (decayed - ((&mom.m / denom)? * step_size)?)?;
        }
    }
    Ok(StepReport {
        grad_norm,
        clipped,
        step: state.step,
    })
}
