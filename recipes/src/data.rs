//! Generated data sets with fixed seeds.

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;

/// A question with a known numeric answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The question text.
    pub question: String,
    /// The exact answer string.
    pub answer: String,
}

/// Every `a + b` with `a, b` in `lo..=hi`, shuffled with `seed`, split into
/// (train, held-out) with `held_out` problems held out. The split never shares a problem.
pub fn addition(lo: u32, hi: u32, seed: u64, held_out: usize) -> (Vec<Problem>, Vec<Problem>) {
    let mut all: Vec<Problem> = (lo..=hi)
        .flat_map(|a| (lo..=hi).map(move |b| (a, b)))
        .map(|(a, b)| Problem {
            question: format!("What is {a} + {b}?"),
            answer: (a + b).to_string(),
        })
        .collect();
    all.shuffle(&mut StdRng::seed_from_u64(seed));
    let held_out = held_out.min(all.len() / 2);
    let train = all.split_off(held_out);
    (train, all)
}

/// The `size` items of training step `step`, walking `items` round and round.
pub fn batch_at<T: Clone>(items: &[T], step: usize, size: usize) -> Vec<T> {
    if items.is_empty() {
        return Vec::new();
    }
    (0..size)
        .map(|i| items[(step * size + i) % items.len()].clone())
        .collect()
}

/// `n` (at least 2) candidate solutions of an addition `p`, each `"<question's sum> =
/// <value>"`, of which `right` (clamped to 1..n-1) say the answer and the others a
/// non-negative value off by 1, 2 or 10 (distinct while there are at most 5 wrong ones);
/// shuffled with `seed`. Returns the texts and which are right.
pub fn candidates(p: &Problem, n: usize, right: usize, seed: u64) -> (Vec<String>, Vec<bool>) {
    assert!(n >= 2, "an exam needs a right and a wrong candidate");
    let mut rng = StdRng::seed_from_u64(seed);
    let answer: i64 = p.answer.parse().expect("an addition's answer is a number");
    let sum = p
        .question
        .trim_start_matches("What is ")
        .trim_end_matches('?');
    let right = right.clamp(1, n - 1);
    let mut offsets: Vec<i64> = [-10, -2, -1, 1, 2, 10]
        .into_iter()
        .filter(|d| answer + d >= 0)
        .collect();
    offsets.shuffle(&mut rng);
    let mut picked: Vec<(i64, bool)> = (0..n)
        .map(|i| match i.checked_sub(right) {
            None => (answer, true),
            Some(k) => (answer + offsets[k % offsets.len()], false),
        })
        .collect();
    picked.shuffle(&mut rng);
    picked
        .into_iter()
        .map(|(v, ok)| (format!("{sum} = {v}"), ok))
        .unzip()
}

/// A disease of the synthetic case table: its symptoms and what a doctor should say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Disease {
    /// The diagnosis, as the doctor should name it.
    pub name: &'static str,
    /// Every symptom it can cause.
    pub symptoms: [&'static str; 4],
    /// What the doctor should recommend.
    pub recommendation: &'static str,
}

/// The synthetic case table: six diseases whose symptoms overlap, so the chief complaint
/// alone rarely decides the diagnosis.
pub const DISEASES: [Disease; 6] = [
    Disease {
        name: "flu",
        symptoms: ["fever", "cough", "body aches", "chills"],
        recommendation: "rest, fluids and fever medicine",
    },
    Disease {
        name: "common cold",
        symptoms: ["cough", "sneezing", "sore throat", "runny nose"],
        recommendation: "rest and fluids",
    },
    Disease {
        name: "migraine",
        symptoms: ["headache", "nausea", "light sensitivity", "dizziness"],
        recommendation: "a dark quiet room and pain relief",
    },
    Disease {
        name: "food poisoning",
        symptoms: ["nausea", "vomiting", "diarrhea", "stomach cramps"],
        recommendation: "fluids and a bland diet",
    },
    Disease {
        name: "allergy",
        symptoms: ["sneezing", "itchy eyes", "runny nose", "rash"],
        recommendation: "antihistamines and avoiding the trigger",
    },
    Disease {
        name: "strep throat",
        symptoms: ["sore throat", "fever", "swollen glands", "headache"],
        recommendation: "a throat swab and antibiotics",
    },
];

/// Every symptom of the table, once, longest first (so "sore throat" matches before a
/// shorter symptom inside it would).
pub fn symptom_vocabulary() -> Vec<&'static str> {
    let mut all: Vec<&'static str> = DISEASES.iter().flat_map(|d| d.symptoms).collect();
    all.sort_by(|a, b| b.len().cmp(&a.len()).then(a.cmp(b)));
    all.dedup();
    all
}

