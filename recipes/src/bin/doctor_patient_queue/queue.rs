//! The patient's side of the queue: what a dialogue leaves on it, the staleness bound,
//! and the patient's own train/sample loop (which samples its drills).

use std::sync::Arc;

use lathe::types::{AdamParams, Datum, LossFn};
use lathe::{SamplingClient, Tokenizer, TrainingClient};
use lathe_recipes::advantages::group_normalised;
use lathe_recipes::clinic::{full_marks, patient_drill, patient_reward};
use lathe_recipes::data::Case;
use lathe_recipes::rollout::{
    ratio_mean, sample_prompts, submit_step, trajectory_data, Generation, Sample, Step,
};
use lathe_recipes::run::{mean, mean_of};
use serde_json::{json, Value};
use tokio::sync::{mpsc, watch, Mutex};

use crate::dialogue::{one_line, Dialogue};

/// One dialogue's patient side on the queue: its case and its replies (none when the
/// doctor diagnosed at once; the case is still drilled).
#[derive(Debug, Clone)]
pub(crate) struct QueueItem {
    /// The patient's case.
    pub(crate) case: Case,
    /// Per reply: its prompt, the sample and its reward.
    pub(crate) replies: Vec<(Vec<i64>, Sample, f64)>,
    /// The oldest patient update any of the replies was sampled from.
    pub(crate) version: u64,
}

/// Drops items older than `max_staleness` updates; returns the kept items and how many
/// were dropped.
pub(crate) fn drop_stale(
    items: Vec<QueueItem>,
    version: u64,
    max_staleness: u64,
) -> (Vec<QueueItem>, usize) {
    let before = items.len();
    let kept: Vec<QueueItem> = items
        .into_iter()
        .filter(|it| version.saturating_sub(it.version) <= max_staleness)
        .collect();
    let dropped = before - kept.len();
    (kept, dropped)
}

/// The patient's drills: questions its case answers, put by the patient loop itself to
/// its newest sampler for every case of an update's dialogues (`clinic::patient_drill`).
/// An addition to MrlX, whose 32B patient reads its case unprompted: a 135M patient
/// trained on the doctor's questions alone answered one way whatever its case (exam
/// 0.31 -> 0.33 in 50 steps); with drills it learned to answer by its case (0.31 -> 0.67).
pub(crate) struct Drills {
    pub(crate) tok: Arc<Tokenizer>,
    /// Replies sampled per drill question; 0 turns the drills off.
    pub(crate) samples: usize,
    pub(crate) generation: Generation,
}

impl Drills {
    /// Samples one drill of each distinct case in `items` from `patient`, which is
    /// update `version`; `drilled` counts the drills so far, so that successive ones
    /// walk every question. Each reply becomes an item of its own.
    async fn sample(
        &self,
        patient: &SamplingClient,
        items: &[QueueItem],
        version: u64,
        drilled: &mut usize,
    ) -> anyhow::Result<Vec<QueueItem>> {
        if self.samples == 0 {
            return Ok(Vec::new());
        }
        let mut cases: Vec<&Case> = Vec::new();
        for it in items {
            if !cases.contains(&&it.case) {
                cases.push(&it.case);
            }
        }
        let mut asked = Vec::new();
        for case in cases {
            for q in patient_drill(case, *drilled) {
                asked.push((case, q));
            }
            *drilled += 1;
        }
        let prompts: Vec<String> = asked
            .iter()
            .map(|(case, q)| Dialogue::default().patient_prompt(case, q))
            .collect();
        let generation = Generation {
            seed: self
                .generation
                .seed
                .wrapping_add(version.wrapping_mul(1_000_003)),
            ..self.generation.clone()
        };
        let rollouts =
            sample_prompts(patient, &self.tok, &prompts, self.samples, &generation).await?;
        let mut drills = Vec::new();
        for ((case, q), r) in asked.into_iter().zip(rollouts) {
            for sample in r.samples {
                let reward = patient_reward(&q, &one_line(&sample.text, "Doctor:"), case);
                drills.push(QueueItem {
                    case: case.clone(),
                    replies: vec![(r.prompt.clone(), sample, reward)],
                    version,
                });
            }
        }
        Ok(drills)
    }
}

/// Held while a step's `forward_backward` and `optim_step` are submitted, so that in
/// fallback mode (one session for both roles) the two loops' gradients never mix: the
/// server runs a session's requests in submission order.
pub(crate) type StepLock = Arc<Mutex<()>>;

/// Submits one step under `lock`.
pub(crate) async fn locked_step(
    lock: &StepLock,
    trainer: &TrainingClient,
    data: &[Datum],
    adam: AdamParams,
) -> anyhow::Result<Option<Step>> {
    let _guard = lock.lock().await;
    submit_step(trainer, data, LossFn::ImportanceSampling, adam).await
}

