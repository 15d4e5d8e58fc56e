//! The selector's side of the pipeline: how its prompt reads, how its reply names a
//! pick (by index, Miles' way, or by final number), and its exam: one problem with fixed
//! candidates, some right and some wrong, where a pick always matters.

use clap::ValueEnum;
use lathe_recipes::data::Problem;
use lathe_recipes::env::{rate, Env, Episode, Observation, Reply};
use lathe_recipes::grade::{judgment, last_integer};
use lathe_recipes::run::mean;

use super::{against_chance, numbered, JUDGMENT_TOKENS, SELECTOR};

/// How a selector's `Judgment: N` names the solution it picks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum PickBy {
    /// N is the solution's 1-based index.
    Index,
    /// N is the solution's final number.
    Value,
}

/// How the selector is asked and credited (the recipe's selector flags).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Selector {
    /// Picks sampled per problem.
    pub(crate) picks: usize,
    /// Credited within the problem's group of every role's samples (Miles), not against
    /// a random pick.
    pub(crate) pooled: bool,
    /// A worked selection before the task.
    pub(crate) example: bool,
    /// How a pick names its solution.
    pub(crate) by: PickBy,
}

impl Selector {
    /// The selector's observations of `solutions` to `p`: one per pick.
    pub(crate) fn observations(&self, p: &Problem, solutions: &[&str]) -> Vec<Observation> {
        let prompt = selector_prompt(p, solutions, self.example, self.by);
        vec![Observation::line(SELECTOR, prompt, JUDGMENT_TOKENS); self.picks]
    }
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

/// The selector's exam: one problem, fixed candidates, the selector's picks of them
/// (each credited against a random pick, even with a pooled selector).
pub(crate) struct SelectExam {
    pub(crate) problem: Problem,
    pub(crate) texts: Vec<String>,
    pub(crate) right: Vec<bool>,
    pub(crate) selector: Selector,
    pub(crate) replies: Vec<Reply>,
}

impl Env for SelectExam {
    fn initial_observations(&mut self) -> Vec<Observation> {
        let texts: Vec<&str> = self.texts.iter().map(String::as_str).collect();
        self.selector.observations(&self.problem, &texts)
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
            let right = pick_of(&reply, &texts, self.selector.by).is_some_and(|k| self.right[k]);
            scores.push(rate(right));
            e.transitions
                .push(against_chance(reply, rate(right), random));
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
    use lathe_recipes::data::candidates;

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
    fn an_exam_credits_picks_against_chance() {
        let p = Problem {
            question: "What is 12 + 9?".into(),
            answer: "21".into(),
        };
        // Candidates 1 and 2: the first right, the second wrong (2 of 5 right).
        let (texts, ok) = candidates(&p, 5, 2, 7);
        let first_right = ok.iter().position(|&r| r).unwrap() + 1;
        let first_wrong = ok.iter().position(|&r| !r).unwrap() + 1;
        let mut exam = Box::new(SelectExam {
            problem: p,
            texts,
            right: ok,
            selector: Selector {
                picks: 3,
                pooled: true,
                example: true,
                by: PickBy::Index,
            },
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
            // A pick that names no candidate earns what a wrong one does, and a pooled
            // selector's exam picks are still credited against a random pick.
            vec![
                (1.2, Some(0.4 * 1.2)),
                (0.0, Some(0.4 * 1.2)),
                (0.0, Some(0.4 * 1.2))
            ]
        );
    }
}