/// One patient: a disease, the chief complaint they open with, and the symptoms they have
/// (two to four of the disease's four, the complaint among them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Case {
    /// The disease.
    pub disease: Disease,
    /// The symptom the patient opens with.
    pub complaint: &'static str,
    /// The symptoms the patient has.
    pub symptoms: Vec<&'static str>,
}

impl Case {
    /// Whether the patient has `symptom`.
    pub fn has(&self, symptom: &str) -> bool {
        self.symptoms.contains(&symptom)
    }
}

/// Every case of the table, shuffled with `seed`, split into (train, held-out): each
/// disease × complaint × a non-empty set of its other three symptoms the patient also has
/// (6 × 4 × 7 = 168), so that a held-out set of 64 cases, `recipes.md`'s floor, leaves
/// 104 to train on.
pub fn cases(seed: u64, held_out: usize) -> (Vec<Case>, Vec<Case>) {
    let mut all = Vec::new();
    for disease in DISEASES {
        for complaint in disease.symptoms {
            let others: Vec<&'static str> = disease
                .symptoms
                .iter()
                .copied()
                .filter(|s| *s != complaint)
                .collect();
            for subset in 1..(1u32 << others.len()) {
                all.push(Case {
                    disease,
                    complaint,
                    // In the table's order, the complaint in its place.
                    symptoms: disease
                        .symptoms
                        .iter()
                        .copied()
                        .filter(|s| {
                            *s == complaint
                                || others
                                    .iter()
                                    .position(|o| o == s)
                                    .is_some_and(|i| subset & (1 << i) != 0)
                        })
                        .collect(),
                });
            }
        }
    }
    all.shuffle(&mut StdRng::seed_from_u64(seed));
    let held_out = held_out.min(all.len() / 2);
    let train = all.split_off(held_out);
    (train, all)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grade::last_integer_reward;

    #[test]
    fn splits_are_disjoint_and_deterministic() {
        let (train, test) = addition(10, 19, 3, 20);
        assert_eq!((train.len(), test.len()), (80, 20));
        assert!(test.iter().all(|p| !train.contains(p)));
        assert_eq!(addition(10, 19, 3, 20).1, test);
        assert_ne!(addition(10, 19, 4, 20).1, test);
        let p = &test[0];
        let nums: Vec<u32> = p.question[8..p.question.len() - 1]
            .split(" + ")
            .map(|n| n.parse().unwrap())
            .collect();
        assert_eq!((nums[0] + nums[1]).to_string(), p.answer);
    }

    #[test]
    fn batches_walk_the_items_round_and_round() {
        let items = [1, 2, 3, 4, 5];
        assert_eq!(batch_at(&items, 0, 2), vec![1, 2]);
        assert_eq!(batch_at(&items, 2, 2), vec![5, 1]);
        assert!(batch_at::<u8>(&[], 3, 2).is_empty());
    }

    #[test]
    fn cases_cover_the_table_and_hold_the_complaint() {
        let (train, test) = cases(1, 64);
        assert_eq!((train.len(), test.len()), (104, 64));
        assert!(test.iter().all(|c| !train.contains(c)));
        let mut sizes = [0; 5];
        for c in train.iter().chain(&test) {
            sizes[c.symptoms.len()] += 1;
            assert!(c.has(c.complaint));
            assert!(c.symptoms.iter().all(|s| c.disease.symptoms.contains(s)));
        }
        // Per disease and complaint: three patients with one more symptom, three with
        // two more, one with all four.
        assert_eq!(sizes, [0, 0, 72, 72, 24]);
        assert_eq!(cases(1, 64).1, test);
        let vocab = symptom_vocabulary();
        assert_eq!(vocab.len(), 17);
        assert!(vocab.windows(2).all(|w| w[0].len() >= w[1].len()));
    }

    #[test]
    fn candidates_are_some_right_some_wrong_by_distinct_offsets() {
        let p = Problem {
            question: "What is 12 + 9?".into(),
            answer: "21".into(),
        };
        for right in 0..7 {
            let (texts, ok) = candidates(&p, 5, right, 7);
            let n_right = ok.iter().filter(|&&r| r).count();
            assert_eq!(n_right, right.clamp(1, 4));
            for (t, r) in texts.iter().zip(&ok) {
                assert!(t.starts_with("12 + 9 = "));
                assert_eq!(*r, last_integer_reward(t, "21") == 1.0, "{t}");
            }
            let wrong: std::collections::BTreeSet<&String> = texts
                .iter()
                .zip(&ok)
                .filter(|(_, r)| !**r)
                .map(|(t, _)| t)
                .collect();
            assert_eq!(wrong.len(), 5 - n_right, "distinct wrong values");
        }
        // Every offset that would go below zero is left out.
        let small = Problem {
            question: "What is 0 + 1?".into(),
            answer: "1".into(),
        };
        let (texts, _) = candidates(&small, 5, 1, 3);
        assert!(texts.iter().all(|t| !t.contains('-')), "{texts:?}");
    }
}
