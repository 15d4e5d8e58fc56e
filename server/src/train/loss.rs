//! Tinker's built-in losses, as functions of the target log-probabilities.
//!
//! Every built-in loss is a sum over tokens of a term that depends on one token's
//! log-probability `lp` and that token's inputs. So a loss is evaluated here on plain
//! numbers, giving the value, the per-token terms (`elementwise_loss`) and `dLoss/dlp`;
//! the model's backward pass takes it from there. Sums, not means: users scale weights
//! and advantages themselves. The ratio `exp(lp - q)` is computed in f64, so it does not
//! overflow for any log-ratio an f32 model can produce.

use std::sync::Arc;

use super::custom::{Array, CustomLoss, Kind};
use super::TrainError;

/// Default PPO clip bounds on the ratio (Tinker's documented epsilon 0.2).
pub const DEFAULT_CLIP_LOW: f64 = 0.8;
/// See [`DEFAULT_CLIP_LOW`].
pub const DEFAULT_CLIP_HIGH: f64 = 1.2;
/// Default CISPO bounds: one-sided, as Tinker documents them (0 below, 4 above).
pub const DEFAULT_CISPO_CLIP_LOW: f64 = 0.0;
/// See [`DEFAULT_CISPO_CLIP_LOW`].
pub const DEFAULT_CISPO_CLIP_HIGH: f64 = 4.0;
/// Default GSPO bounds on the sequence ratio: the GSPO paper's epsilons (3e-4 below,
/// 4e-4 above); Tinker's own defaults could not be read from its docs or SDK. Sequence
/// ratios sit far closer to 1 than token ratios, hence bounds this tight.
pub const DEFAULT_GSPO_CLIP_LOW: f64 = 1.0 - 3e-4;
/// See [`DEFAULT_GSPO_CLIP_LOW`].
pub const DEFAULT_GSPO_CLIP_HIGH: f64 = 1.0 + 4e-4;
/// Default DRO penalty (undocumented by Tinker; tuft's value).
pub const DEFAULT_DRO_BETA: f64 = 0.01;

/// Which loss, with its configuration.
#[derive(Debug, Clone, PartialEq)]
pub enum Loss {
    /// `-sum w * lp`.
    CrossEntropy,
    /// `-sum r * A`, `r = exp(lp - q)`.
    ImportanceSampling,
    /// `-sum min(r A, clip(r, lo, hi) A)`.
    Ppo {
        /// Lower ratio bound.
        clip_low: f64,
        /// Upper ratio bound.
        clip_high: f64,
    },
    /// `-sum sg(clip(r, lo, hi)) * lp * A`.
    Cispo {
        /// Lower ratio bound.
        clip_low: f64,
        /// Upper ratio bound.
        clip_high: f64,
    },
    /// GSPO-token: `-sum min(s_t A, clip(s_t, lo, hi) A)` where every token's ratio has
    /// the value of the datum's sequence ratio `s = exp(mean over M of (lp - q))` and the
    /// gradient of its own log-probability (`s_t = sg(s) exp(lp_t - sg(lp_t))`). `M` is
    /// the positions `sequence_ratio_mask` marks, or, without a mask, those with a
    /// non-zero advantage (the sampled tokens: prompt positions carry zero advantages and
    /// placeholder sampler log-probs, which must not enter the mean).
    Gspo {
        /// Lower bound on the sequence ratio.
        clip_low: f64,
        /// Upper bound on the sequence ratio.
        clip_high: f64,
    },
    /// `-sum (lp A - beta/2 (lp - q)^2)`.
    Dro {
        /// Penalty weight.
        beta: f64,
    },
    /// A loss the client created with `create_custom_loss`: any function of the datum's
    /// target log-probabilities and inputs that its graph spells out.
    Custom(CustomLossRef),
}

/// A shared compiled custom loss; two are equal when they are the same loss.
#[derive(Clone)]
pub struct CustomLossRef(pub Arc<CustomLoss>);

impl PartialEq for CustomLossRef {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl std::fmt::Debug for CustomLossRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CustomLoss({:?})", self.0.name())
    }
}

impl Loss {
    /// The configured ratio bounds of a clipped loss.
    pub fn clip_bounds(&self) -> Option<(f64, f64)> {
        match *self {
            Loss::Ppo {
                clip_low,
                clip_high,
            }
            | Loss::Cispo {
                clip_low,
                clip_high,
            }
            | Loss::Gspo {
                clip_low,
                clip_high,
            } => Some((clip_low, clip_high)),
            _ => None,
        }
    }

