//! The selector's side of the pipeline: how its prompt reads, how its reply names a
//! pick (by index, Miles' way, or by final number), and its exam: one problem with fixed
//! candidates, some right and some wrong, where a pick always matters.

use clap::ValueEnum;
use lathe_recipes::data::Problem;
use lathe_recipes::env::{rate, Env, Episode, Observation, Reply};
use lathe_recipes::grade::{judgment, last_integer};
use lathe_recipes::run::mean;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;

use super::{against_chance, numbered, JUDGMENT_TOKENS, SELECTOR};

/// How a selector's `Judgment: N` names the solution it picks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum PickBy {
    /// N is the solution's 1-based index.
    Index,
    /// N is the solution's final number.
    Value,
}

/// A worked selection shown before the selector's task when `--selector-example` is on:
/// three solutions of another sum, two agreeing and right, and a pick of one of them
/// (its index, or its final number).
fn selector_example(by: PickBy) -> String {
    let pick = match by {
        PickBy::Index => "2",
        PickBy::Value => "17",
    };
    format!("### Problem\nWhat is 12 + 5?\n#### Solution 1\n12 + 5 = 18\n---\n#### Solution 2\n12 + 5 = 17\n---\n#### Solution 3\n12 + 5 = 17\nJudgment: {pick}\n\n")
}

pub(crate) fn selector_prompt(
    p: &Problem,
    solutions: &[&str],
    example: bool,
    by: PickBy,
) -> String {
    let n = solutions.len();
    let ending = match by {
        PickBy::Index => format!("IDX (1 to {n})"),
        PickBy::Value => "N, N being its final number".to_string(),
    };
    format!(
        "You get a math problem and {n} solutions. Analyze them, find the most sound one, and end with exactly Judgment: {ending}.\n{}### Problem\n{}\n{}\nJudgment:",
        if example { selector_example(by) } else { String::new() },
        p.question,
        numbered(solutions),
    )
}

/// The 0-based place among `candidates` that a selector's reply picks (its prompt ends
/// in `Judgment:`), as `by` reads it.
pub(crate) fn pick_of(s: &Reply, candidates: &[&str], by: PickBy) -> Option<usize> {
    let n = judgment(&format!("Judgment:{}", s.sample.text))?;
    match by {
        PickBy::Index => n.checked_sub(1).filter(|&k| k < candidates.len()),
        PickBy::Value => {
            let n = i64::try_from(n).ok()?;
            (candidates.iter()).position(|c| last_integer(c) == Some(n))
        }
    }
}

/// `n` (at least 2) candidate solutions of an addition `p`, each `"<question's sum> =
/// <value>"`, of which `right` (clamped to 1..n-1) say the answer and the others a
/// non-negative value off by 1, 2 or 10 (distinct while there are at most 5 wrong ones);
/// shuffled with `seed`. Returns the texts and which are right.
pub(crate) fn candidates(
    p: &Problem,
    n: usize,
    right: usize,
    seed: u64,
) -> (Vec<String>, Vec<bool>) {
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

/// The selector's exam: one problem, fixed candidates, `picks` sampled picks.
pub(crate) struct SelectExam {
    pub(crate) problem: Problem,
    pub(crate) texts: Vec<String>,
    pub(crate) right: Vec<bool>,
    pub(crate) picks: usize,
    pub(crate) invalid_pick: f64,
    pub(crate) example: bool,
    pub(crate) pick_by: PickBy,
    pub(crate) replies: Vec<Reply>,
}

impl Env for SelectExam {
    fn initial_observations(&mut self) -> Vec<Observation> {
        let texts: Vec<&str> = self.texts.iter().map(String::as_str).collect();
        let prompt = selector_prompt(&self.problem, &texts, self.example, self.pick_by);
        vec![Observation::line(SELECTOR, prompt, JUDGMENT_TOKENS); self.picks]
    }

    fn step(&mut self, replies: Vec<Reply>) -> Vec<Observation> {
        self.replies = replies;
        Vec::new()
    }

    fn finish(self: Box<Self>) -> Episode {
        let random = self.right.iter().filter(|&&r| r).count() as f64 / self.right.len() as f64;
        let mut e = Episode::default();
        let mut scores = Vec::new();
        for reply in self.replies {
            let texts: Vec<&str> = self.texts.iter().map(String::as_str).collect();
            let right = pick_of(&reply, &texts, self.pick_by).map(|k| self.right[k]);
            let score = rate(right.unwrap_or(false));
            scores.push(score);
            let credited = right.map_or(self.invalid_pick, rate);
            e.transitions.push(against_chance(reply, credited, random));
        }
        e.metrics.insert("exam_pick_accuracy".into(), mean(&scores));
        e.metrics.insert("exam_random_accuracy".into(), random);
        e
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::replies;
    use lathe_recipes::grade::last_integer_reward;

    #[test]
    fn picks_name_an_index_or_the_first_solution_ending_in_a_value() {
        let texts = ["2 + 3 = 6", "2 + 3 = 5", "it is 5"];
        let pick = |t: &str, by| pick_of(&replies(&[t])[0], &texts, by);
        assert_eq!(pick(" 5", PickBy::Value), Some(1));
        assert_eq!(pick(" 6\n", PickBy::Value), Some(0));
        assert_eq!(pick(" 7", PickBy::Value), None);
        assert_eq!(pick(" 3", PickBy::Index), Some(2));
        assert_eq!(pick(" 4", PickBy::Index), None);
        assert_eq!(pick(" 0", PickBy::Index), None);
        assert_eq!(pick(" Compare.", PickBy::Value), None);
    }

    #[test]
    fn an_exam_has_right_and_wrong_candidates_and_credits_picks_against_chance() {
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
        // Candidates 1 and 2: the first right, the second wrong (2 of 5 right).
        let (texts, ok) = candidates(&p, 5, 2, 7);
        let first_right = ok.iter().position(|&r| r).unwrap() + 1;
        let first_wrong = ok.iter().position(|&r| !r).unwrap() + 1;
        let mut exam = Box::new(SelectExam {
            problem: p,
            texts,
            right: ok,
            picks: 3,
            invalid_pick: -0.5,
            example: true,
            pick_by: PickBy::Index,
            replies: Vec::new(),
        });
        assert_eq!(exam.initial_observations().len(), 3);
        let picks = [format!(" {first_right}"), format!(" {first_wrong}")];
        assert!(exam
            .step(replies(&[&picks[0], &picks[1], " Compare."]))
            .is_empty());
        let e = exam.finish();
        assert!((e.metrics["exam_pick_accuracy"] - 1.0 / 3.0).abs() < 1e-12);
        assert_eq!(e.metrics["exam_random_accuracy"], 0.4);
        let credited: Vec<(f64, Option<f64>)> = e
            .transitions
            .iter()
            .map(|t| (t.reward, t.baseline))
            .collect();
        assert_eq!(
            credited,
            // A pick that names no candidate earns the invalid pick's reward.
            vec![
                (1.2, Some(0.4 * 1.2)),
                (0.0, Some(0.4 * 1.2)),
                (-0.5 * 1.2, Some(0.4 * 1.2))
            ]
        );
    }
}
