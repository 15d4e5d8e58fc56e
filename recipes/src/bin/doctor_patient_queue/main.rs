//! MrlX-TakesTwo's doctor/patient co-training, offline: doctor and patient are two LoRA
//! sessions with their own train/sample loops running concurrently, connected by a bounded
//! in-process queue. The doctor loop plays dialogues against the patient's newest sampler
//! (the doctor asks one question per turn or diagnoses), trains the doctor, and pushes each
//! dialogue's patient replies onto the queue; the patient loop trains off-policy from the
//! queue, drops dialogues older than `--max-staleness` patient updates, and publishes a
//! fresh sampler after every update. Rewards are rules over the synthetic case table
//! (`data::DISEASES`) in place of MrlX's reference F1 and LLM judge:
//!
//! * doctor = 5 for the right diagnosis (exact, as `recipes.md` asks; MrlX's token F1
//!   paid half for "food allergy"), + 1 per answered question
//!   (one `?`, one symptom) about a symptom not yet named in the dialogue that one of the
//!   complaint's possible causes has, − 2 per "sorry" reply, 0 for any other answered
//!   question (the complaint again, a symptom that narrows nothing, a list, no symptom),
//!   − 2 per doctor turn with two or more `?`, − 5 when no diagnosis is given
//!   (MrlX's precedence bug, which penalised a *present* recommendation, is fixed); see
//!   `clinic::doctor_rewards`;
//! * patient, per reply = mean of information control (1 − 0.2 × symptoms volunteered that
//!   were not asked), completeness (1 − 0.2 × asked symptoms not confirmed when the
//!   patient has them, or not denied when it lacks them) and consistency (1 − 0.2 ×
//!   statements contradicting the case); refusing or hedging on a symptom question
//!   counts as both a miss and a contradiction (see `clinic::patient_reward`).
//!
//! The patient also drills itself, an addition to MrlX (whose 32B patient reads its case
//! unprompted): each update, its loop puts three questions per case of the update's
//! dialogues to its newest sampler (a symptom it has, one it lacks, one off the case) and
//! trains on the replies with the dialogues' (`--drill-samples`; see `queue::Drills`).
//!
//! Credit: each doctor turn trains on its reward-to-go (what it and the later turns
//! earned), normalised against the turn at the same position of every dialogue in the
//! step, asking or diagnosing (`--baseline batch`; `group` is MrlX's per-prompt GRPO
//! group). The patient's replies are normalised over its update's batch.
//!
//! The run ends cleanly: when the doctor finishes it closes the queue, the patient trains on
//! what is left and stops. When the second session cannot be created (or with
//! `--force-fallback`) one session plays both roles, still through the queue.
//!
//! Adapted to a small model: prompts are raw text, one line per turn; the doctor's header
//! holds the case table indexed by symptom (the medical knowledge a 32B doctor brings and
//! a 135M one lacks) and a one-shot example; at the turn cap the doctor's line starts
//! with `Diagnosis:`. Without the table (the doctor told only the names it may use) it
//! started at 0.06 held-out and, in 50 steps, learned to diagnose at once without asking,
//! which starved the patient of questions; held-out accuracy never passed 0.22.

mod dialogue;
mod queue;

use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use dialogue::{play, Dialogue, LatestPatient, TURN_TOKENS};
use lathe::types::{AdamParams, Datum};
use lathe::{SamplingClient, Tokenizer};
use lathe_recipes::advantages::normalised_within;
use lathe_recipes::clinic::{
    diagnosis_correct, doctor_rewards, full_marks, patient_exam, patient_reward, DoctorRewards,
};
use lathe_recipes::data::{batch_at, cases, Case};
use lathe_recipes::rollout::{
    ratio_mean, sample_prompts, trajectory_data, Generation, Sample, StepOutcome,
};
use lathe_recipes::run::{mean, mean_of, progress, Curves};
use lathe_recipes::setup::{
    init_tracing, parse_args, save_final, start, AgentSessions, CommonArgs, Start,
};
use queue::{locked_step, patient_loop, Drills, QueueItem, StepLock};
use serde_json::{json, Value};
use tokio::sync::{mpsc, watch};

