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
/// place in that order), from `base` (a sampling client of the base model), submitted
/// together ([`scoring_plan`] says which sequences are scored). `None` for the others,
/// for replies without tokens, and for those whose prompt and reply leave no room in
/// `context` for the one token the server's scoring request must ask for (a reply cut
/// off by the context): those are not penalised.
pub async fn base_logprobs(
    groups: &[Vec<Episode>],
    base: &SamplingClient,
    context: Option<usize>,
    penalised: impl Fn(usize, &Transition) -> bool,
) -> anyhow::Result<Vec<Option<Vec<f64>>>> {
    let plan = scoring_plan(groups, context, penalised);
    let mut pending = Vec::with_capacity(plan.len());
    for scored in &plan {
        let input = ModelInput::from_ints(scored.tokens.clone());
        pending.push(base.compute_logprobs(&input).await?);
    }
    let count = groups.iter().flatten().map(|e| e.transitions.len()).sum();
    let mut out = vec![None; count];
    for (scored, future) in plan.into_iter().zip(pending) {
        let all = future.result().await?;
        anyhow::ensure!(
            all.len() == scored.tokens.len(),
            "the base model scored {} positions of a sequence of {}",
            all.len(),
            scored.tokens.len()
        );
        for (i, replies) in scored.replies {
            let logprobs: Option<Vec<f64>> = all[replies].iter().copied().collect();
            let logprobs = logprobs.ok_or_else(|| {
                anyhow::anyhow!("the base model gave no logprob for a reply's token")
            })?;
            out[i] = Some(logprobs);
        }
    }
    Ok(out)
}

/// One sequence the base model scores, and where the replies it covers sit in it.
#[derive(Debug, Clone, PartialEq)]
pub struct Scored {
    /// The tokens: a prompt and its reply, or a dialogue's turns of one role.
    pub tokens: Vec<i64>,
    /// Each covered transition's place (in order: group, episode, transition) and the
    /// positions of its reply's tokens in `tokens`.
    pub replies: Vec<(usize, std::ops::Range<usize>)>,
}

/// The sequences that score every transition `penalised` selects: a role's turns of an
/// episode whose prompts extend each other (the turns [`crate::rollout::trajectory_data`]
/// merges into one datum) are scored as one sequence, so a dialogue's later turns do
/// not prefill the earlier ones again; each other selected reply with its own prompt. A
/// sequence longer than `context` allows (its length plus the one token a scoring
/// request asks for) is split back into its turns, and a turn that does not fit alone
/// is left out. Replies without tokens or without a prompt are left out.
pub fn scoring_plan(
    groups: &[Vec<Episode>],
    context: Option<usize>,
    penalised: impl Fn(usize, &Transition) -> bool,
) -> Vec<Scored> {
    // A scoring request asks for one token past the sequence.
    let fits = |len: usize| context.is_none_or(|c| len < c);
    let mut plan = Vec::new();
    let mut index = 0;
    for episode in groups.iter().flatten() {
        // Per role, the chain being extended: its tokens and covered replies.
        let mut chains: Vec<(usize, Scored)> = Vec::new();
        for t in &episode.transitions {
            let i = index;
            index += 1;
            let (prompt, tokens) = (&t.reply.prompt, &t.reply.sample.tokens);
            if tokens.is_empty() || prompt.is_empty() || !penalised(i, t) {
                continue;
            }
            let at = chains.iter().position(|(role, _)| *role == t.role);
            let extends = at.is_some_and(|k| {
                let seq = &chains[k].1.tokens;
                prompt.len() >= seq.len() && prompt.starts_with(seq)
            });
            let span = prompt.len()..prompt.len() + tokens.len();
            if extends {
                let chain = &mut chains[at.expect("a chain to extend")].1;
                chain
                    .tokens
                    .extend_from_slice(&prompt[chain.tokens.len()..]);
                chain.tokens.extend_from_slice(tokens);
                chain.replies.push((i, span));
                continue;
            }
            let scored = Scored {
                tokens: prompt.iter().chain(tokens).copied().collect(),
                replies: vec![(i, span)],
            };
            match at {
                Some(k) => plan.push(std::mem::replace(&mut chains[k].1, scored)),
                None => chains.push((t.role, scored)),
            }
        }
        plan.extend(chains.into_iter().map(|(_, scored)| scored));
    }
    // What does not fit is scored turn by turn, and what still does not fit is dropped.
    let mut out = Vec::with_capacity(plan.len());
    for scored in plan {
        if fits(scored.tokens.len()) {
            out.push(scored);
            continue;
        }
        for (i, span) in scored.replies {
            if fits(span.end) {
                let tokens = scored.tokens[..span.end].to_vec();
                out.push(Scored {
                    tokens,
                    replies: vec![(i, span)],
                });
            }
        }
    }
    out
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

    fn turn(role: usize, prompt: &[i64], tokens: &[i64]) -> Transition {
        let mut t = transition(role, &vec![-1.0; tokens.len()]);
        t.reply.prompt = prompt.to_vec();
        t.reply.sample.tokens = tokens.to_vec();
        t
    }

    #[test]
    fn a_dialogues_turns_are_scored_as_one_sequence() {
        let episode = Episode {
            transitions: vec![
                turn(0, &[1, 2], &[3, 4]),
                turn(1, &[9], &[8]),
                // Extends role 0's first turn: [1, 2] + [3, 4] + observation [5, 6].
                turn(0, &[1, 2, 3, 4, 5, 6], &[7]),
                // Does not: a new sequence.
                turn(0, &[1, 9], &[5]),
                turn(0, &[1], &[]),
            ],
            ..Default::default()
        };
        let groups = vec![vec![Episode::default()], vec![episode]];
        let all = |_: usize, _: &Transition| true;
        let scored = |tokens: &[i64], replies: &[(usize, std::ops::Range<usize>)]| Scored {
            tokens: tokens.to_vec(),
            replies: replies.to_vec(),
        };
        assert_eq!(
            scoring_plan(&groups, None, all),
            vec![
                scored(&[1, 2, 3, 4, 5, 6, 7], &[(0, 2..4), (2, 6..7)]),
                scored(&[1, 9, 5], &[(3, 2..3)]),
                scored(&[9, 8], &[(1, 1..2)]),
            ]
        );
        // Left out: what `penalised` does not select; the merged sequence does not fit a
        // context of 7 (it needs 8), so its turns go alone, and the second does not fit.
        let plan = scoring_plan(&groups, Some(7), |i, _| i != 1);
        assert_eq!(
            plan,
            vec![
                scored(&[1, 2, 3, 4], &[(0, 2..4)]),
                scored(&[1, 9, 5], &[(3, 2..3)])
            ]
        );
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
