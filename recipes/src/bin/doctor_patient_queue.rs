//! MrlX-TakesTwo's doctor/patient co-training, offline: doctor and patient are two LoRA
//! sessions with their own train/sample loops running concurrently, connected by a bounded
//! in-process queue. The doctor loop plays dialogues against the patient's newest sampler
//! (the doctor asks one question per turn or diagnoses), trains the doctor, and pushes each
//! dialogue's patient replies onto the queue; the patient loop trains off-policy from the
//! queue, drops dialogues older than `--max-staleness` patient updates, and publishes a
//! fresh sampler after every update. Rewards are rules over the synthetic case table (`data::DISEASES`)
//! in place of MrlX's reference F1 and LLM judge:
//!
//! * doctor = 5 × token F1 of the diagnosis with the reference, + 1 per answered question
//!   about a symptom not yet named in the dialogue, − 2 per "sorry" reply, 0 for any other
//!   answered question (the complaint again, or no symptom at all),
//!   − 2 per doctor turn with two or more `?`, − 5 when no diagnosis is given
//!   (MrlX's precedence bug, which penalised a *present* recommendation, is fixed); see
//!   `clinic::doctor_reward`;
//! * patient, per reply = mean of information control (1 − 0.2 × symptoms volunteered that
//!   were not asked), completeness (1 − 0.2 × asked symptoms the patient has but did not
//!   confirm) and consistency (1 − 0.2 × statements contradicting the case).
//!
//! The run ends cleanly: when the doctor finishes it closes the queue, the patient trains on
//! what is left and stops. When the second session cannot be created (or with
//! `--force-fallback`) one session plays both roles, still through the queue.
//!
//! Adapted to a small model: prompts are raw text, one line per turn; the doctor's header
//! holds the case table's diseases and symptoms (the medical knowledge a 135M model lacks)
//! and a one-shot example; at the turn cap the doctor's line starts with `Diagnosis:`.

use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use lathe::types::{AdamParams, Datum, LossFn};
use lathe::{SamplingClient, Tokenizer, TrainingClient};
use lathe_recipes::advantages::group_normalised;
use lathe_recipes::clinic::{
    diagnosis_correct, doctor_reward, patient_exam, patient_reward, SORRY,
};
use lathe_recipes::data::{batch_at, cases, Case, DISEASES};
use lathe_recipes::rollout::{
    ratio_mean, sample_prompts, submit_step, trajectory_data, Generation, Sample, Step, StepOutcome,
};
use lathe_recipes::run::{mean, progress, Curves};
use lathe_recipes::setup::{init_tracing, save_final, start, AgentSessions, CommonArgs, Start};
use serde_json::{json, Value};
use tokio::sync::{mpsc, watch, Mutex};

/// A doctor and a patient co-trained through a message queue.
#[derive(Parser, Debug)]
#[command(name = "doctor_patient_queue", about)]
struct Args {
    #[command(flatten)]
    common: CommonArgs,
    /// Use one session for both roles even if two could be created.
    #[arg(long)]
    force_fallback: bool,
    /// Cases per doctor step.
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// Dialogues per case (the doctor's RL group; MrlX samples 8 per prompt).
    #[arg(long, default_value_t = 8)]
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
    /// Evaluate on held-out cases every this many doctor steps.
    #[arg(long, default_value_t = 4)]
    eval_every: usize,
    /// Held-out cases.
    #[arg(long, default_value_t = 18)]
    eval_size: usize,
    /// Sampling temperature of the doctor's training dialogues (MrlX's 1.0: at 0.7 the
    /// doctor collapsed to one diagnosis for every patient, held-out 0.22 -> 0.06 in 8
    /// steps, at `--lr 1e-4` too, since a group whose samples all agree carries no
    /// signal back).
    #[arg(long, default_value_t = 1.0)]
    temperature: f64,
    /// Temperature of the patient's replies (MrlX's patient tool samples at 0.6).
    #[arg(long, default_value_t = 0.6)]
    patient_temperature: f64,
    /// Nucleus mass of the patient's replies (MrlX: 0.95).
    #[arg(long, default_value_t = 0.95)]
    patient_top_p: f64,
}