/// The embedded server's tensors are large and short-lived: see `lathe_server::memory`.
#[global_allocator]
static GLOBAL: lathe_server::memory::MiMalloc = lathe_server::memory::MiMalloc;

/// A doctor and a patient co-trained through a message queue.
#[derive(Parser, Debug)]
#[command(name = "doctor_patient_queue", about)]
struct Args {
    #[command(flatten)]
    common: CommonArgs,
    /// What each doctor turn's reward-to-go is compared with.
    #[arg(long, value_enum, default_value_t = Baseline::Batch)]
    baseline: Baseline,
    /// Dialogues per case (the doctor's RL group; MrlX samples 8 per prompt).
    #[arg(long, default_value_t = 4)]
    group: usize,
    /// Doctor turns per dialogue; the last one must diagnose.
    #[arg(long, default_value_t = 3)]
    max_turns: usize,
    /// Queue capacity in dialogues; a full queue makes the doctor wait.
    #[arg(long, default_value_t = 128)]
    queue_capacity: usize,
    /// Dialogues per patient update (fewer when the doctor has finished); default one
    /// doctor step's worth (batch × group), so the patient keeps pace.
    #[arg(long)]
    patient_batch: Option<usize>,
    /// Dialogues sampled more than this many patient updates ago are dropped.
    #[arg(long, default_value_t = 2)]
    max_staleness: u64,
    /// Temperature of the patient's replies (MrlX's patient tool samples at 0.6).
    #[arg(long, default_value_t = 0.6)]
    patient_temperature: f64,
    /// Nucleus mass of the patient's replies (MrlX: 0.95).
    #[arg(long, default_value_t = 0.95)]
    patient_top_p: f64,
    /// Replies the patient samples to each of its drill questions (three per case of an
    /// update: a symptom it has, one it lacks, one off the case); 0 trains it on the
    /// doctor's dialogues alone, as MrlX.
    #[arg(long, default_value_t = 4)]
    drill_samples: usize,
    /// Temperature of the drill replies: a patient that answers one way whatever its case
    /// must sometimes sample the other answer to learn which is right.
    #[arg(long, default_value_t = 1.0)]
    drill_temperature: f64,
    /// The patient's Adam learning rate (default: the doctor's, `--lr`). In fallback
    /// mode one session plays both roles and each loop's steps use its own rate.
    #[arg(long)]
    patient_lr: Option<f64>,
}

const DOCTOR: usize = 0;
const PATIENT: usize = 1;
/// Held-out dialogues written to `samples.jsonl` per evaluation.
const EXAMPLES: usize = 4;

/// What a doctor turn's reward-to-go is compared with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Baseline {
    /// The turn at the same position of every dialogue in the step: a doctor that gives
    /// one diagnosis to every patient is still told which patients it got wrong. (With
    /// the baseline keyed by the kind of turn, the greedy doctor still converged on one
    /// diagnosis for most patients: `recipes/doctor_patient_queue.md`.)
    Batch,
    /// The turn at the same position of the case's own dialogues (GRPO's group, as
    /// MrlX): once a group agrees it carries no signal.
    Group,
}

