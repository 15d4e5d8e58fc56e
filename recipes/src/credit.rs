//! From episodes to training data: what each reply is credited with (its advantage
//! against a baseline) and the datums each role trains on, for any of the server's
//! losses.

use std::collections::BTreeMap;

use lathe::types::{Datum, LossFn};
use lathe::Tokenizer;

use crate::advantages::{group_centred, group_normalised};
use crate::env::{Episode, Transition};
use crate::kl::Penalty;
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
    /// Balance classes: transitions with a class ([`Transition::in_class`]) are compared
    /// across the step, not within their problem's group, with the same role's classed
    /// transitions (the team's, with `pool_roles`), by [`balanced`]: every class weighs
    /// the same whatever its share of the step, so a verifier shown mostly wrong answers
    /// gains nothing by rejecting everything; only telling the classes apart pays. Off:
    /// classes are ignored.
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
}

/// The advantage of every transition of `groups`, in order (group, episode, transition).
/// A transition with its own baseline ([`Transition::against`]) gets `reward − baseline`
/// (its class, if any, is not used); with `credit.balance`, transitions with a class
/// are credited by [`balanced`] within their role's (or, pooled, the team's) classed
/// transitions of the step; the others are centred or standardised within their
/// baseline's set, as `credit` says.
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
    let mut out = vec![0.0; transitions.len()];
    let mut sets: BTreeMap<(BaselineKey, bool), Vec<usize>> = BTreeMap::new();
    for (i, &(g, t)) in transitions.iter().enumerate() {
        if let Some(b) = t.baseline {
            out[i] = t.reward - b;
            continue;
        }
        let classed = credit.balance && t.class.is_some();
        let key = BaselineKey {
            // A class replaces the problem as what the reply is compared within.
            group: (credit.scope == Scope::Group && !classed).then_some(g),
            role: (!credit.pool_roles).then_some(t.role),
            position: credit.by_position.then_some(t.position),
        };
        sets.entry((key, classed)).or_default().push(i);
    }
    for ((_, classed), members) in sets {
        let rewards: Vec<f64> = members.iter().map(|&i| transitions[i].1.reward).collect();
        let credited = if classed {
            let classes: Vec<usize> = (members.iter())
                .map(|&i| transitions[i].1.class.unwrap_or_default())
                .collect();
            balanced(&rewards, &classes)
        } else {
            match credit.normalise {
                Normalise::Centre => group_centred(&rewards),
                Normalise::Standardise => group_normalised(&rewards),
            }
        };
        for (i, a) in members.into_iter().zip(credited) {
            out[i] = a;
        }
    }
    out
}

