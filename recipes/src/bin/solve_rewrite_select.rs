//! Miles' multi-agent pipeline (`examples/experimental/multi_agent`) on one shared policy:
//! `--num-parallel` solvers answer the problem; as many rewriters each see every usable
//! solution and write a new one; one selector sees the usable rewrites and ends with
//! `Judgment: N`. Every sample is graded 0/1 (last integer; the `</think>` gate is off, a
//! small model does not think); the selector earns the reward of the rewrite it picked.
//! Team weighting: when the selector's pick is correct every reward of the problem is
//! multiplied by 1.2, otherwise by 0.8. All role samples of a problem form one group for
//! the advantages (mean / std) and go into one `importance_sampling` update.
//!
//! Adapted to a small model: prompts are raw text, answers are a line long, and the
//! selector's prompt ends with `Judgment:` so its pick is its first word.

use clap::Parser;
use lathe::types::{AdamParams, Datum, LossFn};
use lathe::{SamplingClient, Tokenizer};
use lathe_recipes::advantages::group_normalised;
use lathe_recipes::data::{addition, batch_at, Problem};
use lathe_recipes::grade::{judgment, last_integer_reward};
use lathe_recipes::rollout::{
    ratio_mean, rl_datum, sample_prompts, submit_step, Generation, Rollout, Sample, StepOutcome,
};
use lathe_recipes::run::{mean, progress, Curves};
use lathe_recipes::setup::{init_tracing, save_final, start, CommonArgs, Start};
use serde_json::json;

/// The embedded server's tensors are large and short-lived: see `lathe_server::memory`.
#[global_allocator]
static GLOBAL: lathe_server::memory::MiMalloc = lathe_server::memory::MiMalloc;

/// Solvers, rewriters and a selector on one policy, trained on the pooled samples.
#[derive(Parser, Debug)]
#[command(name = "solve_rewrite_select", about)]
struct Args {
    #[command(flatten)]
    common: CommonArgs,
    /// Solvers, and rewriters, per problem.
    #[arg(long, default_value_t = 5)]
    num_parallel: usize,
    /// Problems per step.
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// Evaluate on held-out problems every this many steps.
    #[arg(long, default_value_t = 4)]
    eval_every: usize,
    /// Held-out problems.
    #[arg(long, default_value_t = 24)]
    eval_size: usize,
    /// Sampling temperature (training and evaluation; evaluation reuses one seed).
    #[arg(long, default_value_t = 0.7)]
    temperature: f64,
    /// Largest operand of the generated additions.
    #[arg(long, default_value_t = 30)]
    max_operand: u32,
}

const ANSWER_TOKENS: usize = 16;
const JUDGMENT_TOKENS: usize = 3;
/// Miles' `correct_reward_weight` / `incorrect_reward_weight`.
const TEAM_RIGHT: f64 = 1.2;
const TEAM_WRONG: f64 = 0.8;

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

fn selector_prompt(p: &Problem, solutions: &[&str]) -> String {
    format!(
        "You get a math problem and {n} solutions. Analyze them, find the most sound one, and end with exactly Judgment: IDX (1 to {n}).\n### Problem\n{}\n{}\nJudgment:",
        p.question,
        numbered(solutions),
        n = solutions.len()
    )
}

/// Whether a sample hands text to the next role (Miles: non-empty text after `</think>`;
/// here, with the thinking gate off, any non-empty line).
fn usable(s: &Sample) -> bool {
    !s.text.trim().is_empty()
}

/// One problem's pass through the pipeline.
#[derive(Debug, Default)]
struct Pass {
    solvers: Option<Rollout>,
    solver_rewards: Vec<f64>,
    rewriters: Option<Rollout>,
    rewriter_rewards: Vec<f64>,
    selector: Option<Rollout>,
    /// The picked rewrite, as an index into `rewriters.samples`.
    picked: Option<usize>,
    selector_reward: f64,
}

