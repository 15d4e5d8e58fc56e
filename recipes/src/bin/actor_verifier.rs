//! AstraFlow's actor + verifier (`actor_and_verify`) as two LoRA sessions on one base
//! model. For every problem, `--group` independent chains: the solver answers; the verifier
//! reviews that answer and ends with `<verify>approve</verify>` or
//! `<verify>reject</verify>`; a rejected solver retries once with the verifier's output as
//! team context. Solver reward 1/0 (last integer), verifier reward 1 when its verdict
//! matches the first answer's correctness (0 when unparsable, which counts as approve).
//! Rewards are normalised per problem and per agent (mean / unbiased std); groups whose
//! rewards are all equal are dropped unless `--keep-zero-adv`. The verifier's verdicts
//! are balanced by default (an addition to AstraFlow): each is compared with the step's
//! verdicts on answers of the same correctness, and right and wrong answers weigh the
//! same, so rejecting everything while the solver is mostly wrong earns nothing
//! (`--no-balance`: AstraFlow's per-problem baseline). `--verifier-drills` adds verdicts
//! on written sums in contrast pairs, one right and one wrong answer to the same problem
//! (balanced data, another addition). `--single-agent` trains the
//! solver alone with the same problems, steps and group; when the second session cannot be
//! created (or with `--force-fallback`) one session plays both roles.
//!
//! Adapted to a small model: prompts are raw text, answers are a line long, the
//! verifier's prompt ends with the opening `<verify>` tag so its verdict is its first
//! word, and a verdict that names neither keyword but starts with "yes" or "no" counts as
//! approve or reject (AstraFlow would score it unparsed; why, in
//! `recipes/actor_verifier.md`).

use clap::{Parser, ValueEnum};
use lathe::types::LossFn;
use lathe_recipes::credit::{Credit, Normalise, Objective};
use lathe_recipes::data::{addition, batch_at, candidates, Problem};
use lathe_recipes::env::{rate, Env, EnvGroup, Episode, Observation, Reply, Transition};
use lathe_recipes::grade::{last_integer_reward, verdict};
use lathe_recipes::play::{mix_seed, Sampling};
use lathe_recipes::rl::{run, settings_of, Bar, Criterion, Curve, Recipe};
use lathe_recipes::run::Curves;
use lathe_recipes::setup::{init_tracing, parse_args, CommonArgs};
use serde::Serialize;
use serde_json::Value;

/// The embedded server's tensors are large and short-lived: see `lathe_server::memory`.
#[global_allocator]
static GLOBAL: lathe_server::memory::MiMalloc = lathe_server::memory::MiMalloc;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
enum Loss {
    /// Tinker's `importance_sampling`.
    ImportanceSampling,
    /// Tinker's `ppo` (clip 0.8 / 1.2).
    Ppo,
}

/// A solver and a verifier, trained together with per-agent group-normalised RL.
#[derive(Parser, Debug, Serialize)]
#[command(name = "actor_verifier", about)]
struct Args {
    #[command(flatten)]
    #[serde(skip)]
    common: CommonArgs,
    /// Train the solver alone (AstraFlow's single-agent baseline).
    #[arg(long)]
    single_agent: bool,
    /// Independent chains per problem (the RL group).
    #[arg(long, default_value_t = 4)]
    group: usize,
    /// Largest operand of the generated additions.
    #[arg(long, default_value_t = 30)]
    max_operand: u32,
    /// Policy loss.
    #[arg(long, value_enum, default_value_t = Loss::ImportanceSampling)]
    loss: Loss,
    /// Keep groups whose rewards are all equal (AstraFlow's `no-ds` variants).
    #[arg(long)]
    keep_zero_adv: bool,
    /// Credit the verifier as AstraFlow does, within each problem's chains, instead of
    /// balancing right and wrong answers across the step.
    #[arg(long)]
    no_balance: bool,
    /// The verifier's training temperature (default: `--temperature`).
    #[arg(long, conflicts_with = "single_agent")]
    verifier_temperature: Option<f64>,
    /// The verifier's Adam learning rate (default: `--lr`), where the verifier has its
    /// own session.
    #[arg(long, conflicts_with = "single_agent")]
    verifier_lr: Option<f64>,
    /// Contrast pairs of verdict drills per problem: the problem's sum written once with
    /// its answer and once off by 1, 2 or 10, each judged by the verifier, trained on
    /// beside the chains and evaluated on the held-out problems too (0: the verifier
    /// learns from the solver's answers only).
    #[arg(long, default_value_t = 0, conflicts_with_all = ["single_agent", "no_balance"])]
    verifier_drills: usize,
}

