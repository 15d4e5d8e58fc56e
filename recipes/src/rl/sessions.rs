//! The sessions of a run: which plays which role, opening or resuming them, publishing
//! their weights, saving their states, and one synchronous training step.

use std::collections::BTreeMap;

use lathe::types::{AdamParams, Datum, LossFn};
use lathe::{SamplingClient, Tokenizer, TrainingClient};
use serde::Serialize;
use tokio::sync::Mutex;

use super::{Recipe, Team};
use crate::credit::{encoder, role_data, trained, Credit, Objective};
use crate::env::{Episode, Transition};
use crate::kl::{base_logprobs, penalty, Penalty};
use crate::resume::{checkpoint_name, RunState};
use crate::rollout::{ratio_mean, submit_step, Sample, Step, StepOutcome};
use crate::setup::{AgentSessions, CommonArgs, Connection};

/// The sessions of a run and which plays which role.
pub(super) struct RoleSessions {
    pub(super) sessions: AgentSessions,
    /// Session index of each role.
    pub(super) of_role: Vec<usize>,
    /// Each session's label in checkpoint names.
    pub(super) labels: Vec<String>,
    /// Held while a session's step is submitted, so that a queued role's learner and
    /// the loop never interleave their `forward_backward` / `optim_step` pairs on one
    /// session (fallback mode): the server runs a session's requests in order.
    locks: Vec<Mutex<()>>,
}

impl RoleSessions {
    fn new(sessions: AgentSessions, roles: &[&'static str], team: Team) -> Self {
        let distinct = sessions.distinct();
        let of_role: Vec<usize> = (0..roles.len())
            .map(|r| if distinct == 1 { 0 } else { r })
            .collect();
        let labels = if distinct == 1 && roles.len() > 1 {
            vec![match team {
                Team::SharedPolicy => "policy".to_string(),
                Team::PerRole => "shared".to_string(),
            }]
        } else {
            roles[..distinct].iter().map(|r| r.to_string()).collect()
        };
        let locks = labels.iter().map(|_| Mutex::new(())).collect();
        Self {
            sessions,
            of_role,
            labels,
            locks,
        }
    }

    pub(super) fn trainer(&self, session: usize) -> &TrainingClient {
        self.sessions.trainer(session)
    }

    /// Submits a training step of `session` under its lock.
    pub(super) async fn submit(
        &self,
        session: usize,
        data: &[Datum],
        loss: LossFn,
        adam: AdamParams,
    ) -> anyhow::Result<Option<Step>> {
        let _guard = self.locks[session].lock().await;
        submit_step(self.trainer(session), data, loss, adam).await
    }

    pub(super) fn count(&self) -> usize {
        self.labels.len()
    }

    pub(super) fn mode(&self, team: Team) -> String {
        match team {
            Team::SharedPolicy => "shared-policy".into(),
            Team::PerRole => self.sessions.mode().into(),
        }
    }
}

/// The run's sessions: resumed from `state`'s checkpoints, or new.
pub(super) async fn open_team<R: Recipe>(
    conn: &Connection,
    recipe: &R,
    args: &CommonArgs,
    state: Option<&RunState>,
    roles: &[&'static str],
) -> anyhow::Result<RoleSessions> {
    let team = recipe.team();
    let wanted = match team {
        Team::SharedPolicy => 1,
        Team::PerRole => roles.len(),
    };
    let sessions = match state {
        None => {
            let force = args.force_fallback && wanted > 1;
            AgentSessions::open(conn, wanted, force, |i| args.lora(i)).await?
        }
        Some(s) => {
            let mut trainers = Vec::with_capacity(s.checkpoints.len());
            for (label, uri) in &s.checkpoints {
                eprintln!("loading {label} from {uri}");
                trainers.push(
                    conn.service
                        .create_training_client_from_state_with_optimizer(
                            &uri.parse()
                                .map_err(|e: String| anyhow::anyhow!("{uri}: {e}"))?,
                        )
                        .await?,
                );
            }
            let fallback = (trainers.len() == 1 && wanted > 1)
                .then(|| "the resumed run had one session for every role".to_string());
            anyhow::ensure!(
                trainers.len() == 1 || trainers.len() == wanted,
                "the run saved {} sessions; {} has {wanted}",
                trainers.len(),
                recipe.name()
            );
            AgentSessions::from_trainers(trainers, wanted, fallback)
        }
    };
    Ok(RoleSessions::new(sessions, roles, team))
}

/// One role's numbers of a training step.
#[derive(Debug, Clone, Default, Serialize)]
pub struct AgentRecord {
    /// Mean reward of its replies (`null` without replies).
    pub reward_mean: Option<f64>,
    /// Its session's loss per datum (`null` when the session trained on nothing).
    pub loss: Option<f64>,
    /// Datums it trained on.
    pub datums: usize,
    /// Mean `exp(train logprob − sampler logprob)` over its sampled tokens: 1.0 when
    /// trainer and sampler agree (`null` without sampled tokens).
    pub ratio_mean: Option<f64>,
    /// Under a KL penalty: the mean sampler-minus-base logprob of its sampled tokens,
    /// the sampled estimate of KL(policy ‖ base) per token.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kl_base: Option<f64>,
    /// For a queued role: its episodes put on the queue this step (it trains in its own
    /// learner, which logs its updates).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub queued: Option<usize>,
}

/// A run's KL penalty towards the base model (`--kl-coef`): its coefficient, the base
/// model's sampler and the context the scoring requests must fit.
#[derive(Clone, Copy)]
pub(super) struct Kl<'a> {
    pub(super) coef: f64,
    pub(super) base: &'a SamplingClient,
    pub(super) context: Option<usize>,
}

impl Kl<'_> {
    /// The penalty of `groups` for `roles` roles: the replies an update with `credit`
    /// trains on and `include` selects are scored by the base model.
    pub(super) async fn penalty(
        &self,
        groups: &[Vec<Episode>],
        credit: &Credit,
        roles: usize,
        include: impl Fn(&Transition) -> bool,
    ) -> anyhow::Result<Penalty> {
        let trained = trained(groups, credit);
        let scored = |i: usize, t: &Transition| trained[i] && include(t);
        let logprobs = base_logprobs(groups, self.base, self.context, scored).await?;
        penalty(groups, &logprobs, self.coef, roles)
    }
}

