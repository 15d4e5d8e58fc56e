//! Rule-based rubrics over the synthetic case table ([`crate::data::DISEASES`]), in
//! place of MrlX-TakesTwo's reference F1 and LLM judge: the doctor's reward for a
//! dialogue, the patient's reward for a reply, and a held-out exam for the patient.

use crate::data::{symptom_vocabulary, Case, DISEASES};

/// The refusal the patient's prompt prescribes for questions outside its case.
pub const SORRY: &str = "Sorry, I cannot answer this question.";

/// The symptoms of the table mentioned in `text` (whole phrases, case-insensitive).
pub fn mentioned(text: &str) -> Vec<&'static str> {
    let mut lower = text.to_lowercase();
    let mut found = Vec::new();
    for s in symptom_vocabulary() {
        if let Some(at) = lower.find(s) {
            found.push(s);
            lower.replace_range(at..at + s.len(), &" ".repeat(s.len()));
        }
    }
    found
}

fn words(text: &str) -> Vec<String> {
    text.to_lowercase()
        .split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_string)
        .collect()
}

/// Whether a diagnosis names exactly the right disease of the table.
/// Names are matched as whole words ("influenza" is not "flu"). `recipes.md` asks for an
/// exact match where MrlX scores a token F1 with the reference: with six short names, F1
/// paid 2.5 of 5 for "food allergy" to a food-poisoning patient (and 3.3 to an allergic
/// one), and a 50-step run learned to say it.
pub fn diagnosis_correct(text: &str, case: &Case) -> bool {
    let spaced = format!(" {} ", words(text).join(" "));
    let named: Vec<&str> = DISEASES
        .iter()
        .map(|d| d.name)
        .filter(|n| spaced.contains(&format!(" {n} ")))
        .collect();
    named == [case.disease.name]
}

/// Whether a reply is the prescribed refusal.
pub fn is_sorry(reply: &str) -> bool {
    reply.to_lowercase().contains("sorry")
}

/// The symptoms that tell apart the diseases that can cause `complaint`: every other
/// symptom of those diseases.
pub fn relevant_symptoms(complaint: &str) -> Vec<&'static str> {
    let mut relevant: Vec<&'static str> = DISEASES
        .iter()
        .filter(|d| d.symptoms.contains(&complaint))
        .flat_map(|d| d.symptoms)
        .filter(|s| *s != complaint)
        .collect();
    relevant.sort_unstable();
    relevant.dedup();
    relevant
}

/// The doctor's rewards for one dialogue, turn by turn. Their sum is the dialogue's
/// reward in MrlX's rubric; apart, they say which turn earned what, so that a turn is
/// credited only with what it and the turns after it earned (see [`Self::returns`]).
#[derive(Debug, Clone, PartialEq)]
pub struct DoctorRewards {
    /// Per question, in order: information (+1, 0 or −2) plus compliance (−2 when the
    /// line holds two or more `?`).
    pub questions: Vec<f64>,
    /// The diagnosis turn: 5 when it names the right disease and no other
    /// ([`diagnosis_correct`]), 0 when it is wrong, −5 when no diagnosis was given.
    pub diagnosis: f64,
}

impl DoctorRewards {
    /// The dialogue's reward: every turn's, summed.
    pub fn total(&self) -> f64 {
        self.questions.iter().sum::<f64>() + self.diagnosis
    }

    /// The reward-to-go of each doctor turn, the questions' in order and then the
    /// diagnosis turn's: what the turn and the turns after it earned. A turn cannot change
    /// what came before it, so crediting it with earlier rewards only adds noise: a
    /// dialogue's good question would otherwise raise its wrong diagnosis too.
    pub fn returns(&self) -> Vec<f64> {
        let mut to_go = self.diagnosis;
        let mut out = vec![to_go];
        for q in self.questions.iter().rev() {
            to_go += q;
            out.push(to_go);
        }
        out.reverse();
        out
    }
}

