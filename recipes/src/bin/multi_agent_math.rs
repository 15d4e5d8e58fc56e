//! MinT's two-agent math recipe: two independent LoRA sessions on one base model. Agent A
//! answers; agent B answers after seeing A's answer; reward +1 / −0.25 on the first
//! number. Both are trained — by default supervised on the known answer (as MinT), or with
//! `--objective rl` on their own sampled answers with group-centred advantages and the
//! `importance_sampling` loss. When a second session cannot be created (or with
//! `--force-fallback`) one session plays both roles.

use std::collections::BTreeMap;

use anyhow::Context;
use clap::{Parser, ValueEnum};
use lathe::types::{
    AdamParams, Datum, LoraConfig, LossFn, ModelInput, SampleResponse, SamplingParams,
    StopCondition, TensorData,
};
use lathe::{SamplingClient, Tokenizer, TrainingClient};
use lathe_recipes::advantages::group_centred;
use lathe_recipes::data::{addition, Problem};
use lathe_recipes::grade::{first_number_correct, math_reward};
use lathe_recipes::run::{progress, RunDir};
use lathe_recipes::setup::{connect, CommonArgs};
use serde_json::json;

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

/// How the run is set up: two sessions, or one playing both roles (and why).
#[derive(Debug, PartialEq)]
enum Mode<T> {
    TwoAgents(T),
    Fallback(String),
}

/// Falls back to one session when the second could not be created or was not wanted.
fn choose_mode<T, E: std::fmt::Display>(
    force: bool,
    second: impl FnOnce() -> Result<T, E>,
) -> Mode<T> {
    if force {
        return Mode::Fallback("--force-fallback".into());
    }
    match second() {
        Ok(t) => Mode::TwoAgents(t),
        Err(e) => Mode::Fallback(format!("could not create the second session: {e}")),
    }
}

struct Rollout {
    prompt: Vec<i64>,
    /// One response per sample.
    responses: Vec<(Vec<i64>, Vec<f64>, String)>,
}

async fn sample_all(
    sampler: &SamplingClient,
    tok: &Tokenizer,
    prompts: &[String],
    n: usize,
    temperature: f64,
    seed: u64,
) -> anyhow::Result<Vec<Rollout>> {
    let mut futures = Vec::new();
    let mut encoded = Vec::new();
    for (i, text) in prompts.iter().enumerate() {
        let ids = tok.encode(text)?;
        let params = SamplingParams {
            max_tokens: Some(MAX_TOKENS),
            seed: Some(seed + i as u64 * 7919),
            stop: Some(StopCondition::Texts(vec!["\n".into()])),
            temperature,
            ..Default::default()
        };
        futures.push(
            sampler
                .sample(&ModelInput::from_ints(ids.clone()), n, &params)
                .await?,
        );
        encoded.push(ids);
    }
    let mut out = Vec::new();
    for (fut, prompt) in futures.into_iter().zip(encoded) {
        let resp: SampleResponse = fut.result().await?;
        let responses = resp
            .sequences
            .into_iter()
            .map(|s| {
                let text = tok.decode(&s.tokens).unwrap_or_default();
                (s.tokens, s.logprobs.unwrap_or_default(), text)
            })
            .collect();
        out.push(Rollout { prompt, responses });
    }
    Ok(out)
}

