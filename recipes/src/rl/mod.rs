//! The one training loop every recipe runs ([`run`]): per step, publish each session's
//! weights to a sampler, evaluate on held-out environments when due, play the step's
//! environment groups, credit the replies, train every session on its roles' datums (all
//! sessions' steps in flight together, so the server fuses them), log, and save the state
//! every `--save-every` steps so that `--resume` continues exactly.
//!
//! A role may instead be *queued* ([`Recipe::queued`]): its replies go onto a bounded
//! queue, and a learner of its own ([`learner`]) trains on them off-policy, dropping
//! replies sampled more than a bound of its updates ago and publishing fresh weights
//! after each update, while the loop goes on (MrlX's asynchronous co-training).
//!
//! A recipe is a [`Recipe`]: its roles, environments, objective and criterion. The loop
//! owns the run directory, the sessions (one per role, one per team, or one playing every
//! role when no more can be created), the logs, the plots, the summary and resuming.

mod begin;
mod learner;
mod run;
mod sessions;

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::Value;

use crate::credit::{Credit, Objective};
use crate::env::{Env, EnvGroup};
use crate::play::Sampling;
use crate::run::Curves;

pub use run::run;

/// A recipe's own flags as [`Recipe::settings`] wants them: `args` (its `clap` struct,
/// deriving `Serialize`, with its flattened [`crate::setup::CommonArgs`] marked
/// `#[serde(skip)]`: the loop adds those itself) as a JSON object.
pub fn settings_of(args: &impl Serialize) -> Value {
    serde_json::to_value(args).expect("a recipe's flags serialise to JSON")
}

pub use sessions::AgentRecord;

/// A held-out curve: its label in the plot and summary, and the episode metric it
/// follows.
#[derive(Debug, Clone, Copy)]
pub struct Curve {
    /// The label.
    pub label: &'static str,
    /// The name of the mean episode metric plotted.
    pub metric: &'static str,
}

impl Curve {
    /// The curve `label` over the metric `metric`.
    pub const fn new(label: &'static str, metric: &'static str) -> Self {
        Self { label, metric }
    }
}

/// A target the recipe's upstream sets for one of its roles, which the small model may
/// not reach: measured and reported in the summary, not gated by `--check`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Bar {
    /// The target, in words.
    pub text: String,
    /// Whether the run reached it; `None` when a number it needs was not measured (no
    /// held-out point of a curve it reads).
    pub met: Option<bool>,
}

impl Bar {
    /// A bar whose test reads `numbers`: unmeasured when any is NaN, else `test`'s answer.
    pub fn on(text: impl Into<String>, numbers: &[f64], test: impl FnOnce() -> bool) -> Self {
        Self {
            text: text.into(),
            met: numbers.iter().all(|x| !x.is_nan()).then(test),
        }
    }
}

/// What a recipe promises and whether the run kept it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Criterion {
    /// The promise, in words.
    pub text: String,
    /// Whether it held.
    pub passed: bool,
}

/// How a recipe's roles map onto training sessions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Team {
    /// One session per role (falling back to one for all when no more can be created).
    PerRole,
    /// One session trained on every role's replies by design (Miles' shared policy).
    SharedPolicy,
}

/// How a queued role learns: off-policy from a bounded queue of its replies.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Queued {
    /// Episodes' worth of replies per update (fewer at a flush or the end).
    pub batch: usize,
    /// Replies sampled more than this many of the role's updates ago are dropped.
    pub max_staleness: u64,
    /// Queue capacity in episodes; a full queue makes the loop wait.
    pub capacity: usize,
    /// The role's Adam learning rate.
    pub lr: f64,
    /// How its replies are credited: over each update's batch.
    pub credit: Credit,
}