/// The doctor's training data: each turn carries its reward-to-go
/// ([`DoctorRewards::returns`]) normalised against the turns at the same position
/// (the first turn of every dialogue, the second, ...) within the `baseline`'s scope; a
/// dialogue's turns merge into one datum.
///
/// The position, not the kind of turn, is the baseline's key: at each position the
/// doctor chooses between asking and diagnosing, and a baseline that depends on the
/// choice (questions against questions, diagnoses against diagnoses) cancels the very
/// signal that should tell it which is worth more. Keyed by kind, a first-turn diagnosis
/// was compared with the diagnoses forced after two questions, never with a question.
fn doctor_data(
    dialogues: &[(usize, Dialogue)],
    rewards: &[DoctorRewards],
    baseline: Baseline,
) -> Vec<Datum> {
    let scope = |case: usize| match baseline {
        Baseline::Batch => None,
        Baseline::Group => Some(case),
    };
    let to_go: Vec<Vec<f64>> = rewards.iter().map(DoctorRewards::returns).collect();
    let mut returns = Vec::new();
    let mut keys = Vec::new();
    for ((case, d), g) in dialogues.iter().zip(&to_go) {
        debug_assert_eq!(g.len(), d.doctor_samples.len(), "one return per turn");
        for (position, &r) in g.iter().enumerate() {
            returns.push(r);
            keys.push((scope(*case), position));
        }
    }
    let mut advantages = normalised_within(&returns, &keys).into_iter();
    let mut data = Vec::new();
    for ((_, d), g) in dialogues.iter().zip(&to_go) {
        // Every return takes its advantage off the iterator, trained on or not.
        let turn_advantages: Vec<f64> = advantages.by_ref().take(g.len()).collect();
        let turns: Vec<(&[i64], &Sample, f64)> = d
            .doctor_samples
            .iter()
            .zip(turn_advantages)
            .filter(|(_, adv)| *adv != 0.0)
            .map(|((p, s), adv)| (&p[..], s, adv))
            .collect();
        data.extend(trajectory_data(&turns));
    }
    data
}

/// The patient's held-out exam.
struct Exam {
    /// Mean reward of the replies.
    reward: f64,
    /// The fraction of replies with full marks.
    correct: f64,
    /// The first few cases' questions, replies and rewards, for `samples.jsonl`.
    examples: Vec<Value>,
}

/// Puts every held-out case's exam questions to `patient`, greedily.
async fn examine_patient(
    patient: &SamplingClient,
    tok: &Tokenizer,
    held_out: &[Case],
    greedy: &Generation,
) -> anyhow::Result<Exam> {
    let mut asked = Vec::new();
    let mut prompts = Vec::new();
    for (i, case) in held_out.iter().enumerate() {
        for q in patient_exam(case, i) {
            prompts.push(Dialogue::default().patient_prompt(case, &q));
            asked.push((case, q));
        }
    }
    let replies = sample_prompts(patient, tok, &prompts, 1, greedy).await?;
    let rewards: Vec<f64> = asked
        .iter()
        .zip(&replies)
        .map(|((case, q), r)| patient_reward(q, r.samples[0].text.trim(), case))
        .collect();
    let examples = asked
        .iter()
        .zip(&replies)
        .zip(&rewards)
        .take(EXAMPLES * 3)
        .map(|(((case, q), r), reward)| {
            json!({
                "symptoms": case.symptoms,
                "question": q,
                "reply": r.samples[0].text.trim(),
                "reward": reward,
            })
        })
        .collect();
    Ok(Exam {
        reward: mean(&rewards),
        correct: full_marks(&rewards).unwrap_or(0.0),
        examples,
    })
}

/// Held-out numbers from greedy dialogues.
struct Eval {
    diagnosis_accuracy: f64,
    doctor_reward: f64,
    /// Mean reward of the patient's replies in the doctor's dialogues (none when the
    /// doctor asked nothing).
    patient_reward: Option<f64>,
    /// The patient's exam.
    exam: Exam,
    /// The first few dialogues, for `samples.jsonl`.
    examples: Vec<Value>,
}

impl Eval {
    fn to_json(&self) -> Value {
        json!({
            "doctor_diagnosis_accuracy": self.diagnosis_accuracy,
            "doctor_reward": self.doctor_reward,
            "patient_reward": self.patient_reward,
            "patient_exam_reward": self.exam.reward,
            "patient_exam_correct": self.exam.correct,
        })
    }
}

/// What a held-out evaluation needs besides the doctor's weights.
struct HeldOut<'a> {
    cases: &'a [Case],
    patient: &'a LatestPatient,
    tok: &'a Tokenizer,
    max_turns: usize,
    greedy: &'a Generation,
}

