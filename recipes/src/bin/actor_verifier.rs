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
//! (`--no-balance`: AstraFlow's per-problem baseline). `--single-agent` trains the
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
use lathe_recipes::data::{addition, batch_at, Problem};
use lathe_recipes::env::{rate, Env, EnvGroup, Episode, Observation, Reply, Transition};
use lathe_recipes::grade::{last_integer, last_integer_reward, verdict};
use lathe_recipes::play::Sampling;
use lathe_recipes::rl::{later_setting, run, Bar, Criterion, Curve, Recipe};
use lathe_recipes::run::Curves;
use lathe_recipes::setup::{init_tracing, parse_args, CommonArgs};

/// The embedded server's tensors are large and short-lived: see `lathe_server::memory`.
#[global_allocator]
static GLOBAL: lathe_server::memory::MiMalloc = lathe_server::memory::MiMalloc;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Loss {
    /// Tinker's `importance_sampling`.
    ImportanceSampling,
    /// Tinker's `ppo` (clip 0.8 / 1.2).
    Ppo,
}

/// A solver and a verifier, trained together with per-agent group-normalised RL.
#[derive(Parser, Debug)]
#[command(name = "actor_verifier", about)]
struct Args {
    #[command(flatten)]
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
    /// The verifier first answers the problem itself (a turn rewarded like the solver's),
    /// then gives its verdict with both final numbers in view. Needs the balanced credit,
    /// which compares verdicts only with verdicts.
    #[arg(long, conflicts_with_all = ["single_agent", "no_balance"])]
    recompute: bool,
    /// With `--recompute`: show the verifier two worked verdicts (equal numbers
    /// approved, different ones rejected) before its own.
    #[arg(long, requires = "recompute")]
    verdict_examples: bool,
    /// The verifier's Adam learning rate (default: `--lr`), where the verifier has its
    /// own session.
    #[arg(long, conflicts_with = "single_agent")]
    verifier_lr: Option<f64>,
}

const SOLVER: usize = 0;
const VERIFIER: usize = 1;
const SOLVER_TOKENS: usize = 16;
const VERIFIER_TOKENS: usize = 4;
/// The verifier's own answer with `--recompute`: a line, like the solver's.
const RECOMPUTE_TOKENS: usize = SOLVER_TOKENS;
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

/// The verifier's first turn with `--recompute`: the problem, to answer itself.
fn recompute_prompt(p: &Problem) -> String {
    format!(
        "{}\n# Your role: Verifier. Before checking the Solver, solve the problem yourself and end with the final number.\nSolution:",
        environment(p)
    )
}

/// Two worked verdicts shown before the verifier's own with `--verdict-examples`.
const VERDICT_EXAMPLES: &str = "# Examples\nThe Solver's final number: 17. Your own final number: 17. Verdict: <verify>approve</verify>\nThe Solver's final number: 15. Your own final number: 17. Verdict: <verify>reject</verify>\n";

/// The verifier's verdict turn with `--recompute`: the Solver's final number beside its
/// own (after worked verdicts when `examples`), ending in the opening tag of its verdict.
fn compare_prompt(p: &Problem, solution: &str, own: &str, examples: bool) -> String {
    let number = |text: &str| last_integer(text).map_or("(none)".to_string(), |n| n.to_string());
    format!(
        "{}\n{}# The Solver's final number: {}\n# Your own final number: {}\n# Your role: Verifier. Answer <verify>approve</verify> if the Solver is correct, <verify>reject</verify> if not.\nVerdict: <verify>",
        environment(p),
        if examples { VERDICT_EXAMPLES } else { "" },
        number(solution),
        number(own)
    )
}

