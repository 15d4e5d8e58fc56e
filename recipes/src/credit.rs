//! From episodes to training data: what each reply is credited with (its advantage
//! against a baseline) and the datums each role trains on, for any of the server's
//! losses.

use lathe::types::{Datum, LossFn};
use lathe::Tokenizer;

use crate::advantages::{centred_within, normalised_within};
use crate::env::Episode;
use crate::rollout::{trajectory_data, Sample};

/// How rewards become advantages within a baseline's set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Normalise {
    /// Reward minus the set's mean (the Tinker cookbook's GRPO without the std division).
    Centre,
    /// `(reward − mean) / std`, unbiased std (AstraFlow's and Miles' group norm).
    Standardise,
}

/// Which replies share a baseline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// The episodes of one group (one problem's samples).
    Group,
    /// Every episode of the step.
    Batch,
}

/// How rewards are turned into advantages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Credit {
    /// Centre or standardise.
    pub normalise: Normalise,
    /// Group or batch baseline.
    pub scope: Scope,
    /// One baseline for every role's replies (a team trained as one policy) instead of
    /// one per role.
    pub pool_roles: bool,
    /// Compare a turn only with the turns at the same position of the other episodes
    /// (for multi-turn episodes whose positions differ in kind).
    pub by_position: bool,
    /// Train on replies whose advantage is zero too (they carry no gradient through the
    /// policy-gradient losses but count in the sums); off drops them, as dynamic
    /// sampling does.
    pub keep_zero: bool,
}

impl Credit {
    /// A per-role group baseline with zero-advantage replies dropped.
    pub fn group(normalise: Normalise) -> Self {
        Self {
            normalise,
            scope: Scope::Group,
            pool_roles: false,
            by_position: false,
            keep_zero: false,
        }
    }
}

/// What a step trains on.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Objective {
    /// A policy-gradient loss (`importance_sampling`, `ppo`, ...) on the sampled replies,
    /// credited as `Credit` says.
    Rl(LossFn, Credit),
    /// `cross_entropy` on each transition's reference completion.
    Supervised,
}

impl Objective {
    /// The loss the server computes.
    pub fn loss_fn(&self) -> LossFn {
        match self {
            Objective::Rl(loss, _) => *loss,
            Objective::Supervised => LossFn::CrossEntropy,
        }
    }
}

/// The advantage of every transition of `groups`, in order (group, episode, transition).
pub fn advantages(groups: &[Vec<Episode>], credit: &Credit) -> Vec<f64> {
    let mut rewards = Vec::new();
    let mut keys = Vec::new();
    for (g, episodes) in groups.iter().enumerate() {
        for e in episodes {
            for t in &e.transitions {
                rewards.push(t.reward);
                keys.push((
                    (credit.scope == Scope::Group).then_some(g),
                    (!credit.pool_roles).then_some(t.role),
                    credit.by_position.then_some(t.position),
                ));
            }
        }
    }
    match credit.normalise {
        Normalise::Centre => centred_within(&rewards, &keys),
        Normalise::Standardise => normalised_within(&rewards, &keys),
    }
}

/// How a reference completion becomes tokens (the tokenizer's `encode`).
pub type Encode<'a> = &'a dyn Fn(&str) -> anyhow::Result<Vec<i64>>;

/// [`Encode`] with `tok`.
pub fn encoder(tok: &Tokenizer) -> impl Fn(&str) -> anyhow::Result<Vec<i64>> + '_ {
    move |text| Ok(tok.encode(text)?)
}

/// Per role (of `roles`): the datums of `groups` under `objective`. RL datums carry the
/// sampler's logprobs and the advantage on the reply's tokens; an episode's turns of one
/// role that extend each other merge into one datum ([`trajectory_data`]). Supervised
/// datums train each transition's prompt on its reference completion, encoded by
/// `encode`.
pub fn role_data(
    groups: &[Vec<Episode>],
    objective: &Objective,
    roles: usize,
    encode: Encode,
) -> anyhow::Result<Vec<Vec<Datum>>> {
    let mut out = vec![Vec::new(); roles];
    for episode in episode_data(groups, objective, roles, encode)? {
        for (role, data) in episode.into_iter().enumerate() {
            out[role].extend(data);
        }
    }
    Ok(out)
}

/// [`role_data`] per episode (in order: group, episode), then per role.
pub fn episode_data(
    groups: &[Vec<Episode>],
    objective: &Objective,
    roles: usize,
    encode: Encode,
) -> anyhow::Result<Vec<Vec<Vec<Datum>>>> {
    let mut out = Vec::new();
    match objective {
        Objective::Supervised => {
            for e in groups.iter().flatten() {
                let mut per_role = vec![Vec::new(); roles];
                for t in &e.transitions {
                    if let Some(reference) = &t.reference {
                        let completion = encode(reference)?;
                        per_role[t.role].push(Datum::supervised(&t.reply.prompt, &completion));
                    }
                }
                out.push(per_role);
            }
        }
        Objective::Rl(_, credit) => {
            let mut advantages = advantages(groups, credit).into_iter();
            for e in groups.iter().flatten() {
                let mut turns: Vec<Vec<(&[i64], &Sample, f64)>> = vec![Vec::new(); roles];
                for t in &e.transitions {
                    let adv = advantages.next().expect("one advantage per transition");
                    if !t.reply.sample.tokens.is_empty() && (credit.keep_zero || adv != 0.0) {
                        turns[t.role].push((&t.reply.prompt, &t.reply.sample, adv));
                    }
                }
                out.push(turns.iter().map(|t| trajectory_data(t)).collect());
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::advantages::{group_centred, group_normalised};
    use crate::env::{Reply, Transition};

    fn transition(role: usize, reward: f64, position: usize) -> Transition {
        let reply = Reply {
            prompt: vec![1, 2],
            sample: Sample {
                tokens: vec![3 + position as i64],
                logprobs: vec![-0.5],
                text: String::new(),
            },
            version: 0,
        };
        Transition::new(role, reply, reward, position)
    }

    fn episode(ts: Vec<Transition>) -> Episode {
        Episode {
            transitions: ts,
            ..Default::default()
        }
    }

    #[test]
    fn baselines_are_per_group_and_role_unless_pooled() {
        let groups = vec![
            vec![
                episode(vec![transition(0, 1.0, 0), transition(1, 5.0, 0)]),
                episode(vec![transition(0, 0.0, 0), transition(1, 7.0, 0)]),
            ],
            vec![episode(vec![transition(0, 3.0, 0)])],
        ];
        let per_role = advantages(&groups, &Credit::group(Normalise::Centre));
        let a = group_centred(&[1.0, 0.0]);
        let b = group_centred(&[5.0, 7.0]);
        assert_eq!(per_role, vec![a[0], b[0], a[1], b[1], 0.0]);

        let pooled = Credit {
            pool_roles: true,
            scope: Scope::Batch,
            ..Credit::group(Normalise::Standardise)
        };
        assert_eq!(
            advantages(&groups, &pooled),
            group_normalised(&[1.0, 5.0, 0.0, 7.0, 3.0])
        );
    }

    #[test]
    fn positions_have_their_own_baseline() {
        let groups = vec![vec![
            episode(vec![transition(0, 1.0, 0), transition(0, 4.0, 1)]),
            episode(vec![transition(0, 3.0, 0), transition(0, 2.0, 1)]),
        ]];
        let credit = Credit {
            by_position: true,
            ..Credit::group(Normalise::Centre)
        };
        assert_eq!(advantages(&groups, &credit), vec![-1.0, 1.0, 1.0, -1.0]);
    }
}
