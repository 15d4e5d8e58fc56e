//! Samples and the SDK calls around them: RL datums from sampled completions (merging a
//! trajectory's turns), the trainer/sampler agreement check, and one training step.

use std::collections::BTreeMap;

use anyhow::Context;
use lathe::types::{AdamParams, Datum, LossFn, ModelInput, TensorData};
use lathe::TrainingClient;

/// One sampled completion.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Sample {
    /// The new tokens.
    pub tokens: Vec<i64>,
    /// The sampler's logprob of each new token.
    pub logprobs: Vec<f64>,
    /// The decoded text.
    pub text: String,
}

/// An RL datum for one sampled completion: the sampler's logprobs and `advantage` on the
/// completion's tokens, zeros on the prompt (next-token aligned).
pub fn rl_datum(prompt: &[i64], sample: &Sample, advantage: f64) -> Datum {
    let ids: Vec<i64> = prompt.iter().chain(&sample.tokens).copied().collect();
    let n = ids.len() - 1;
    let first = prompt.len() - 1;
    let mut logprobs = vec![0.0f32; n];
    let mut advantages = vec![0.0f32; n];
    for (j, &lp) in sample.logprobs.iter().enumerate() {
        logprobs[first + j] = lp as f32;
        advantages[first + j] = advantage as f32;
    }
    let mut inputs = BTreeMap::new();
    inputs.insert(
        "target_tokens".to_string(),
        TensorData::int64(ids[1..].to_vec()),
    );
    inputs.insert("logprobs".to_string(), TensorData::float32(logprobs));
    inputs.insert("advantages".to_string(), TensorData::float32(advantages));
    Datum {
        model_input: ModelInput::from_ints(ids[..n].to_vec()),
        loss_fn_inputs: inputs,
    }
}

/// The RL datums of one multi-turn trajectory, each turn `(prompt, completion,
/// advantage of each completion token)`: a turn joins the previous datum when its prompt extends the previous
/// prompt plus completion token for token (the observation in between gets zeros), and
/// starts a new datum otherwise — the Tinker cookbook's rule. One datum instead of one
/// per turn trains each shared prefix once; the loss is the same.
pub fn trajectory_data(turns: &[(&[i64], &Sample, &[f64])]) -> Vec<Datum> {
    // Per position of the full sequence: the token, its sampler logprob and advantage
    // (zeros on observation tokens).
    struct Seq {
        tokens: Vec<i64>,
        logprobs: Vec<f32>,
        advantages: Vec<f32>,
    }
    fn finish(seq: Seq) -> Option<Datum> {
        let n = seq.tokens.len().checked_sub(1).filter(|&n| n > 0)?;
        let mut inputs = BTreeMap::new();
        inputs.insert(
            "target_tokens".to_string(),
            TensorData::int64(seq.tokens[1..].to_vec()),
        );
        inputs.insert(
            "logprobs".to_string(),
            TensorData::float32(seq.logprobs[1..].to_vec()),
        );
        inputs.insert(
            "advantages".to_string(),
            TensorData::float32(seq.advantages[1..].to_vec()),
        );
        Some(Datum {
            model_input: ModelInput::from_ints(seq.tokens[..n].to_vec()),
            loss_fn_inputs: inputs,
        })
    }
    let mut out = Vec::new();
    let mut current: Option<Seq> = None;
    for &(prompt, sample, advantages) in turns {
        if sample.tokens.is_empty() || prompt.is_empty() {
            continue;
        }
        assert_eq!(
            advantages.len(),
            sample.tokens.len(),
            "an advantage per completion token"
        );
        let extends = current
            .as_ref()
            .is_some_and(|c| prompt.len() >= c.tokens.len() && prompt.starts_with(&c.tokens));
        let mut seq = match current.take() {
            Some(c) if extends => c,
            other => {
                out.extend(other.and_then(finish));
                Seq {
                    tokens: Vec::new(),
                    logprobs: Vec::new(),
                    advantages: Vec::new(),
                }
            }
        };
        let observed = &prompt[seq.tokens.len()..];
        seq.tokens.extend_from_slice(observed);
        seq.logprobs.resize(seq.tokens.len(), 0.0);
        seq.advantages.resize(seq.tokens.len(), 0.0);
        seq.tokens.extend_from_slice(&sample.tokens);
        seq.logprobs
            .extend(sample.logprobs.iter().map(|&l| l as f32));
        seq.logprobs.resize(seq.tokens.len(), 0.0);
        seq.advantages.extend(advantages.iter().map(|&a| a as f32));
        current = Some(seq);
    }
    out.extend(current.and_then(finish));
    out
}

