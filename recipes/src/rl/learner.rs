//! A queued role's learner: it waits for a batch of the role's episodes on a bounded
//! queue, drops those sampled more than `max_staleness` of its updates ago, plays the
//! recipe's learner environments from its newest weights, trains on both, and publishes
//! fresh weights for the loop's next rollouts. It ends when the loop closes the queue and
//! everything left is trained on.

use lathe::types::AdamParams;
use lathe::{SamplingClient, Tokenizer};
use serde_json::{json, Value};
use tokio::sync::{mpsc, watch};

use super::sessions::{Kl, RoleSessions};
use super::{QueueTotals, Queued, Recipe};
use crate::credit::{encoder, episode_data, Objective};
use crate::env::{mean_metrics, Episode, Transition};
use crate::play::{mix_seed, play, Policy};
use crate::rollout::{ratio_mean, Sample};
use crate::run::{mean, mean_of};

/// What travels on a queue.
pub(super) enum Message {
    /// One episode's replies of the role.
    Episode(QueuedEpisode),
    /// Train on what has arrived now, even if it is less than a batch.
    Flush,
}

/// One episode's replies of the queued role.
pub(super) struct QueuedEpisode {
    /// The replies, with their rewards.
    pub(super) transitions: Vec<Transition>,
    /// The episode's source ([`Episode::source`]).
    pub(super) source: Option<usize>,
    /// The oldest of the role's updates any reply was sampled from.
    pub(super) version: u64,
}

/// The loop's end of a queue.
pub(super) struct QueueHandle {
    /// `None` once closed.
    tx: Option<mpsc::Sender<Message>>,
    /// The role's newest weights and their update count.
    pub(super) latest: watch::Receiver<(u64, SamplingClient)>,
    /// Episodes the learner has received, and its environments' cursor.
    consumed: watch::Receiver<(u64, usize)>,
    /// Episodes sent so far.
    pub(super) sent: u64,
}

/// The learner's end of a queue.
pub(super) struct LearnerEnds {
    rx: mpsc::Receiver<Message>,
    publish: watch::Sender<(u64, SamplingClient)>,
    consumed: watch::Sender<(u64, usize)>,
}

/// A queue of `capacity` episodes whose role starts at update `first` with `sampler`,
/// its learner's environments at `cursor`.
pub(super) fn queue(
    capacity: usize,
    first: (u64, SamplingClient),
    cursor: usize,
) -> (QueueHandle, LearnerEnds) {
    let (tx, rx) = mpsc::channel(capacity.max(1));
    let (publish, latest) = watch::channel(first);
    let (consumed_tx, consumed) = watch::channel((0, cursor));
    (
        QueueHandle {
            tx: Some(tx),
            latest,
            consumed,
            sent: 0,
        },
        LearnerEnds {
            rx,
            publish,
            consumed: consumed_tx,
        },
    )
}

impl QueueHandle {
    /// Puts an episode on the queue (waiting while it is full).
    pub(super) async fn send(&mut self, episode: QueuedEpisode) -> anyhow::Result<()> {
        self.sender()?
            .send(Message::Episode(episode))
            .await
            .map_err(|_| anyhow::anyhow!("the learner stopped early"))?;
        self.sent += 1;
        Ok(())
    }

    /// Waits until the learner has trained on (or dropped) everything sent: the state
    /// saved then is the whole run's.
    pub(super) async fn drain(&mut self) -> anyhow::Result<()> {
        self.sender()?
            .send(Message::Flush)
            .await
            .map_err(|_| anyhow::anyhow!("the learner stopped early"))?;
        let sent = self.sent;
        self.consumed
            .wait_for(|&(c, _)| c >= sent)
            .await
            .map_err(|_| anyhow::anyhow!("the learner stopped before draining its queue"))?;
        Ok(())
    }

    /// Closes the queue: the learner trains on what is left and stops. The newest
    /// weights and the counters stay readable.
    pub(super) fn close(&mut self) {
        self.tx = None;
    }