/// The patient's loop: waits for `batch` dialogues (or the queue's close), drops stale
/// ones, samples its drills from its newest sampler (the one `publish` holds), trains on
/// both, publishes a fresh sampler. Returns when the doctor closes the queue and everything
/// left is trained; its per-update records go to `records`.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn patient_loop(
    trainer: TrainingClient,
    drills: Drills,
    lock: StepLock,
    mut queue: mpsc::Receiver<QueueItem>,
    publish: watch::Sender<(u64, SamplingClient)>,
    records: mpsc::UnboundedSender<Value>,
    batch: usize,
    max_staleness: u64,
    adam: AdamParams,
    capacity: usize,
) -> anyhow::Result<()> {
    let mut version = 0u64;
    let mut dropped_total = 0usize;
    let mut drilled = 0usize;
    loop {
        let mut items = Vec::with_capacity(batch);
        let open = queue.recv_many(&mut items, batch).await > 0;
        while open && items.len() < batch {
            let wanted = batch - items.len();
            if queue.recv_many(&mut items, wanted).await == 0 {
                break;
            }
        }
        if items.is_empty() {
            return Ok(());
        }
        let depth = queue.len();
        let received = items.len();
        let staleness: Vec<f64> = items
            .iter()
            .map(|it| version.saturating_sub(it.version) as f64)
            .collect();
        let (mut items, dropped) = drop_stale(items, version, max_staleness);
        dropped_total += dropped;
        let newest = publish.borrow().1.clone();
        let drill_items = drills
            .sample(&newest, &items, version, &mut drilled)
            .await?;
        let drill_rewards: Vec<f64> = drill_items.iter().map(|it| it.replies[0].2).collect();
        let dialogue_rewards: Vec<f64> = items
            .iter()
            .flat_map(|it| it.replies.iter().map(|r| r.2))
            .collect();
        items.extend(drill_items);
        let rewards: Vec<f64> = dialogue_rewards
            .iter()
            .chain(&drill_rewards)
            .copied()
            .collect();
        // Advantages over the whole batch, drills included: the same reply ("Yes.") is
        // then worth more to a question the case confirms than to one it denies, even when
        // every sample of a question agrees. Each dialogue's replies merge into one datum.
        // Per datum: whether its replies come from the current weights (the agreement
        // check's tokens; older ones are off policy by design).
        let mut advantages = group_normalised(&rewards).into_iter();
        let mut data: Vec<Datum> = Vec::new();
        let mut fresh: Vec<bool> = Vec::new();
        for it in &items {
            let turns: Vec<(&[i64], &Sample, f64)> = it
                .replies
                .iter()
                .zip(advantages.by_ref())
                .filter(|(_, adv)| *adv != 0.0)
                .map(|((p, s, _), adv)| (&p[..], s, adv))
                .collect();
            let datums = trajectory_data(&turns);
            fresh.extend(std::iter::repeat_n(it.version == version, datums.len()));
            data.extend(datums);
        }
        // The agreement check comes from the step's own pass; an update that trains on
        // no fresh reply is checked with a forward pass over them first.
        let unchecked = if fresh.contains(&true) {
            None
        } else {
            let replies: Vec<(&[i64], &Sample)> = items
                .iter()
                .filter(|it| it.version == version)
                .flat_map(|it| it.replies.iter().map(|(p, s, _)| (&p[..], s)))
                .collect();
            ratio_mean(&trainer, &replies).await?
        };
        let outcome = match locked_step(&lock, &trainer, &data, adam).await? {
            Some(step) => {
                let outcome = step.finish().await?;
                version += 1;
                let sampler = trainer.save_weights_and_get_sampling_client().await?;
                // `send_replace` keeps the value after the doctor, finished, has dropped
                // its receiver: the drills still need it.
                publish.send_replace((version, sampler));
                Some(outcome)
            }
            None => None,
        };
        let ratio = outcome
            .as_ref()
            .and_then(|o| o.ratio_mean_where(|i| fresh[i]))
            .or(unchecked);
        let _ = records.send(json!({
            "patient_update": version,
            "agents": {"patient": {
                // The replies in the doctor's dialogues.
                "reward_mean": mean_of(&dialogue_rewards),
                "accuracy": full_marks(&dialogue_rewards),
                "drills": drill_rewards.len(),
                "drill_reward_mean": mean_of(&drill_rewards),
                "drill_accuracy": full_marks(&drill_rewards),
                "loss": outcome.as_ref().map(|o| o.loss),
                "datums": data.len(),
                "ratio_mean": ratio,
            }},
            "queue/received": received,
            "queue/depth": depth,
            "queue/capacity": capacity,
            "queue/staleness_mean": mean(&staleness),
            "queue/staleness_max": staleness.iter().copied().fold(0.0, f64::max),
            "queue/dropped": dropped,
            "queue/dropped_total": dropped_total,
        }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_replies_are_dropped() {
        let item = |version| QueueItem {
            case: lathe_recipes::data::cases(0, 0).0[0].clone(),
            replies: vec![(vec![1], Sample::default(), 0.0)],
            version,
        };
        let (kept, dropped) = drop_stale(vec![item(0), item(3), item(5)], 5, 2);
        assert_eq!((kept.len(), dropped), (2, 1));
        assert!(kept.iter().all(|it| it.version >= 3));
    }
}