/// Mean `exp(train logprob − sampler logprob)` over the tokens of `samples` (each with its
/// prompt), from a forward pass of `trainer`: 1.0 when trainer and sampler agree. `None`
/// when there is no sampled token.
pub async fn ratio_mean(
    trainer: &TrainingClient,
    samples: &[(&[i64], &Sample)],
) -> anyhow::Result<Option<f64>> {
    let mut data = Vec::new();
    let mut spans = Vec::new();
    for (prompt, sample) in samples {
        if sample.tokens.is_empty() || sample.logprobs.len() != sample.tokens.len() {
            continue;
        }
        let mut d = rl_datum(prompt, sample, 0.0);
        // Cross-entropy with zero weights: a forward pass that only reports logprobs.
        let n = d.model_input.length();
        d.loss_fn_inputs.remove("logprobs");
        d.loss_fn_inputs.remove("advantages");
        d.loss_fn_inputs
            .insert("weights".into(), TensorData::float32(vec![0.0; n]));
        data.push(d);
        spans.push((prompt.len() - 1, &sample.logprobs));
    }
    if data.is_empty() {
        return Ok(None);
    }
    let out = trainer
        .forward(&data, LossFn::CrossEntropy, None)
        .await?
        .result()
        .await?;
    let (mut sum, mut count) = (0.0, 0usize);
    for (i, (first, sampled)) in spans.iter().enumerate() {
        let train = out.logprobs(i).context("forward returned no logprobs")?;
        for (j, &q) in sampled.iter().enumerate() {
            sum += (f64::from(train[first + j]) - q).exp();
            count += 1;
        }
    }
    Ok(Some(sum / count as f64))
}

/// A submitted `forward_backward` + `optim_step` pair; [`Step::finish`] waits for both.
pub struct Step {
    /// Per datum: its sampled positions and their sampler logprobs (empty for datums
    /// without a `logprobs` input, such as cross-entropy ones).
    sampled: Vec<Vec<(usize, f64)>>,
    forward_backward: lathe::ApiFuture<lathe::types::ForwardBackwardOutput>,
    optim: lathe::ApiFuture<lathe::types::OptimStepResponse>,
}

/// What a finished [`Step`] reports.
#[derive(Debug, Clone, PartialEq)]
pub struct StepOutcome {
    /// The loss per datum.
    pub loss: f64,
    /// Per datum: the sum of `exp(train logprob − sampler logprob)` over its sampled
    /// tokens, and how many there were.
    ratios: Vec<(f64, usize)>,
}

impl StepOutcome {
    /// Mean `exp(train logprob − sampler logprob)` over the step's sampled tokens, from
    /// the `forward_backward` pass itself (the first forward on these weights, so no
    /// extra pass): 1.0 when trainer and sampler agree. `None` without sampled tokens.
    pub fn ratio_mean(&self) -> Option<f64> {
        self.ratio_mean_where(|_| true)
    }

    /// [`Self::ratio_mean`] over the datums whose index passes `keep`.
    pub fn ratio_mean_where(&self, keep: impl Fn(usize) -> bool) -> Option<f64> {
        let (sum, count) = self
            .ratios
            .iter()
            .enumerate()
            .filter(|(i, _)| keep(*i))
            .fold((0.0, 0), |(s, c), (_, (ds, dc))| (s + ds, c + dc));
        (count > 0).then(|| sum / count as f64)
    }
}

impl Step {
    /// Waits for the step.
    pub async fn finish(self) -> anyhow::Result<StepOutcome> {
        let out = self.forward_backward.result().await?;
        self.optim.result().await?;
        let mut ratios = Vec::with_capacity(self.sampled.len());
        for (i, sampled) in self.sampled.iter().enumerate() {
            let mut sum = 0.0;
            if !sampled.is_empty() {
                let train = out
                    .logprobs(i)
                    .context("forward_backward returned no logprobs")?;
                for &(at, q) in sampled {
                    let p = *train
                        .get(at)
                        .context("forward_backward logprobs too short")?;
                    sum += (f64::from(p) - q).exp();
                }
            }
            ratios.push((sum, sampled.len()));
        }
        Ok(StepOutcome {
            loss: out.loss().unwrap_or(f64::NAN) / self.sampled.len().max(1) as f64,
            ratios,
        })
    }
}

/// The positions of `datum` that hold a sampled token, with the sampler's logprob: those
/// with a non-zero advantage or logprob (observation tokens carry zeros in both).
fn sampled_positions(datum: &Datum) -> Vec<(usize, f64)> {
    let dense = |name: &str| {
        datum
            .loss_fn_inputs
            .get(name)
            .and_then(|t| t.to_dense().ok())
    };
    let (Some(logprobs), Some(advantages)) = (dense("logprobs"), dense("advantages")) else {
        return Vec::new();
    };
    logprobs
        .iter()
        .zip(&advantages)
        .enumerate()
        .filter(|(_, (lp, adv))| **lp != 0.0 || **adv != 0.0)
        .map(|(at, (lp, _))| (at, *lp))
        .collect()
}