impl HeldOut<'_> {
    /// Evaluates `doctor` and the latest patient, and adds the point at `step` to both
    /// curves.
    async fn evaluate(
        &self,
        doctor: &SamplingClient,
        step: usize,
        curves: &mut Curves,
    ) -> anyhow::Result<Eval> {
        let e = evaluate(doctor, self).await?;
        curves.push("doctor diagnosis accuracy", step, e.diagnosis_accuracy);
        curves.push("patient exam correct", step, e.exam.correct);
        Ok(e)
    }
}

async fn evaluate(doctor: &SamplingClient, h: &HeldOut<'_>) -> anyhow::Result<Eval> {
    let HeldOut {
        cases: held_out,
        patient,
        tok,
        max_turns,
        greedy,
    } = *h;
    let dialogues = play(doctor, patient, tok, held_out, 1, max_turns, greedy, greedy).await?;
    let (correct, doctor, patient_rewards) = score(&dialogues, held_out);
    let doctor_rewards: Vec<f64> = doctor.iter().map(DoctorRewards::total).collect();
    let examples = dialogues
        .iter()
        .take(EXAMPLES)
        .map(|(c, d)| {
            json!({
                "disease": held_out[*c].disease.name,
                "complaint": held_out[*c].complaint,
                "turns": d.turns,
                "diagnosis": d.diagnosis,
            })
        })
        .collect();
    let latest = patient.borrow().1.clone();
    let exam = examine_patient(&latest, tok, held_out, greedy).await?;
    Ok(Eval {
        diagnosis_accuracy: mean(&correct),
        doctor_reward: mean(&doctor_rewards),
        patient_reward: mean_of(&patient_rewards),
        exam,
        examples,
    })
}

