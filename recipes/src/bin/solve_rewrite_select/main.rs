//! Miles' multi-agent pipeline (`examples/experimental/multi_agent`) on one shared policy:
//! `--num-parallel` solvers answer the problem; as many rewriters each see every usable
//! solution and write a new one; one selector sees the usable rewrites and ends with
//! `Judgment: N`. Every sample is graded 0/1 (last integer; the `</think>` gate is off, a
//! small model does not think); the selector earns the reward of the rewrite it picked.
//! Team weighting: when the selector's pick is correct every reward of the problem is
//! multiplied by 1.2, otherwise by 0.8. All role samples of a problem form one group for
//! the advantages (mean / std) and go into one `importance_sampling` update. (A weight
//! shared by a whole group cancels in its standardisation, in Miles as here: the team
//! weighting changes what is logged, not what is learnt.)
//!
//! The selector departs from Miles in two ways (`--selectors 1 --pooled-selector` is
//! Miles): it samples `--selectors` picks of each problem, and each pick earns 1.2 when
//! right and is credited against what a uniformly random pick of the same rewrites
//! earns (1.2 × the share of right ones), outside the group, so a pick gains only where
//! it beats chance. The solvers and rewriters form the group. With several picks the
//! team weight is 0.8 + 0.4 × the share of right picks (its expectation with one).
//!
//! Once the rewriters agree, a pick no longer matters, and a held-out pipeline no longer
//! measures the selector. So the selector also sits an exam (an addition to Miles): a
//! problem with `--num-parallel` candidate solutions, some right and some wrong (the
//! wrong ones off by 1, 2 or 10), where a random pick always leaves room to beat it; one
//! per held-out problem, and `--select-drills` per training problem to train on
//! (each pick credited against a random pick, even with `--pooled-selector`; none by
//! default, see `recipes/solve_rewrite_select.md`).
//!
//! Adapted to a small model: prompts are raw text, answers are a line long, and the
//! selector's prompt ends with `Judgment:` so its pick is its first word.

use clap::Parser;
use lathe::types::LossFn;
use lathe_recipes::credit::{Credit, Normalise, Objective, Scope};
use lathe_recipes::data::{addition, batch_at, candidates, Problem};
use lathe_recipes::env::{Env, EnvGroup, Episode, Observation, Reply, Transition};
use lathe_recipes::grade::last_integer_reward;
use lathe_recipes::play::{mix_seed, Sampling};
use lathe_recipes::rl::{run, settings_of, Bar, Criterion, Curve, Recipe, Team};
use lathe_recipes::run::{mean, Curves};
use lathe_recipes::setup::{init_tracing, parse_args, CommonArgs};
use serde::Serialize;
use serde_json::{json, Value};

mod selector;

use selector::{pick_of, PickBy, SelectExam, Selector};

/// The embedded server's tensors are large and short-lived: see `lathe_server::memory`.
#[global_allocator]
static GLOBAL: lathe_server::memory::MiMalloc = lathe_server::memory::MiMalloc;

/// Solvers, rewriters and selectors on one policy, trained on the pooled samples.
#[derive(Parser, Debug, Serialize)]
#[command(name = "solve_rewrite_select", about)]
struct Args {
    #[command(flatten)]
    #[serde(skip)]
    common: CommonArgs,
    /// Solvers, and rewriters, per problem.
    #[arg(long, default_value_t = 5)]
    num_parallel: usize,
    /// Largest operand of the generated additions.
    #[arg(long, default_value_t = 30)]
    max_operand: u32,
    /// Selector picks sampled per problem.
    #[arg(long, default_value_t = 8)]
    selectors: usize,
    /// Credit the selector within the problem's group of every role's samples (Miles),
    /// not against a random pick.
    #[arg(long)]
    pooled_selector: bool,
    /// Selector exams per training problem, trained on beside the pipelines (0: the
    /// selector learns from pipelines only).
    #[arg(long, default_value_t = 0)]
    select_drills: usize,
    /// Show the selector a worked selection (another sum's candidates and a pick) before
    /// its own.
    #[arg(long)]
    selector_example: bool,
    /// How the selector names its pick: by the solution's index (Miles), or by the
    /// solution's final number (the first usable solution ending in it is the pick).
    #[arg(long, value_enum, default_value_t = PickBy::Index)]
    pick_by: PickBy,
}