/// The doctor's rewards for a finished dialogue: its `diagnosis` (if any) and its `turns`
/// as `(question, patient reply)`.
///
/// MrlX's rubric, with one rule standing in for a patient that a small model cannot be
/// trusted to be: an answered question earns +1 only when it is one question (ending in
/// `?`) about one symptom not yet named in the dialogue (the complaint counts as named)
/// that belongs to a disease able to cause the complaint ([`relevant_symptoms`]), i.e. a
/// question that narrows the diagnosis; any other answered question earns nothing, and a
/// "sorry" still costs 2.
/// Without the relevance rule the doctor learned to ask every patient about a sore
/// throat, a sure +1, and then to diagnose strep throat, the disease whose index line
/// follows it (`recipes/doctor_patient_queue.md`). MrlX's capable patient
/// refuses questions off its case; a 135M patient answers them, and the doctor learned,
/// in turn, to ask anything ("What is your name?") and to re-ask the complaint ("Do you
/// have nausea?" to a patient who opened with nausea) for +1 a turn — and the patient,
/// asked only about symptoms it had, learned to answer "Yes." to everything. Scoring
/// off-topic questions as a refusal (−2) instead made every sampled question a risk, and
/// the doctor stopped asking, which starved the patient.
///
/// MrlX's −2 for two or more question marks looked at the patient's messages (the user
/// role in the doctor's list); here it applies to the doctor's question line, as meant.
/// Its −5 for a missing diagnosis fired when a recommendation was present (operator
/// precedence); here it fires when the diagnosis is missing.
pub fn doctor_rewards<'a>(
    diagnosis: Option<&str>,
    turns: impl IntoIterator<Item = (&'a str, &'a str)>,
    case: &Case,
) -> DoctorRewards {
    let relevant = relevant_symptoms(case.complaint);
    let mut named = vec![case.complaint];
    let questions = turns
        .into_iter()
        .map(|(question, reply)| {
            let asked = mentioned(question);
            // One question about one symptom: a line that lists symptoms asks nothing.
            let new = match asked[..] {
                [s] => {
                    question.trim_end().ends_with('?')
                        && !named.contains(&s)
                        && relevant.contains(&s)
                }
                _ => false,
            };
            named.extend(asked);
            let information = if is_sorry(reply) {
                -2.0
            } else if new {
                1.0
            } else {
                0.0
            };
            let compliance = if question.matches('?').count() >= 2 {
                -2.0
            } else {
                0.0
            };
            information + compliance
        })
        .collect();
    let diagnosis = match diagnosis.filter(|t| !t.trim().is_empty()) {
        Some(t) if diagnosis_correct(t, case) => 5.0,
        Some(_) => 0.0,
        None => -5.0,
    };
    DoctorRewards {
        questions,
        diagnosis,
    }
}

/// The patient's reward for one reply to `question`.
pub fn patient_reward(question: &str, reply: &str, case: &Case) -> f64 {
    let asked = mentioned(question);
    let said = mentioned(reply);
    let lower = format!(" {} ", words(reply).join(" "));
    let yes = lower.contains(" yes ");
    let no = lower.contains(" no ") || lower.contains(" not ") || lower.contains(" don t ");
    // A bare reply that says both ("Yes, no. No.") answers nothing: it neither confirms
    // nor denies (a patient learned it: it dodged both penalties either way).
    let hedged = yes && no && said.is_empty();
    let (yes, no) = if hedged { (false, false) } else { (yes, no) };
    // Evading a symptom question, by hedging or by the refusal the prompt keeps for
    // questions off the case, misses the fact and contradicts the case, which answers it.
    // Scored as a miss alone, evasion paid what a guess pays and more off the case, and a
    // patient learned to refuse every question (`recipes/doctor_patient_queue.md`).
    let evaded = !asked.is_empty() && (hedged || is_sorry(reply));
    let volunteered = said
        .iter()
        .filter(|s| !asked.contains(s) && case.has(s))
        .count();
    // Whether the patient has an asked symptom is the requested fact, either way: a
    // symptom it has must be confirmed ("Yes.", or naming it without a denial: "I have a
    // cough."), one it lacks denied.
    let mut missed = asked
        .iter()
        .filter(|s| {
            if case.has(s) {
                !(yes || (said.contains(s) && !no))
            } else {
                !no
            }
        })
        .count();
    // A question about nothing in the case asks for the refusal the prompt prescribes.
    if asked.is_empty() && !is_sorry(reply) {
        missed += 1;
    }
    let mut conflicts = said.iter().filter(|s| !case.has(s) && !no).count();
    conflicts += usize::from(evaded);
    conflicts += asked.iter().filter(|s| case.has(s) && no && !yes).count();
    conflicts += asked.iter().filter(|s| !case.has(s) && yes && !no).count();
    let rate = |n: usize| (1.0 - 0.2 * n as f64).max(0.0);
    (rate(volunteered) + rate(missed) + rate(conflicts)) / 3.0
}