/// Adam learning rate when `--lr` is not given: at 5e-4 the doctor collapsed to one
/// diagnosis for every patient within four steps.
const DEFAULT_LR: f64 = 2e-4;
const DOCTOR: usize = 0;
const PATIENT: usize = 1;
const TURN_TOKENS: usize = 16;
/// Held-out dialogues written to `samples.jsonl` per evaluation.
const EXAMPLES: usize = 4;

/// The doctor's instructions. A 32B doctor knows medicine; a 135M one knows none of the
/// synthetic table, so the header gives it the table as its textbook, indexed by symptom
/// ("fever: flu or strep throat."): a small model finds the complaint's line and copies
/// what follows it more readily than it finds the disease whose list holds the complaint.
/// Measured on the base model over all 24 disease × complaint openings, greedy: 0.38 of
/// first-turn diagnoses right with the index, 0.25 with the table by disease.
fn doctor_header() -> String {
    let mut symptoms: Vec<&str> = Vec::new();
    for d in DISEASES {
        for s in d.symptoms {
            if !symptoms.contains(&s) {
                symptoms.push(s);
            }
        }
    }
    let index: String = symptoms
        .iter()
        .map(|s| {
            let causes: Vec<&str> = DISEASES
                .iter()
                .filter(|d| d.symptoms.contains(s))
                .map(|d| d.name)
                .collect();
            format!("{s}: {}.\n", causes.join(" or "))
        })
        .collect();
    format!(
        "You are a doctor. Each symptom and the diseases that cause it:\n{index}Each turn, ask 'Question: Do you have <symptom>?' or answer 'Diagnosis: <disease>'.\nExample:\nPatient: I have a rash.\nDoctor: Question: Do you have itchy eyes?\nPatient: Yes.\nDoctor: Diagnosis: allergy.\nA new patient:\n"
    )
}

fn patient_header(case: &Case) -> String {
    format!(
        "You are a patient. Answer the doctor in one short sentence about your symptoms only; if a question is not about symptoms, say '{SORRY}'\nComplaint: {}. Symptoms: {}.\n",
        case.complaint,
        case.symptoms.join(", ")
    )
}

/// One doctor/patient exchange so far.
#[derive(Debug, Clone, Default)]
struct Dialogue {
    /// `(question line, patient reply)` pairs.
    turns: Vec<(String, String)>,
    /// The diagnosis line, once given.
    diagnosis: Option<String>,
    /// The doctor's samples with their prompts, one per turn.
    doctor_samples: Vec<(Vec<i64>, Sample)>,
    /// The patient's samples with their prompts and the patient update that sampled
    /// them, one per reply.
    patient_samples: Vec<(Vec<i64>, Sample, u64)>,
    /// Doctor turns with two or more question marks.
    multi_questions: usize,
}

impl Dialogue {
    fn transcript(&self, case: &Case, doctor_view: bool) -> String {
        let mut s = if doctor_view {
            format!("{}Patient: I have {}.\n", doctor_header(), case.complaint)
        } else {
            format!(
                "{}Patient: I have {}.\n",
                patient_header(case),
                case.complaint
            )
        };
        for (q, a) in &self.turns {
            s.push_str(&format!("Doctor: {q}\nPatient: {a}\n"));
        }
        s
    }

    /// The doctor's next prompt; at the cap it opens the diagnosis line.
    fn doctor_prompt(&self, case: &Case, last_turn: bool) -> String {
        let mut s = self.transcript(case, true);
        s.push_str(if last_turn {
            "Doctor: Diagnosis:"
        } else {
            "Doctor:"
        });
        s
    }

    /// The patient's prompt for a reply to `question`.
    fn patient_prompt(&self, case: &Case, question: &str) -> String {
        format!(
            "{}Doctor: {question}\nPatient:",
            self.transcript(case, false)
        )
    }
}