    /// Whether the loss needs sampler log-probs and advantages.
    pub fn is_rl(&self) -> bool {
        !matches!(self, Loss::CrossEntropy | Loss::Custom(_))
    }
}

/// The per-token inputs of one datum, already checked to have the right lengths.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TokenInputs {
    /// Cross-entropy weights, one per target (`rows * k`).
    pub weights: Vec<f32>,
    /// Advantages (RL losses).
    pub advantages: Vec<f32>,
    /// Sampler log-probabilities `q` (RL losses).
    pub sampler_logprobs: Vec<f32>,
    /// Per-token lower clip bound overriding the config.
    pub clip_low: Option<Vec<f32>>,
    /// Per-token upper clip bound overriding the config.
    pub clip_high: Option<Vec<f32>>,
    /// GSPO: which positions the sequence ratio averages over (non-zero: included).
    pub sequence_ratio_mask: Option<Vec<f32>>,
    /// A custom loss's inputs.
    pub custom: Option<CustomInputs>,
}

/// What a custom loss reads besides the log-probabilities.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CustomInputs {
    /// The shape `logprobs` takes: the datum's `target_tokens` shape.
    pub logprobs_shape: Vec<usize>,
    /// The loss's other inputs, in its declaration order.
    pub inputs: Vec<Array>,
}

impl TokenInputs {
    /// Checks that `loss` has what it needs for `n` targets, and that every value is
    /// finite. The messages name the offending input.
    pub fn validate(&self, loss: &Loss, n: usize) -> Result<(), TrainError> {
        let check = |name: &str, v: &[f32], required: bool| -> Result<(), TrainError> {
            if v.is_empty() && required {
                return Err(TrainError::Input(format!(
                    "loss requires loss_fn_inputs[{name:?}]"
                )));
            }
            if !v.is_empty() && v.len() != n {
                return Err(TrainError::Input(format!(
                    "{name} has {} values but there are {n} targets",
                    v.len()
                )));
            }
            if let Some(bad) = v.iter().find(|x| !x.is_finite()) {
                return Err(TrainError::Input(format!(
                    "{name} contains a non-finite value ({bad})"
                )));
            }
            Ok(())
        };
        check("weights", &self.weights, *loss == Loss::CrossEntropy)?;
        if let Loss::Custom(custom) = loss {
            let Some(inputs) = &self.custom else {
                return Err(TrainError::Input(format!(
                    "custom loss {:?} has no inputs",
                    custom.0.name()
                )));
            };
            if inputs.logprobs_shape.iter().product::<usize>() != n
                || inputs.inputs.len() + 1 != custom.0.inputs().len()
            {
                return Err(TrainError::Input(format!(
                    "the inputs do not match custom loss {:?}",
                    custom.0.name()
                )));
            }
        }
        check("advantages", &self.advantages, loss.is_rl())?;
        check("logprobs", &self.sampler_logprobs, loss.is_rl())?;
        check(
            "clip_low_threshold",
            self.clip_low.as_deref().unwrap_or(&[]),
            false,
        )?;
        check(
            "clip_high_threshold",
            self.clip_high.as_deref().unwrap_or(&[]),
            false,
        )?;
        check(
            "sequence_ratio_mask",
            self.sequence_ratio_mask.as_deref().unwrap_or(&[]),
            false,
        )?;
        if let Some((lo, hi)) = loss.clip_bounds() {
            for t in 0..n {
                let low = self.clip_low.as_ref().map_or(lo, |v| v[t] as f64);
                let high = self.clip_high.as_ref().map_or(hi, |v| v[t] as f64);
                if !(0.0..=high).contains(&low) {
                    return Err(TrainError::Input(format!(
                        "token {t}: clip bounds must satisfy 0 <= low <= high, got {low} and \
                         {high} (per-token clip_*_threshold inputs meet the loss's config)"
                    )));
                }
            }
        }
        Ok(())
    }
}