/// The fraction of patient replies' `rewards` with full marks (`None` of none): the
/// exam's score, and the patient's accuracy in training.
pub fn full_marks(rewards: &[f64]) -> Option<f64> {
    let perfect: Vec<f64> = rewards
        .iter()
        .map(|&r| f64::from(u8::from(r >= 1.0 - 1e-9)))
        .collect();
    crate::run::mean_of(&perfect)
}

/// Questions not about symptoms, for the patient's exam.
pub const UNRELATED: [&str; 3] = [
    "Question: How old are you?",
    "Question: What is your job?",
    "Question: Where do you live?",
];

/// The patient's held-out exam for case number `i`: a question about a symptom the
/// patient has (not the complaint), one about a symptom they lack, one unrelated.
pub fn patient_exam(case: &Case, i: usize) -> [String; 3] {
    let lack = |s: &str| !case.disease.symptoms.contains(&s);
    let [have, lack] = symptom_questions(case, lack, i);
    [have, lack, UNRELATED[i % UNRELATED.len()].to_string()]
}

/// The `k`-th question about a symptom the case has (not its complaint), and the `k`-th
/// about one of the table's symptoms for which `lacking` holds.
fn symptom_questions(case: &Case, lacking: impl Fn(&str) -> bool, k: usize) -> [String; 2] {
    let have: Vec<&str> = case
        .symptoms
        .iter()
        .copied()
        .filter(|s| *s != case.complaint)
        .collect();
    let lack: Vec<&str> = symptom_vocabulary()
        .into_iter()
        .filter(|s| lacking(s))
        .collect();
    let ask = |s: &str| format!("Question: Do you have {s}?");
    [ask(have[k % have.len()]), ask(lack[k % lack.len()])]
}

/// Questions off the case for the patient's drills: none is an exam question
/// ([`UNRELATED`]); the disease names are what the doctor asks once it guesses.
fn drill_off_topic(k: usize) -> String {
    const OTHER: [&str; 3] = [
        "Question: What is your name?",
        "Question: Do you smoke?",
        "Question: How did you sleep?",
    ];
    let n = OTHER.len() + DISEASES.len();
    match k % n {
        i if i < OTHER.len() => OTHER[i].to_string(),
        i => format!("Question: Do you have {}?", DISEASES[i - OTHER.len()].name),
    }
}

