//! A KL penalty towards the base policy, as tinker-cookbook's `kl_penalty_coef`: each
//! sampled token's advantage gains `coef · (mean_diff − diff)`, where `diff` is the
//! sampler's logprob of the token minus the base model's and `mean_diff` is the mean of
//! those differences over the same role's sampled tokens of the step. In expectation the
//! policy gradient then pulls against `coef · KL(policy ‖ base)` (`diff` is a one-sample
//! estimate of the KL; the mean is a baseline and changes no expectation), so a role that
//! drifts far from what the base model would say pays for it: the tool that keeps a
//! reply's format while its content is trained.

use lathe::types::ModelInput;
use lathe::SamplingClient;

use crate::env::{Episode, Transition};

/// The penalty of a step: per transition (in order: group, episode, transition), the
/// addition to each sampled token's advantage; and per role, the mean `diff` (the
/// sampled estimate of KL(policy ‖ base), in nats per token; `None` for a role without
/// sampled tokens).
#[derive(Debug, Clone, PartialEq)]
pub struct Penalty {
    /// Per transition, one addition per sampled token.
    pub per_token: Vec<Vec<f64>>,
    /// Per role, the mean logprob difference to the base model.
    pub kl: Vec<Option<f64>>,
}

/// The base model's logprob of every sampled token of every transition of `groups` (in
/// order: group, episode, transition) that `penalised` selects, from `base` (a sampling
/// client of the base model): one prefill of the prompt and the reply each, submitted
/// together. `None` for the others.
pub async fn base_logprobs(
    groups: &[Vec<Episode>],
    base: &SamplingClient,
    penalised: impl Fn(&Transition) -> bool,
) -> anyhow::Result<Vec<Option<Vec<f64>>>> {
    let transitions = groups.iter().flatten().flat_map(|e| &e.transitions);
    let mut pending = Vec::new();
    for t in transitions {
        let tokens = &t.reply.sample.tokens;
        if !penalised(t) {
            pending.push(None);
            continue;
        }
        let ids: Vec<i64> = t.reply.prompt.iter().chain(tokens).copied().collect();
        let input = ModelInput::from_ints(ids);
        pending.push(Some((tokens.len(), base.compute_logprobs(&input).await?)));
    }
    let mut out = Vec::with_capacity(pending.len());
    for p in pending {
        let Some((n, future)) = p else {
            out.push(None);
            continue;
        };
        let all = future.result().await?;
        let tail = all.len().checked_sub(n).map(|at| &all[at..]);
        let logprobs: Option<Vec<f64>> = tail.and_then(|t| t.iter().copied().collect());
        let logprobs = logprobs.ok_or_else(|| {
            anyhow::anyhow!(
                "the base model's logprobs cover {} positions, not the reply's {n}",
                all.len()
            )
        })?;
        out.push(Some(logprobs));
    }
    Ok(out)
}

/// The penalty of `groups` with coefficient `coef`, given the base model's logprob of
/// every sampled token (`base`, as [`base_logprobs`] returns it) for `roles` roles. A
/// transition without base logprobs is not penalised (its additions are zeros) and not
/// counted in its role's mean. Panics if `base` does not match the transitions' sampled
/// tokens.
pub fn penalty(
    groups: &[Vec<Episode>],
    base: &[Option<Vec<f64>>],
    coef: f64,
    roles: usize,
) -> Penalty {
    let transitions: Vec<_> = groups
        .iter()
        .flatten()
        .flat_map(|e| &e.transitions)
        .collect();
    assert_eq!(
        transitions.len(),
        base.len(),
        "base logprobs per transition"
    );
    let diffs: Vec<Option<Vec<f64>>> = transitions
        .iter()
        .zip(base)
        .map(|(t, b)| {
            let sampled = &t.reply.sample.logprobs;
            let b = b.as_ref()?;
            assert_eq!(sampled.len(), b.len(), "a base logprob per sampled token");
            Some(sampled.iter().zip(b).map(|(s, b)| s - b).collect())
        })
        .collect();
    let mut sums = vec![(0.0, 0usize); roles];
    for (t, d) in transitions.iter().zip(&diffs) {
        if let Some(d) = d {
            sums[t.role].0 += d.iter().sum::<f64>();
            sums[t.role].1 += d.len();
        }
    }
    let kl: Vec<Option<f64>> = (sums.iter())
        .map(|&(s, n)| (n > 0).then(|| s / n as f64))
        .collect();
    let per_token = transitions
        .iter()
        .zip(&diffs)
        .map(|(t, d)| match d {
            Some(d) => {
                let mean = kl[t.role].unwrap_or_default();
                d.iter().map(|d| coef * (mean - d)).collect()
            }
            None => vec![0.0; t.reply.sample.tokens.len()],
        })
        .collect();
    Penalty { per_token, kl }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::env::{Reply, Transition};
    use crate::rollout::Sample;

    fn transition(role: usize, logprobs: &[f64]) -> Transition {
        let reply = Reply {
            prompt: vec![1, 2],
            sample: Sample {
                tokens: (0..logprobs.len() as i64).collect(),
                logprobs: logprobs.to_vec(),
                text: String::new(),
            },
            version: 0,
        };
        Transition::new(role, reply, 0.0, 0)
    }

    #[test]
    fn tokens_more_likely_than_under_the_base_are_pushed_down() {
        let groups = vec![
            vec![Episode {
                transitions: vec![transition(0, &[-0.1, -2.0]), transition(1, &[-1.0])],
                ..Default::default()
            }],
            vec![Episode {
                transitions: vec![transition(0, &[-0.5])],
                ..Default::default()
            }],
        ];
        let base = vec![Some(vec![-1.1, -2.0]), Some(vec![-1.0]), Some(vec![-0.5])];
        let p = penalty(&groups, &base, 0.5, 3);
        // Role 0's diffs 1.0, 0.0, 0.0 (mean 1/3); role 1's 0.0; role 2 sampled nothing.
        assert_eq!(p.kl, vec![Some(1.0 / 3.0), Some(0.0), None]);
        let third = 1.0 / 3.0;
        assert_eq!(
            p.per_token,
            vec![
                vec![0.5 * (third - 1.0), 0.5 * third],
                vec![0.0],
                vec![0.5 * third],
            ]
        );
        // The additions of a role sum to zero: the penalty moves credit between tokens.
        let role0: f64 = [&p.per_token[0][..], &p.per_token[2][..]]
            .concat()
            .iter()
            .sum();
        assert!(role0.abs() < 1e-15);
        // A policy equal to the base pays nothing.
        let same = [Some(vec![-0.1, -2.0]), Some(vec![-1.0]), Some(vec![-0.5])];
        let same = penalty(&groups, &same, 0.5, 2);
        assert!(same.per_token.iter().flatten().all(|&a| a == 0.0));
        assert_eq!(same.kl, vec![Some(0.0), Some(0.0)]);
        // A transition left out is neither penalised nor counted.
        let partial = penalty(&groups, &[None, Some(vec![-2.0]), Some(vec![-1.5])], 1.0, 2);
        assert_eq!(partial.kl, vec![Some(1.0), Some(1.0)]);
        assert_eq!(
            partial.per_token,
            vec![vec![0.0, 0.0], vec![0.0], vec![0.0]]
        );
    }
}