/// A loss evaluated on one datum.
#[derive(Debug, Clone, PartialEq)]
pub struct LossEval {
    /// Sum of the per-token terms.
    pub total: f64,
    /// The per-token terms.
    pub elementwise: Vec<f32>,
    /// `dLoss/dlp` per token.
    pub grad: Vec<f32>,
    /// A custom loss's metrics, in its order (empty for the built-in losses).
    pub metrics: Vec<f64>,
    /// Tensor elements a custom loss's evaluation made (0 for the built-in losses).
    pub elements: usize,
}

/// Evaluates `loss` for target log-probs `lp` (inputs already validated for `lp.len()`).
/// `lp` is f64 so that an f64 model (the finite-difference tests) keeps its precision.
/// Only a custom loss can fail here (its graph may not fit the datum's shapes); its
/// per-token terms are its linearisation `dLoss/dlp * lp`.
pub fn evaluate(loss: &Loss, lp: &[f64], inp: &TokenInputs) -> Result<LossEval, TrainError> {
    let Loss::Custom(custom) = loss else {
        return Ok(builtin(loss, lp, inp));
    };
    let inputs = inp.custom.clone().unwrap_or_default();
    let logprobs = Array::new(inputs.logprobs_shape, lp.to_vec(), Kind::Float);
    let out = custom
        .0
        .evaluate(logprobs, inputs.inputs)
        .map_err(|e| TrainError::Input(e.to_string()))?;
    Ok(LossEval {
        total: out.loss,
        elementwise: out
            .grad
            .iter()
            .zip(lp)
            .map(|(g, x)| (g * x) as f32)
            .collect(),
        grad: out.grad.iter().map(|&g| g as f32).collect(),
        metrics: out.metrics,
        elements: out.elements,
    })
}

fn builtin(loss: &Loss, lp: &[f64], inp: &TokenInputs) -> LossEval {
    let n = lp.len();
    let mut elementwise = Vec::with_capacity(n);
    let mut grad = Vec::with_capacity(n);
    let mut total = 0.0f64;
    let bounds = |t: usize, lo: f64, hi: f64| {
        (
            inp.clip_low.as_ref().map_or(lo, |v| v[t] as f64),
            inp.clip_high.as_ref().map_or(hi, |v| v[t] as f64),
        )
    };
    let seq_ratio = match loss {
        Loss::Gspo { .. } => sequence_ratio(lp, inp),
        _ => 1.0,
    };
    for (t, &x) in lp.iter().enumerate() {
        let (l, d) = match *loss {
            Loss::CrossEntropy => {
                let w = inp.weights[t] as f64;
                (-w * x, -w)
            }
            Loss::ImportanceSampling => {
                let (a, r) = rl_terms(inp, t, x);
                (-r * a, -r * a)
            }
            Loss::Ppo {
                clip_low,
                clip_high,
            } => {
                let (a, r) = rl_terms(inp, t, x);
                clipped_surrogate(a, r, bounds(t, clip_low, clip_high))
            }
            // The token's ratio is worth `s` and moves with its own lp as `r` does in
            // PPO (d s_t / d lp_t = s_t), so PPO's branches apply with `s` for `r`.
            Loss::Gspo {
                clip_low,
                clip_high,
            } => {
                let a = inp.advantages[t] as f64;
                clipped_surrogate(a, seq_ratio, bounds(t, clip_low, clip_high))
            }
            Loss::Cispo {
                clip_low,
                clip_high,
            } => {
                let (a, r) = rl_terms(inp, t, x);
                let (lo, hi) = bounds(t, clip_low, clip_high);
                let c = r.max(lo).min(hi);
                (-c * x * a, -c * a)
            }
            Loss::Dro { beta } => {
                let a = inp.advantages[t] as f64;
                let diff = x - inp.sampler_logprobs[t] as f64;
                (-(x * a - 0.5 * beta * diff * diff), -(a - beta * diff))
            }
            Loss::Custom(_) => unreachable!("evaluate runs custom losses"),
        };
        total += l;
        elementwise.push(l as f32);
        grad.push(d as f32);
    }
    LossEval {
        total,
        elementwise,
        grad,
        metrics: Vec::new(),
        elements: 0,
    }
}

