//! The doctor/patient environments: both roles' prompts, the consultation, and single
//! questions put to the patient (its held-out exam and its drills).

use lathe_recipes::clinic::{diagnosis_correct, doctor_rewards, full_marks, patient_reward, SORRY};
use lathe_recipes::data::{Case, DISEASES};
use lathe_recipes::env::{rate, Env, Episode, Observation, Reply, Transition};
use lathe_recipes::run::mean_of;

use crate::{DOCTOR, PATIENT};

/// New tokens per turn, either role.
pub(crate) const TURN_TOKENS: usize = 16;

/// The doctor's instructions. A 32B doctor knows medicine; a 135M one knows none of the
/// synthetic table, so the header gives it the table as its textbook, indexed by symptom
/// ("fever: flu or strep throat."): a small model finds the complaint's line and copies
/// what follows it more readily than it finds the disease whose list holds the complaint
/// (the measurement is in `recipes/doctor_patient_queue.md`).
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

/// A doctor's turn: a line, cut where a small model starts writing the patient's.
fn doctor_turn(prompt: String) -> Observation {
    Observation::line(DOCTOR, prompt, TURN_TOKENS).stop_at(&["\n", "Patient:"])
}

/// A patient's reply: a line, cut where it starts writing the doctor's.
fn patient_turn(prompt: String) -> Observation {
    Observation::line(PATIENT, prompt, TURN_TOKENS).stop_at(&["\n", "Doctor:"])
}

/// One consultation: the doctor asks one question per turn or diagnoses; at the turn cap
/// it must diagnose. Each doctor turn is credited with its reward-to-go
/// ([`lathe_recipes::clinic::DoctorRewards::returns`]); each patient reply with [`patient_reward`].
pub(crate) struct Consultation {
    pub(crate) case: Case,
    /// The case's index in its set: the patient's learner drills it.
    pub(crate) source: usize,
    pub(crate) max_turns: usize,
    pub(crate) dialogue: Dialogue,
    doctor: Vec<Reply>,
    patient: Vec<Reply>,
    /// The question awaiting the patient's reply.
    asked: Option<String>,
}

impl Consultation {
    pub(crate) fn new(case: Case, source: usize, max_turns: usize) -> Self {
        Self {
            case,
            source,
            max_turns: max_turns.max(1),
            dialogue: Dialogue::default(),
            doctor: Vec::new(),
            patient: Vec::new(),
            asked: None,
        }
    }

    fn next_doctor_turn(&self) -> Observation {
        let last = self.doctor.len() + 1 == self.max_turns;
        doctor_turn(self.dialogue.doctor_prompt(&self.case, last))
    }
}

impl Env for Consultation {
    fn initial_observations(&mut self) -> Vec<Observation> {
        vec![self.next_doctor_turn()]
    }

    fn step(&mut self, replies: Vec<Reply>) -> Vec<Observation> {
        let Some(reply) = replies.into_iter().next() else {
            return Vec::new();
        };
        if let Some(question) = self.asked.take() {
            let answer = one_line(&reply.sample.text, "Doctor:");
            self.dialogue.turns.push((question, answer));
            self.patient.push(reply);
            return vec![self.next_doctor_turn()];
        }
        let line = one_line(&reply.sample.text, "Patient:");
        let last = self.doctor.len() + 1 == self.max_turns;
        self.doctor.push(reply);
        if last {
            self.dialogue.diagnosis = Some(line);
            Vec::new()
        } else if let Some(at) = line.find("Diagnosis:") {
            self.dialogue.diagnosis = Some(line[at + "Diagnosis:".len()..].to_string());
            Vec::new()
        } else {
            let prompt = self.dialogue.patient_prompt(&self.case, &line);
            self.asked = Some(line);
            vec![patient_turn(prompt)]
        }
    }

    fn finish(self: Box<Self>) -> Episode {
        let Self {
            case,
            source,
            dialogue,
            doctor,
            patient,
            ..
        } = *self;
        let rewards = doctor_rewards(
            dialogue.diagnosis.as_deref(),
            dialogue.turns.iter().map(|(q, a)| (q.as_str(), a.as_str())),
            &case,
        );
        let patient_rewards: Vec<f64> = dialogue
            .turns
            .iter()
            .map(|(q, a)| patient_reward(q, a, &case))
            .collect();
        let mut e = Episode {
            source: Some(source),
            ..Default::default()
        };
        let correct = dialogue
            .diagnosis
            .as_deref()
            .is_some_and(|d| diagnosis_correct(d, &case));
        e.metrics.insert("diagnosis_accuracy".into(), rate(correct));
        e.metrics.insert("doctor_reward".into(), rewards.total());
        e.metrics.insert("doctor_turns".into(), doctor.len() as f64);
        if let Some(m) = mean_of(&patient_rewards) {
            e.metrics.insert("patient_reward".into(), m);
        }
        for (position, (reply, r)) in doctor.into_iter().zip(rewards.returns()).enumerate() {
            e.transitions
                .push(Transition::new(DOCTOR, reply, r, position));
        }
        for (position, (reply, r)) in patient.into_iter().zip(patient_rewards).enumerate() {
            e.transitions
                .push(Transition::new(PATIENT, reply, r, position));
        }
        e
    }
}

/// One question put to a patient outside a dialogue, `samples` replies: the held-out
/// exam (`metric` "exam") and the learner's drills ("drill").
pub(crate) struct Question {
    pub(crate) case: Case,
    pub(crate) question: String,
    pub(crate) samples: usize,
    pub(crate) metric: &'static str,
    replies: Vec<Reply>,
}

impl Question {
    pub(crate) fn new(case: Case, question: String, samples: usize, metric: &'static str) -> Self {
        Self {
            case,
            question,
            samples,
            metric,
            replies: Vec::new(),
        }
    }
}

impl Env for Question {
    fn initial_observations(&mut self) -> Vec<Observation> {
        let prompt = Dialogue::default().patient_prompt(&self.case, &self.question);
        vec![patient_turn(prompt); self.samples.max(1)]
    }

    fn step(&mut self, replies: Vec<Reply>) -> Vec<Observation> {
        self.replies = replies;
        Vec::new()
    }

    fn finish(self: Box<Self>) -> Episode {
        let mut e = Episode::default();
        let rewards: Vec<f64> = self
            .replies
            .iter()
            .map(|r| {
                patient_reward(
                    &self.question,
                    &one_line(&r.sample.text, "Doctor:"),
                    &self.case,
                )
            })
            .collect();
        if let Some(m) = full_marks(&rewards) {
            e.metrics.insert(format!("{}_correct", self.metric), m);
        }
        if let Some(m) = mean_of(&rewards) {
            e.metrics.insert(format!("{}_reward", self.metric), m);
        }
        for (reply, r) in self.replies.into_iter().zip(rewards) {
            e.transitions.push(Transition::new(PATIENT, reply, r, 0));
        }
        e
    }
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
