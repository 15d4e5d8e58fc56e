//! MrlX-TakesTwo's doctor/patient co-training, offline: doctor and patient are two LoRA
//! sessions trained concurrently and joined by a bounded queue. The loop plays
//! consultations (the doctor asks one question per turn or diagnoses) against the
//! patient's newest weights and trains the doctor on-policy; each consultation's patient
//! replies go onto the queue, where the patient's learner trains off-policy, drops
//! replies older than `--max-staleness` of its updates, and publishes fresh weights after
//! every update. Rewards are rules over the synthetic case table (`data::DISEASES`) in
//! place of MrlX's reference F1 and LLM judge:
//!
//! * doctor = 5 for the right diagnosis (exact, as `recipes.md` asks; MrlX's token F1
//!   paid half for "food allergy"), + 1 per answered question (one `?`, one symptom)
//!   about a symptom not yet named in the dialogue that one of the complaint's possible
//!   causes has, − 2 per "sorry" reply, 0 for any other answered question, − 2 per doctor
//!   turn with two or more `?`, − 5 when no diagnosis is given (MrlX's precedence bug,
//!   which penalised a *present* recommendation, is fixed); see `clinic::doctor_rewards`;
//! * patient, per reply = mean of information control, completeness and consistency
//!   against its case (`clinic::patient_reward`).
//!
//! The patient also drills itself, an addition to MrlX (whose 32B patient reads its case
//! unprompted): before each update its learner puts three questions per case of the
//! update's consultations to its newest weights (a symptom it has, one it lacks, one off
//! the case) and trains on the replies with the consultations' (`--drill-samples`).
//!
//! Credit: each doctor turn trains on its reward-to-go, normalised against the turn at the
//! same position of every consultation in the step (`--baseline batch`; `group` is MrlX's
//! per-case group). The patient's replies are normalised over its update's batch.
//!
//! The run ends cleanly: the loop closes the queue, the learner trains on what is left
//! and stops, and the final evaluation uses both final weights. Saving a state drains
//! the queue first, so a resumed run loses no reply (it does not continue bit for bit: the
//! two loops' interleaving depends on timing). When the second session cannot be created
//! (or with `--force-fallback`) one session plays both roles, still through the queue.
//!
//! Adapted to a small model: prompts are raw text, one line per turn; the doctor's header
//! holds the case table indexed by symptom (the medical knowledge a 32B doctor brings and
//! a 135M one lacks) and a one-shot example; at the turn cap the doctor's line starts
//! with `Diagnosis:`. The runs behind each choice are in `recipes/doctor_patient_queue.md`.

mod dialogue;

use clap::Parser;
use dialogue::{Consultation, Question};
use lathe::types::LossFn;
use lathe_recipes::clinic::{patient_drill, patient_exam};
use lathe_recipes::credit::{Credit, Normalise, Objective, Scope};
use lathe_recipes::data::{batch_at, cases, Case};
use lathe_recipes::env::{Env, EnvGroup};
use lathe_recipes::play::Sampling;
use lathe_recipes::rl::{run, settings_of, Criterion, Curve, Queued, Recipe};
use lathe_recipes::run::Curves;
use lathe_recipes::setup::{init_tracing, parse_args, CommonArgs};
use serde::Serialize;
use serde_json::Value;

/// The embedded server's tensors are large and short-lived: see `lathe_server::memory`.
#[global_allocator]
static GLOBAL: lathe_server::memory::MiMalloc = lathe_server::memory::MiMalloc;