/// The team context of a retry: the rejected solution and the verifier's output on it
/// (with `--recompute`, its own final number first).
fn retry_context(solution: &str, own: Option<&str>, review: &str) -> String {
    let own = own
        .and_then(last_integer)
        .map_or(String::new(), |n| format!("my answer is {n}. "));
    format!(
        "Solver: {}\nVerifier: {own}<verify>{}",
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
    /// The verifier answers the problem itself before its verdict (`--recompute`).
    recompute: bool,
    /// Worked verdicts in the comparison's prompt (`--verdict-examples`).
    examples: bool,
    replies: Vec<Reply>,
}

impl Chain {
    /// The verifier's turns: its own answer (with `--recompute`), then its verdict.
    fn verifier_turns(&self) -> usize {
        if self.recompute {
            2
        } else {
            1
        }
    }
}

impl Env for Chain {
    fn initial_observations(&mut self) -> Vec<Observation> {
        vec![Observation::line(
            SOLVER,
            solver_prompt(&self.problem, None),
            SOLVER_TOKENS,
        )]
    }

    fn step(&mut self, mut replies: Vec<Reply>) -> Vec<Observation> {
        self.replies.append(&mut replies);
        let text = |i: usize| self.replies[i].sample.text.as_str();
        let verdict_at = self.verifier_turns();
        match self.replies.len() {
            1 if self.verify && self.recompute => {
                let prompt = recompute_prompt(&self.problem);
                vec![Observation::line(VERIFIER, prompt, RECOMPUTE_TOKENS)]
            }
            n if self.verify && n == verdict_at => {
                let prompt = if self.recompute {
                    compare_prompt(&self.problem, text(0), text(1), self.examples)
                } else {
                    verifier_prompt(&self.problem, text(0))
                };
                vec![Observation::line(VERIFIER, prompt, VERIFIER_TOKENS)
                    .stop_at(&["</verify>", "\n"])]
            }
            n if self.verify && n == verdict_at + 1 && !decision(text(verdict_at)).0 => {
                let own = self.recompute.then(|| text(1));
                let context = retry_context(text(0), own, text(verdict_at));
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
        if self.recompute {
            if let Some(own) = replies.next() {
                let reward = last_integer_reward(&own.sample.text, answer);
                e.metrics.insert("verifier_own_correct".into(), reward);
                e.transitions
                    .push(Transition::new(VERIFIER, own, reward, 0));
            }
        }
        let verdict_position = usize::from(self.recompute);
        if let Some(review) = replies.next() {
            let (approved, parsed) = decision(&review.sample.text);
            let reward = verifier_reward(&review.sample.text, first_reward);
            e.metrics.insert("verifier_accuracy".into(), reward);
            e.metrics.insert("approve_rate".into(), rate(approved));
            e.metrics.insert("parsed_rate".into(), rate(parsed));
            e.metrics.insert("retry_rate".into(), rate(!approved));
            let judged_right = first_reward > 0.5;
            let class = if judged_right {
                "approve_right"
            } else {
                "reject_wrong"
            };
            e.metrics
                .insert(class.into(), rate(approved == judged_right));
            e.transitions.push(
                Transition::new(VERIFIER, review, reward, verdict_position)
                    .in_class(usize::from(judged_right)),
            );
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

struct ActorVerifier {
    max_operand: u32,
    verify: bool,
    group: usize,
    batch: usize,
    temperature: f64,
    loss: Loss,
    keep_zero_adv: bool,
    balance: bool,
    verifier_temperature: Option<f64>,
    recompute: bool,
    verdict_examples: bool,
    verifier_lr: Option<f64>,
    train: Vec<Problem>,
    held_out: Vec<Problem>,
}

impl ActorVerifier {
    fn chain(&self, problem: &Problem) -> Box<dyn Env> {
        Box::new(Chain {
            problem: problem.clone(),
            verify: self.verify,
            recompute: self.recompute,
            examples: self.verdict_examples,
            replies: Vec::new(),
        })
    }
}

impl Recipe for ActorVerifier {
    fn name(&self) -> &'static str {
        "actor_verifier"
    }

    fn roles(&self) -> Vec<&'static str> {
        if self.verify {
            vec!["solver", "verifier"]
        } else {
            vec!["solver"]
        }
    }

    fn objective(&self) -> Objective {
        let loss = match self.loss {
            Loss::ImportanceSampling => LossFn::ImportanceSampling,
            Loss::Ppo => LossFn::Ppo,
        };
        let credit = Credit {
            keep_zero: self.keep_zero_adv,
            balance: self.balance,
            ..Credit::group(Normalise::Standardise)
        };
        Objective::Rl(loss, credit)
    }

    fn sampling(&self, role: usize) -> Sampling {
        match (role, self.verifier_temperature) {
            (VERIFIER, Some(t)) => Sampling::at(t),
            _ => Sampling::at(self.temperature),
        }
    }

    fn groups(&self, step: usize) -> Vec<EnvGroup> {
        batch_at(&self.train, step, self.batch)
            .iter()
            .map(|p| (0..self.group.max(1)).map(|_| self.chain(p)).collect())
            .collect()
    }

    fn held_out(&self) -> Vec<Box<dyn Env>> {
        self.held_out.iter().map(|p| self.chain(p)).collect()
    }

    fn curves(&self) -> Vec<Curve> {
        let mut curves = vec![Curve {
            label: "final correct",
            metric: "final_correct",
        }];
        if self.verify {
            curves.push(Curve {
                label: "first attempt correct",
                metric: "first_correct",
            });
            curves.push(Curve::new("verifier accuracy", "verifier_accuracy"));
            curves.push(Curve::new("verifier approves right", "approve_right"));
            curves.push(Curve::new("verifier rejects wrong", "reject_wrong"));
            if self.recompute {
                curves.push(Curve::new(
                    "verifier's own answer correct",
                    "verifier_own_correct",
                ));
            }
        }
        curves
    }

    fn criterion(&self, curves: &Curves) -> Criterion {
        let (before, after) = curves.before_after("final correct");
        let (_, first_after) = curves.before_after("first attempt correct");
        let gained = after - before >= CRITERION_GAIN;
        if self.verify {
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
        if !self.verify {
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
        self.verifier_lr.filter(|_| role == VERIFIER)
    }

    fn settings(&self) -> String {
        format!(
            "verify={} group={} loss={:?} keep_zero_adv={} balance={} verifier_temperature={:?} max_operand={}{}{}{}",
            self.verify, self.group, self.loss, self.keep_zero_adv, self.balance, self.verifier_temperature, self.max_operand,
            later_setting("recompute", self.recompute, true),
            later_setting("verdict_examples", self.verdict_examples, true),
            later_setting("verifier_lr", self.verifier_lr.is_some(), self.verifier_lr.unwrap_or(0.0)),
        )
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
    let c = &args.common;
    let (train, held_out) = addition(1, args.max_operand, c.seed, c.eval_size);
    let recipe = ActorVerifier {
        max_operand: args.max_operand,
        verify: !args.single_agent,
        group: args.group,
        batch: c.batch,
        temperature: c.temperature,
        loss: args.loss,
        keep_zero_adv: args.keep_zero_adv,
        balance: !args.no_balance,
        verifier_temperature: args.verifier_temperature,
        recompute: args.recompute,
        verdict_examples: args.verdict_examples,
        verifier_lr: args.verifier_lr,
        train,
        held_out,
    };
    if let Some(lr) = args.verifier_lr {
        anyhow::ensure!(
            lr.is_finite() && lr > 0.0,
            "--verifier-lr must be a positive number, got {lr}"
        );
    }
    run(&recipe, c).await?;
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

    /// A chain on [`problem`], reviewed with `verify`, the verifier answering first
    /// with `recompute`.
    fn new_chain(verify: bool, recompute: bool) -> Box<Chain> {
        Box::new(Chain {
            problem: problem(),
            verify,
            recompute,
            examples: false,
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
        assert_eq!(decision("nothing"), (true, false));
        // Unparsable: counts as approve, but earns nothing even when the answer is right.
        assert_eq!(decision("hmm"), (true, false));
        assert_eq!(verifier_reward("hmm", 1.0), 0.0);
    }

    #[test]
    fn prompts_carry_the_team_context() {
        let p = problem();
        assert!(solver_prompt(&p, None).contains("(none)"));
        let retry = solver_prompt(&p, Some(&retry_context(" 6\n", None, "reject</verify>")));
        assert!(retry.contains("Solver: 6\nVerifier: <verify>reject</verify>"));
        assert!(verifier_prompt(&p, " 6\n").ends_with("6\n# Your role: Verifier. Check the solution; answer <verify>approve</verify> if it is correct, <verify>reject</verify> if not.\nVerdict: <verify>"));
    }

    #[test]
    fn a_rejected_answer_is_retried_and_the_retry_is_final() {
        let mut chain = new_chain(true, false);
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
        let mut chain = new_chain(false, false);
        chain.initial_observations();
        assert!(chain.step(vec![reply(" 5")]).is_empty());
    }

    #[test]
    fn a_recomputing_verifier_answers_first_and_judges_with_both_numbers() {
        let mut chain = new_chain(true, true);
        chain.initial_observations();
        let own = chain.step(vec![reply(" 2 + 3 = 6")]);
        assert_eq!(own[0].role, VERIFIER);
        assert!(own[0]
            .prompt
            .ends_with("solve the problem yourself and end with the final number.\nSolution:"));
        let review = chain.step(vec![reply(" 5")]);
        assert_eq!(review[0].role, VERIFIER);
        assert!(review[0]
            .prompt
            .contains("# The Solver's final number: 6\n# Your own final number: 5\n"));
        assert!(review[0].prompt.ends_with("Verdict: <verify>"));
        assert!(!review[0].prompt.contains(VERDICT_EXAMPLES));
        // With worked verdicts, they come before the numbers.
        let mut shown = new_chain(true, true);
        shown.examples = true;
        shown.initial_observations();
        shown.step(vec![reply(" 2 + 3 = 6")]);
        let prompt = &shown.step(vec![reply(" 5")])[0].prompt;
        let at = |s: &str| prompt.find(s).unwrap();
        assert!(at(VERDICT_EXAMPLES) < at("# The Solver's final number: 6\n"));
        let retry = chain.step(vec![reply("reject</verify>")]);
        assert_eq!(retry[0].role, SOLVER);
        assert!(retry[0]
            .prompt
            .contains("Solver: 2 + 3 = 6\nVerifier: my answer is 5. <verify>reject"));
        assert!(chain.step(vec![reply(" 5")]).is_empty());
        let e = chain.finish();
        let turns: Vec<(usize, f64, usize, Option<usize>)> = e
            .transitions
            .iter()
            .map(|t| (t.role, t.reward, t.position, t.class))
            .collect();
        // The own answer is rewarded like the solver's and has no class; the verdict is
        // classed by the judged answer's correctness.
        assert_eq!(
            turns,
            vec![
                (SOLVER, 0.0, 0, None),
                (VERIFIER, 1.0, 0, None),
                (VERIFIER, 1.0, 1, Some(0)),
                (SOLVER, 1.0, 1, None)
            ]
        );
        assert_eq!(e.metrics["verifier_own_correct"], 1.0);
        assert_eq!(e.metrics["verifier_accuracy"], 1.0);
        // An approved answer ends the chain after the verdict.
        let mut chain = new_chain(true, true);
        chain.initial_observations();
        chain.step(vec![reply(" 5")]);
        chain.step(vec![reply(" 7")]);
        assert!(chain.step(vec![reply("approve</verify>")]).is_empty());
        let e = chain.finish();
        assert_eq!(e.metrics["verifier_own_correct"], 0.0);
        assert_eq!(e.metrics["final_correct"], 1.0);
    }

    #[test]
    fn the_verifier_bar_is_the_majority_class_and_the_team_bar_the_first_attempt() {
        let recipe = ActorVerifier {
            max_operand: 30,
            verify: true,
            group: 4,
            batch: 8,
            temperature: 0.7,
            loss: Loss::ImportanceSampling,
            keep_zero_adv: false,
            balance: true,
            verifier_temperature: None,
            recompute: false,
            verdict_examples: false,
            verifier_lr: None,
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
        let hot = ActorVerifier {
            verifier_temperature: Some(1.0),
            ..recipe
        };
        assert_eq!(hot.sampling(VERIFIER), Sampling::at(1.0));
        assert_eq!(hot.sampling(SOLVER), Sampling::at(0.7));
    }
}