impl Pass {
    /// Indices of the usable rewrites, in the order the selector saw them.
    fn usable_rewrites(&self) -> Vec<usize> {
        self.rewriters.as_ref().map_or_else(Vec::new, |r| {
            (0..r.samples.len())
                .filter(|&i| usable(&r.samples[i]))
                .collect()
        })
    }

    /// Miles' team weighting: 1.2 when the selector's pick is correct, else 0.8.
    fn multiplier(&self) -> f64 {
        if self.selector.is_some() && self.selector_reward == 1.0 {
            TEAM_RIGHT
        } else {
            TEAM_WRONG
        }
    }

    /// Every sample with its prompt and raw (unweighted) reward, solvers first.
    fn samples(&self) -> Vec<(&[i64], &Sample, f64)> {
        let mut out = Vec::new();
        for (rollout, rewards) in [
            (&self.solvers, &self.solver_rewards),
            (&self.rewriters, &self.rewriter_rewards),
        ] {
            if let Some(r) = rollout {
                out.extend(
                    r.samples
                        .iter()
                        .zip(rewards)
                        .map(|(s, &w)| (&r.prompt[..], s, w)),
                );
            }
        }
        if let Some(r) = &self.selector {
            out.push((&r.prompt[..], &r.samples[0], self.selector_reward));
        }
        out
    }

    /// Whether the pick is right given that at least one usable rewrite is right
    /// (`None` when none is), and the chance that a uniformly random pick is right.
    fn pick_vs_random(&self) -> Option<(f64, f64)> {
        let rewrites = self.usable_rewrites();
        let right = rewrites
            .iter()
            .filter(|&&i| self.rewriter_rewards[i] == 1.0)
            .count();
        (self.selector.is_some() && right > 0)
            .then(|| (self.selector_reward, right as f64 / rewrites.len() as f64))
    }

    /// RL datums: the problem's samples form one group over the weighted rewards.
    fn data(&self) -> Vec<Datum> {
        let samples = self.samples();
        let weighted: Vec<f64> = samples
            .iter()
            .map(|(_, _, r)| r * self.multiplier())
            .collect();
        samples
            .iter()
            .zip(group_normalised(&weighted))
            .filter(|((_, s, _), adv)| *adv != 0.0 && !s.tokens.is_empty())
            .map(|((prompt, s, _), adv)| rl_datum(prompt, s, adv))
            .collect()
    }
}