/// PPO's clipped objective for one token with advantage `a` and ratio `r` (whose
/// derivative in the token's lp is `r`): the term and `dLoss/dlp`.
fn clipped_surrogate(a: f64, r: f64, (lo, hi): (f64, f64)) -> (f64, f64) {
    // Not `clamp`, which panics on lo > hi: validation refuses such bounds, and a loss
    // must never take down the pass it shares with other requests.
    let clipped = r.max(lo).min(hi);
    let (unclipped_obj, clipped_obj) = (r * a, clipped * a);
    if unclipped_obj <= clipped_obj {
        (-unclipped_obj, -r * a)
    } else {
        // The clipped branch is constant in lp once the ratio is outside the bounds.
        let inside = r > lo && r < hi;
        (-clipped_obj, if inside { -r * a } else { 0.0 })
    }
}

/// GSPO's sequence ratio of one datum: the geometric mean of the token ratios over the
/// masked positions (1 when none are, so that the datum contributes its plain
/// advantages).
fn sequence_ratio(lp: &[f64], inp: &TokenInputs) -> f64 {
    let included = |t: usize| match &inp.sequence_ratio_mask {
        Some(mask) => mask[t] != 0.0,
        None => inp.advantages[t] != 0.0,
    };
    let (sum, count) = (0..lp.len())
        .filter(|&t| included(t))
        .fold((0.0f64, 0usize), |(s, c), t| {
            (s + lp[t] - inp.sampler_logprobs[t] as f64, c + 1)
        });
    if count == 0 {
        1.0
    } else {
        (sum / count as f64).exp()
    }
}

