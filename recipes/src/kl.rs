//! A KL penalty towards the base policy, after tinker-cookbook's `kl_penalty_coef`
//! (without its discounting): each sampled token's advantage gains
//! `coef · (mean_diff − diff)`, where `diff` is the sampler's logprob of the token minus
//! the base model's and `mean_diff` is the mean of those differences over the same role's
//! trained tokens of the step (the cookbook takes one mean over the whole batch; a role
//! here may be its own policy). `diff` is a one-sample estimate of the token's
//! KL(policy ‖ base), so tokens the policy now favours more than the base does lose
//! credit and the others gain it; the mean keeps the additions of a role summing to zero.
//! Only replies that are trained on are scored, as the cookbook scores its batch after
//! dropping constant-reward groups.

use lathe::types::ModelInput;
use lathe::SamplingClient;

use crate::env::{Episode, Transition};

/// The penalty of a step: per transition (in order: group, episode, transition), the
/// addition to each sampled token's advantage; and per role, the mean `diff` (the
/// sampled estimate of KL(policy ‖ base), in nats per token; `None` for a role without
/// scored tokens).
#[derive(Debug, Clone, PartialEq)]
pub struct Penalty {
    /// Per transition, one addition per sampled token.
    pub per_token: Vec<Vec<f64>>,
    /// Per role, the mean logprob difference to the base model.
    pub kl: Vec<Option<f64>>,
}

/// The base model's logprob of every sampled token of every transition of `groups` (in
/// order: group, episode, transition) that `penalised` selects (given the transition's
/// place in that order), from `base` (a sampling client of the base model): one prefill
/// of the prompt and the reply each, submitted together. `None` for the others, for
/// replies without tokens, and for those whose prompt and reply leave no room in
/// `context` for the one token the server's scoring request must ask for (a reply cut
/// off by the context): those are not penalised. Each turn is scored with its whole
/// prompt, so a role's later turns of a long dialogue prefill the earlier ones again
/// (the datums merge them, [`crate::rollout::trajectory_data`]; the scoring does not).
pub async fn base_logprobs(
    groups: &[Vec<Episode>],
    base: &SamplingClient,
    context: Option<usize>,
    penalised: impl Fn(usize, &Transition) -> bool,
) -> anyhow::Result<Vec<Option<Vec<f64>>>> {
    let transitions = groups.iter().flatten().flat_map(|e| &e.transitions);
    let mut pending = Vec::new();
    for (i, t) in transitions.enumerate() {
        let tokens = &t.reply.sample.tokens;
        let scored_len = t.reply.prompt.len() + tokens.len() + 1;
        let fits = context.is_none_or(|c| scored_len <= c);
        if tokens.is_empty() || t.reply.prompt.is_empty() || !fits || !penalised(i, t) {
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
/// counted in its role's mean. Fails when `base` does not match the transitions (one
/// entry per transition; as many logprobs as the reply has tokens, and the sampler's
/// logprob of each).
pub fn penalty(
    groups: &[Vec<Episode>],
    base: &[Option<Vec<f64>>],
    coef: f64,
    roles: usize,
) -> anyhow::Result<Penalty> {
    let transitions: Vec<_> = groups
        .iter()
        .flatten()
        .flat_map(|e| &e.transitions)
        .collect();
    anyhow::ensure!(
        transitions.len() == base.len(),
        "{} base logprob entries for {} transitions",
        base.len(),
        transitions.len()
    );
    let mut diffs: Vec<Option<Vec<f64>>> = Vec::with_capacity(base.len());
    for (t, b) in transitions.iter().zip(base) {
        let Some(b) = b else {
            diffs.push(None);
            continue;
        };
        let sample = &t.reply.sample;
        anyhow::ensure!(
            sample.tokens.len() == b.len() && sample.logprobs.len() == b.len(),
            "a reply of {} tokens with {} sampler logprobs and {} base logprobs",
            sample.tokens.len(),
            sample.logprobs.len(),
            b.len()
        );
        diffs.push(Some(
            sample.logprobs.iter().zip(b).map(|(s, b)| s - b).collect(),
        ));
    }
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
    Ok(Penalty { per_token, kl })
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
        let p = penalty(&groups, &base, 0.5, 3).unwrap();
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
        let same = penalty(&groups, &same, 0.5, 2).unwrap();
        assert!(same.per_token.iter().flatten().all(|&a| a == 0.0));
        assert_eq!(same.kl, vec![Some(0.0), Some(0.0)]);
        // A transition left out is neither penalised nor counted.
        let partial = penalty(&groups, &[None, Some(vec![-2.0]), Some(vec![-1.5])], 1.0, 2);
        let partial = partial.unwrap();
        assert_eq!(partial.kl, vec![Some(1.0), Some(1.0)]);
        assert_eq!(
            partial.per_token,
            vec![vec![0.0, 0.0], vec![0.0], vec![0.0]]
        );
        // Entries that do not match the transitions are an error, not a panic.
        assert!(penalty(&groups, &base[..2], 0.5, 3).is_err());
        let short = [Some(vec![-1.1]), Some(vec![-1.0]), Some(vec![-0.5])];
        assert!(penalty(&groups, &short, 0.5, 3).is_err());
        let mut no_logprobs = groups.clone();
        no_logprobs[1][0].transitions[0]
            .reply
            .sample
            .logprobs
            .clear();
        assert!(penalty(&no_logprobs, &base, 0.5, 3).is_err());
    }
}