/// Runs every problem through solvers → rewriters → selector; each stage samples all
/// problems at once.
async fn run_pipeline(
    sampler: &SamplingClient,
    tok: &Tokenizer,
    problems: &[Problem],
    num_parallel: usize,
    generation: &Generation,
) -> anyhow::Result<Vec<Pass>> {
    let prompts: Vec<String> = problems.iter().map(solver_prompt).collect();
    let solvers = sample_prompts(sampler, tok, &prompts, num_parallel, generation).await?;
    let mut passes: Vec<Pass> = solvers
        .into_iter()
        .zip(problems)
        .map(|(r, p)| Pass {
            solver_rewards: r
                .samples
                .iter()
                .map(|s| last_integer_reward(&s.text, &p.answer))
                .collect(),
            solvers: Some(r),
            ..Default::default()
        })
        .collect();

    // Rewriters, for problems with at least one usable solution.
    let mut owners = Vec::new();
    let mut prompts = Vec::new();
    for (i, (pass, p)) in passes.iter().zip(problems).enumerate() {
        let texts: Vec<&str> = pass
            .solvers
            .iter()
            .flat_map(|r| &r.samples)
            .filter(|s| usable(s))
            .map(|s| s.text.as_str())
            .collect();
        if !texts.is_empty() {
            owners.push(i);
            prompts.push(rewriter_prompt(p, &texts));
        }
    }
    let rewrite_gen = Generation {
        seed: generation.seed.wrapping_add(1),
        ..generation.clone()
    };
    let rewrites = sample_prompts(sampler, tok, &prompts, num_parallel, &rewrite_gen).await?;
    for (i, r) in owners.into_iter().zip(rewrites) {
        passes[i].rewriter_rewards = r
            .samples
            .iter()
            .map(|s| last_integer_reward(&s.text, &problems[i].answer))
            .collect();
        passes[i].rewriters = Some(r);
    }

    // The selector, for problems with at least one usable rewrite.
    let mut owners = Vec::new();
    let mut prompts = Vec::new();
    for (i, (pass, p)) in passes.iter().zip(problems).enumerate() {
        let rewrites = pass.usable_rewrites();
        if let (false, Some(r)) = (rewrites.is_empty(), &pass.rewriters) {
            let texts: Vec<&str> = rewrites
                .iter()
                .map(|&j| r.samples[j].text.as_str())
                .collect();
            owners.push(i);
            prompts.push(selector_prompt(p, &texts));
        }
    }
    let select_gen = Generation {
        max_tokens: JUDGMENT_TOKENS,
        seed: generation.seed.wrapping_add(2),
        ..generation.clone()
    };
    let selections = sample_prompts(sampler, tok, &prompts, 1, &select_gen).await?;
    for (i, r) in owners.into_iter().zip(selections) {
        let pass = &mut passes[i];
        let rewrites = pass.usable_rewrites();
        pass.picked = judgment(&format!("Judgment:{}", r.samples[0].text))
            .and_then(|n| n.checked_sub(1))
            .and_then(|k| rewrites.get(k).copied());
        pass.selector_reward = pass.picked.map_or(0.0, |k| pass.rewriter_rewards[k]);
        pass.selector = Some(r);
    }
    Ok(passes)
}

/// Numbers over a set of passes.
#[derive(Debug, Default)]
struct Stats {
    /// Mean raw reward over every sample.
    raw_reward: f64,
    solver_accuracy: f64,
    rewriter_accuracy: f64,
    /// Fraction of problems whose selector picked a correct rewrite.
    team_correct: f64,
    /// Over problems with a correct usable rewrite: the selector's hit rate, and a random
    /// pick's expected hit rate.
    pick_accuracy: f64,
    random_pick: f64,
    samples: usize,
}