const SOLVER: usize = 0;
const VERIFIER: usize = 1;
const SOLVER_TOKENS: usize = 16;
const VERIFIER_TOKENS: usize = 4;
/// The criterion's gain, calibrated from measured runs (`recipes/actor_verifier.md`).
const CRITERION_GAIN: f64 = 0.15;

fn environment(p: &Problem) -> String {
    format!(
        "You are a member of an expert multi-agent team solving this math problem: {}",
        p.question
    )
}

/// The solver's prompt; `context` is the teammates' output (the verifier's review on a
/// retry).
fn solver_prompt(p: &Problem, context: Option<&str>) -> String {
    format!(
        "{}\n# Your teammates' outputs\n{}\n# Your role: Solver. Consider your teammates' outputs if any, and end with the final number.\nSolution:",
        environment(p),
        context.unwrap_or("(none)")
    )
}

/// The verifier's prompt, ending in the opening tag of its verdict.
fn verifier_prompt(p: &Problem, solution: &str) -> String {
    format!(
        "{}\n# The Solver's solution\n{}\n# Your role: Verifier. Check the solution; answer <verify>approve</verify> if it is correct, <verify>reject</verify> if not.\nVerdict: <verify>",
        environment(p),
        solution.trim()
    )
}

/// The team context of a retry: the rejected solution and the verifier's output on it.
fn retry_context(solution: &str, review: &str) -> String {
    format!(
        "Solver: {}\nVerifier: <verify>{}",
        solution.trim(),
        review.trim()
    )
}

/// What the verifier decided: `(approved, parsed)`. Undecidable counts as approve.
/// AstraFlow's verdict decides first; failing that, a first word "yes" or "no" does, so
/// the verifier's first reward does not hinge on which keyword it happens to sample
/// first (see the module's adaptations).
fn decision(review: &str) -> (bool, bool) {
    let first_word = review
        .split(|c: char| !c.is_ascii_alphabetic())
        .find(|w| !w.is_empty())
        .map(str::to_ascii_lowercase);
    match verdict(&format!("<verify>{review}")) {
        Some(approved) => (approved, true),
        None => match first_word.as_deref() {
            Some("yes") => (true, true),
            Some("no") => (false, true),
            _ => (true, false),
        },
    }
}

/// The verifier's reward: 1 when its parsed verdict matches the answer's correctness.
fn verifier_reward(review: &str, solver_reward: f64) -> f64 {
    let (approved, parsed) = decision(review);
    if parsed && approved == (solver_reward > 0.5) {
        1.0
    } else {
        0.0
    }
}

/// One chain: an answer, its review (unless the solver works alone), a retry when
/// rejected.
struct Chain {
    problem: Problem,
    verify: bool,
    replies: Vec<Reply>,
}

impl Env for Chain {
    fn initial_observations(&mut self) -> Vec<Observation> {
        let prompt = solver_prompt(&self.problem, None);
        vec![Observation::line(SOLVER, prompt, SOLVER_TOKENS)]
    }

    fn step(&mut self, mut replies: Vec<Reply>) -> Vec<Observation> {
        self.replies.append(&mut replies);
        let text = |i: usize| self.replies[i].sample.text.as_str();
        match self.replies.len() {
            1 if self.verify => vec![review(&self.problem, text(0))],
            2 if !decision(text(1)).0 => {
                let context = retry_context(text(0), text(1));
                let prompt = solver_prompt(&self.problem, Some(&context));
                vec![Observation::line(SOLVER, prompt, SOLVER_TOKENS)]
            }
            _ => Vec::new(),
        }
    }

