//! MinT's two-agent math recipe: two independent LoRA sessions on one base model. Agent A
//! answers; agent B answers after seeing A's answer; reward +1 / −0.25 on the first
//! number. Both are trained — by default supervised on the known answer (as MinT), or with
//! `--objective rl` on their own sampled answers with group-centred advantages and the
//! `importance_sampling` loss. When a second session cannot be created (or with
//! `--force-fallback`) one session plays both roles.

use clap::{Parser, ValueEnum};
use lathe::types::{AdamParams, Datum, LossFn};
use lathe::{SamplingClient, Tokenizer};
use lathe_recipes::advantages::group_centred;
use lathe_recipes::data::{addition, batch_at, Problem};
use lathe_recipes::grade::{first_number_correct, math_reward};
use lathe_recipes::rollout::{
    ratio_mean, rl_datum, sample_prompts, submit_step, Generation, Rollout,
};
use lathe_recipes::run::progress;
use lathe_recipes::setup::{init_tracing, start, AgentSessions, CommonArgs, Start};
use serde_json::json;

/// The embedded server's tensors are large and short-lived: see `lathe_server::memory`.
#[global_allocator]
static GLOBAL: lathe_server::memory::MiMalloc = lathe_server::memory::MiMalloc;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Objective {
    /// Cross-entropy on the known answer (MinT's recipe).
    Supervised,
    /// Importance sampling on sampled answers, group-centred advantages.
    Rl,
}

/// Two agents answer arithmetic questions; both are trained.
#[derive(Parser, Debug)]
#[command(name = "multi_agent_math", about)]
struct Args {
    #[command(flatten)]
    common: CommonArgs,
    /// Training objective.
    #[arg(long, value_enum, default_value_t = Objective::Supervised)]
    objective: Objective,
    /// Use one session for both roles even if two could be created.
    #[arg(long)]
    force_fallback: bool,
    /// Problems per step.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Samples per problem with `--objective rl`.
    #[arg(long, default_value_t = 4)]
    group: usize,
    /// Evaluate on held-out problems every this many steps.
    #[arg(long, default_value_t = 4)]
    eval_every: usize,
    /// Held-out problems.
    #[arg(long, default_value_t = 40)]
    eval_size: usize,
    /// Sampling temperature for training rollouts.
    #[arg(long, default_value_t = 0.7)]
    temperature: f64,
}

const MAX_TOKENS: usize = 8;
const ROLES: [&str; 2] = ["A", "B"];

/// MinT's prompts (raw text, no chat template).
fn prompt(role: &str, p: &Problem, a_answer: Option<&str>) -> String {
    match (role, a_answer) {
        ("B", Some(a)) => format!(
            "Agent B: Agent A answered '{}'. Now answer the same question with only the number. {}\nAnswer:",
            a.trim(),
            p.question
        ),
        _ => format!(
            "Agent A: answer the math question with only the number. {}\nAnswer:",
            p.question
        ),
    }
}

/// A supervised datum: the prompt, then the answer and a newline; loss on the answer.
fn sft_datum(tok: &Tokenizer, prompt: &[i64], answer: &str) -> anyhow::Result<Datum> {
    Ok(Datum::supervised(
        prompt,
        &tok.encode(&format!(
            " {answer}
"
        ))?,
    ))
}