fn rl_terms(inp: &TokenInputs, t: usize, lp: f64) -> (f64, f64) {
    let a = inp.advantages[t] as f64;
    let r = (lp - inp.sampler_logprobs[t] as f64).exp();
    (a, r)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn evaluate(loss: &Loss, lp: &[f64], inp: &TokenInputs) -> LossEval {
        super::evaluate(loss, lp, inp).unwrap()
    }

    /// Direct implementations of each formula on f64, as written in the Tinker docs.
    fn reference(loss: &Loss, lp: &[f64], inp: &TokenInputs) -> f64 {
        let q = |t: usize| inp.sampler_logprobs[t] as f64;
        let a = |t: usize| inp.advantages[t] as f64;
        (0..lp.len())
            .map(|t| match *loss {
                Loss::CrossEntropy => -(inp.weights[t] as f64) * lp[t],
                Loss::ImportanceSampling => -(lp[t] - q(t)).exp() * a(t),
                Loss::Ppo {
                    clip_low,
                    clip_high,
                } => {
                    let r = (lp[t] - q(t)).exp();
                    -f64::min(r * a(t), r.clamp(clip_low, clip_high) * a(t))
                }
                Loss::Cispo { .. } | Loss::Gspo { .. } => {
                    unreachable!("stop-gradients need their own checks")
                }
                Loss::Dro { beta } => -(lp[t] * a(t) - 0.5 * beta * (lp[t] - q(t)).powi(2)),
                Loss::Custom(_) => unreachable!("built-in losses only"),
            })
            .sum()
    }

    fn to64(v: &[f32]) -> Vec<f64> {
        v.iter().map(|&x| x as f64).collect()
    }

    fn inputs() -> (Vec<f32>, TokenInputs) {
        // Ratios exp(lp - q): 1.65 (above 1.2), 0.61 (below 0.8), 1.05 (inside), 0.9, 1.5.
        let lp = vec![-1.0f32, -2.5, -0.7, -3.0, -0.2];
        let q = vec![-1.5f32, -2.0, -0.75, -2.9, -0.6];
        let inp = TokenInputs {
            weights: vec![1.0, 0.5, 0.0, 2.0, 1.0],
            advantages: vec![1.0, 1.0, -0.5, -2.0, -1.0],
            sampler_logprobs: q,
            ..Default::default()
        };
        (lp, inp)
    }

    fn check_against_reference(loss: Loss) {
        let (lp, inp) = inputs();
        let ev = evaluate(&loss, &to64(&lp), &inp);
        let lp64: Vec<f64> = lp.iter().map(|&x| x as f64).collect();
        let want = reference(&loss, &lp64, &inp);
        assert!(
            (ev.total - want).abs() < 1e-6,
            "{loss:?}: {} vs {want}",
            ev.total
        );
        for (t, &g) in ev.grad.iter().enumerate() {
            let h = 1e-6;
            let (mut up, mut down) = (lp64.clone(), lp64.clone());
            up[t] += h;
            down[t] -= h;
            let fd = (reference(&loss, &up, &inp) - reference(&loss, &down, &inp)) / (2.0 * h);
            assert!(
                (g as f64 - fd).abs() < 1e-5 * (1.0 + fd.abs()),
                "{loss:?} token {t}: grad {g} vs finite difference {fd}"
            );
        }
    }

    #[test]
    fn cross_entropy_matches_formula() {
        check_against_reference(Loss::CrossEntropy);
    }

    #[test]
    fn importance_sampling_matches_formula() {
        check_against_reference(Loss::ImportanceSampling);
    }

    #[test]
    fn ppo_matches_formula_with_clipping_on_both_sides() {
        let loss = Loss::Ppo {
            clip_low: DEFAULT_CLIP_LOW,
            clip_high: DEFAULT_CLIP_HIGH,
        };
        check_against_reference(loss.clone());
        let (lp, inp) = inputs();
        let ev = evaluate(&loss, &to64(&lp), &inp);
        // Token 0: ratio 1.65 > 1.2 with A > 0 -> clipped, no gradient.
        assert_eq!(ev.grad[0], 0.0);
        assert!((ev.elementwise[0] - (-1.2)).abs() < 1e-6);
        // Token 1: ratio 0.61 < 0.8 with A > 0 -> min picks the unclipped term.
        assert!(ev.grad[1] != 0.0);
        // Token 3: ratio 0.905 inside -> gradient -r*A.
        let r3 = (-0.1f64).exp();
        assert!((ev.grad[3] as f64 - 2.0 * r3).abs() < 1e-5);
        // Token 4: ratio 1.49 > 1.2 with A < 0 -> unclipped term is smaller, gradient flows.
        assert!(ev.grad[4] != 0.0);
    }

    #[test]
    fn dro_matches_formula() {
        check_against_reference(Loss::Dro { beta: 0.3 });
    }

    #[test]
    fn cispo_value_uses_clipped_ratio_and_gradient_stops_through_it() {
        let loss = Loss::Cispo {
            clip_low: 0.8,
            clip_high: 1.2,
        };
        let (lp, inp) = inputs();
        let ev = evaluate(&loss, &to64(&lp), &inp);
        for (t, &x) in lp.iter().enumerate() {
            let r = ((x - inp.sampler_logprobs[t]) as f64).exp();
            let c = r.clamp(0.8, 1.2);
            let a = inp.advantages[t] as f64;
            assert!((ev.elementwise[t] as f64 - (-c * x as f64 * a)).abs() < 1e-5);
            // Stop-gradient: the derivative is -c*A exactly, not including dc/dlp.
            assert!((ev.grad[t] as f64 - (-c * a)).abs() < 1e-6);
        }
        // Token 2 lies inside the bounds; a loss without stop-gradient would add -r*lp*A.
        let r2 = ((lp[2] - inp.sampler_logprobs[2]) as f64).exp();
        let no_sg = -r2 * 0.5 * (1.0 + lp[2] as f64);
        assert!((ev.grad[2] as f64 - no_sg).abs() > 1e-3);
    }

    /// GSPO-token's surrogate as a function of `lp`, with its stop-gradient parts (the
    /// sequence ratio `s` and the detached `lp`) frozen at `at`: its derivative at `at`
    /// is the loss's gradient.
    fn gspo_surrogate(lp: &[f64], at: &[f64], inp: &TokenInputs, lo: f64, hi: f64) -> f64 {
        let s = sequence_ratio(at, inp);
        (0..lp.len())
            .map(|t| {
                let r = s * (lp[t] - at[t]).exp();
                let a = inp.advantages[t] as f64;
                -f64::min(r * a, r.clamp(lo, hi) * a)
            })
            .sum()
    }

    #[test]
    fn gspo_uses_the_sequence_ratio_and_matches_finite_differences_of_its_surrogate() {
        let (lp, mut inp) = inputs();
        // The first two positions play the prompt: out of the mask.
        inp.sequence_ratio_mask = Some(vec![0.0, 0.0, 1.0, 1.0, 1.0]);
        let lp64 = to64(&lp);
        let q: Vec<f64> = to64(&inp.sampler_logprobs);
        let s = ((2..5).map(|t| lp64[t] - q[t]).sum::<f64>() / 3.0).exp();
        assert!((sequence_ratio(&lp64, &inp) - s).abs() < 1e-12);
        for (lo, hi) in [
            (0.0, 10.0),
            (0.99, 1.01),
            (DEFAULT_GSPO_CLIP_LOW, DEFAULT_GSPO_CLIP_HIGH),
        ] {
            let loss = Loss::Gspo {
                clip_low: lo,
                clip_high: hi,
            };
            let ev = evaluate(&loss, &lp64, &inp);
            let want = gspo_surrogate(&lp64, &lp64, &inp, lo, hi);
            assert!((ev.total - want).abs() < 1e-9, "{} vs {want}", ev.total);
            for t in 0..lp.len() {
                let h = 1e-6;
                let (mut up, mut down) = (lp64.clone(), lp64.clone());
                up[t] += h;
                down[t] -= h;
                let fd = (gspo_surrogate(&up, &lp64, &inp, lo, hi)
                    - gspo_surrogate(&down, &lp64, &inp, lo, hi))
                    / (2.0 * h);
                assert!(
                    (ev.grad[t] as f64 - fd).abs() < 1e-5 * (1.0 + fd.abs()),
                    "bounds ({lo}, {hi}) token {t}: grad {} vs finite difference {fd}",
                    ev.grad[t]
                );
            }
        }
        // Wide bounds: every token's gradient is -s A, whatever its own ratio.
        let wide = evaluate(
            &Loss::Gspo {
                clip_low: 0.0,
                clip_high: 10.0,
            },
            &lp64,
            &inp,
        );
        for t in 0..5 {
            assert!((wide.grad[t] as f64 + s * inp.advantages[t] as f64).abs() < 1e-6);
        }
        // Without a mask the positions with non-zero advantages form the sequence.
        let mut unmasked = inp.clone();
        unmasked.sequence_ratio_mask = None;
        unmasked.advantages[0] = 0.0;
        unmasked.advantages[1] = 0.0;
        assert!((sequence_ratio(&lp64, &unmasked) - s).abs() < 1e-12);
        // An empty mask gives ratio 1, not NaN.
        unmasked.advantages = vec![0.0; 5];
        assert_eq!(sequence_ratio(&lp64, &unmasked), 1.0);
    }

    #[test]
    fn per_token_clip_thresholds_override_the_config() {
        let (lp, mut inp) = inputs();
        inp.clip_low = Some(vec![0.0; 5]);
        inp.clip_high = Some(vec![10.0; 5]);
        let ppo = evaluate(
            &Loss::Ppo {
                clip_low: 0.8,
                clip_high: 1.2,
            },
            &to64(&lp),
            &inp,
        );
        let is = evaluate(&Loss::ImportanceSampling, &to64(&lp), &inp);
        assert_eq!(ppo.grad, is.grad);
    }

    #[test]
    fn per_token_bounds_crossing_the_configured_ones_are_refused_not_a_panic() {
        let (lp, mut inp) = inputs();
        let gspo = Loss::Gspo {
            clip_low: DEFAULT_GSPO_CLIP_LOW,
            clip_high: DEFAULT_GSPO_CLIP_HIGH,
        };
        inp.clip_low = Some(vec![1.1; 5]);
        let err = inp.validate(&gspo, 5).unwrap_err().to_string();
        assert!(err.contains("clip bounds"), "{err}");
        // Evaluated anyway (validation skipped), the loss does not panic.
        let ev = evaluate(&gspo, &to64(&lp), &inp);
        assert!(ev.total.is_finite());
        inp.clip_high = Some(vec![2.0; 5]);
        assert!(inp.validate(&gspo, 5).is_ok());
    }

    #[test]
    fn validation_names_missing_and_mismatched_inputs() {
        let (_, inp) = inputs();
        let ppo = Loss::Ppo {
            clip_low: 0.8,
            clip_high: 1.2,
        };
        assert!(inp.validate(&ppo, 5).is_ok());
        let err = inp.validate(&ppo, 4).unwrap_err().to_string();
        assert!(
            err.contains("has 5 values but there are 4 targets"),
            "{err}"
        );
        let missing = TokenInputs {
            weights: vec![1.0; 5],
            ..Default::default()
        };
        assert!(missing
            .validate(&ppo, 5)
            .unwrap_err()
            .to_string()
            .contains("advantages"));
        let mut nan = inp.clone();
        nan.advantages[2] = f32::NAN;
        assert!(nan
            .validate(&ppo, 5)
            .unwrap_err()
            .to_string()
            .contains("non-finite"));
    }
}