const SOLVER: usize = 0;
const REWRITER: usize = 1;
const SELECTOR: usize = 2;
const ANSWER_TOKENS: usize = 16;
const JUDGMENT_TOKENS: usize = 3;
/// Miles' `correct_reward_weight` / `incorrect_reward_weight`.
const TEAM_RIGHT: f64 = 1.2;
const TEAM_WRONG: f64 = 0.8;
/// The criterion's gain, calibrated from a measured run (`recipes/solve_rewrite_select.md`).
const CRITERION_GAIN: f64 = 0.2;
/// How far the selector's pick must beat a random one on its exam, or half the room a
/// random pick leaves when that is less: a selector that reads the rewrites, not one
/// that guesses.
const SELECTOR_MARGIN: f64 = 0.15;

fn solver_prompt(p: &Problem) -> String {
    format!("Problem: {}\nSolution:", p.question)
}

fn numbered(solutions: &[&str]) -> String {
    solutions
        .iter()
        .enumerate()
        .map(|(i, s)| format!("#### Solution {}\n{}", i + 1, s.trim()))
        .collect::<Vec<_>>()
        .join("\n---\n")
}

fn rewriter_prompt(p: &Problem, solutions: &[&str]) -> String {
    format!(
        "Task: solution rewriting based on previous solutions. You get a problem and {} previous solutions; write a new, correct solution using what they discovered, and end with the final number.\n### Problem\n{}\n{}\nNew solution:",
        solutions.len(),
        p.question,
        numbered(solutions)
    )
}

/// Whether a reply hands text to the next role (Miles: non-empty text after `</think>`;
/// here, with the thinking gate off, any non-empty line).
fn usable(r: &Reply) -> bool {
    !r.sample.text.trim().is_empty()
}

/// One problem through the pipeline: solvers, then rewriters, then the selector.
struct Pipeline {
    problem: Problem,
    n: usize,
    selector: Selector,
    solvers: Vec<Reply>,
    rewriters: Vec<Reply>,
    picks: Vec<Reply>,
}

impl Pipeline {
    fn grade(&self, r: &Reply) -> f64 {
        last_integer_reward(&r.sample.text, &self.problem.answer)
    }

    /// Indices of the usable rewrites, in the order the selector saw them.
    fn usable_rewrites(&self) -> Vec<usize> {
        (0..self.rewriters.len())
            .filter(|&i| usable(&self.rewriters[i]))
            .collect()
    }

    /// The rewrite a selector's reply picked, as an index into `rewriters`.
    fn picked(&self, s: &Reply) -> Option<usize> {
        let usable = self.usable_rewrites();
        let texts: Vec<&str> = (usable.iter())
            .map(|&i| self.rewriters[i].sample.text.as_str())
            .collect();
        usable.get(pick_of(s, &texts, self.selector.by)?).copied()
    }
}

/// A selector's pick credited against a uniformly random pick among candidates of which
/// `random` are right: a right pick makes the team right (weight 1.2), and so does a
/// random one with probability `random`.
fn against_chance(reply: Reply, right: f64, random: f64) -> Transition {
    Transition::new(SELECTOR, reply, right * TEAM_RIGHT, 0).against(random * TEAM_RIGHT)
}

impl Env for Pipeline {
    fn initial_observations(&mut self) -> Vec<Observation> {
        let ob = Observation::line(SOLVER, solver_prompt(&self.problem), ANSWER_TOKENS);
        vec![ob; self.n]
    }

    fn step(&mut self, replies: Vec<Reply>) -> Vec<Observation> {
        if self.solvers.is_empty() {
            self.solvers = replies;
            let texts: Vec<&str> = self
                .solvers
                .iter()
                .filter(|r| usable(r))
                .map(|r| r.sample.text.as_str())
                .collect();
            if texts.is_empty() {
                return Vec::new();
            }
            let prompt = rewriter_prompt(&self.problem, &texts);
            vec![Observation::line(REWRITER, prompt, ANSWER_TOKENS); self.n]
        } else if self.rewriters.is_empty() {
            self.rewriters = replies;
            let texts: Vec<&str> = self
                .usable_rewrites()
                .iter()
                .map(|&i| self.rewriters[i].sample.text.as_str())
                .collect();
            if texts.is_empty() {
                return Vec::new();
            }
            self.selector.observations(&self.problem, &texts)
        } else {
            self.picks = replies;
            Vec::new()
        }
    }