fn stats(passes: &[Pass]) -> Stats {
    let all: Vec<f64> = passes
        .iter()
        .flat_map(|p| p.samples().into_iter().map(|s| s.2))
        .collect();
    let solver: Vec<f64> = passes
        .iter()
        .flat_map(|p| p.solver_rewards.clone())
        .collect();
    let rewriter: Vec<f64> = passes
        .iter()
        .flat_map(|p| p.rewriter_rewards.clone())
        .collect();
    let picks: Vec<(f64, f64)> = passes.iter().filter_map(Pass::pick_vs_random).collect();
    Stats {
        raw_reward: mean(&all),
        solver_accuracy: mean(&solver),
        rewriter_accuracy: mean(&rewriter),
        team_correct: mean(
            &passes
                .iter()
                .map(|p| f64::from(u8::from(p.multiplier() == TEAM_RIGHT)))
                .collect::<Vec<_>>(),
        ),
        pick_accuracy: mean(&picks.iter().map(|p| p.0).collect::<Vec<_>>()),
        random_pick: mean(&picks.iter().map(|p| p.1).collect::<Vec<_>>()),
        samples: all.len(),
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    init_tracing();
    let args = Args::parse();
    let c = &args.common;
    let steps = c.steps_or(lathe_recipes::setup::DEFAULT_STEPS);
    let n = args.num_parallel.max(1);
    let Start { mut run, conn, tok } = start("solve_rewrite_select", c).await?;
    let trainer = conn
        .service
        .create_lora_training_client(&conn.base_model, c.lora(0))
        .await?;
    let (train, held_out) = addition(1, args.max_operand, c.seed, args.eval_size);
    let adam = AdamParams {
        learning_rate: c.lr_or(5e-4),
        ..Default::default()
    };
    let mut curves = Curves::new(&["raw reward", "team correct", "selector pick", "random pick"]);
    let bar = progress(steps);
    bar.set_prefix("shared policy");
    for step in 0..=steps {
        let sampler = trainer.save_weights_and_get_sampling_client().await?;
        if step % args.eval_every.max(1) == 0 || step == steps {
            // One fixed seed: evaluations differ only by the weights.
            let generation = Generation::sampled(ANSWER_TOKENS, args.temperature, 99_991)
                .within(conn.max_context);
            let s = stats(&run_pipeline(&sampler, &tok, &held_out, n, &generation).await?);
            curves.push("raw reward", step, s.raw_reward);
            curves.push("team correct", step, s.team_correct);
            curves.push("selector pick", step, s.pick_accuracy);
            curves.push("random pick", step, s.random_pick);
            run.log(&json!({"step": step, "eval": {
                "raw_reward": s.raw_reward,
                "solver_accuracy": s.solver_accuracy,
                "rewriter_accuracy": s.rewriter_accuracy,
                "team_correct": s.team_correct,
                "selector_pick_accuracy": s.pick_accuracy,
                "random_pick_accuracy": s.random_pick,
            }}))?;
            bar.set_message(format!(
                "held-out raw reward {:.2} pick {:.2} (random {:.2})",
                s.raw_reward, s.pick_accuracy, s.random_pick
            ));
        }
        if step == steps {
            break;
        }
        let problems: Vec<Problem> = batch_at(&train, step, args.batch);
        let generation = Generation::sampled(ANSWER_TOKENS, args.temperature, c.step_seed(step))
            .within(conn.max_context);
        let passes = run_pipeline(&sampler, &tok, &problems, n, &generation).await?;
        let data: Vec<Datum> = passes.iter().flat_map(Pass::data).collect();
        // The agreement check comes from the step's own pass; a step with nothing to
        // train on is checked with a forward pass over the solvers' first samples.
        let unchecked = if data.is_empty() {
            let firsts: Vec<(&[i64], &Sample)> = passes
                .iter()
                .filter_map(|p| p.solvers.as_ref())
                .map(Rollout::first)
                .collect();
            ratio_mean(&trainer, &firsts).await?
        } else {
            None
        };
        let outcome = match submit_step(&trainer, &data, LossFn::ImportanceSampling, adam).await? {
            Some(s) => Some(s.finish().await?),
            None => None,
        };
        let loss = outcome.as_ref().map(|o| o.loss);
        let ratio = outcome
            .as_ref()
            .and_then(StepOutcome::ratio_mean)
            .or(unchecked);
        let s = stats(&passes);
        run.log(&json!({
            "step": step + 1,
            "mode": "shared-policy",
            "rollout/raw_reward": s.raw_reward,
            "team_correct": s.team_correct,
            "selector_pick_accuracy": s.pick_accuracy,
            "random_pick_accuracy": s.random_pick,
            "agents": {"policy": {
                "reward_mean": s.raw_reward,
                "accuracy": s.solver_accuracy,
                "rewriter_accuracy": s.rewriter_accuracy,
                "samples": s.samples,
                "loss": loss,
                "datums": data.len(),
                "ratio_mean": ratio,
            }},
        }))?;
        bar.inc(1);
    }
    bar.finish();

    let mut checkpoints = serde_json::Map::new();
    checkpoints.insert(
        "policy".into(),
        save_final(&trainer, "solve-rewrite-select-final").await?,
    );
    let (raw_before, raw_after) = curves.before_after("raw reward");
    let (team_before, team_after) = curves.before_after("team correct");
    let passed =
        raw_after - raw_before >= CRITERION_GAIN && team_after - team_before >= CRITERION_GAIN;
    let criterion = format!(
        "held-out mean raw reward and the team's final accuracy (the selector's pick is correct) each rise by >= {CRITERION_GAIN}"
    );
    let summary = json!({
        "recipe": "solve_rewrite_select",
        "mode": "shared-policy",
        "steps": steps,
        "num_parallel": n,
        "base_model": conn.base_model,
        "held_out": curves.to_json(),
        "criterion": criterion,
        "passed": passed,
        "checkpoints": checkpoints,
    });
    run.summary(&summary)?;
    let plotted = curves.plot(&run, "solve_rewrite_select (one policy)", "held-out rate")?;
    println!("mode: shared-policy ({n} solvers, {n} rewriters, 1 selector)");
    curves.report(&run, plotted, &checkpoints);
    if c.check && !passed {
        anyhow::bail!("criterion not met: {criterion}");
    }
    Ok(())
}

/// Calibrated from a measured run on the default model (README, recipe table): both rose
/// by about 0.45 in 12 steps. The selector's pick against a random pick is reported, not
/// gated: once most rewrites are right a random pick is right too (0.94 at step 12).
const CRITERION_GAIN: f64 = 0.2;

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(text: &str) -> Sample {
        Sample {
            tokens: vec![9],
            logprobs: vec![-0.5],
            text: text.into(),
        }
    }

    fn rollout(texts: &[&str]) -> Rollout {
        Rollout {
            prompt: vec![1, 2],
            samples: texts.iter().map(|t| sample(t)).collect(),
        }
    }

    fn pass(picked: Option<usize>) -> Pass {
        let rewriters = rollout(&["5", "", "6"]);
        let rewriter_rewards = vec![1.0, 0.0, 0.0];
        Pass {
            solvers: Some(rollout(&["5", "4"])),
            solver_rewards: vec![1.0, 0.0],
            selector_reward: picked.map_or(0.0, |k| rewriter_rewards[k]),
            rewriters: Some(rewriters),
            rewriter_rewards,
            selector: Some(rollout(&["1"])),
            picked,
        }
    }

    #[test]
    fn prompts_number_the_solutions_from_one() {
        let p = Problem {
            question: "What is 2 + 3?".into(),
            answer: "5".into(),
        };
        let s = selector_prompt(&p, &[" 5\n", "6"]);
        assert!(s.contains("#### Solution 1\n5\n---\n#### Solution 2\n6\n"));
        assert!(s.ends_with("Judgment:"));
        assert!(rewriter_prompt(&p, &["5"]).contains("1 previous solutions"));
    }

    #[test]
    fn the_team_multiplier_rewards_a_correct_pick() {
        assert_eq!(pass(Some(0)).multiplier(), TEAM_RIGHT);
        assert_eq!(pass(Some(2)).multiplier(), TEAM_WRONG);
        assert_eq!(pass(None).multiplier(), TEAM_WRONG);
        // Rewrite 1 is empty, so the selector saw rewrites 0 and 2 as "1" and "2".
        assert_eq!(pass(None).usable_rewrites(), vec![0, 2]);
    }

    #[test]
    fn picks_are_compared_with_a_random_pick() {
        assert_eq!(pass(Some(0)).pick_vs_random(), Some((1.0, 0.5)));
        assert_eq!(pass(Some(2)).pick_vs_random(), Some((0.0, 0.5)));
        let mut none_right = pass(Some(2));
        none_right.rewriter_rewards = vec![0.0; 3];
        assert_eq!(none_right.pick_vs_random(), None);
    }

    #[test]
    fn all_roles_are_pooled_into_one_group() {
        let p = pass(Some(0));
        // 2 solvers + 3 rewriters + 1 selector; the weighted rewards are not all equal.
        assert_eq!(p.samples().len(), 6);
        let data = p.data();
        assert_eq!(data.len(), 6);
        let adv = |d: &Datum| *d.loss_fn_inputs["advantages"].data.last().unwrap();
        // Correct samples (solver 0, rewriter 0, selector) get the positive advantage.
        assert!(adv(&data[0]) > 0.0 && adv(&data[1]) < 0.0);
        assert!(adv(&data[5]) > 0.0);
    }
}