/// A recipe for [`run`]: roles, environments, objective, held-out evaluation and
/// criterion. Everything random must derive from the step number and the seed the recipe
/// was built with, so a resumed run continues exactly.
pub trait Recipe {
    /// The recipe's name (run directory, checkpoint names, summary).
    fn name(&self) -> &'static str;
    /// The role names, in index order.
    fn roles(&self) -> Vec<&'static str>;
    /// How roles map onto sessions.
    fn team(&self) -> Team {
        Team::PerRole
    }
    /// What a step trains its on-policy roles on.
    fn objective(&self) -> Objective;
    /// Whether `role` learns from a queue instead, and how.
    fn queued(&self, _role: usize) -> Option<Queued> {
        None
    }
    /// `role`'s own Adam learning rate, where it differs from `--lr` (a role that
    /// collapses within one update at the team's rate, say). Roles that share a session
    /// train at `--lr` unless they all name the same rate.
    fn lr(&self, _role: usize) -> Option<f64> {
        None
    }
    /// Environments a queued role's learner plays from its newest weights before an
    /// update and trains on with the queued replies (the patient's drills), given the
    /// [`crate::env::Episode::source`]s of the update's queued episodes; `cursor` is the
    /// learner's own counter, kept between updates.
    fn learner_envs(
        &self,
        _role: usize,
        _sources: &[usize],
        _cursor: &mut usize,
    ) -> Vec<Box<dyn Env>> {
        Vec::new()
    }
    /// How `role` samples its training replies.
    fn sampling(&self, role: usize) -> Sampling;
    /// How a queued role's learner samples its own environments.
    fn learner_sampling(&self, role: usize) -> Sampling {
        self.sampling(role)
    }
    /// How `role` samples on held-out environments (greedy unless the recipe says).
    fn eval_sampling(&self, _role: usize) -> Sampling {
        Sampling::GREEDY
    }
    /// The sampling seed of held-out evaluations (one for all, so evaluations differ
    /// only by the weights).
    fn eval_seed(&self) -> u64 {
        0
    }
    /// The environment groups of training step `step`.
    fn groups(&self, step: usize) -> Vec<EnvGroup>;
    /// The held-out environments.
    fn held_out(&self) -> Vec<Box<dyn Env>>;
    /// The held-out curves; the progress bar shows them.
    fn curves(&self) -> Vec<Curve>;
    /// The recipe's criterion over the finished curves.
    fn criterion(&self, curves: &Curves) -> Criterion;
    /// The recipe's own flags, as a JSON object ([`settings_of`] its `Args`): a resume
    /// with other settings is warned, and `summary.json` records them.
    fn settings(&self) -> Value;
    /// The upstream's targets for single roles, over the finished curves (reported, not
    /// gated).
    fn upstream_bars(&self, _curves: &Curves) -> Vec<Bar> {
        Vec::new()
    }
    /// Recipe-specific fields of `summary.json`.
    fn summary_fields(&self) -> serde_json::Map<String, Value> {
        serde_json::Map::new()
    }
}

/// The end of a run, as written to `summary.json`.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    /// The recipe.
    pub recipe: String,
    /// `two-agent`, `fallback`, `shared-policy`, ...
    pub mode: String,
    /// Why one session plays every role, in fallback mode.
    pub fallback_reason: Option<String>,
    /// Training steps done.
    pub steps: usize,
    /// The step this run resumed from, if it did.
    pub resumed_from_step: Option<usize>,
    /// The base model.
    pub base_model: String,
    /// Every flag that changes what the run computes or logs: the recipe's and the common
    /// ones.
    pub settings: Value,
    /// The held-out curves: `{label: {before, after, curve}}`.
    pub held_out: Value,
    /// The criterion, in words.
    pub criterion: String,
    /// Whether it held.
    pub passed: bool,
    /// The upstream's targets for single roles and whether the run reached them.
    pub upstream_bars: Vec<Bar>,
    /// Per session label: the final state and sampler URIs.
    pub checkpoints: BTreeMap<String, Saved>,
    /// Per queued role: its updates and the episodes it received and dropped as stale.
    pub queues: BTreeMap<String, QueueTotals>,
    /// Recipe-specific fields.
    #[serde(flatten)]
    pub recipe_fields: serde_json::Map<String, Value>,
}

/// A session's final checkpoints.
#[derive(Debug, Clone, Serialize)]
pub struct Saved {
    /// Training state (with optimizer): `--resume` or `load_state_with_optimizer`.
    pub state: String,
    /// Sampler weights.
    pub sampler: String,
}

/// What went through a queued role's queue in this process.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct QueueTotals {
    /// Episodes put on the queue.
    pub sent: u64,
    /// Episodes its learner received (all of `sent` once the run ends cleanly).
    pub received: u64,
    /// Of those, dropped as stale.
    pub dropped: u64,
    /// The role's updates so far (a resumed run counts on from the saved number).
    pub updates: u64,
}