    fn finish(self: Box<Self>) -> Episode {
        let answer = &self.problem.answer;
        let mut e = Episode::default();
        let mut replies = self.replies.into_iter();
        let Some(first) = replies.next() else {
            return e;
        };
        let first_reward = last_integer_reward(&first.sample.text, answer);
        e.metrics.insert("first_correct".into(), first_reward);
        e.metrics.insert("final_correct".into(), first_reward);
        e.transitions
            .push(Transition::new(SOLVER, first, first_reward, 0));
        if let Some(review) = replies.next() {
            let (approved, parsed) = decision(&review.sample.text);
            e.metrics.insert("approve_rate".into(), rate(approved));
            e.metrics.insert("parsed_rate".into(), rate(parsed));
            e.metrics.insert("retry_rate".into(), rate(!approved));
            let verdict = judged(review, first_reward > 0.5, "verifier_accuracy");
            e.metrics.extend(verdict.metrics);
            e.transitions.extend(verdict.transitions);
        }
        if let Some(retry) = replies.next() {
            let reward = last_integer_reward(&retry.sample.text, answer);
            e.metrics.insert("final_correct".into(), reward);
            e.transitions
                .push(Transition::new(SOLVER, retry, reward, 1));
        }
        e
    }
}

/// The verifier's observation of `solution` to `problem`.
fn review(problem: &Problem, solution: &str) -> Observation {
    let prompt = verifier_prompt(problem, solution);
    Observation::line(VERIFIER, prompt, VERIFIER_TOKENS).stop_at(&["</verify>", "\n"])
}

/// A verdict on an answer that was `right`: its reward under `accuracy`, and whether
/// the answer was approved when right or rejected when wrong (an undecidable verdict
/// counting as approve, as in the chain) under its class's metric. Its class, for the
/// balanced credit, is the answer's correctness.
fn judged(review: Reply, right: bool, accuracy: &str) -> Episode {
    let reward = verifier_reward(&review.sample.text, rate(right));
    let class = if right {
        "approve_right"
    } else {
        "reject_wrong"
    };
    let mut e = Episode::default();
    e.metrics.insert(accuracy.into(), reward);
    let approved = decision(&review.sample.text).0;
    e.metrics.insert(class.into(), rate(approved == right));
    e.transitions
        .push(Transition::new(VERIFIER, review, reward, 0).in_class(usize::from(right)));
    e
}

/// A verdict drill: the verifier judges a written solution whose correctness is known.
struct Drill {
    problem: Problem,
    solution: String,
    right: bool,
    review: Option<Reply>,
}

impl Env for Drill {
    fn initial_observations(&mut self) -> Vec<Observation> {
        vec![review(&self.problem, &self.solution)]
    }

    fn step(&mut self, mut replies: Vec<Reply>) -> Vec<Observation> {
        self.review = replies.pop();
        Vec::new()
    }

    fn finish(self: Box<Self>) -> Episode {
        let Some(review) = self.review else {
            return Episode::default();
        };
        let mut e = judged(review, self.right, "drill_verifier_accuracy");
        // The chains' class metrics are the verifier's on the solver's answers.
        e.metrics.retain(|name, _| name.starts_with("drill"));
        e
    }
}

/// A contrast pair of drills on `problem` (its answer and a wrong one), from `seed`.
fn drill_pair(problem: &Problem, seed: u64) -> Vec<Box<dyn Env>> {
    let (texts, right) = candidates(problem, 2, 1, seed);
    let drill = |(solution, right)| -> Box<dyn Env> {
        Box::new(Drill {
            problem: problem.clone(),
            solution,
            right,
            review: None,
        })
    };
    texts.into_iter().zip(right).map(drill).collect()
}

struct ActorVerifier {
    args: Args,
    train: Vec<Problem>,
    held_out: Vec<Problem>,
}

impl ActorVerifier {
    fn verify(&self) -> bool {
        !self.args.single_agent
    }

    fn chain(&self, problem: &Problem) -> Box<dyn Env> {
        Box::new(Chain {
            problem: problem.clone(),
            verify: self.verify(),
            replies: Vec::new(),
        })
    }

    /// `--verifier-drills` contrast pairs on `problem`, from `seed`.
    fn drills(&self, problem: &Problem, seed: u64) -> Vec<Box<dyn Env>> {
        (0..self.args.verifier_drills as u64)
            .flat_map(|d| drill_pair(problem, mix_seed(seed, &[d])))
            .collect()
    }
}