/// Submits one training step on `data` (nothing when it is empty: no gradient, no step).
/// Submitting without waiting lets several sessions' steps run in one fused pass.
pub async fn submit_step(
    trainer: &TrainingClient,
    data: &[Datum],
    loss_fn: LossFn,
    adam: AdamParams,
) -> anyhow::Result<Option<Step>> {
    if data.is_empty() {
        return Ok(None);
    }
    let forward_backward = trainer.forward_backward(data, loss_fn, None).await?;
    let optim = trainer.optim_step(adam).await?;
    Ok(Some(Step {
        sampled: data.iter().map(sampled_positions).collect(),
        forward_backward,
        optim,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(tokens: &[i64], logprobs: &[f64]) -> Sample {
        Sample {
            tokens: tokens.to_vec(),
            logprobs: logprobs.to_vec(),
            text: String::new(),
        }
    }

    #[test]
    fn the_agreement_check_reads_only_sampled_tokens() {
        // Two turns: sampled tokens 4, 5 and 7; token 6 is the other speaker's.
        let first = sample(&[4, 5], &[-0.5, -0.25]);
        let second = sample(&[7], &[-1.0]);
        let data = trajectory_data(&[
            (&[1, 2, 3], &first, &[0.5, 0.5]),
            (&[1, 2, 3, 4, 5, 6], &second, &[0.5]),
        ]);
        assert_eq!(data.len(), 1);
        assert_eq!(
            sampled_positions(&data[0]),
            vec![(2, -0.5), (3, -0.25), (5, -1.0)]
        );
        // Cross-entropy datums have no sampled tokens.
        let mut ce = data[0].clone();
        ce.loss_fn_inputs.remove("logprobs");
        assert!(sampled_positions(&ce).is_empty());

        let outcome = StepOutcome {
            loss: 0.0,
            ratios: vec![(3.0, 3), (0.0, 0), (2.4, 2)],
        };
        assert!((outcome.ratio_mean().unwrap() - 5.4 / 5.0).abs() < 1e-12);
        assert_eq!(outcome.ratio_mean_where(|i| i == 0), Some(1.0));
        assert_eq!(outcome.ratio_mean_where(|i| i == 1), None);
    }

    #[test]
    fn one_turn_trajectories_equal_rl_datums() {
        let s = sample(&[4, 5], &[-0.5, -0.25]);
        assert_eq!(
            trajectory_data(&[(&[1, 2, 3], &s, &[0.75, 0.75])]),
            vec![rl_datum(&[1, 2, 3], &s, 0.75)]
        );
    }

    #[test]
    fn turns_that_extend_the_prefix_merge_into_one_datum() {
        let first = sample(&[4, 5], &[-0.5, -0.25]);
        let second = sample(&[8], &[-1.0]);
        // Turn 2's prompt = turn 1's prompt + completion + observation [6, 7].
        let data = trajectory_data(&[
            (&[1, 2, 3], &first, &[2.0, 2.0]),
            (&[1, 2, 3, 4, 5, 6, 7], &second, &[3.0]),
        ]);
        assert_eq!(data.len(), 1);
        let d = &data[0];
        assert_eq!(d.model_input.to_ints().unwrap(), vec![1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(
            d.loss_fn_inputs["target_tokens"].data,
            vec![2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
        );
        assert_eq!(
            d.loss_fn_inputs["advantages"].data,
            vec![0.0, 0.0, 2.0, 2.0, 0.0, 0.0, 3.0]
        );
        assert_eq!(
            d.loss_fn_inputs["logprobs"].data,
            vec![0.0, 0.0, -0.5, -0.25, 0.0, 0.0, -1.0]
        );
        // A prompt that does not extend the sequence starts a new datum.
        let data = trajectory_data(&[
            (&[1, 2, 3], &first, &[2.0, 2.0]),
            (&[1, 2, 9, 4, 5], &second, &[2.0]),
        ]);
        assert_eq!(data.len(), 2);
        assert_eq!(data[1], rl_datum(&[1, 2, 9, 4, 5], &second, 2.0));
    }

    #[test]
    fn rl_datums_put_advantages_on_the_completion_only() {
        let sample = Sample {
            tokens: vec![4, 5],
            logprobs: vec![-0.5, -0.25],
            text: String::new(),
        };
        let d = rl_datum(&[1, 2, 3], &sample, 0.75);
        assert_eq!(d.model_input.to_ints().unwrap(), vec![1, 2, 3, 4]);
        assert_eq!(
            d.loss_fn_inputs["target_tokens"].data,
            vec![2.0, 3.0, 4.0, 5.0]
        );
        assert_eq!(
            d.loss_fn_inputs["advantages"].data,
            vec![0.0, 0.0, 0.75, 0.75]
        );
        assert_eq!(
            d.loss_fn_inputs["logprobs"].data,
            vec![0.0, 0.0, -0.5, -0.25]
        );
    }
}