/// What one step's update is: the objective, each session's optimizer parameters and,
/// under a KL penalty, the penalty the RL datums carry.
#[derive(Clone, Copy)]
pub(super) struct Update<'a> {
    pub(super) objective: &'a Objective,
    pub(super) adam: &'a [AdamParams],
    pub(super) penalty: Option<&'a Penalty>,
}

/// Which datums of a session's step are which role's: `(role, index range)`.
type RoleRanges = Vec<(usize, std::ops::Range<usize>)>;

/// Credits the step's replies, trains every session on its on-policy roles' datums and
/// measures the trainer/sampler agreement per role; `queued[r]` marks the roles left to
/// their learners.
pub(super) async fn train_step(
    team: &RoleSessions,
    groups: &[Vec<Episode>],
    update: Update<'_>,
    roles: &[&'static str],
    queued: &[bool],
    tok: &Tokenizer,
) -> anyhow::Result<BTreeMap<String, AgentRecord>> {
    let Update {
        objective,
        adam,
        penalty,
    } = update;
    let mut per_role = role_data(groups, objective, roles.len(), &encoder(tok), penalty)?;
    for (data, _) in per_role.iter_mut().zip(queued).filter(|(_, q)| **q) {
        data.clear();
    }
    let mut records: Vec<AgentRecord> = (0..roles.len())
        .map(|r| {
            let rewards: Vec<f64> = groups
                .iter()
                .flatten()
                .flat_map(|e| &e.transitions)
                .filter(|t| t.role == r)
                .map(|t| t.reward)
                .collect();
            AgentRecord {
                reward_mean: crate::run::mean_of(&rewards),
                datums: per_role[r].len(),
                kl_base: penalty.and_then(|p| p.kl[r]),
                ..Default::default()
            }
        })
        .collect();
    // A role whose datums hold no sampled tokens (none at all, or supervised ones) is
    // checked with a forward pass over a few of its replies, before any update; the
    // others from their own training pass.
    let own_pass = matches!(objective, Objective::Rl(..));
    for (r, record) in records.iter_mut().enumerate() {
        if !queued[r] && (record.datums == 0 || !own_pass) {
            let replies: Vec<(&[i64], &Sample)> = groups
                .iter()
                .flatten()
                .flat_map(|e| &e.transitions)
                .filter(|t| t.role == r && !t.reply.sample.tokens.is_empty())
                .take(16)
                .map(|t| (&t.reply.prompt[..], &t.reply.sample))
                .collect();
            record.ratio_mean = ratio_mean(team.trainer(team.of_role[r]), &replies).await?;
        }
    }
    // Each session's datums: its roles' in role order, with each role's index range.
    let mut pending: Vec<(RoleRanges, Step)> = Vec::new();
    for (s, &adam) in adam.iter().enumerate().take(team.count()) {
        let mut data: Vec<Datum> = Vec::new();
        let mut ranges = Vec::new();
        for (r, role_data) in per_role.iter().enumerate() {
            if team.of_role[r] == s {
                ranges.push((r, data.len()..data.len() + role_data.len()));
                data.extend(role_data.iter().cloned());
            }
        }
        if let Some(step) = team.submit(s, &data, objective.loss_fn(), adam).await? {
            pending.push((ranges, step));
        }
    }
    for (ranges, step) in pending {
        let outcome: StepOutcome = step.finish().await?;
        for (r, range) in ranges {
            if range.is_empty() {
                // The session trained on other roles' datums (fallback mode).
                continue;
            }
            records[r].loss = Some(outcome.loss);
            if own_pass {
                records[r].ratio_mean = outcome.ratio_mean_where(|i| range.contains(&i));
            }
        }
    }
    Ok(roles.iter().map(|r| r.to_string()).zip(records).collect())
}

/// Saves every session's training state as step `done`; returns `(label, URI)` pairs.
pub(super) async fn save_states(
    team: &RoleSessions,
    recipe: &str,
    tag: &str,
    attempt: u32,
    done: usize,
) -> anyhow::Result<Vec<(String, String)>> {
    let mut pending = Vec::new();
    for (s, label) in team.labels.iter().enumerate() {
        let name = checkpoint_name(recipe, tag, attempt, done, label);
        pending.push((label.clone(), team.trainer(s).save_state(&name).await?));
    }
    let mut out = Vec::new();
    for (label, future) in pending {
        out.push((label, future.result().await?.to_string()));
    }
    Ok(out)
}

/// Session `s`'s learning rate, `of_role[r]` being role `r`'s session: its roles' own
/// (`own(r)`, [`super::Recipe::lr`]) where they all name the same one, else `default` (`--lr`).
pub(super) fn session_lr(
    of_role: &[usize],
    own: impl Fn(usize) -> Option<f64>,
    s: usize,
    default: f64,
) -> f64 {
    let mut rates = (0..of_role.len()).filter(|&r| of_role[r] == s).map(own);
    match rates.next().flatten() {
        Some(lr) if rates.all(|o| o == Some(lr)) => lr,
        _ => default,
    }
}

#[cfg(test)]
mod tests {
    use super::session_lr;

    #[test]
    fn a_session_trains_at_its_roles_own_rate_only_when_they_agree() {
        // Two roles, one session each: the second names its own rate.
        let own = |r: usize| (r == 1).then_some(1e-4);
        assert_eq!(session_lr(&[0, 1], own, 0, 5e-4), 5e-4);
        assert_eq!(session_lr(&[0, 1], own, 1, 5e-4), 1e-4);
        // Both roles in one session (the fallback): they disagree, so `--lr`.
        assert_eq!(session_lr(&[0, 0], own, 0, 5e-4), 5e-4);
        // ... unless both name the same rate.
        assert_eq!(session_lr(&[0, 0], |_| Some(2e-4), 0, 5e-4), 2e-4);
        // A session with no role keeps `--lr`.
        assert_eq!(session_lr(&[0, 0], |_| Some(2e-4), 1, 5e-4), 5e-4);
    }
}