impl Recipe for ActorVerifier {
    fn name(&self) -> &'static str {
        "actor_verifier"
    }

    fn roles(&self) -> Vec<&'static str> {
        if self.verify() {
            vec!["solver", "verifier"]
        } else {
            vec!["solver"]
        }
    }

    fn objective(&self) -> Objective {
        let loss = match self.args.loss {
            Loss::ImportanceSampling => LossFn::ImportanceSampling,
            Loss::Ppo => LossFn::Ppo,
        };
        let credit = Credit {
            keep_zero: self.args.keep_zero_adv,
            balance: !self.args.no_balance,
            ..Credit::group(Normalise::Standardise)
        };
        Objective::Rl(loss, credit)
    }

    fn sampling(&self, role: usize) -> Sampling {
        match (role, self.args.verifier_temperature) {
            (VERIFIER, Some(t)) => Sampling::at(t),
            _ => Sampling::at(self.args.common.temperature),
        }
    }

    /// Each problem's chains, then its verdict drills in a group of their own (the
    /// balanced credit compares verdicts across the step, whatever their group).
    fn groups(&self, step: usize) -> Vec<EnvGroup> {
        let c = &self.args.common;
        let mut groups = Vec::new();
        for (i, p) in batch_at(&self.train, step, c.batch).iter().enumerate() {
            groups.push((0..self.args.group.max(1)).map(|_| self.chain(p)).collect());
            let drills = self.drills(p, mix_seed(c.seed, &[step as u64, i as u64]));
            if !drills.is_empty() {
                groups.push(drills);
            }
        }
        groups
    }

    /// A chain per held-out problem, then its drills (fixed by the seed and the
    /// problem's place).
    fn held_out(&self) -> Vec<Box<dyn Env>> {
        let chains = self.held_out.iter().map(|p| self.chain(p));
        let drills = (self.held_out.iter().enumerate()).flat_map(|(i, p)| {
            self.drills(p, mix_seed(self.args.common.seed, &[u64::MAX, i as u64]))
        });
        chains.chain(drills).collect()
    }

    fn curves(&self) -> Vec<Curve> {
        let mut curves = vec![Curve::new("final correct", "final_correct")];
        if self.verify() {
            curves.extend([
                Curve::new("first attempt correct", "first_correct"),
                Curve::new("verifier accuracy", "verifier_accuracy"),
                Curve::new("verifier approves right", "approve_right"),
                Curve::new("verifier rejects wrong", "reject_wrong"),
            ]);
        }
        if self.args.verifier_drills > 0 {
            curves.push(Curve::new(
                "drills: verifier accuracy",
                "drill_verifier_accuracy",
            ));
        }
        curves
    }

    fn criterion(&self, curves: &Curves) -> Criterion {
        let (before, after) = curves.before_after("final correct");
        let (_, first_after) = curves.before_after("first attempt correct");
        let gained = after - before >= CRITERION_GAIN;
        if self.verify() {
            Criterion {
                text: format!("held-out final accuracy rises by >= {CRITERION_GAIN} and ends >= first-attempt accuracy"),
                passed: gained && after >= first_after,
            }
        } else {
            Criterion {
                text: format!("held-out accuracy rises by >= {CRITERION_GAIN}"),
                passed: gained,
            }
        }
    }

    /// AstraFlow's bars: the verifier better than always saying the verdict that is right
    /// most often on these answers, and verification improving on the first attempt.
    fn upstream_bars(&self, curves: &Curves) -> Vec<Bar> {
        if !self.verify() {
            return Vec::new();
        }
        let (_, after) = curves.before_after("final correct");
        let (_, first_after) = curves.before_after("first attempt correct");
        let (_, verifier_after) = curves.before_after("verifier accuracy");
        let majority = first_after.max(1.0 - first_after);
        vec![
            Bar::on(
                "held-out verifier accuracy ends above the majority-class baseline (the larger of first-attempt accuracy and its complement)",
                &[verifier_after, majority],
                || verifier_after > majority,
            ),
            Bar::on(
                "held-out final accuracy ends above first-attempt accuracy",
                &[after, first_after],
                || after > first_after,
            ),
        ]
    }

    fn lr(&self, role: usize) -> Option<f64> {
        self.args.verifier_lr.filter(|_| role == VERIFIER)
    }

    fn settings(&self) -> Value {
        settings_of(&self.args)
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    init_tracing();
    // AstraFlow samples at 1.0; a 135M model rarely answers correctly that hot.
    let args: Args = parse_args(&[
        ("steps", "12"),
        ("lr", "5e-4"),
        ("batch", "8"),
        ("temperature", "0.7"),
        ("eval_every", "4"),
        ("eval_size", "40"),
    ]);
    if let Some(lr) = args.verifier_lr {
        anyhow::ensure!(
            lr.is_finite() && lr > 0.0,
            "--verifier-lr must be a positive number, got {lr}"
        );
    }
    let c = args.common.clone();
    let (train, held_out) = addition(1, args.max_operand, c.seed, c.eval_size);
    let recipe = ActorVerifier {
        args,
        train,
        held_out,
    };
    run(&recipe, &c).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use lathe_recipes::rollout::Sample;

    fn problem() -> Problem {
        Problem {
            question: "What is 2 + 3?".into(),
            answer: "5".into(),
        }
    }

    /// A chain on [`problem`], reviewed with `verify`.
    fn new_chain(verify: bool) -> Box<Chain> {
        Box::new(Chain {
            problem: problem(),
            verify,
            replies: Vec::new(),
        })
    }

    fn reply(text: &str) -> Reply {
        Reply {
            prompt: vec![1],
            sample: Sample {
                tokens: vec![2],
                logprobs: vec![-0.1],
                text: text.into(),
            },
            version: 0,
        }
    }

    #[test]
    fn verifier_reward_is_verdict_matching_correctness() {
        assert_eq!(verifier_reward("approve</verify>", 1.0), 1.0);
        assert_eq!(verifier_reward("reject</verify>", 0.0), 1.0);
        assert_eq!(verifier_reward("reject", 1.0), 0.0);
        assert_eq!(verifier_reward("approve", 0.0), 0.0);
        // A first "yes" or "no" decides.
        assert_eq!(verifier_reward("yes</verify>", 1.0), 1.0);
        assert_eq!(verifier_reward("No, 7</verify>", 0.0), 1.0);
        // Unparsable: counts as approve, but earns nothing even when the answer is right.
        assert_eq!(decision("hmm"), (true, false));
        assert_eq!(verifier_reward("hmm", 1.0), 0.0);
    }

    #[test]
    fn prompts_carry_the_team_context() {
        let p = problem();
        assert!(solver_prompt(&p, None).contains("(none)"));
        let retry = solver_prompt(&p, Some(&retry_context(" 6\n", "reject</verify>")));
        assert!(retry.contains("Solver: 6\nVerifier: <verify>reject</verify>"));
        assert!(verifier_prompt(&p, " 6\n").ends_with("6\n# Your role: Verifier. Check the solution; answer <verify>approve</verify> if it is correct, <verify>reject</verify> if not.\nVerdict: <verify>"));
    }

    #[test]
    fn a_rejected_answer_is_retried_and_the_retry_is_final() {
        let mut chain = new_chain(true);
        chain.initial_observations();
        let review = chain.step(vec![reply(" 6")]);
        assert_eq!(review[0].role, VERIFIER);
        let retry = chain.step(vec![reply("reject</verify>")]);
        assert!(retry[0]
            .prompt
            .contains("Solver: 6\nVerifier: <verify>reject"));
        assert!(chain.step(vec![reply(" 5")]).is_empty());
        let e = chain.finish();
        let rewards: Vec<(usize, f64, usize)> = e
            .transitions
            .iter()
            .map(|t| (t.role, t.reward, t.position))
            .collect();
        assert_eq!(
            rewards,
            vec![(SOLVER, 0.0, 0), (VERIFIER, 1.0, 0), (SOLVER, 1.0, 1)]
        );
        // The verdict's class is the correctness of the answer it judged.
        let classes: Vec<Option<usize>> = e.transitions.iter().map(|t| t.class).collect();
        assert_eq!(classes, vec![None, Some(0), None]);
        assert_eq!(e.metrics["reject_wrong"], 1.0);
        assert!(!e.metrics.contains_key("approve_right"));
        assert_eq!(
            (e.metrics["first_correct"], e.metrics["final_correct"]),
            (0.0, 1.0)
        );
        // An approved answer ends the chain; alone, the solver is never reviewed.
        let mut chain = new_chain(true);
        chain.initial_observations();
        chain.step(vec![reply(" 5")]);
        assert!(chain.step(vec![reply("approve</verify>")]).is_empty());
        let mut chain = new_chain(false);
        chain.initial_observations();
        assert!(chain.step(vec![reply(" 5")]).is_empty());
    }

    #[test]
    fn drills_come_in_contrast_pairs_judged_like_the_chains_verdicts() {
        let mut pair = drill_pair(&problem(), 3);
        let prompts: Vec<String> = (pair.iter_mut())
            .map(|d| d.initial_observations().remove(0).prompt)
            .collect();
        assert!(prompts[0] != prompts[1], "{prompts:?}");
        assert!(prompts.iter().all(|p| p.contains("2 + 3 = ")));
        // Approving both: one verdict right (class 1), one wrong (class 0).
        let episodes: Vec<Episode> = (pair.into_iter())
            .map(|mut d| {
                d.step(vec![reply("approve</verify>")]);
                d.finish()
            })
            .collect();
        let mut judged: Vec<(Option<usize>, f64)> = (episodes.iter())
            .map(|e| (e.transitions[0].class, e.transitions[0].reward))
            .collect();
        judged.sort_by_key(|j| j.0);
        assert_eq!(judged, vec![(Some(0), 0.0), (Some(1), 1.0)]);
        // Drills report their own accuracy, not the chains' class metrics.
        assert!(episodes
            .iter()
            .all(|e| e.metrics.len() == 1 && e.metrics.contains_key("drill_verifier_accuracy")));
    }

    #[test]
    fn the_verifier_bar_is_the_majority_class_and_the_team_bar_the_first_attempt() {
        let args = Args::parse_from([
            "actor_verifier",
            "--steps",
            "12",
            "--lr",
            "5e-4",
            "--batch",
            "8",
            "--temperature",
            "0.7",
            "--eval-every",
            "4",
            "--eval-size",
            "40",
        ]);
        let recipe = ActorVerifier {
            args,
            train: Vec::new(),
            held_out: Vec::new(),
        };
        let curves = |first: f64, final_: f64, verifier: f64| {
            let mut c = Curves::new(&[
                "final correct",
                "first attempt correct",
                "verifier accuracy",
            ]);
            for (name, v) in [
                ("final correct", final_),
                ("first attempt correct", first),
                ("verifier accuracy", verifier),
            ] {
                c.push(name, 0, 0.4);
                c.push(name, 12, v);
            }
            c
        };
        let met = |c: &Curves| -> Vec<Option<bool>> {
            recipe.upstream_bars(c).iter().map(|b| b.met).collect()
        };
        // Always approving answers that are right 60% of the time is the majority class.
        assert_eq!(met(&curves(0.6, 0.6, 0.6)), vec![Some(false), Some(false)]);
        assert_eq!(met(&curves(0.6, 0.65, 0.7)), vec![Some(true), Some(true)]);
        // Mostly wrong answers: the baseline is always rejecting.
        assert_eq!(met(&curves(0.3, 0.3, 0.65)), vec![Some(false), Some(false)]);
        // No held-out point: not measured.
        let empty = Curves::new(&[
            "final correct",
            "first attempt correct",
            "verifier accuracy",
        ]);
        assert_eq!(met(&empty), vec![None, None]);
        // The learning criterion is separate: +0.2 and final = first passes it.
        assert!(recipe.criterion(&curves(0.6, 0.6, 0.6)).passed);
        // The verifier samples at its own temperature when given one.
        assert_eq!(recipe.sampling(VERIFIER), Sampling::at(0.7));
        let mut hot = recipe;
        hot.args.verifier_temperature = Some(1.0);
        assert_eq!(hot.sampling(VERIFIER), Sampling::at(1.0));
        assert_eq!(hot.sampling(SOLVER), Sampling::at(0.7));
        // The settings are the recipe's own flags.
        let settings = hot.settings();
        assert_eq!(settings["group"], 4);
        assert_eq!(settings["loss"], "importance-sampling");
        assert!(settings.get("common").is_none());
    }
}
