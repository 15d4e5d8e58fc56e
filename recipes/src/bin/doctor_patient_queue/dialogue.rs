//! The doctor/patient dialogue: both roles' prompts, the transcript, and [`play`], which
//! runs a batch of dialogues against the doctor's sampler and the patient's newest one.

use lathe::{SamplingClient, Tokenizer};
use lathe_recipes::clinic::SORRY;
use lathe_recipes::data::{Case, DISEASES};
use lathe_recipes::rollout::{sample_prompts, Generation, Sample};
use tokio::sync::watch;

/// New tokens per turn, either role.
pub(crate) const TURN_TOKENS: usize = 16;

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
pub(crate) struct Dialogue {
    /// `(question line, patient reply)` pairs.
    pub(crate) turns: Vec<(String, String)>,
    /// The diagnosis line, once given.
    pub(crate) diagnosis: Option<String>,
    /// The doctor's samples with their prompts, one per turn.
    pub(crate) doctor_samples: Vec<(Vec<i64>, Sample)>,
    /// The patient's samples with their prompts and the patient update that sampled
    /// them, one per reply.
    pub(crate) patient_samples: Vec<(Vec<i64>, Sample, u64)>,
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
    pub(crate) fn doctor_prompt(&self, case: &Case, last_turn: bool) -> String {
        let mut s = self.transcript(case, true);
        s.push_str(if last_turn {
            "Doctor: Diagnosis:"
        } else {
            "Doctor:"
        });
        s
    }

    /// The patient's prompt for a reply to `question`.
    pub(crate) fn patient_prompt(&self, case: &Case, question: &str) -> String {
        format!(
            "{}Doctor: {question}\nPatient:",
            self.transcript(case, false)
        )
    }
}

/// A turn's text without the other speaker's label it was stopped at.
pub(crate) fn one_line(text: &str, other: &str) -> String {
    text.trim().trim_end_matches(other).trim().to_string()
}

/// The patient's newest sampler and its update count, published by the patient loop.
pub(crate) type LatestPatient = watch::Receiver<(u64, SamplingClient)>;

/// Plays `group` dialogues of every case: doctor turns with `doctor`, replies with
/// `patient`; every stage samples all open dialogues at once.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn play(
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