/// The `k`-th drill for a training case's patient: a question about a symptom it has (not
/// its complaint), one about a symptom it lacks (any of the table's, its own disease's
/// symptoms the patient lacks included), and one off the case. Successive `k` walk every
/// choice. A 135M patient does not read its case from the doctor's few questions alone
/// (`recipes/doctor_patient_queue.md`); these give every update questions whose answer
/// its case decides.
pub fn patient_drill(case: &Case, k: usize) -> [String; 3] {
    let [have, lack] = symptom_questions(case, |s| !case.has(s), k);
    [have, lack, drill_off_topic(k)]
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
    fn symptoms_are_found_as_whole_phrases() {
        assert_eq!(mentioned("Do you have a Sore Throat?"), vec!["sore throat"]);
        let mut both = mentioned("fever and a cough");
        both.sort_unstable();
        assert_eq!(both, vec!["cough", "fever"]);
        assert!(mentioned("How old are you?").is_empty());
    }

    #[test]
    fn patient_rewards_follow_the_rubric() {
        let case = flu_case();
        let q = "Question: Do you have a cough?";
        assert_eq!(patient_reward(q, "Yes, I have a cough.", &case), 1.0);
        // Volunteering chills, which was not asked: information control 0.8.
        let r = patient_reward(q, "Yes, a cough and chills.", &case);
        assert!((r - (0.8 + 1.0 + 1.0) / 3.0).abs() < 1e-12);
        // Denying a symptom the patient has: missed and contradicted, whether or not the
        // denial names it.
        for denial in ["No.", "No, I do not have a cough."] {
            let r = patient_reward(q, denial, &case);
            assert!((r - (1.0 + 0.8 + 0.8) / 3.0).abs() < 1e-12, "{denial}: {r}");
        }
        assert_eq!(patient_reward(q, "I have a cough.", &case), 1.0);
        // Claiming a symptom the patient lacks costs as much as denying one it has: the
        // requested fact is missed and the case contradicted (otherwise "Yes." to
        // everything would be the safe answer).
        let r = patient_reward("Question: Do you have a rash?", "Yes.", &case);
        assert!((r - (1.0 + 0.8 + 0.8) / 3.0).abs() < 1e-12);
        assert!(patient_reward("Question: Do you have a rash?", "I have a cough.", &case) < 1.0);
        assert_eq!(
            patient_reward("Question: Do you have a rash?", "No, I don't.", &case),
            1.0
        );
        // Yes and no at once, or a refusal, evades the question: the fact is missed and
        // the case, which answers it, contradicted. Evasion scores no better than a wrong
        // answer, so it is not the safe reply to a question the patient cannot tell.
        for q in [q, "Question: Do you have a rash?"] {
            for evasion in ["Yes, no. No.", SORRY, "I am sorry, I cannot answer this."] {
                let r = patient_reward(q, evasion, &case);
                assert!(
                    (r - (1.0 + 0.8 + 0.8) / 3.0).abs() < 1e-12,
                    "{q}: {evasion}: {r}"
                );
            }
        }
        // Off the case, the refusal is the right reply and anything else misses it.
        assert_eq!(
            patient_reward("Question: How old are you?", SORRY, &case),
            1.0
        );
        assert!(patient_reward("Question: How old are you?", "25.", &case) < 1.0);
    }

    #[test]
    fn doctor_rewards_fix_mrlx_precedence() {
        let case = flu_case();
        let asked = "Question: Do you have chills?";
        assert_eq!(
            doctor_reward(Some(" flu"), [(asked, "Yes.")], &case),
            5.0 + 1.0
        );
        assert!(diagnosis_correct(" flu", &case));
        assert!(!diagnosis_correct("flu or allergy", &case));
        assert!(diagnosis_correct("Flu.", &case));
        assert!(!diagnosis_correct("influenza", &case));
        // Two questions in one line cost 2, a refusal 2.
        let two = "Question: Do you have chills? Or a rash?";
        let turns = [(asked, "Yes."), (two, SORRY)];
        assert_eq!(
            doctor_reward(Some(" flu"), turns, &case),
            5.0 + 1.0 - 2.0 - 2.0
        );
        assert_eq!(doctor_reward(None, turns, &case), 1.0 - 2.0 - 2.0 - 5.0);
        // A recommendation never costs anything (MrlX's precedence bug did that).
        assert_eq!(doctor_reward(Some(" "), [], &case), -5.0);
    }

    /// The dialogue's total, for the rubric's tests.
    fn doctor_reward<'a>(
        diagnosis: Option<&str>,
        turns: impl IntoIterator<Item = (&'a str, &'a str)>,
        case: &Case,
    ) -> f64 {
        doctor_rewards(diagnosis, turns, case).total()
    }

    #[test]
    fn each_turn_is_credited_with_what_it_and_later_turns_earned() {
        let case = flu_case();
        let chills = ("Question: Do you have chills?", "Yes.");
        let refused = ("Question: What is your name?", SORRY);
        let r = doctor_rewards(Some("flu"), [refused, chills], &case);
        assert_eq!(r.questions, [-2.0, 1.0]);
        assert_eq!(r.diagnosis, 5.0);
        assert_eq!(r.returns(), [4.0, 6.0, 5.0]);
        assert_eq!(r.total(), r.returns()[0]);
        let r = doctor_rewards(Some("allergy"), [], &case);
        assert_eq!(r.returns(), [0.0]);
    }

    #[test]
    fn only_questions_about_new_symptoms_earn() {
        let case = flu_case();
        // The complaint (fever) is already named; chills is new, once.
        let complaint = ("Question: Do you have a fever?", "Yes.");
        let chills = ("Question: Do you have chills?", "Yes.");
        assert_eq!(doctor_reward(Some("flu"), [complaint], &case), 5.0);
        assert_eq!(
            doctor_reward(Some("flu"), [chills, chills, complaint], &case),
            5.0 + 1.0
        );
        // A symptom the patient lacks is information too, when it tells apart the
        // complaint's causes: fever is flu or strep throat, and strep throat brings a
        // sore throat.
        let sore = ("Question: Do you have a sore throat?", "No.");
        assert_eq!(doctor_reward(Some("flu"), [sore, chills], &case), 5.0 + 2.0);
        // A rash causes no fever: asking about it narrows nothing.
        let rash = ("Question: Do you have a rash?", "No.");
        assert_eq!(doctor_reward(Some("flu"), [rash, chills], &case), 5.0 + 1.0);
        // The patient answered, but the question is about no symptom: 0, not +1.
        let name = ("Question: What is your name?", "John.");
        assert_eq!(doctor_reward(Some("flu"), [name], &case), 5.0);
        let refused = ("Question: What is your name?", SORRY);
        assert_eq!(doctor_reward(Some("flu"), [refused], &case), 5.0 - 2.0);
        let symptom = ("Question: Do you have body aches?", "No.");
        assert_eq!(doctor_reward(Some("flu"), [symptom], &case), 5.0 + 1.0);
        // One question about one symptom: a list of symptoms, or no question, earns nothing.
        let list = ("Possible diagnoses: flu, sore throat, chills?", "Yes.");
        assert_eq!(doctor_reward(Some("flu"), [list], &case), 5.0);
        let statement = ("You have chills.", "Yes.");
        assert_eq!(doctor_reward(Some("flu"), [statement], &case), 5.0);
    }

    #[test]
    fn relevant_symptoms_are_those_of_the_complaints_possible_causes() {
        // Fever: flu (cough, body aches, chills) or strep throat (sore throat, swollen
        // glands, headache).
        let mut want = vec![
            "body aches",
            "chills",
            "cough",
            "headache",
            "sore throat",
            "swollen glands",
        ];
        want.sort_unstable();
        assert_eq!(relevant_symptoms("fever"), want);
        // A rash has one cause, allergy.
        let mut want = vec!["itchy eyes", "runny nose", "sneezing"];
        want.sort_unstable();
        assert_eq!(relevant_symptoms("rash"), want);
    }

    #[test]
    fn unrelated_questions_ask_for_the_refusal() {
        let case = flu_case();
        assert_eq!(patient_reward(UNRELATED[0], SORRY, &case), 1.0);
        assert!(patient_reward(UNRELATED[0], "I am 40.", &case) < 1.0);
        let exam = patient_exam(&case, 0);
        assert!(exam[0].contains("cough") || exam[0].contains("chills"));
        assert!(mentioned(&exam[1])
            .iter()
            .all(|s| !case.disease.symptoms.contains(s)));
        assert!(mentioned(&exam[2]).is_empty());
    }

    #[test]
    fn drills_ask_what_the_case_decides_and_never_the_exam() {
        let case = flu_case();
        let mut lacked = Vec::new();
        for k in 0..40 {
            let [have, lack, off] = patient_drill(&case, k);
            assert!(mentioned(&have)
                .iter()
                .all(|s| case.has(s) && *s != "fever"));
            let l = mentioned(&lack);
            assert!(l.len() == 1 && !case.has(l[0]), "{lack}");
            lacked.push(l[0]);
            assert!(mentioned(&off).is_empty(), "{off}");
            assert!(!UNRELATED.contains(&off.as_str()));
            assert_eq!(patient_reward(&off, SORRY, &case), 1.0);
        }
        // Body aches, the flu symptom this patient lacks, is drilled too.
        assert!(lacked.contains(&"body aches"));
        lacked.sort_unstable();
        lacked.dedup();
        assert_eq!(
            lacked.len(),
            symptom_vocabulary().len() - case.symptoms.len()
        );
    }
}
