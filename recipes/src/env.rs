//! Environments: what a recipe is made of. An environment hands the policy prompts
//! (observations), takes its replies, and at the end says what every reply earned.
//!
//! This is the Rust counterpart of tinker-cookbook's `Env` (`rl/types.py`), widened in two
//! ways that multi-agent recipes need:
//! - an observation names the *role* that answers it, and the loop samples it from that
//!   role's training client, so one environment can hold a whole team;
//! - an environment may ask for several replies at once (Miles' parallel solvers all see
//!   the same problem), and the rewards come at the end ([`Env::finish`]), because in a
//!   team the worth of a reply is often known only later (a verifier is graded against
//!   the solver's answer, a selector's pick weights every member's reward).
//!
//! Environments are plain synchronous state machines: the loop ([`crate::play`]) does all
//! the sampling, batching every open environment's prompts into one round of requests.

use std::collections::BTreeMap;

use crate::rollout::Sample;

/// Named numbers an episode reports (accuracy, approve rate, ...). The loop averages each
/// name over the episodes that report it.
pub type Metrics = BTreeMap<String, f64>;

/// A prompt for one role.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Observation {
    /// Index of the role that answers (into the recipe's role names).
    pub role: usize,
    /// The prompt text (raw text: the recipes use no chat template).
    pub prompt: String,
    /// New tokens at most.
    pub max_tokens: usize,
    /// Stop strings.
    pub stop: Vec<String>,
}

impl Observation {
    /// A prompt for `role` that stops at a newline.
    pub fn line(role: usize, prompt: String, max_tokens: usize) -> Self {
        Self {
            role,
            prompt,
            max_tokens,
            stop: vec!["\n".into()],
        }
    }

    /// The same prompt with other stop strings.
    pub fn stop_at(mut self, stop: &[&str]) -> Self {
        self.stop = stop.iter().map(|s| s.to_string()).collect();
        self
    }
}

/// The policy's reply to one observation.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Reply {
    /// The prompt as encoded and sampled.
    pub prompt: Vec<i64>,
    /// The completion.
    pub sample: Sample,
    /// Which published weights of the role sampled it (0 for the weights at the start of
    /// the step; later versions only in the asynchronous mode).
    pub version: u64,
}

/// One reply with what it earned.
#[derive(Debug, Clone, PartialEq)]
pub struct Transition {
    /// The role that replied.
    pub role: usize,
    /// The reply.
    pub reply: Reply,
    /// Its reward (or return: an environment may credit a turn with what follows it).
    pub reward: f64,
    /// Its place among the same role's turns of the episode (0 for the first), for
    /// baselines that compare turns at the same position.
    pub position: usize,
    /// The completion a supervised objective trains on instead of the sample (the known
    /// answer); `None` when there is none.
    pub reference: Option<String>,
    /// What the reply is compared with when the environment knows it better than the
    /// reply's group does (a selector's pick against the expected reward of a random
    /// pick): the advantage is then `reward − baseline`, unscaled, and the reply stays
    /// out of its group's statistics.
    pub baseline: Option<f64>,
    /// The kind of situation the reply answered (a verifier's: whether the answer it
    /// judged was right), for credit that balances classes ([`crate::credit::Credit`]'s
    /// `balance`).
    pub class: Option<usize>,
}

impl Transition {
    /// A reply of `role` at `position` with `reward`.
    pub fn new(role: usize, reply: Reply, reward: f64, position: usize) -> Self {
        Self {
            role,
            reply,
            reward,
            position,
            reference: None,
            baseline: None,
            class: None,
        }
    }

    /// The same transition compared with `baseline` instead of its group.
    pub fn against(mut self, baseline: f64) -> Self {
        self.baseline = Some(baseline);
        self
    }

    /// The same transition in `class`.
    pub fn in_class(mut self, class: usize) -> Self {
        self.class = Some(class);
        self
    }

    /// The same transition with a reference completion for supervised objectives.
    pub fn with_reference(mut self, reference: impl Into<String>) -> Self {
        self.reference = Some(reference.into());
        self
    }
}

/// A finished environment: every reply with its reward, in the order they were made,
/// and the episode's metrics.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Episode {
    /// The replies.
    pub transitions: Vec<Transition>,
    /// Named numbers for the logs and the held-out curves.
    pub metrics: Metrics,
    /// What the environment was built from, as an index the recipe understands (the
    /// case of a dialogue): a queued role's learner gets these back
    /// ([`crate::rl::Recipe::learner_envs`]).
    pub source: Option<usize>,
}

/// One episode of a recipe: a problem, a chain of agents, a dialogue.
///
/// The loop calls [`Env::initial_observations`] once, then [`Env::step`] with one reply
/// per observation (in their order) until it returns no observation, then
/// [`Env::finish`].
pub trait Env: Send {
    /// The first prompts (at least one).
    fn initial_observations(&mut self) -> Vec<Observation>;

    /// Takes the replies to the last observations; returns the next ones (none: done).
    fn step(&mut self, replies: Vec<Reply>) -> Vec<Observation>;

    /// The episode, once done.
    fn finish(self: Box<Self>) -> Episode;
}

/// The environments whose episodes share a baseline: the samples of one problem (GRPO's
/// group).
pub type EnvGroup = Vec<Box<dyn Env>>;

/// The mean of each metric over the episodes that report it.
pub fn mean_metrics<'a>(episodes: impl IntoIterator<Item = &'a Episode>) -> Metrics {
    let mut sums: BTreeMap<String, (f64, usize)> = BTreeMap::new();
    for e in episodes {
        for (name, &v) in &e.metrics {
            let s = sums.entry(name.clone()).or_default();
            s.0 += v;
            s.1 += 1;
        }
    }
    sums.into_iter()
        .map(|(name, (sum, n))| (name, sum / n as f64))
        .collect()
}

/// `1.0` for true, `0.0` for false: for rate metrics.
pub fn rate(b: bool) -> f64 {
    f64::from(u8::from(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_average_over_the_episodes_that_report_them() {
        let e = |pairs: &[(&str, f64)]| Episode {
            metrics: pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
            ..Default::default()
        };
        let m = mean_metrics(&[e(&[("a", 1.0), ("b", 2.0)]), e(&[("a", 0.0)])]);
        assert_eq!(m["a"], 0.5);
        assert_eq!(m["b"], 2.0);
        assert!(mean_metrics(&[]).is_empty());
    }
}