    fn sender(&self) -> anyhow::Result<&mpsc::Sender<Message>> {
        self.tx
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("the queue is closed"))
    }

    /// The learner's position in its environments' sequence, as of its last update.
    pub(super) fn cursor(&self) -> usize {
        self.consumed.borrow().1
    }
}

/// Keeps the episodes sampled at most `max_staleness` updates before `version`; returns
/// how many were dropped.
fn drop_stale(items: &mut Vec<QueuedEpisode>, version: u64, max_staleness: u64) -> usize {
    let before = items.len();
    items.retain(|e| version.saturating_sub(e.version) <= max_staleness);
    before - items.len()
}

/// A queued role's learner.
pub(super) struct Learner<'a, R: Recipe> {
    pub(super) recipe: &'a R,
    pub(super) role: usize,
    pub(super) queued: Queued,
    pub(super) team: &'a RoleSessions,
    pub(super) tok: &'a Tokenizer,
    pub(super) context: Option<usize>,
    pub(super) seed: u64,
    /// The KL penalty, when there is one.
    pub(super) kl: Option<Kl<'a>>,
    /// Log lines for `metrics.jsonl`.
    pub(super) records: mpsc::UnboundedSender<Value>,
}

impl<R: Recipe> Learner<'_, R> {
    /// Runs until the queue is closed and drained; returns what went through it.
    pub(super) async fn run(self, mut ends: LearnerEnds) -> anyhow::Result<QueueTotals> {
        let roles = self.recipe.roles();
        let name = roles[self.role];
        let session = self.team.of_role[self.role];
        let q = self.queued;
        let objective = Objective::Rl(self.recipe.objective().loss_fn(), q.credit);
        let mut totals = QueueTotals {
            updates: ends.publish.borrow().0,
            ..Default::default()
        };
        let mut cursor = ends.consumed.borrow().1;
        loop {
            let mut items = Vec::with_capacity(q.batch);
            let mut closed = false;
            while items.len() < q.batch.max(1) {
                match ends.rx.recv().await {
                    Some(Message::Episode(e)) => items.push(e),
                    Some(Message::Flush) => break,
                    None => {
                        closed = true;
                        break;
                    }
                }
            }
            if items.is_empty() {
                ends.consumed.send_replace((totals.received, cursor));
                if closed {
                    return Ok(totals);
                }
                continue;
            }
            let version = totals.updates;
            let received = items.len();
            let depth = ends.rx.len();
            let staleness: Vec<f64> = items
                .iter()
                .map(|e| version.saturating_sub(e.version) as f64)
                .collect();
            let dropped = drop_stale(&mut items, version, q.max_staleness);

            // The learner's own environments, from its newest weights.
            let newest = ends.publish.borrow().1.clone();
            let mut sources: Vec<usize> = Vec::new();
            for s in items.iter().filter_map(|e| e.source) {
                if !sources.contains(&s) {
                    sources.push(s);
                }
            }
            let envs = self.recipe.learner_envs(self.role, &sources, &mut cursor);
            let policy = |_| Policy {
                sampler: newest.clone(),
                version,
                sampling: self.recipe.learner_sampling(self.role),
            };
            let own = play(
                envs,
                &policy,
                self.tok,
                self.context,
                mix_seed(self.seed, &[0x1ea7, version]),
            )
            .await?;

            // One batch: the queued episodes, then the learner's.
            let queued_rewards: Vec<f64> = items
                .iter()
                .flat_map(|e| e.transitions.iter().map(|t| t.reward))
                .collect();
            let own_rewards: Vec<f64> = own
                .iter()
                .flat_map(|e| e.transitions.iter().map(|t| t.reward))
                .collect();
            let own_metrics = mean_metrics(&own);
            let episodes: Vec<Episode> = items
                .into_iter()
                .map(|e| Episode {
                    transitions: e.transitions,
                    ..Default::default()
                })
                .chain(own)
                .collect();
            let groups = std::slice::from_ref(&episodes);
            let penalty = match self.kl {
                Some(kl) => {
                    let own_role = |t: &Transition| t.role == self.role;
                    Some(kl.penalty(groups, &q.credit, roles.len(), own_role).await?)
                }
                None => None,
            };
            let per_episode = episode_data(
                groups,
                &objective,
                roles.len(),
                &encoder(self.tok),
                penalty.as_ref(),
            )?;
            // Datums from the current weights carry the agreement check's tokens; older
            // ones are off policy by design.
            let mut data = Vec::new();
            let mut fresh = Vec::new();
            for (e, mut per_role) in episodes.iter().zip(per_episode) {
                let is_fresh = e.transitions.iter().all(|t| t.reply.version == version);
                let datums = std::mem::take(&mut per_role[self.role]);
                fresh.extend(std::iter::repeat_n(is_fresh, datums.len()));
                data.extend(datums);
            }
            let unchecked = if fresh.contains(&true) {
                None
            } else {
                let replies: Vec<(&[i64], &Sample)> = episodes
                    .iter()
                    .flat_map(|e| &e.transitions)
                    .filter(|t| t.reply.version == version && !t.reply.sample.tokens.is_empty())
                    .take(16)
                    .map(|t| (&t.reply.prompt[..], &t.reply.sample))
                    .collect();
                ratio_mean(self.team.trainer(session), &replies).await?
            };
            let adam = AdamParams {
                learning_rate: q.lr,
                ..Default::default()
            };
            let outcome = match self
                .team
                .submit(session, &data, objective.loss_fn(), adam)
                .await?
            {
                Some(step) => {
                    let outcome = step.finish().await?;
                    totals.updates += 1;
                    let sampler = self
                        .team
                        .trainer(session)
                        .save_weights_and_get_sampling_client()
                        .await?;
                    ends.publish.send_replace((totals.updates, sampler));
                    Some(outcome)
                }
                None => None,
            };
            totals.received += received as u64;
            totals.dropped += dropped as u64;
            ends.consumed.send_replace((totals.received, cursor));
            let ratio = outcome
                .as_ref()
                .and_then(|o| o.ratio_mean_where(|i| fresh[i]))
                .or(unchecked);
            let mut line = json!({
                "update": totals.updates,
                "role": name,
                "agents": {name: {
                    "reward_mean": mean_of(&queued_rewards),
                    "learner_replies": own_rewards.len(),
                    "learner_reward_mean": mean_of(&own_rewards),
                    "loss": outcome.as_ref().map(|o| o.loss),
                    "datums": data.len(),
                    "ratio_mean": ratio,
                    "kl_base": penalty.as_ref().and_then(|p| p.kl[self.role]),
                }},
                "queue/received": received,
                "queue/depth": depth,
                "queue/capacity": q.capacity,
                "queue/staleness_mean": mean(&staleness),
                "queue/staleness_max": staleness.iter().copied().fold(0.0, f64::max),
                "queue/dropped": dropped,
                "queue/dropped_total": totals.dropped,
            });
            for (k, v) in own_metrics {
                line[format!("learner/{k}")] = json!(v);
            }
            let _ = self.records.send(line);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_episodes_are_dropped() {
        let episode = |version| QueuedEpisode {
            transitions: Vec::new(),
            source: None,
            version,
        };
        let mut items = vec![episode(0), episode(3), episode(5), episode(6)];
        // At update 5 with a bound of 2: sampled at 3 and 5 stay; 0 goes; 6 (newer than
        // the learner, as after a resume) stays.
        assert_eq!(drop_stale(&mut items, 5, 2), 1);
        let kept: Vec<u64> = items.iter().map(|e| e.version).collect();
        assert_eq!(kept, vec![3, 5, 6]);
    }
}