    /// Every reply graded, then weighted by whether the selector's picks are correct.
    fn finish(self: Box<Self>) -> Episode {
        let solver: Vec<f64> = self.solvers.iter().map(|r| self.grade(r)).collect();
        let rewriter: Vec<f64> = self.rewriters.iter().map(|r| self.grade(r)).collect();
        let usable = self.usable_rewrites();
        let right = usable.iter().filter(|&&i| rewriter[i] == 1.0).count();
        // What a uniformly random pick among the usable rewrites is right with.
        let random = right as f64 / usable.len().max(1) as f64;
        let picks: Vec<f64> = (self.picks.iter())
            .map(|s| self.picked(s).map_or(0.0, |k| rewriter[k]))
            .collect();
        let team = if picks.is_empty() { 0.0 } else { mean(&picks) };
        let weight = TEAM_WRONG + (TEAM_RIGHT - TEAM_WRONG) * team;
        let mut e = Episode::default();
        if !picks.is_empty() && right > 0 {
            e.metrics.insert("selector_pick_accuracy".into(), team);
            e.metrics.insert("random_pick_accuracy".into(), random);
        }
        if !picks.is_empty() && right > 0 && right < usable.len() {
            // Where the pick matters: some usable rewrites right, some wrong.
            e.metrics.insert("contested_pick_accuracy".into(), team);
            e.metrics.insert("contested_random_accuracy".into(), random);
        }
        e.metrics.insert("solver_accuracy".into(), mean(&solver));
        if !rewriter.is_empty() {
            e.metrics
                .insert("rewriter_accuracy".into(), mean(&rewriter));
        }
        e.metrics.insert("team_correct".into(), team);
        // The raw reward counts the selector once, as Miles' one selector.
        let mut raw: Vec<f64> = solver.iter().chain(&rewriter).copied().collect();
        if !picks.is_empty() {
            raw.push(team);
        }
        e.metrics.insert("raw_reward".into(), mean(&raw));
        let pooled_selector = self.selector.pooled;
        let Self {
            solvers,
            rewriters,
            picks: selectors,
            ..
        } = *self;
        let graded = (solvers.into_iter().zip(solver).map(|(r, w)| (SOLVER, r, w))).chain(
            rewriters
                .into_iter()
                .zip(rewriter)
                .map(|(r, w)| (REWRITER, r, w)),
        );
        for (role, reply, reward) in graded {
            e.transitions
                .push(Transition::new(role, reply, reward * weight, 0));
        }
        for (reply, pick) in selectors.into_iter().zip(picks) {
            e.transitions.push(if pooled_selector {
                Transition::new(SELECTOR, reply, pick * weight, 0)
            } else {
                against_chance(reply, pick, random)
            });
        }
        e
    }
}

struct SolveRewriteSelect {
    args: Args,
    train: Vec<Problem>,
    held_out: Vec<Problem>,
}

impl SolveRewriteSelect {
    /// Solvers, and rewriters, per problem.
    fn n(&self) -> usize {
        self.args.num_parallel.max(1)
    }

    fn selector(&self) -> Selector {
        Selector {
            picks: self.args.selectors.max(1),
            pooled: self.args.pooled_selector,
            example: self.args.selector_example,
            by: self.args.pick_by,
        }
    }

    fn pipeline(&self, problem: &Problem) -> Box<dyn Env> {
        Box::new(Pipeline {
            problem: problem.clone(),
            n: self.n(),
            selector: self.selector(),
            solvers: Vec::new(),
            rewriters: Vec::new(),
            picks: Vec::new(),
        })
    }

    /// An exam on `problem` whose candidates and number of right ones derive from `seed`.
    fn exam(&self, problem: &Problem, seed: u64) -> Box<dyn Env> {
        let n = self.n().max(2);
        let right_ones = 1 + (seed % (n as u64 - 1)) as usize;
        let (texts, right) = candidates(problem, n, right_ones, seed);
        Box::new(SelectExam {
            problem: problem.clone(),
            texts,
            right,
            selector: self.selector(),
            replies: Vec::new(),
        })
    }
}