/// A doctor and a patient co-trained through a message queue.
#[derive(Parser, Debug, Serialize)]
#[command(name = "doctor_patient_queue", about)]
struct Args {
    #[command(flatten)]
    #[serde(skip)]
    common: CommonArgs,
    /// What each doctor turn's reward-to-go is compared with.
    #[arg(long, value_enum, default_value_t = Baseline::Batch)]
    baseline: Baseline,
    /// Consultations per case (the doctor's RL group; MrlX samples 8 per prompt).
    #[arg(long, default_value_t = 4)]
    group: usize,
    /// Doctor turns per consultation; the last one must diagnose.
    #[arg(long, default_value_t = 3)]
    max_turns: usize,
    /// Queue capacity in consultations; a full queue makes the loop wait.
    #[arg(long, default_value_t = 128)]
    queue_capacity: usize,
    /// Consultations per patient update (fewer at a save or the end); default one doctor
    /// step's worth (batch × group), so the patient keeps pace.
    #[arg(long)]
    patient_batch: Option<usize>,
    /// Replies sampled more than this many patient updates ago are dropped.
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
    /// consultations alone, as MrlX.
    #[arg(long, default_value_t = 4)]
    drill_samples: usize,
    /// Temperature of the drill replies: a patient that answers one way whatever its case
    /// must sometimes sample the other answer to learn which is right.
    #[arg(long, default_value_t = 1.0)]
    drill_temperature: f64,
    /// The patient's Adam learning rate (default: the doctor's, `--lr`).
    #[arg(long)]
    patient_lr: Option<f64>,
}

pub(crate) const DOCTOR: usize = 0;
pub(crate) const PATIENT: usize = 1;
/// The targets of `recipes.md`: the doctor's gain within 50 steps, and the patient's,
/// applied to its exam score since its mean reply reward starts near the top of its range
/// (`recipes/doctor_patient_queue.md`).
const CRITERION_DOCTOR_GAIN: f64 = 0.2;
const CRITERION_PATIENT_GAIN: f64 = 0.1;

/// What a doctor turn's reward-to-go is compared with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
enum Baseline {
    /// The turn at the same position of every consultation in the step: a doctor that
    /// gives one diagnosis to every patient is still told which patients it got wrong.
    Batch,
    /// The turn at the same position of the case's own consultations (GRPO's group, as
    /// MrlX): once a group agrees it carries no signal.
    Group,
}

struct DoctorPatient {
    args: Args,
    train: Vec<Case>,
    held_out: Vec<Case>,
}

impl Recipe for DoctorPatient {
    fn name(&self) -> &'static str {
        "doctor_patient_queue"
    }

    fn roles(&self) -> Vec<&'static str> {
        vec!["doctor", "patient"]
    }

    /// The doctor's turns are compared by position, not by kind: at each position the
    /// doctor chooses between asking and diagnosing, and a baseline that depends on the
    /// choice would cancel the signal that tells it which is worth more.
    fn objective(&self) -> Objective {
        let scope = match self.args.baseline {
            Baseline::Batch => Scope::Batch,
            Baseline::Group => Scope::Group,
        };
        let credit = Credit {
            scope,
            by_position: true,
            ..Credit::group(Normalise::Standardise)
        };
        Objective::Rl(LossFn::ImportanceSampling, credit)
    }

    /// The patient learns from the queue; its replies are compared over its update's
    /// batch, drills included, so the same "Yes." is worth more to a question its case
    /// confirms than to one it denies even when every sample of a question agrees.
    fn queued(&self, role: usize) -> Option<Queued> {
        let c = &self.args.common;
        (role == PATIENT).then(|| Queued {
            batch: self
                .args
                .patient_batch
                .unwrap_or(c.batch * self.args.group)
                .max(1),
            max_staleness: self.args.max_staleness,
            capacity: self.args.queue_capacity,
            lr: self.args.patient_lr.unwrap_or(c.lr),
            credit: Credit {
                scope: Scope::Batch,
                ..Credit::group(Normalise::Standardise)
            },
        })
    }

    /// The drills: for each case of the update, three questions its case answers,
    /// walking every choice across updates.
    fn learner_envs(
        &self,
        _role: usize,
        sources: &[usize],
        cursor: &mut usize,
    ) -> Vec<Box<dyn Env>> {
        if self.args.drill_samples == 0 {
            return Vec::new();
        }
        let mut envs: Vec<Box<dyn Env>> = Vec::new();
        for &s in sources {
            let case = &self.train[s];
            for q in patient_drill(case, *cursor) {
                envs.push(Box::new(Question::new(
                    case.clone(),
                    q,
                    self.args.drill_samples,
                    "drill",
                )));
            }
            *cursor += 1;
        }
        envs
    }

    fn sampling(&self, role: usize) -> Sampling {
        match role {
            DOCTOR => Sampling::at(self.args.common.temperature),
            _ => Sampling {
                temperature: self.args.patient_temperature,
                top_p: self.args.patient_top_p,
            },
        }
    }

    fn learner_sampling(&self, _role: usize) -> Sampling {
        Sampling::at(self.args.drill_temperature)
    }

    fn groups(&self, step: usize) -> Vec<EnvGroup> {
        // The step's cases by index: the index is each consultation's source.
        let indices: Vec<usize> = (0..self.train.len()).collect();
        batch_at(&indices, step, self.args.common.batch)
            .into_iter()
            .map(|s| {
                (0..self.args.group.max(1))
                    .map(|_| self.consultation(&self.train, s))
                    .collect()
            })
            .collect()
    }

    /// Every held-out case's consultation, then its exam: a question about a symptom it
    /// has, one it lacks, one off the case.
    fn held_out(&self) -> Vec<Box<dyn Env>> {
        let mut envs: Vec<Box<dyn Env>> = (0..self.held_out.len())
            .map(|i| self.consultation(&self.held_out, i))
            .collect();
        for (i, case) in self.held_out.iter().enumerate() {
            for q in patient_exam(case, i) {
                envs.push(Box::new(Question::new(case.clone(), q, 1, "exam")));
            }
        }
        envs
    }

    fn curves(&self) -> Vec<Curve> {
        vec![
            Curve::new("doctor diagnosis accuracy", "diagnosis_accuracy"),
            Curve::new("patient exam correct", "exam_correct"),
        ]
    }

    fn criterion(&self, curves: &Curves) -> Criterion {
        let gain = |name| {
            let (before, after) = curves.before_after(name);
            after - before
        };
        Criterion {
            text: format!("held-out doctor diagnosis accuracy rises by >= {CRITERION_DOCTOR_GAIN} and the patient's exam score (replies with full marks) by >= {CRITERION_PATIENT_GAIN}"),
            passed: gain("doctor diagnosis accuracy") >= CRITERION_DOCTOR_GAIN
                && gain("patient exam correct") >= CRITERION_PATIENT_GAIN,
        }
    }

    fn settings(&self) -> Value {
        settings_of(&self.args)
    }
}