/// Per dialogue: diagnosis correct (0/1), the doctor's rewards; per reply: patient reward.
fn score(
    dialogues: &[(usize, Dialogue)],
    cases: &[Case],
) -> (Vec<f64>, Vec<DoctorRewards>, Vec<f64>) {
    let mut correct = Vec::new();
    let mut doctor = Vec::new();
    let mut patient = Vec::new();
    for (c, d) in dialogues {
        let case = &cases[*c];
        correct.push(f64::from(u8::from(
            d.diagnosis
                .as_deref()
                .is_some_and(|t| diagnosis_correct(t, case)),
        )));
        doctor.push(doctor_rewards(
            d.diagnosis.as_deref(),
            d.turns
                .iter()
                .map(|(q, reply)| (q.as_str(), reply.as_str())),
            case,
        ));
        patient.extend(d.turns.iter().map(|(q, a)| patient_reward(q, a, case)));
    }
    (correct, doctor, patient)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    init_tracing();
    // 50 doctor steps: `recipes.md` gives the doctor 50 steps to gain 0.2 held-out; the
    // rest: `recipes/doctor_patient_queue.md`.
    let args: Args = parse_args(&[
        ("steps", "50"),
        ("lr", "2e-4"),
        ("batch", "8"),
        ("temperature", "1.0"),
        ("eval_every", "5"),
        ("eval_size", "64"),
    ]);
    let c = &args.common;
    let steps = c.steps;
    let Start { mut run, conn, tok } = start("doctor_patient_queue", c).await?;
    // Shared with the patient loop, which samples its drills.
    let tok = Arc::new(tok);
    let sessions = AgentSessions::open(&conn, 2, c.force_fallback, |i| c.lora(i)).await?;
    let mode = sessions.mode();
    let doctor = sessions.trainer(DOCTOR).clone();
    let patient = sessions.trainer(PATIENT).clone();
    let (train, held_out) = cases(c.seed, c.eval_size);
    let adam = AdamParams {
        learning_rate: c.lr,
        ..Default::default()
    };

    let (queue_tx, queue_rx) = mpsc::channel::<QueueItem>(args.queue_capacity.max(1));
    let first_patient = patient.save_weights_and_get_sampling_client().await?;
    let (publish, latest_patient) = watch::channel((0u64, first_patient));
    let (records_tx, mut records_rx) = mpsc::unbounded_channel();
    let doctor_lock = StepLock::default();
    let patient_lock = if sessions.distinct() == 2 {
        StepLock::default()
    } else {
        doctor_lock.clone()
    };
    let drills = Drills {
        tok: Arc::clone(&tok),
        samples: args.drill_samples,
        generation: Generation::sampled(
            TURN_TOKENS,
            args.drill_temperature,
            c.step_seed(0).wrapping_add(0x5eed),
        )
        .within(conn.max_context)
        .stop_at(&["\n", "Doctor:"]),
    };
    let patient_task = tokio::spawn(patient_loop(
        patient.clone(),
        drills,
        patient_lock,
        queue_rx,
        publish,
        records_tx,
        args.patient_batch.unwrap_or(c.batch * args.group).max(1),
        args.max_staleness,
        AdamParams {
            learning_rate: args.patient_lr.unwrap_or(adam.learning_rate),
            ..adam
        },
        args.queue_capacity,
    ));

    let greedy = Generation::greedy(TURN_TOKENS).within(conn.max_context);
    let exam = HeldOut {
        cases: &held_out,
        patient: &latest_patient,
        tok: &tok,
        max_turns: args.max_turns,
        greedy: &greedy,
    };
    let mut curves = Curves::new(&["doctor diagnosis accuracy", "patient exam correct"]);
    let bar = progress(steps);
    bar.set_prefix(mode);
    let mut sent = 0usize;
    for step in 0..=steps {
        while let Ok(record) = records_rx.try_recv() {
            run.log(&record)?;
        }
        let doctor_sampler = doctor.save_weights_and_get_sampling_client().await?;
        let patient_version = latest_patient.borrow().0;
        // The last point is taken after the patient has drained the queue, below.
        if step % c.eval_every.max(1) == 0 && step < steps {
            let e = exam.evaluate(&doctor_sampler, step, &mut curves).await?;
            run.log(
                &json!({"step": step, "patient_version": patient_version, "eval": e.to_json()}),
            )?;
            run.sample(&json!({
                "step": step,
                "dialogues": e.examples,
                "exam": e.exam.examples,
            }))?;
            bar.set_message(format!(
                "held-out diagnosis {:.2}, patient exam {:.2}",
                e.diagnosis_accuracy, e.exam.correct
            ));
        }
        if step == steps {
            break;
        }
        let batch: Vec<Case> = batch_at(&train, step, c.batch);
        let doctor_generation = Generation::sampled(TURN_TOKENS, c.temperature, c.step_seed(step))
            .within(conn.max_context);
        let patient_generation = Generation {
            temperature: args.patient_temperature,
            top_p: args.patient_top_p,
            ..doctor_generation.clone()
        };
        let dialogues = play(
            &doctor_sampler,
            &latest_patient,
            &tok,
            &batch,
            args.group.max(1),
            args.max_turns,
            &doctor_generation,
            &patient_generation,
        )
        .await?;
        let (correct, rewards, patient_rewards) = score(&dialogues, &batch);

        let data = doctor_data(&dialogues, &rewards, args.baseline);
        // The agreement check comes from the step's own pass; a step with nothing to
        // train on is checked with a forward pass over the first turns.
        let unchecked = if data.is_empty() {
            let firsts: Vec<(&[i64], &Sample)> = dialogues
                .iter()
                .filter_map(|(_, d)| d.doctor_samples.first())
                .map(|(p, s)| (&p[..], s))
                .collect();
            ratio_mean(&doctor, &firsts).await?
        } else {
            None
        };
        let step_future = locked_step(&doctor_lock, &doctor, &data, adam).await?;

        // The dialogues' patient sides go onto the queue while the doctor trains; one
        // without a question still brings its case to the patient's drills (a doctor that
        // stopped asking starved the patient of updates).
        let mut queued = 0;
        for (c_idx, d) in &dialogues {
            let item = QueueItem {
                case: batch[*c_idx].clone(),
                replies: d
                    .patient_samples
                    .iter()
                    .zip(&d.turns)
                    .map(|((prompt, sample, _), (q, a))| {
                        (
                            prompt.clone(),
                            sample.clone(),
                            patient_reward(q, a, &batch[*c_idx]),
                        )
                    })
                    .collect(),
                version: d
                    .patient_samples
                    .iter()
                    .map(|p| p.2)
                    .min()
                    .unwrap_or(patient_version),
            };
            queue_tx
                .send(item)
                .await
                .map_err(|_| anyhow::anyhow!("the patient loop stopped early"))?;
            queued += 1;
        }
        sent += queued;
        let outcome = match step_future {
            Some(s) => Some(s.finish().await?),
            None => None,
        };
        run.log(&json!({
            "step": step + 1,
            "mode": mode,
            "patient_version": patient_version,
            "queue/sent": queued,
            "queue/depth": args.queue_capacity - queue_tx.capacity(),
            "agents": {"doctor": {
                "reward_mean": mean(&rewards.iter().map(DoctorRewards::total).collect::<Vec<_>>()),
                "accuracy": mean(&correct),
                "loss": outcome.as_ref().map(|o| o.loss),
                "datums": data.len(),
                // Doctor turns sampled; a dialogue's turns merge into one datum.
                "turns": dialogues.iter().map(|(_, d)| d.doctor_samples.len()).sum::<usize>(),
                "ratio_mean": outcome.as_ref().and_then(StepOutcome::ratio_mean).or(unchecked),
                "patient_reward_mean": mean_of(&patient_rewards),
            }},
        }))?;
        bar.inc(1);
    }
    bar.finish();

    // Clean termination: closing the queue ends the patient loop once it has trained on
    // what is left.
    drop(queue_tx);
    eprintln!(
        "doctor finished; waiting for the patient to drain the queue ({sent} dialogues sent)"
    );
    tokio::time::timeout(Duration::from_secs(600), patient_task)
        .await
        .map_err(|_| anyhow::anyhow!("the patient loop did not finish within 10 minutes"))???;
    while let Ok(record) = records_rx.try_recv() {
        run.log(&record)?;
    }
    // Final held-out numbers with both final weights.
    let doctor_sampler = doctor.save_weights_and_get_sampling_client().await?;
    let e = exam.evaluate(&doctor_sampler, steps, &mut curves).await?;
    run.log(&json!({"step": steps, "final": true, "eval": e.to_json()}))?;
    run.sample(&json!({
        "step": steps,
        "final": true,
        "dialogues": e.examples,
        "exam": e.exam.examples,
    }))?;

    let mut checkpoints = serde_json::Map::new();
    if sessions.distinct() == 2 {
        checkpoints.insert("doctor".into(), save_final(&doctor, "doctor-final").await?);
        checkpoints.insert(
            "patient".into(),
            save_final(&patient, "patient-final").await?,
        );
    } else {
        checkpoints.insert(
            "shared".into(),
            save_final(&doctor, "doctor-patient-shared-final").await?,
        );
    }
    let (dx_before, dx_after) = curves.before_after("doctor diagnosis accuracy");
    let (pt_before, pt_after) = curves.before_after("patient exam correct");
    let passed = dx_after - dx_before >= CRITERION_DOCTOR_GAIN
        && pt_after - pt_before >= CRITERION_PATIENT_GAIN;
    let criterion = format!(
        "held-out doctor diagnosis accuracy rises by >= {CRITERION_DOCTOR_GAIN} and the patient's exam score (replies with full marks) by >= {CRITERION_PATIENT_GAIN}"
    );
    let summary = json!({
        "recipe": "doctor_patient_queue",
        "mode": mode,
        "fallback_reason": sessions.fallback_reason,
        "steps": steps,
        "patient_dialogues_sent": sent,
        "base_model": conn.base_model,
        "held_out": curves.to_json(),
        "criterion": criterion,
        "passed": passed,
        "checkpoints": checkpoints,
    });
    run.summary(&summary)?;
    let plotted = curves.plot(&run, &format!("doctor_patient_queue ({mode})"), "held-out")?;
    println!("mode: {mode}");
    curves.report(&run, plotted);
    for (role, ck) in &checkpoints {
        println!("checkpoint {role}: {}", ck["state"].as_str().unwrap_or(""));
    }
    if c.check && !passed {
        anyhow::bail!("criterion not met: {criterion}");
    }
    Ok(())
}

