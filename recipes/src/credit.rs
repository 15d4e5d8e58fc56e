//! From episodes to training data: what each reply is credited with (its advantage
//! against a baseline) and the datums each role trains on, for any of the server's
//! losses.

use std::collections::BTreeMap;

use lathe::types::{Datum, LossFn};
use lathe::Tokenizer;

use crate::advantages::{centred_within, normalised_within};
use crate::env::{Episode, Transition};
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
    /// Balance classes: a transition with a class ([`Transition::in_class`]) is compared
    /// with its role's transitions of the same class across the step (its class, not its
    /// problem, says what it faced), and every class present weighs the same in the
    /// role's update whatever its share of the step. A verifier shown mostly wrong
    /// answers then gains nothing by rejecting everything; only telling the classes apart
    /// pays (exactly so with `Centre`; `Standardise` divides each class by its own std
    /// estimate). Off: classes are ignored.
    pub balance: bool,
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
            balance: false,
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

/// Which transitions share a baseline: `None` in a field means "any".
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct BaselineKey {
    group: Option<usize>,
    role: Option<usize>,
    position: Option<usize>,
    class: Option<usize>,
}

/// The advantage of every transition of `groups`, in order (group, episode, transition).
/// A transition with its own baseline ([`Transition::against`]) gets `reward − baseline`;
/// the others are centred or standardised within their baseline's set, as `credit` says.
pub fn advantages(groups: &[Vec<Episode>], credit: &Credit) -> Vec<f64> {
    let transitions: Vec<(usize, &Transition)> = groups
        .iter()
        .enumerate()
        .flat_map(|(g, episodes)| {
            episodes
                .iter()
                .flat_map(move |e| e.transitions.iter().map(move |t| (g, t)))
        })
        .collect();
    let key = |g: usize, t: &Transition| {
        let class = t.class.filter(|_| credit.balance);
        BaselineKey {
            // A class replaces the problem as what the reply is compared within.
            group: (credit.scope == Scope::Group && class.is_none()).then_some(g),
            role: (!credit.pool_roles).then_some(t.role),
            position: credit.by_position.then_some(t.position),
            class,
        }
    };
    let mut out = vec![0.0; transitions.len()];
    let (mut rewards, mut keys, mut at) = (Vec::new(), Vec::new(), Vec::new());
    for (i, &(g, t)) in transitions.iter().enumerate() {
        match t.baseline {
            Some(b) => out[i] = t.reward - b,
            None => {
                rewards.push(t.reward);
                keys.push(key(g, t));
                at.push(i);
            }
        }
    }
    let within = match credit.normalise {
        Normalise::Centre => centred_within(&rewards, &keys),
        Normalise::Standardise => normalised_within(&rewards, &keys),
    };
    for (&i, a) in at.iter().zip(within) {
        out[i] = a;
    }
    if credit.balance {
        // Each class's weight: the set's size over (classes × the class's size).
        let mut sizes: BTreeMap<BaselineKey, BTreeMap<usize, usize>> = BTreeMap::new();
        let classed = || {
            at.iter()
                .zip(&keys)
                .filter_map(|(&i, k)| k.class.map(|c| (i, BaselineKey { class: None, ..*k }, c)))
        };
        for (_, set, class) in classed() {
            *sizes.entry(set).or_default().entry(class).or_default() += 1;
        }
        for (i, set, class) in classed() {
            let classes = &sizes[&set];
            let total: usize = classes.values().sum();
            out[i] *= total as f64 / (classes.len() * classes[&class]) as f64;
        }
    }
    out
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
    use crate::env::Reply;

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

    #[test]
    fn an_own_baseline_is_subtracted_and_kept_out_of_the_group() {
        let groups = vec![vec![
            episode(vec![
                transition(0, 1.0, 0),
                transition(0, 1.0, 0).against(0.25),
            ]),
            episode(vec![
                transition(0, 0.0, 0),
                transition(0, 0.0, 0).against(0.25),
            ]),
        ]];
        let credit = Credit::group(Normalise::Standardise);
        let g = group_normalised(&[1.0, 0.0]);
        assert_eq!(advantages(&groups, &credit), vec![g[0], 0.75, g[1], -0.25]);
    }

    #[test]
    fn balanced_classes_remove_the_majority_class_pull() {
        // A verifier that cannot tell right answers from wrong ones and says approve or
        // reject at random: shown four wrong answers (class 0) and two right ones (class
        // 1). Reward 1 when the verdict matches; `true` is a rejection.
        let judged = |right: bool, reject: bool| {
            let reward = if right != reject { 1.0 } else { 0.0 };
            (
                reject,
                transition(1, reward, 0).in_class(usize::from(right)),
            )
        };
        let verdicts = [
            judged(false, false),
            judged(false, false),
            judged(false, true),
            judged(false, true),
            judged(true, false),
            judged(true, true),
        ];
        let groups = vec![verdicts
            .iter()
            .map(|(_, t)| episode(vec![t.clone()]))
            .collect::<Vec<_>>()];
        // The sum of the advantages given to rejections: how hard the update pulls the
        // verdict every prompt shares towards "reject".
        let pull = |credit: &Credit| -> f64 {
            let a = advantages(&groups, credit);
            verdicts
                .iter()
                .zip(a)
                .filter(|((reject, _), _)| *reject)
                .map(|(_, a)| a)
                .sum()
        };
        // Unbalanced, the majority class wins: rejecting is pulled up.
        assert_eq!(pull(&Credit::group(Normalise::Centre)), 0.5);
        // Balanced, guessing earns nothing either way.
        let balanced = Credit {
            balance: true,
            ..Credit::group(Normalise::Centre)
        };
        assert_eq!(pull(&balanced), 0.0);
    }

    #[test]
    fn balanced_classes_weigh_the_same_whatever_their_size() {
        // Class 0 has three replies, class 1 one pair: within each class the replies are
        // centred, then class 0 is scaled by 5/(2*3) and class 1 by 5/(2*2).
        let t = |reward: f64, class: usize| episode(vec![transition(0, reward, 0).in_class(class)]);
        let groups = vec![vec![t(1.0, 0), t(0.0, 0), t(0.0, 0), t(1.0, 1), t(0.0, 1)]];
        let credit = Credit {
            balance: true,
            ..Credit::group(Normalise::Centre)
        };
        let a = advantages(&groups, &credit);
        let expect = [
            2.0 / 3.0 * 5.0 / 6.0,
            -1.0 / 3.0 * 5.0 / 6.0,
            -1.0 / 3.0 * 5.0 / 6.0,
            0.5 * 5.0 / 4.0,
            -0.5 * 5.0 / 4.0,
        ];
        for (a, e) in a.iter().zip(expect) {
            assert!((a - e).abs() < 1e-12, "{a} != {e}");
        }
        // The classes' total weights are equal: |sum| of positive parts match per class.
        let class0: f64 = a[..3].iter().map(|x| x.abs()).sum();
        let class1: f64 = a[3..].iter().map(|x| x.abs()).sum();
        assert!((class0 - 10.0 / 9.0).abs() < 1e-12 && (class1 - 1.25).abs() < 1e-12);
    }
}