/// Class-balanced advantages of one set of replies: each reward is centred within its
/// class, and each class is weighted by `n / (k · (n_c − 1))` (`n` replies in the `k`
/// classes that have at least two, `n_c` in this one). With those weights a policy that
/// answers every class alike gains nothing in expectation, whatever the classes' sizes:
/// a reply's own reward is part of its class's mean, which shrinks its expected
/// advantage by `(n_c − 1) / n_c`, and the weight undoes that. A set with fewer than two
/// such classes gets zeros: with one kind of situation only, the update could teach
/// nothing but the verdict that suits that kind. The set is centred, never divided by a
/// std, whatever the credit's `Normalise`: a scale drawn from the step's own rewards
/// would bring a pull towards one class back.
pub fn balanced(rewards: &[f64], classes: &[usize]) -> Vec<f64> {
    assert_eq!(rewards.len(), classes.len(), "one class per reward");
    let mut out = vec![0.0; rewards.len()];
    let mut by_class: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (i, &c) in classes.iter().enumerate() {
        by_class.entry(c).or_default().push(i);
    }
    let counted: Vec<Vec<usize>> = by_class.into_values().filter(|m| m.len() >= 2).collect();
    if counted.len() < 2 {
        return out;
    }
    let n: usize = counted.iter().map(Vec::len).sum();
    for members in &counted {
        let class_rewards: Vec<f64> = members.iter().map(|&i| rewards[i]).collect();
        let weight = n as f64 / (counted.len() * (members.len() - 1)) as f64;
        for (&i, c) in members.iter().zip(group_centred(&class_rewards)) {
            out[i] = c * weight;
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
/// sampler's logprobs and the advantage on the reply's tokens, plus the KL `penalty`'s
/// per-token addition when there is one ([`crate::kl`]; one entry per transition, in the
/// order of `groups`); replies with a zero advantage are left out unless the credit
/// keeps them ([`trained`]); an episode's turns of one role that extend each other merge
/// into one datum ([`trajectory_data`]). Supervised datums train each transition's prompt
/// on its reference completion, encoded by `encode` (a penalty does not apply to them).
pub fn role_data(
    groups: &[Vec<Episode>],
    objective: &Objective,
    roles: usize,
    encode: Encode,
    penalty: Option<&Penalty>,
) -> anyhow::Result<Vec<Vec<Datum>>> {
    let mut out = vec![Vec::new(); roles];
    for episode in episode_data(groups, objective, roles, encode, penalty)? {
        for (role, data) in episode.into_iter().enumerate() {
            out[role].extend(data);
        }
    }
    Ok(out)
}

/// Whether a transition with advantage `adv` goes into an RL datum under `credit`: it
/// sampled tokens, and its advantage is not zero unless `keep_zero`.
fn is_trained(t: &Transition, adv: f64, credit: &Credit) -> bool {
    !t.reply.sample.tokens.is_empty() && (credit.keep_zero || adv != 0.0)
}

/// Per transition of `groups` (in order: group, episode, transition), whether an RL
/// objective with `credit` trains on it (the replies a KL penalty scores).
pub fn trained(groups: &[Vec<Episode>], credit: &Credit) -> Vec<bool> {
    let transitions = groups.iter().flatten().flat_map(|e| &e.transitions);
    (transitions.zip(advantages(groups, credit)))
        .map(|(t, adv)| is_trained(t, adv, credit))
        .collect()
}

/// A reply's prompt, its sample and each sampled token's advantage.
type CreditedTurn<'a> = (&'a [i64], &'a Sample, Vec<f64>);

/// [`role_data`] per episode (in order: group, episode), then per role.
pub fn episode_data(
    groups: &[Vec<Episode>],
    objective: &Objective,
    roles: usize,
    encode: Encode,
    penalty: Option<&Penalty>,
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
            let mut penalties = penalty.map(|p| p.per_token.iter());
            for e in groups.iter().flatten() {
                let mut turns: Vec<Vec<CreditedTurn>> = vec![Vec::new(); roles];
                for t in &e.transitions {
                    let adv = advantages.next().expect("one advantage per transition");
                    let n = t.reply.sample.tokens.len();
                    let per_token: Vec<f64> = match penalties.as_mut() {
                        Some(p) => {
                            let k = p.next().ok_or_else(|| {
                                anyhow::anyhow!("fewer penalties than transitions")
                            })?;
                            anyhow::ensure!(
                                k.len() == n,
                                "a penalty of {} tokens for a reply of {n}",
                                k.len()
                            );
                            k.iter().map(|k| adv + k).collect()
                        }
                        None => vec![adv; n],
                    };
                    if is_trained(t, adv, credit) {
                        turns[t.role].push((&t.reply.prompt, &t.reply.sample, per_token));
                    }
                }
                let data = turns.iter().map(|turns| {
                    let borrowed: Vec<_> = (turns.iter())
                        .map(|(prompt, sample, adv)| (*prompt, *sample, &adv[..]))
                        .collect();
                    trajectory_data(&borrowed)
                });
                out.push(data.collect());
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::env::Reply;
    use crate::kl::Penalty;
    use lathe::types::LossFn;

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

    /// The expected pull towards "reject" of a verifier that rejects with probability `q`
    /// whatever it is shown: `wrong` wrong answers (class 0) and `right` right ones (class
    /// 1), reward 1 when the verdict matches; every assignment of verdicts enumerated.
    fn expected_pull(wrong: usize, right: usize, q: f64, credit: &Credit) -> f64 {
        let n = wrong + right;
        let mut pull = 0.0;
        for rejects in 0u32..(1 << n) {
            let reject = |i: usize| rejects & (1 << i) != 0;
            let p: f64 = (0..n)
                .map(|i| if reject(i) { q } else { 1.0 - q })
                .product();
            let episodes = (0..n)
                .map(|i| {
                    let is_right = i >= wrong;
                    let reward = if is_right != reject(i) { 1.0 } else { 0.0 };
                    episode(vec![
                        transition(1, reward, 0).in_class(usize::from(is_right))
                    ])
                })
                .collect();
            let a = advantages(&[episodes], credit);
            pull += p * (0..n).filter(|&i| reject(i)).map(|i| a[i]).sum::<f64>();
        }
        pull
    }

    #[test]
    fn balanced_classes_remove_the_majority_class_pull() {
        let plain = Credit::group(Normalise::Centre);
        let balanced = Credit {
            balance: true,
            ..plain
        };
        for (wrong, right, q) in [(5, 2, 0.3), (6, 3, 0.8), (4, 4, 0.5), (7, 2, 0.05)] {
            // Unbalanced, a majority of wrong answers pulls towards "reject".
            let unbalanced = expected_pull(wrong, right, q, &plain);
            assert_eq!(
                wrong > right,
                unbalanced > 0.01,
                "{wrong}/{right}: {unbalanced}"
            );
            // Balanced, guessing gains nothing either way, whatever the class sizes.
            for normalise in [Normalise::Centre, Normalise::Standardise] {
                let credit = Credit {
                    normalise,
                    ..balanced
                };
                let pull = expected_pull(wrong, right, q, &credit);
                assert!(pull.abs() < 1e-12, "{wrong}/{right} at {q}: {pull}");
            }
        }
    }

    #[test]
    fn a_class_replaces_the_group_and_needs_a_second_class() {
        // Group 0 holds only wrong answers, group 1 only right ones: per group there is
        // nothing to compare with, across the step each class has a right and a wrong
        // verdict.
        let judged =
            |right: bool, reward: f64| transition(1, reward, 0).in_class(usize::from(right));
        let groups = vec![
            vec![
                episode(vec![judged(false, 1.0)]),
                episode(vec![judged(false, 0.0)]),
            ],
            vec![
                episode(vec![judged(true, 1.0)]),
                episode(vec![judged(true, 0.0)]),
            ],
        ];
        let credit = Credit {
            balance: true,
            ..Credit::group(Normalise::Centre)
        };
        // Each class centred (±0.5) and weighted 4 / (2 × 1).
        assert_eq!(advantages(&groups, &credit), vec![1.0, -1.0, 1.0, -1.0]);
        // One class alone teaches nothing; a class of one is left out.
        assert_eq!(balanced_only(&[1.0, 0.0, 1.0], &[0, 0, 0]), vec![0.0; 3]);
        assert_eq!(balanced_only(&[1.0, 0.0, 1.0], &[0, 0, 1]), vec![0.0; 3]);
        // Standardise does not rescale a balanced set: the expected pull stays zero.
        let standardised = Credit {
            normalise: Normalise::Standardise,
            ..credit
        };
        assert_eq!(
            advantages(&groups, &standardised),
            vec![1.0, -1.0, 1.0, -1.0]
        );
    }

    #[test]
    fn a_kl_penalty_adds_to_each_sampled_tokens_advantage() {
        let reply = |tokens: &[i64]| Reply {
            prompt: vec![1, 2],
            sample: Sample {
                tokens: tokens.to_vec(),
                logprobs: vec![-0.5; tokens.len()],
                text: String::new(),
            },
            version: 0,
        };
        // Rewards 1, 0 and 1 (advantages 1/3, -2/3, 1/3) in one group, 1 alone in another.
        let groups = vec![
            vec![
                episode(vec![Transition::new(0, reply(&[3, 4]), 1.0, 0)]),
                episode(vec![Transition::new(0, reply(&[5]), 0.0, 0)]),
                episode(vec![Transition::new(0, reply(&[6]), 1.0, 0)]),
            ],
            vec![episode(vec![Transition::new(0, reply(&[7]), 1.0, 0)])],
        ];
        let credit = Credit::group(Normalise::Centre);
        let objective = Objective::Rl(LossFn::ImportanceSampling, credit);
        let none = |_: &str| -> anyhow::Result<Vec<i64>> { unreachable!() };
        // The lone reply's zero advantage leaves it out, penalty or not.
        assert_eq!(trained(&groups, &credit), vec![true, true, true, false]);
        let penalty = Penalty {
            per_token: vec![vec![0.25, -0.5], vec![0.125], vec![0.0], vec![0.0]],
            kl: vec![Some(0.1)],
        };
        let data = role_data(&groups, &objective, 1, &none, Some(&penalty)).unwrap();
        let advantages: Vec<Vec<f64>> = (data[0].iter())
            .map(|d| d.loss_fn_inputs["advantages"].data.clone())
            .collect();
        // The advantages are f64 until the datum stores them as f32.
        let (third, two_thirds) = (1.0f64 / 3.0, 2.0f64 / 3.0);
        let stored = |a: f64| a as f32 as f64;
        assert_eq!(
            advantages,
            vec![
                vec![0.0, stored(third + 0.25), stored(third - 0.5)],
                vec![0.0, stored(0.125 - two_thirds)],
                vec![0.0, stored(third)],
            ]
        );
    }

    fn balanced_only(rewards: &[f64], classes: &[usize]) -> Vec<f64> {
        balanced(rewards, classes)
    }
}