/// The targets of `recipes.md` (doctor +0.2 within 50 steps; the patient's +0.1 applied
/// to its exam, since its mean reply reward starts above 0.9). Met on the default model:
/// the default 50-step run took held-out diagnosis 0.23 -> 0.59 and the exam 0.32 ->
/// 0.67 (one run; the curves are in the README's recipe table, the runs before it in
/// `recipes/doctor_patient_queue.md`).
const CRITERION_DOCTOR_GAIN: f64 = 0.2;
const CRITERION_PATIENT_GAIN: f64 = 0.1;

#[cfg(test)]
mod tests {
    use super::*;
    use lathe_recipes::advantages::group_normalised;
    use lathe_recipes::data::DISEASES;

    fn case(disease: usize, complaint: usize) -> Case {
        let d = DISEASES[disease];
        Case {
            disease: d,
            complaint: d.symptoms[complaint],
            symptoms: d.symptoms[..3].to_vec(),
        }
    }

    /// A dialogue of `questions` then `diagnosis`; each doctor turn's prompt extends the
    /// one before, as in a real transcript.
    fn dialogue(questions: &[(&str, &str)], diagnosis: &str) -> Dialogue {
        let mut prompt = vec![1, 2, 3];
        let mut d = Dialogue::default();
        for (i, (q, a)) in questions.iter().enumerate() {
            let sample = Sample {
                tokens: vec![10 + i as i64],
                logprobs: vec![-1.0],
                text: q.to_string(),
            };
            d.doctor_samples.push((prompt.clone(), sample.clone()));
            prompt.extend(&sample.tokens);
            prompt.push(99); // the patient's reply
            d.turns.push((q.to_string(), a.to_string()));
        }
        let sample = Sample {
            tokens: vec![50],
            logprobs: vec![-1.0],
            text: diagnosis.into(),
        };
        d.doctor_samples.push((prompt, sample));
        d.diagnosis = Some(diagnosis.into());
        d
    }