/// The exam's mean reward and the fraction of replies with full marks.
async fn examine_patient(
    patient: &SamplingClient,
    tok: &Tokenizer,
    held_out: &[Case],
    greedy: &Generation,
) -> anyhow::Result<(f64, f64)> {
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
    let perfect: Vec<f64> = rewards
        .iter()
        .map(|&r| f64::from(u8::from(r >= 1.0 - 1e-9)))
        .collect();
    Ok((mean(&rewards), mean(&perfect)))
}

/// A turn's text without the other speaker's label it was stopped at.
fn one_line(text: &str, other: &str) -> String {
    text.trim().trim_end_matches(other).trim().to_string()
}

/// The patient's newest sampler and its update count, published by the patient loop.
type LatestPatient = watch::Receiver<(u64, SamplingClient)>;

/// Plays `group` dialogues of every case: doctor turns with `doctor`, replies with
/// `patient`; every stage samples all open dialogues at once.
#[allow(clippy::too_many_arguments)]
async fn play(
    doctor: &SamplingClient,
    patient: &LatestPatient,
    tok: &Tokenizer,
    cases: &[Case],
    group: usize,
    max_turns: usize,
    doctor_generation: &Generation,
    patient_generation: &Generation,
) -> anyhow::Result<Vec<(usize, Dialogue)>> {
    let mut dialogues: Vec<(usize, Dialogue)> = (0..cases.len())
        .flat_map(|c| (0..group).map(move |_| (c, Dialogue::default())))
        .collect();
    for turn in 0..max_turns.max(1) {
        let last = turn + 1 == max_turns.max(1);
        let open: Vec<usize> = (0..dialogues.len())
            .filter(|&i| dialogues[i].1.diagnosis.is_none())
            .collect();
        if open.is_empty() {
            break;
        }
        // A line ends a turn; a small model that writes the patient's line too is cut
        // there.
        let doctor_gen = Generation {
            max_tokens: TURN_TOKENS,
            seed: doctor_generation.seed.wrapping_add(turn as u64 * 31),
            ..doctor_generation.clone()
        }
        .stop_at(&["\n", "Patient:"]);
        // The first turn's prompt is the same for a case's whole group: one request with
        // `group` samples, so the server prefills it once.
        let lines: Vec<(Vec<i64>, Sample)> = if turn == 0 {
            let prompts: Vec<String> = cases
                .iter()
                .map(|case| Dialogue::default().doctor_prompt(case, last))
                .collect();
            sample_prompts(doctor, tok, &prompts, group, &doctor_gen)
                .await?
                .into_iter()
                .flat_map(|r| {
                    let prompt = r.prompt;
                    r.samples.into_iter().map(move |s| (prompt.clone(), s))
                })
                .collect()
        } else {
            let prompts: Vec<String> = open
                .iter()
                .map(|&i| dialogues[i].1.doctor_prompt(&cases[dialogues[i].0], last))
                .collect();
            sample_prompts(doctor, tok, &prompts, 1, &doctor_gen)
                .await?
                .into_iter()
                .map(|r| (r.prompt, r.samples.into_iter().next().unwrap_or_default()))
                .collect()
        };
        let mut questions = Vec::new();
        for (&i, (prompt, sample)) in open.iter().zip(lines) {
            let line = one_line(&sample.text, "Patient:");
            let d = &mut dialogues[i].1;
            d.doctor_samples.push((prompt, sample));
            if last {
                d.diagnosis = Some(line);
            } else if let Some(at) = line.find("Diagnosis:") {
                d.diagnosis = Some(line[at + "Diagnosis:".len()..].to_string());
            } else {
                if line.matches('?').count() >= 2 {
                    d.multi_questions += 1;
                }
                questions.push((i, line));
            }
        }
        if questions.is_empty() {
            continue;
        }
        let prompts: Vec<String> = questions
            .iter()
            .map(|(i, q)| dialogues[*i].1.patient_prompt(&cases[dialogues[*i].0], q))
            .collect();
        let patient_gen = Generation {
            max_tokens: TURN_TOKENS,
            seed: doctor_gen.seed.wrapping_add(17),
            ..patient_generation.clone()
        }
        .stop_at(&["\n", "Doctor:"]);
        // The patient's newest weights, as MrlX's doctor queries the patient's router.
        let (version, sampler) = patient.borrow().clone();
        let replies = sample_prompts(&sampler, tok, &prompts, 1, &patient_gen).await?;
        for ((i, q), r) in questions.into_iter().zip(replies) {
            let sample = r.samples.into_iter().next().unwrap_or_default();
            let d = &mut dialogues[i].1;
            d.turns.push((q, one_line(&sample.text, "Doctor:")));
            d.patient_samples.push((r.prompt, sample, version));
        }
    }
    Ok(dialogues)
}