fn tensor_f32(v: Vec<f32>) -> TensorData {
    TensorData::float32(v)
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

/// An RL datum for one sampled response: sampler logprobs and the advantage on the
/// response's tokens, zeros on the prompt.
fn rl_datum(prompt: &[i64], tokens: &[i64], logprobs: &[f64], advantage: f64) -> Datum {
    let ids: Vec<i64> = prompt.iter().chain(tokens).copied().collect();
    let n = ids.len() - 1;
    let first = prompt.len() - 1;
    let mut lp = vec![0.0f32; n];
    let mut adv = vec![0.0f32; n];
    for (j, &l) in logprobs.iter().enumerate() {
        lp[first + j] = l as f32;
        adv[first + j] = advantage as f32;
    }
    let mut inputs = BTreeMap::new();
    inputs.insert(
        "target_tokens".to_string(),
        TensorData::int64(ids[1..].to_vec()),
    );
    inputs.insert("logprobs".to_string(), tensor_f32(lp));
    inputs.insert("advantages".to_string(), tensor_f32(adv));
    Datum {
        model_input: ModelInput::from_ints(ids[..n].to_vec()),
        loss_fn_inputs: inputs,
    }
}

/// Mean `exp(train logprob − sampler logprob)` over the sampled tokens: 1.0 when trainer
/// and sampler agree.
async fn ratio_mean(trainer: &TrainingClient, rollouts: &[Rollout]) -> anyhow::Result<f64> {
    let mut data = Vec::new();
    let mut sampled = Vec::new();
    for r in rollouts {
        let (tokens, lps, _) = &r.responses[0];
        if tokens.is_empty() {
            continue;
        }
        data.push(rl_datum(&r.prompt, tokens, lps, 0.0));
        sampled.push((r.prompt.len() - 1, lps.clone()));
    }
    if data.is_empty() {
        return Ok(1.0);
    }
    // Cross-entropy with zero weights: a forward pass that only reports logprobs.
    let data: Vec<Datum> = data
        .into_iter()
        .map(|mut d| {
            let n = d.model_input.length();
            d.loss_fn_inputs
                .insert("weights".into(), tensor_f32(vec![0.0; n]));
            d.loss_fn_inputs.remove("logprobs");
            d.loss_fn_inputs.remove("advantages");
            d
        })
        .collect();
    let out = trainer
        .forward(&data, LossFn::CrossEntropy, None)
        .await?
        .result()
        .await?;
    let (mut sum, mut count) = (0.0, 0usize);
    for (i, (first, lps)) in sampled.iter().enumerate() {
        let train = out.logprobs(i).context("logprobs")?;
        for (j, &q) in lps.iter().enumerate() {
            sum += (f64::from(train[first + j]) - q).exp();
            count += 1;
        }
    }
    Ok(if count == 0 { 1.0 } else { sum / count as f64 })
}

/// Greedy held-out accuracy of both roles (B sees A's greedy answer).
async fn evaluate(
    samplers: &[SamplingClient; 2],
    tok: &Tokenizer,
    problems: &[Problem],
) -> anyhow::Result<[f64; 2]> {
    let a_prompts: Vec<String> = problems.iter().map(|p| prompt("A", p, None)).collect();
    let a = sample_all(&samplers[0], tok, &a_prompts, 1, 0.0, 0).await?;
    let b_prompts: Vec<String> = problems
        .iter()
        .zip(&a)
        .map(|(p, r)| prompt("B", p, Some(&r.responses[0].2)))
        .collect();
    let b = sample_all(&samplers[1], tok, &b_prompts, 1, 0.0, 0).await?;
    let acc = |rs: &[Rollout]| {
        rs.iter()
            .zip(problems)
            .filter(|(r, p)| first_number_correct(&r.responses[0].2, &p.answer))
            .count() as f64
            / problems.len().max(1) as f64
    };
    Ok([acc(&a), acc(&b)])
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let c = &args.common;
    let mut run = RunDir::create("multi_agent_math", c.out.as_deref())?;
    eprintln!("multi_agent_math: output in {}", run.path.display());
    let conn = connect(c, &run.path).await?;
    eprintln!("endpoint {}, base model {}", conn.endpoint, conn.base_model);
    let tok = conn.service.get_tokenizer(&conn.base_model).await?;
    let lora = |seed: u64| LoraConfig {
        rank: c.rank,
        seed: Some(seed),
        ..Default::default()
    };
    let agent_a = conn
        .service
        .create_lora_training_client(&conn.base_model, lora(c.seed))
        .await?;
    let second = if args.force_fallback {
        None
    } else {
        Some(
            conn.service
                .create_lora_training_client(&conn.base_model, lora(c.seed + 1))
                .await,
        )
    };
    let mode = choose_mode(args.force_fallback, || {
        second.expect("created unless forced")
    });
    let (trainers, mode_name, fallback_reason) = match mode {
        Mode::TwoAgents(b) => ([agent_a.clone(), b], "two-agent", None),
        Mode::Fallback(reason) => {
            eprintln!("falling back to one session playing both roles: {reason}");
            ([agent_a.clone(), agent_a.clone()], "fallback", Some(reason))
        }
    };
    let distinct = if mode_name == "fallback" { 1 } else { 2 };

    // Two-digit sums stay well below 0.9 at step 0 for small models.
    let (train, held_out) = addition(10, 49, c.seed, args.eval_size);
    let adam = AdamParams {
        learning_rate: c.lr,
        ..Default::default()
    };
    let mut curves: [Vec<(usize, f64)>; 2] = [Vec::new(), Vec::new()];
    let bar = progress(c.steps);
    bar.set_prefix(format!("{mode_name} {:?}", args.objective).to_lowercase());
    let mut cursor = 0;
    for step in 0..=c.steps {
        let samplers = [
            trainers[0].save_weights_and_get_sampling_client().await?,
            if distinct == 2 {
                trainers[1].save_weights_and_get_sampling_client().await?
            } else {
                trainers[0].save_weights_and_get_sampling_client().await?
            },
        ];
        if step % args.eval_every.max(1) == 0 || step == c.steps {
            let acc = evaluate(&samplers, &tok, &held_out).await?;
            for r in 0..2 {
                curves[r].push((step, acc[r]));
            }
            run.log(&json!({"step": step, "eval": {"A": acc[0], "B": acc[1]}}))?;
            bar.set_message(format!("held-out acc A {:.2} B {:.2}", acc[0], acc[1]));
        }
        if step == c.steps {
            break;
        }
        let problems: Vec<Problem> = (0..args.batch)
            .map(|i| train[(cursor + i) % train.len()].clone())
            .collect();
        cursor += args.batch;
        let n = if args.objective == Objective::Rl {
            args.group.max(2)
        } else {
            1
        };
        let seed = c.seed * 1_000_003 + step as u64 * 101;
        let a_prompts: Vec<String> = problems.iter().map(|p| prompt("A", p, None)).collect();
        let a = sample_all(&samplers[0], &tok, &a_prompts, n, args.temperature, seed).await?;
        let b_prompts: Vec<String> = problems
            .iter()
            .zip(&a)
            .map(|(p, r)| prompt("B", p, Some(&r.responses[0].2)))
            .collect();
        let b = sample_all(
            &samplers[1],
            &tok,
            &b_prompts,
            n,
            args.temperature,
            seed + 1,
        )
        .await?;
        let rollouts = [a, b];

        let mut per_role = serde_json::Map::new();
        let mut data: [Vec<Datum>; 2] = [Vec::new(), Vec::new()];
        for (r, rs) in rollouts.iter().enumerate() {
            let rewards: Vec<Vec<f64>> = rs
                .iter()
                .zip(&problems)
                .map(|(ro, p)| {
                    ro.responses
                        .iter()
                        .map(|(_, _, t)| math_reward(t, &p.answer))
                        .collect()
                })
                .collect();
            for ((ro, p), rw) in rs.iter().zip(&problems).zip(&rewards) {
                match args.objective {
                    Objective::Supervised => data[r].push(sft_datum(&tok, &ro.prompt, &p.answer)?),
                    Objective::Rl => {
                        for ((tokens, lps, _), adv) in ro.responses.iter().zip(group_centred(rw)) {
                            if adv != 0.0 && !tokens.is_empty() {
                                data[r].push(rl_datum(&ro.prompt, tokens, lps, adv));
                            }
                        }
                    }
                }
            }
            let flat: Vec<f64> = rewards.iter().flatten().copied().collect();
            let ratio = ratio_mean(&trainers[r], rs).await?;
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
            if d.is_empty() {
                continue;
            }
            let fb = trainers[*t].forward_backward(d, loss_fn, None).await?;
            let opt = trainers[*t].optim_step(adam).await?;
            pending.push((*t, d.len(), fb, opt));
        }
        for (t, count, fb, opt) in pending {
            let out = fb.result().await?;
            opt.result().await?;
            let loss = out.loss().unwrap_or(f64::NAN) / count as f64;
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
        "steps": c.steps,
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

    #[test]
    fn fallback_is_chosen_when_the_second_session_fails_or_is_not_wanted() {
        assert_eq!(
            choose_mode(false, || Ok::<_, String>(7)),
            Mode::TwoAgents(7)
        );
        assert!(
            matches!(choose_mode(false, || Err::<u8, _>("capacity")), Mode::Fallback(r) if r.contains("capacity"))
        );
        assert!(matches!(
            choose_mode(true, || Ok::<_, String>(7)),
            Mode::Fallback(_)
        ));
    }

    #[test]
    fn rl_datums_put_advantages_on_the_response_only() {
        let d = rl_datum(&[1, 2, 3], &[4, 5], &[-0.5, -0.25], 0.75);
        assert_eq!(d.model_input.to_ints().unwrap(), vec![1, 2, 3, 4]);
        assert_eq!(
            d.loss_fn_inputs["target_tokens"].data,
            vec![2.0, 3.0, 4.0, 5.0]
        );
        assert_eq!(
            d.loss_fn_inputs["advantages"].data,
            vec![0.0, 0.0, 0.75, 0.75]
        );
        assert_eq!(
            d.loss_fn_inputs["logprobs"].data,
            vec![0.0, 0.0, -0.5, -0.25]
        );
    }
}