    fn advantages(data: &[Datum]) -> Vec<Vec<f64>> {
        data.iter()
            .map(|d| d.loss_fn_inputs["advantages"].data.clone())
            .collect()
    }

    #[test]
    fn each_doctor_turn_is_compared_with_the_same_position_of_the_batch() {
        let flu = case(0, 0); // fever
        let cold = case(1, 0); // cough
        let chills = ("Question: Do you have chills?", "Yes.");
        let dialogues = vec![
            (0, dialogue(&[chills], "flu")),
            (0, dialogue(&[chills], "migraine")),
            (1, dialogue(&[], "common cold")),
            (1, dialogue(&[], "common cold")),
        ];
        let cases = [flu, cold];
        let (_, rewards, _) = score(&dialogues, &cases);
        let batch = advantages(&doctor_data(&dialogues, &rewards, Baseline::Batch));
        // First turns: two questions (6 and 1 to go) and two diagnoses (5 each), one
        // choice against the other; second turns: the diagnoses after a question, 5 and 0.
        let first_turns = group_normalised(&[6.0, 1.0, 5.0, 5.0]);
        let second_turns = group_normalised(&[5.0, 0.0]);
        assert_eq!(batch.len(), 4, "{batch:?}");
        let first = |a: &Vec<f64>| a.iter().copied().find(|x| *x != 0.0).unwrap();
        let last = |a: &Vec<f64>| *a.last().unwrap();
        for (i, a) in batch.iter().enumerate() {
            assert!((first(a) - first_turns[i]).abs() < 1e-6, "{batch:?}");
        }
        assert!((last(&batch[0]) - second_turns[0]).abs() < 1e-6);
        assert!((last(&batch[1]) - second_turns[1]).abs() < 1e-6);
        // The two diagnoses at once score alike, above the first turns' mean.
        assert!(first(&batch[2]) > 0.0 && first(&batch[2]) == first(&batch[3]));
        // Within each case's own group, the agreeing second case carries no signal.
        let group = advantages(&doctor_data(&dialogues, &rewards, Baseline::Group));
        assert_eq!(group.len(), 2, "{group:?}");
    }
}