/// One dialogue's patient side on the queue.
#[derive(Debug, Clone)]
struct QueueItem {
    /// Per reply: its prompt, the sample and its reward.
    replies: Vec<(Vec<i64>, Sample, f64)>,
    /// The oldest patient update any of the replies was sampled from.
    version: u64,
}

/// Drops items older than `max_staleness` updates; returns the kept items and how many
/// were dropped.
fn drop_stale(items: Vec<QueueItem>, version: u64, max_staleness: u64) -> (Vec<QueueItem>, usize) {
    let before = items.len();
    let kept: Vec<QueueItem> = items
        .into_iter()
        .filter(|it| version.saturating_sub(it.version) <= max_staleness)
        .collect();
    let dropped = before - kept.len();
    (kept, dropped)
}

/// Held while a step's `forward_backward` and `optim_step` are submitted, so that in
/// fallback mode (one session for both roles) the two loops' gradients never mix: the
/// server runs a session's requests in submission order.
type StepLock = Arc<Mutex<()>>;

/// Submits one step under `lock`.
async fn locked_step(
    lock: &StepLock,
    trainer: &TrainingClient,
    data: &[Datum],
    adam: AdamParams,
) -> anyhow::Result<Option<Step>> {
    let _guard = lock.lock().await;
    submit_step(trainer, data, LossFn::ImportanceSampling, adam).await
}