impl DoctorPatient {
    /// A consultation of `cases[i]`; the case's index is the episode's source, which the
    /// learner drills (training cases only).
    fn consultation(&self, cases: &[Case], i: usize) -> Box<dyn Env> {
        Box::new(Consultation::new(cases[i].clone(), i, self.args.max_turns))
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    init_tracing();
    // 50 doctor steps: `recipes.md` gives the doctor 50 steps to gain 0.2 held-out; the
    // other defaults' runs are in `recipes/doctor_patient_queue.md`.
    let args: Args = parse_args(&[
        ("steps", "50"),
        ("lr", "2e-4"),
        ("batch", "8"),
        ("temperature", "1.0"),
        ("eval_every", "5"),
        ("eval_size", "64"),
    ]);
    // Two rounds of replies per doctor turn; the library stops an episode at 256.
    anyhow::ensure!(
        (1..=100).contains(&args.max_turns),
        "--max-turns must be between 1 and 100"
    );
    let (train, held_out) = cases(args.common.seed, args.common.eval_size);
    let common = args.common.clone();
    let recipe = DoctorPatient {
        args,
        train,
        held_out,
    };
    run(&recipe, &common).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use lathe_recipes::credit::role_data;
    use lathe_recipes::data::DISEASES;
    use lathe_recipes::env::{Episode, Reply};
    use lathe_recipes::rollout::Sample;

    fn case(disease: usize, complaint: usize) -> Case {
        let d = DISEASES[disease];
        Case {
            disease: d,
            complaint: d.symptoms[complaint],
            symptoms: d.symptoms[..3].to_vec(),
        }
    }

    fn reply(prompt: &[i64], text: &str, token: i64) -> Reply {
        Reply {
            prompt: prompt.to_vec(),
            sample: Sample {
                tokens: vec![token],
                logprobs: vec![-1.0],
                text: text.into(),
            },
            version: 0,
        }
    }

    /// A consultation of `case` with `questions` (each answered "Yes.") then `diagnosis`;
    /// each doctor turn's prompt extends the one before, as in a real transcript.
    fn consult(case: Case, questions: &[&str], diagnosis: &str) -> Episode {
        let mut env = Box::new(Consultation::new(case, 0, 3));
        let first = env.initial_observations();
        assert_eq!(first[0].role, DOCTOR);
        let mut prompt = vec![1, 2, 3];
        for (i, q) in questions.iter().enumerate() {
            let token = 10 + i as i64;
            let next = env.step(vec![reply(&prompt, q, token)]);
            assert_eq!(next[0].role, PATIENT);
            prompt.push(token);
            let next = env.step(vec![reply(&prompt, " Yes.", 99)]);
            assert_eq!(next[0].role, DOCTOR);
            prompt.push(99);
        }
        let last = env.step(vec![reply(
            &prompt,
            &format!(" Diagnosis: {diagnosis}"),
            50,
        )]);
        assert!(last.is_empty());
        env.finish()
    }

    fn advantages(data: &[lathe::types::Datum]) -> Vec<Vec<f64>> {
        data.iter()
            .map(|d| d.loss_fn_inputs["advantages"].data.clone())
            .collect()
    }

    #[test]
    fn each_doctor_turn_is_compared_with_the_same_position_of_the_batch() {
        let flu = case(0, 0); // fever
        let cold = case(1, 0); // cough
        let chills = " Question: Do you have chills?";
        let groups = vec![
            vec![
                consult(flu.clone(), &[chills], "flu"),
                consult(flu, &[chills], "migraine"),
            ],
            vec![
                consult(cold.clone(), &[], "common cold"),
                consult(cold, &[], "common cold"),
            ],
        ];
        // Returns: the questions earn 1, the right diagnoses 5.
        let returns: Vec<Vec<f64>> = groups
            .iter()
            .flatten()
            .map(|e| {
                e.transitions
                    .iter()
                    .filter(|t| t.role == DOCTOR)
                    .map(|t| t.reward)
                    .collect()
            })
            .collect();
        assert_eq!(
            returns,
            vec![vec![6.0, 5.0], vec![1.0, 0.0], vec![5.0], vec![5.0]]
        );
        let no_references =
            |_: &str| -> anyhow::Result<Vec<i64>> { unreachable!("RL needs no reference") };
        let recipe_objective = |baseline| {
            let scope = match baseline {
                Baseline::Batch => Scope::Batch,
                Baseline::Group => Scope::Group,
            };
            Objective::Rl(
                LossFn::ImportanceSampling,
                Credit {
                    scope,
                    by_position: true,
                    ..Credit::group(Normalise::Standardise)
                },
            )
        };
        let batch = role_data(
            &groups,
            &recipe_objective(Baseline::Batch),
            2,
            &no_references,
            None,
        )
        .unwrap();
        let batch = advantages(&batch[DOCTOR]);
        // First turns: two questions (6 and 1 to go) and two diagnoses (5 each), one
        // choice against the other; second turns: the diagnoses after a question, 5 and 0.
        let first_turns = lathe_recipes::advantages::group_normalised(&[6.0, 1.0, 5.0, 5.0]);
        let second_turns = lathe_recipes::advantages::group_normalised(&[5.0, 0.0]);
        assert_eq!(batch.len(), 4, "{batch:?}");
        let first = |a: &Vec<f64>| a.iter().copied().find(|x| *x != 0.0).unwrap();
        let last = |a: &Vec<f64>| *a.last().unwrap();
        for (i, a) in batch.iter().enumerate() {
            assert!((first(a) - first_turns[i]).abs() < 1e-6, "{batch:?}");
        }
        assert!((last(&batch[0]) - second_turns[0]).abs() < 1e-6);
        assert!((last(&batch[1]) - second_turns[1]).abs() < 1e-6);
        // Within each case's own group, the agreeing second case carries no signal.
        let group = role_data(
            &groups,
            &recipe_objective(Baseline::Group),
            2,
            &no_references,
            None,
        )
        .unwrap();
        assert_eq!(group[DOCTOR].len(), 2, "{:?}", advantages(&group[DOCTOR]));
    }
}