/// Greedy held-out accuracy of both roles (B sees A's greedy answer).
async fn evaluate(
    samplers: &[SamplingClient; 2],
    tok: &Tokenizer,
    problems: &[Problem],
    context: Option<usize>,
) -> anyhow::Result<[f64; 2]> {
    let a_prompts: Vec<String> = problems.iter().map(|p| prompt("A", p, None)).collect();
    let greedy = Generation::greedy(MAX_TOKENS).within(context);
    let a = sample_prompts(&samplers[0], tok, &a_prompts, 1, &greedy).await?;
    let b_prompts: Vec<String> = problems
        .iter()
        .zip(&a)
        .map(|(p, r)| prompt("B", p, Some(&r.samples[0].text)))
        .collect();
    let b = sample_prompts(&samplers[1], tok, &b_prompts, 1, &greedy).await?;
    let acc = |rs: &[Rollout]| {
        rs.iter()
            .zip(problems)
            .filter(|(r, p)| first_number_correct(&r.samples[0].text, &p.answer))
            .count() as f64
            / problems.len().max(1) as f64
    };
    Ok([acc(&a), acc(&b)])
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    init_tracing();
    let args = Args::parse();
    let c = &args.common;
    let steps = c.steps_or(lathe_recipes::setup::DEFAULT_STEPS);
    let Start { mut run, conn, tok } = start("multi_agent_math", c).await?;
    let sessions = AgentSessions::open(&conn, 2, args.force_fallback, |i| c.lora(i)).await?;
    let trainers = [sessions.trainer(0).clone(), sessions.trainer(1).clone()];
    let mode_name = sessions.mode();
    let fallback_reason = sessions.fallback_reason.clone();
    let distinct = sessions.distinct();

    // Two-digit sums stay well below 0.9 at step 0 for small models.
    let (train, held_out) = addition(10, 49, c.seed, args.eval_size);
    let adam = AdamParams {
        learning_rate: c.lr_or(5e-4),
        ..Default::default()
    };
    let mut curves: [Vec<(usize, f64)>; 2] = [Vec::new(), Vec::new()];
    let bar = progress(steps);
    bar.set_prefix(format!("{mode_name} {:?}", args.objective).to_lowercase());
    for step in 0..=steps {
        let samplers = [
            trainers[0].save_weights_and_get_sampling_client().await?,
            if distinct == 2 {
                trainers[1].save_weights_and_get_sampling_client().await?
            } else {
                trainers[0].save_weights_and_get_sampling_client().await?
            },
        ];
        if step % args.eval_every.max(1) == 0 || step == steps {
            let acc = evaluate(&samplers, &tok, &held_out, conn.max_context).await?;
            for r in 0..2 {
                curves[r].push((step, acc[r]));
            }
            run.log(&json!({"step": step, "eval": {"A": acc[0], "B": acc[1]}}))?;
            bar.set_message(format!("held-out acc A {:.2} B {:.2}", acc[0], acc[1]));
        }
        if step == steps {
            break;
        }
        let problems: Vec<Problem> = batch_at(&train, step, args.batch);
        let n = if args.objective == Objective::Rl {
            args.group.max(2)
        } else {
            1
        };
        let seed = c.step_seed(step);
        let a_prompts: Vec<String> = problems.iter().map(|p| prompt("A", p, None)).collect();
        let generation =
            |seed| Generation::sampled(MAX_TOKENS, args.temperature, seed).within(conn.max_context);
        let a = sample_prompts(&samplers[0], &tok, &a_prompts, n, &generation(seed)).await?;
        let b_prompts: Vec<String> = problems
            .iter()
            .zip(&a)
            .map(|(p, r)| prompt("B", p, Some(&r.samples[0].text)))
            .collect();
        let b = sample_prompts(&samplers[1], &tok, &b_prompts, n, &generation(seed + 1)).await?;
        let rollouts = [a, b];

        let mut per_role = serde_json::Map::new();
        let mut data: [Vec<Datum>; 2] = [Vec::new(), Vec::new()];
        for (r, rs) in rollouts.iter().enumerate() {
            let rewards: Vec<Vec<f64>> = rs
                .iter()
                .zip(&problems)
                .map(|(ro, p)| {
                    ro.samples
                        .iter()
                        .map(|s| math_reward(&s.text, &p.answer))
                        .collect()
                })
                .collect();
            for ((ro, p), rw) in rs.iter().zip(&problems).zip(&rewards) {
                match args.objective {
                    Objective::Supervised => data[r].push(sft_datum(&tok, &ro.prompt, &p.answer)?),
                    Objective::Rl => {
                        for (sample, adv) in ro.samples.iter().zip(group_centred(rw)) {
                            if adv != 0.0 && !sample.tokens.is_empty() {
                                data[r].push(rl_datum(&ro.prompt, sample, adv));
                            }
                        }
                    }
                }
            }
            let flat: Vec<f64> = rewards.iter().flatten().copied().collect();
            let firsts: Vec<_> = rs.iter().map(Rollout::first).collect();
            let ratio = ratio_mean(&trainers[r], &firsts).await?;
            per_role.insert(
                ROLES[r].into(),
                json!({
                    "reward_mean": flat.iter().sum::<f64>() / flat.len().max(1) as f64,
                    "accuracy": flat.iter().filter(|&&x| x > 0.0).count() as f64 / flat.len().max(1) as f64,
                    "datums": data[r].len(),
                    "ratio_mean": ratio,
                }),
            );
        }
        // Train: each session on its role's data (in fallback, one session on both).
        let loss_fn = match args.objective {
            Objective::Supervised => LossFn::CrossEntropy,
            Objective::Rl => LossFn::ImportanceSampling,
        };
        let jobs: Vec<(usize, Vec<Datum>)> = if distinct == 2 {
            vec![
                (0, std::mem::take(&mut data[0])),
                (1, std::mem::take(&mut data[1])),
            ]
        } else {
            vec![(0, data.concat())]
        };
        let mut pending = Vec::new();
        for (t, d) in &jobs {
            if let Some(step) = submit_step(&trainers[*t], d, loss_fn, adam).await? {
                pending.push((*t, step));
            }
        }
        for (t, step) in pending {
            let loss = step.finish().await?.loss;
            let role = if distinct == 2 { ROLES[t] } else { "A" };
            if let Some(entry) = per_role.get_mut(role) {
                entry["loss"] = json!(loss);
            }
            if distinct == 1 {
                if let Some(entry) = per_role.get_mut("B") {
                    entry["loss"] = json!(loss);
                }
            }
        }
        run.log(&json!({"step": step + 1, "mode": mode_name, "agents": per_role}))?;
        bar.inc(1);
    }
    bar.finish();

    let mut checkpoints = serde_json::Map::new();
    for (r, t) in trainers.iter().enumerate().take(distinct) {
        let name = format!(
            "multi-agent-{}-final",
            if distinct == 2 {
                ROLES[r].to_lowercase()
            } else {
                "role-switch".into()
            }
        );
        let state = t.save_state(&name).await?.result().await?;
        let sampler = t.save_weights_for_sampler(&name).await?.result().await?;
        checkpoints.insert(
            ROLES[r].into(),
            json!({"state": state.to_string(), "sampler": sampler.to_string()}),
        );
    }
    let before = [curves[0][0].1, curves[1][0].1];
    let after = [
        curves[0].last().expect("evaluated").1,
        curves[1].last().expect("evaluated").1,
    ];
    let passed = (0..2).all(|r| after[r] - before[r] >= 0.3 || after[r] >= 0.9);
    let summary = json!({
        "recipe": "multi_agent_math",
        "mode": mode_name,
        "fallback_reason": fallback_reason,
        "objective": format!("{:?}", args.objective).to_lowercase(),
        "steps": steps,
        "base_model": conn.base_model,
        "held_out_accuracy": {
            "A": {"before": before[0], "after": after[0], "curve": curves[0]},
            "B": {"before": before[1], "after": after[1], "curve": curves[1]},
        },
        "criterion": "each agent's held-out accuracy rises by >= 0.3 or reaches >= 0.9",
        "passed": passed,
        "checkpoints": checkpoints,
    });
    run.summary(&summary)?;
    let png = run.path.join("curves.png");
    let plotted = lathe_recipes::plot::curves(
        &png,
        &format!("multi_agent_math ({mode_name}, {:?})", args.objective).to_lowercase(),
        "held-out accuracy",
        &[("agent A", &curves[0]), ("agent B", &curves[1])],
    )?;
    println!("mode: {mode_name} ({:?} objective)", args.objective);
    println!("agent  held-out accuracy  before  after");
    for r in 0..2 {
        println!(
            "{:<6} {:<18} {:>6.2}  {:>5.2}",
            ROLES[r], "", before[r], after[r]
        );
    }
    println!("metrics: {}", run.path.join("metrics.jsonl").display());
    println!("summary: {}", run.path.join("summary.json").display());
    if plotted {
        println!("curves:  {}", png.display());
    }
    for (role, ck) in &checkpoints {
        println!("checkpoint {role}: {}", ck["state"].as_str().unwrap_or(""));
    }
    if c.check && !passed {
        anyhow::bail!("criterion not met: {}", summary["criterion"]);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn role_prompts_follow_mint() {
        let p = Problem {
            question: "What is 2 + 3?".into(),
            answer: "5".into(),
        };
        assert_eq!(
            prompt("A", &p, None),
            "Agent A: answer the math question with only the number. What is 2 + 3?\nAnswer:"
        );
        assert!(prompt("B", &p, Some(" 5\n")).starts_with("Agent B: Agent A answered '5'."));
    }
}