/// The patient's loop: waits for `batch` replies (or the queue's close), drops stale
/// ones, trains, publishes a fresh sampler. Returns its per-update records when the doctor
/// closes the queue and everything left is trained.
#[allow(clippy::too_many_arguments)]
async fn patient_loop(
    trainer: TrainingClient,
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
        let (items, dropped) = drop_stale(items, version, max_staleness);
        dropped_total += dropped;
        let rewards: Vec<f64> = items
            .iter()
            .flat_map(|it| it.replies.iter().map(|r| r.2))
            .collect();
        // Advantages over the whole batch; each dialogue's replies merge into one datum.
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
                // The doctor may have finished and dropped its receiver; that is fine.
                let _ = publish.send((version, sampler));
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
                "reward_mean": mean(&rewards),
                // Replies with full marks.
                "accuracy": rewards.iter().filter(|&&r| r >= 1.0 - 1e-9).count() as f64
                    / rewards.len().max(1) as f64,
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

/// Held-out numbers from greedy dialogues.
struct Eval {
    diagnosis_accuracy: f64,
    doctor_reward: f64,
    /// Mean reward of the patient's replies in the doctor's dialogues.
    patient_reward: f64,
    /// The patient's exam: mean reward, and the fraction of replies with full marks.
    exam_reward: f64,
    exam_correct: f64,
    /// The first few dialogues, for `samples.jsonl`.
    examples: Vec<Value>,
}

impl Eval {
    fn to_json(&self) -> Value {
        json!({
            "doctor_diagnosis_accuracy": self.diagnosis_accuracy,
            "doctor_reward": self.doctor_reward,
            "patient_reward": self.patient_reward,
            "patient_exam_reward": self.exam_reward,
            "patient_exam_correct": self.exam_correct,
        })
    }
}

async fn evaluate(
    doctor: &SamplingClient,
    patient: &LatestPatient,
    tok: &Tokenizer,
    held_out: &[Case],
    max_turns: usize,
    greedy: &Generation,
) -> anyhow::Result<Eval> {
    let dialogues = play(doctor, patient, tok, held_out, 1, max_turns, greedy, greedy).await?;
    let (correct, doctor_rewards, patient_rewards) = score(&dialogues, held_out);
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
    let (exam_reward, exam_correct) = examine_patient(&latest, tok, held_out, greedy).await?;
    Ok(Eval {
        diagnosis_accuracy: mean(&correct),
        doctor_reward: mean(&doctor_rewards),
        patient_reward: mean(&patient_rewards),
        exam_reward,
        exam_correct,
        examples,
    })
}

/// Per dialogue: diagnosis correct (0/1), doctor reward; per reply: patient reward.
fn score(dialogues: &[(usize, Dialogue)], cases: &[Case]) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
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
        doctor.push(doctor_reward(
            d.diagnosis.as_deref(),
            d.turns
                .iter()
                .map(|(q, reply)| (q.as_str(), reply.as_str())),
            d.multi_questions,
            case,
        ));
        patient.extend(d.turns.iter().map(|(q, a)| patient_reward(q, a, case)));
    }
    (correct, doctor, patient)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    init_tracing();
    let args = Args::parse();
    let c = &args.common;
    let Start { mut run, conn, tok } = start("doctor_patient_queue", c).await?;
    let sessions = AgentSessions::open(&conn, 2, args.force_fallback, |i| c.lora(i)).await?;
    let mode = sessions.mode();
    let doctor = sessions.trainer(DOCTOR).clone();
    let patient = sessions.trainer(PATIENT).clone();
    let (train, held_out) = cases(c.seed, args.eval_size);
    let adam = AdamParams {
        learning_rate: c.lr_or(DEFAULT_LR),
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
    let patient_task = tokio::spawn(patient_loop(
        patient.clone(),
        patient_lock,
        queue_rx,
        publish,
        records_tx,
        args.patient_batch.unwrap_or(args.batch * args.group).max(1),
        args.max_staleness,
        adam,
        args.queue_capacity,
    ));

    let greedy = Generation::greedy(TURN_TOKENS).within(conn.max_context);
    let mut curves = Curves::new(&["doctor diagnosis accuracy", "patient exam correct"]);
    let bar = progress(c.steps);
    bar.set_prefix(mode);
    let mut sent = 0usize;
    for step in 0..=c.steps {
        while let Ok(record) = records_rx.try_recv() {
            run.log(&record)?;
        }
        let doctor_sampler = doctor.save_weights_and_get_sampling_client().await?;
        let patient_version = latest_patient.borrow().0;
        // The last point is taken after the patient has drained the queue, below.
        if step % args.eval_every.max(1) == 0 && step < c.steps {
            let e = evaluate(
                &doctor_sampler,
                &latest_patient,
                &tok,
                &held_out,
                args.max_turns,
                &greedy,
            )
            .await?;
            curves.push("doctor diagnosis accuracy", step, e.diagnosis_accuracy);
            curves.push("patient exam correct", step, e.exam_correct);
            run.log(
                &json!({"step": step, "patient_version": patient_version, "eval": e.to_json()}),
            )?;
            run.sample(&json!({"step": step, "dialogues": e.examples}))?;
            bar.set_message(format!(
                "held-out diagnosis {:.2}, patient exam {:.2}",
                e.diagnosis_accuracy, e.exam_correct
            ));
        }
        if step == c.steps {
            break;
        }
        let batch: Vec<Case> = batch_at(&train, step, args.batch);
        let doctor_generation =
            Generation::sampled(TURN_TOKENS, args.temperature, c.step_seed(step))
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

        // Doctor: every turn of a dialogue carries the dialogue's advantage; groups are
        // the dialogues of one case.
        let mut data = Vec::new();
        for (case, chunk) in dialogues.chunks(args.group.max(1)).enumerate() {
            let group_rewards = &rewards[case * args.group.max(1)..][..chunk.len()];
            for ((_, d), adv) in chunk.iter().zip(group_normalised(group_rewards)) {
                if adv != 0.0 {
                    let turns: Vec<(&[i64], &Sample, f64)> = d
                        .doctor_samples
                        .iter()
                        .map(|(p, s)| (&p[..], s, adv))
                        .collect();
                    data.extend(trajectory_data(&turns));
                }
            }
        }
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

        // The dialogues' patient sides go onto the queue while the doctor trains.
        let mut queued = 0;
        for (c_idx, d) in &dialogues {
            if d.patient_samples.is_empty() {
                continue;
            }
            let item = QueueItem {
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
                version: d.patient_samples.iter().map(|p| p.2).min().unwrap_or(0),
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
                "reward_mean": mean(&rewards),
                "accuracy": mean(&correct),
                "loss": outcome.as_ref().map(|o| o.loss),
                "datums": data.len(),
                // Doctor turns sampled; a dialogue's turns merge into one datum.
                "turns": dialogues.iter().map(|(_, d)| d.doctor_samples.len()).sum::<usize>(),
                "ratio_mean": outcome.as_ref().and_then(StepOutcome::ratio_mean).or(unchecked),
                "patient_reward_mean": mean(&patient_rewards),
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
    let e = evaluate(
        &doctor_sampler,
        &latest_patient,
        &tok,
        &held_out,
        args.max_turns,
        &greedy,
    )
    .await?;
    curves.push("doctor diagnosis accuracy", c.steps, e.diagnosis_accuracy);
    curves.push("patient exam correct", c.steps, e.exam_correct);
    run.log(&json!({"step": c.steps, "final": true, "eval": e.to_json()}))?;
    run.sample(&json!({"step": c.steps, "final": true, "dialogues": e.examples}))?;

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
        "steps": c.steps,
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
    curves.report(&run, plotted, &checkpoints);
    if c.check && !passed {
        anyhow::bail!("criterion not met: {criterion}");
    }
    Ok(())
}

/// The targets of `recipes.md` (doctor +0.2; the patient's +0.1 applied to its exam).
/// Not yet met on the default model within the default steps: the measured run went
/// 0.22 -> 0.22 for the doctor (0.33 at step 8) and 0.31 -> 0.31 for the patient (0.37
/// at step 8); README, recipe table.
const CRITERION_DOCTOR_GAIN: f64 = 0.2;
const CRITERION_PATIENT_GAIN: f64 = 0.1;

#[cfg(test)]
mod tests {
    use super::*;

    fn flu_case() -> Case {
        Case {
            disease: DISEASES[0],
            complaint: "fever",
            symptoms: vec!["fever", "cough", "chills"],
        }
    }

    #[test]
    fn stale_replies_are_dropped() {
        let item = |version| QueueItem {
            replies: vec![(vec![1], Sample::default(), 0.0)],
            version,
        };
        let (kept, dropped) = drop_stale(vec![item(0), item(3), item(5)], 5, 2);
        assert_eq!((kept.len(), dropped), (2, 1));
        assert!(kept.iter().all(|it| it.version >= 3));
    }

    #[test]
    fn turns_lose_the_label_they_stopped_at() {
        assert_eq!(
            one_line(" Question: Cough?\n", "Patient:"),
            "Question: Cough?"
        );
        assert_eq!(
            one_line(" Question: Cough? Patient:", "Patient:"),
            "Question: Cough?"
        );
        assert_eq!(one_line(" Yes. Doctor:", "Doctor:"), "Yes.");
    }

    #[test]
    fn the_last_turn_asks_for_the_diagnosis() {
        let case = flu_case();
        let d = Dialogue {
            turns: vec![("Question: Do you have chills?".into(), "Yes.".into())],
            ..Default::default()
        };
        let p = d.doctor_prompt(&case, true);
        assert!(p.ends_with("Patient: Yes.\nDoctor: Diagnosis:"));
        assert!(p.contains("Patient: I have fever.\n"));
        // The doctor's textbook: every symptom with the diseases that cause it.
        assert!(p.contains("\nfever: flu or strep throat.\n"));
        assert!(p.contains("\nswollen glands: strep throat.\n"));
        // Seven symptoms have two causes; the eighth " or " is the instructions'.
        assert_eq!(p.matches(" or ").count(), 8);
        let p = d.patient_prompt(&case, "Question: Do you have a cough?");
        assert!(p.contains("Symptoms: fever, cough, chills."));
        assert!(p.ends_with("Doctor: Question: Do you have a cough?\nPatient:"));
    }
}