impl Recipe for SolveRewriteSelect {
    fn name(&self) -> &'static str {
        "solve_rewrite_select"
    }

    fn roles(&self) -> Vec<&'static str> {
        vec!["solver", "rewriter", "selector"]
    }

    fn team(&self) -> Team {
        Team::SharedPolicy
    }

    fn objective(&self) -> Objective {
        let credit = Credit {
            pool_roles: true,
            scope: Scope::Group,
            ..Credit::group(Normalise::Standardise)
        };
        Objective::Rl(LossFn::ImportanceSampling, credit)
    }

    fn sampling(&self, _role: usize) -> Sampling {
        Sampling::at(self.args.common.temperature)
    }

    /// Held-out pipelines sample too (a greedy team gives one answer to every
    /// rewriter), with one fixed seed, so evaluations differ only by the weights.
    fn eval_sampling(&self, _role: usize) -> Sampling {
        Sampling::at(self.args.common.temperature)
    }

    fn eval_seed(&self) -> u64 {
        99_991
    }

    fn groups(&self, step: usize) -> Vec<EnvGroup> {
        let c = &self.args.common;
        batch_at(&self.train, step, c.batch)
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let drills = (0..self.args.select_drills).map(|d| {
                    let seed = mix_seed(c.seed, &[step as u64, i as u64, d as u64]);
                    self.exam(p, seed)
                });
                std::iter::once(self.pipeline(p)).chain(drills).collect()
            })
            .collect()
    }

    /// A pipeline and an exam per held-out problem (the exams' candidates fixed by the
    /// seed and the problem's place).
    fn held_out(&self) -> Vec<Box<dyn Env>> {
        let pipelines = self.held_out.iter().map(|p| self.pipeline(p));
        let exams = (self.held_out.iter().enumerate())
            .map(|(i, p)| self.exam(p, mix_seed(self.args.common.seed, &[u64::MAX, i as u64])));
        pipelines.chain(exams).collect()
    }

    fn curves(&self) -> Vec<Curve> {
        [
            ("raw reward", "raw_reward"),
            ("team correct", "team_correct"),
            ("selector pick", "selector_pick_accuracy"),
            ("random pick", "random_pick_accuracy"),
            ("contested: selector pick", "contested_pick_accuracy"),
            ("contested: random pick", "contested_random_accuracy"),
            ("exam: selector pick", "exam_pick_accuracy"),
            ("exam: random pick", "exam_random_accuracy"),
        ]
        .into_iter()
        .map(|(label, metric)| Curve::new(label, metric))
        .collect()
    }

    fn criterion(&self, curves: &Curves) -> Criterion {
        let gain = |name| {
            let (before, after) = curves.before_after(name);
            after - before
        };
        Criterion {
            text: format!("held-out mean raw reward and the team's final accuracy (the selector's pick is correct) each rise by >= {CRITERION_GAIN}"),
            passed: gain("raw reward") >= CRITERION_GAIN && gain("team correct") >= CRITERION_GAIN,
        }
    }

    /// Miles' bar for the selector, measured on its exam, where a pick always matters.
    fn upstream_bars(&self, curves: &Curves) -> Vec<Bar> {
        let (_, pick) = curves.before_after("exam: selector pick");
        let (_, random) = curves.before_after("exam: random pick");
        let margin = SELECTOR_MARGIN.min((1.0 - random) / 2.0);
        vec![Bar::on(
            format!("on its held-out exam (candidates some right, some wrong) the selector's pick ends above a random pick's accuracy by >= {SELECTOR_MARGIN}, or half the room a random pick leaves when that is less"),
            &[pick, random],
            || pick - random >= margin,
        )]
    }

    fn settings(&self) -> Value {
        settings_of(&self.args)
    }

    fn summary_fields(&self) -> serde_json::Map<String, Value> {
        serde_json::Map::from_iter([("num_parallel".to_string(), json!(self.n()))])
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    init_tracing();
    let args: Args = parse_args(&[
        ("steps", "12"),
        ("lr", "5e-4"),
        ("batch", "4"),
        ("temperature", "0.7"),
        ("eval_every", "4"),
        ("eval_size", "24"),
    ]);
    let c = args.common.clone();
    let (train, held_out) = addition(1, args.max_operand, c.seed, c.eval_size);
    let recipe = SolveRewriteSelect {
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
    use lathe_recipes::env::mean_metrics;
    use lathe_recipes::rollout::Sample;

    pub(crate) fn problem() -> Problem {
        Problem {
            question: "What is 2 + 3?".into(),
            answer: "5".into(),
        }
    }

    pub(crate) fn replies(texts: &[&str]) -> Vec<Reply> {
        texts
            .iter()
            .map(|t| Reply {
                prompt: vec![1, 2],
                sample: Sample {
                    tokens: vec![9],
                    logprobs: vec![-0.5],
                    text: t.to_string(),
                },
                version: 0,
            })
            .collect()
    }

    /// Solvers "5", "4"; rewriters "5", "", "6"; the selectors answer `picks`.
    fn episode(picks: &[&str], pooled_selector: bool) -> Episode {
        let mut env = Box::new(Pipeline {
            problem: problem(),
            n: 2,
            selector: Selector {
                picks: picks.len(),
                pooled: pooled_selector,
                example: false,
                by: PickBy::Index,
            },
            solvers: Vec::new(),
            rewriters: Vec::new(),
            picks: Vec::new(),
        });
        assert_eq!(env.initial_observations().len(), 2);
        let rewrite = env.step(replies(&["5", "4"]));
        assert!(rewrite[0].prompt.contains("2 previous solutions"));
        let select = env.step(replies(&["5", "", "6"]));
        // Rewrite 2 is empty, so the selector sees rewrites 1 and 3 as "1" and "2".
        assert!(select[0]
            .prompt
            .contains("#### Solution 1\n5\n---\n#### Solution 2\n6\n"));
        assert!(select[0].prompt.ends_with("Judgment:"));
        assert_eq!(select.len(), picks.len());
        assert!(env.step(replies(picks)).is_empty());
        env.finish()
    }

    #[test]
    fn the_team_weight_follows_the_pick() {
        let right = episode(&[" 1"], true);
        assert_eq!(right.metrics["team_correct"], 1.0);
        assert_eq!(right.metrics["selector_pick_accuracy"], 1.0);
        assert_eq!(right.metrics["random_pick_accuracy"], 0.5);
        let rewards: Vec<f64> = right.transitions.iter().map(|t| t.reward).collect();
        assert_eq!(rewards, vec![1.2, 0.0, 1.2, 0.0, 0.0, 1.2]);
        let wrong = episode(&[" 2"], true);
        assert_eq!(wrong.metrics["team_correct"], 0.0);
        let rewards: Vec<f64> = wrong.transitions.iter().map(|t| t.reward).collect();
        assert_eq!(rewards, vec![0.8, 0.0, 0.8, 0.0, 0.0, 0.0]);
        assert_eq!(
            mean_metrics(&[right, wrong])["raw_reward"],
            0.5 * (3.0 / 6.0 + 2.0 / 6.0)
        );
    }

    #[test]
    fn picks_are_credited_against_a_random_pick() {
        // One right pick of three, among rewrites of which a random pick is right half
        // the time: the team weight is 0.8 + 0.4 / 3 on the solvers and rewriters, and
        // each pick earns 1.2 when right, measured against 1.2 * 0.5.
        let e = episode(&[" 1", " 2", " 2"], false);
        let w = 0.8 + 0.4 / 3.0;
        assert_eq!(e.metrics["team_correct"], 1.0 / 3.0);
        assert_eq!(e.metrics["contested_pick_accuracy"], 1.0 / 3.0);
        assert_eq!(e.metrics["contested_random_accuracy"], 0.5);
        let credited: Vec<(usize, f64, Option<f64>)> = e
            .transitions
            .iter()
            .map(|t| (t.role, t.reward, t.baseline))
            .collect();
        assert_eq!(
            credited,
            vec![
                (SOLVER, w, None),
                (SOLVER, 0.0, None),
                (REWRITER, w, None),
                (REWRITER, 0.0, None),
                (REWRITER, 0.0, None),
                (SELECTOR, 1.2, Some(0.6)),
                (SELECTOR, 0.0, Some(0.6)),
                (SELECTOR, 0.0, Some(0.6)),
            ]
        );
        // The raw reward counts the picks once, as one selector.
        assert_eq!(e.metrics["raw_reward"], (2.0 + 1.0 / 3.0) / 6.0);
    }

    #[test]
    fn the_selector_bar_reads_the_exam() {
        let args = Args::parse_from([
            "solve_rewrite_select",
            "--steps",
            "12",
            "--lr",
            "5e-4",
            "--batch",
            "4",
            "--temperature",
            "0.7",
            "--eval-every",
            "4",
            "--eval-size",
            "24",
        ]);
        let recipe = SolveRewriteSelect {
            args,
            train: Vec::new(),
            held_out: Vec::new(),
        };
        let met = |pick: f64, random: f64| {
            let mut c = Curves::new(&["exam: selector pick", "exam: random pick"]);
            c.push("exam: selector pick", 12, pick);
            c.push("exam: random pick", 12, random);
            recipe.upstream_bars(&c)[0].met
        };
        assert_eq!(met(0.64, 0.49), Some(true));
        assert_eq!(met(0.55, 0.49), Some(false));
        // Little room left: half of it is enough.
        assert_eq!(met(0.97, 0.9), Some(true));
        assert_eq!(met(0.94, 0.9), Some(false));
        let none = Curves::new(&["exam: selector pick", "exam: random pick"]);
        assert_eq!(recipe.upstream_bars(&none)[0].met, None);
    }
}
