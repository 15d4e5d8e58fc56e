//! MinT's two-agent math recipe: two independent LoRA sessions on one base model. Agent A
//! answers; agent B answers after seeing A's answer; reward +1 / −0.25 on the first
//! number. Both are trained — by default supervised on the known answer (as MinT), or with
//! `--objective rl` on their own sampled answers with group-centred advantages and the
//! `importance_sampling` loss. When a second session cannot be created (or with
//! `--force-fallback`) one session plays both roles.

use clap::{Parser, ValueEnum};
use lathe::types::LossFn;
use lathe_recipes::credit::{Credit, Normalise, Objective};
use lathe_recipes::data::{addition, batch_at, Problem};
use lathe_recipes::env::{rate, Env, EnvGroup, Episode, Observation, Reply, Transition};
use lathe_recipes::grade::{first_number_correct, math_reward};
use lathe_recipes::play::Sampling;
use lathe_recipes::rl::{run, settings_of, Criterion, Curve, Recipe};
use lathe_recipes::run::Curves;
use lathe_recipes::setup::{init_tracing, parse_args, CommonArgs};
use serde::Serialize;
use serde_json::{json, Value};

/// The embedded server's tensors are large and short-lived: see `lathe_server::memory`.
#[global_allocator]
static GLOBAL: lathe_server::memory::MiMalloc = lathe_server::memory::MiMalloc;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
enum ObjectiveArg {
    /// Cross-entropy on the known answer (MinT's recipe).
    Supervised,
    /// Importance sampling on sampled answers, group-centred advantages.
    Rl,
}

/// Two agents answer arithmetic questions; both are trained.
#[derive(Parser, Debug, Serialize)]
#[command(name = "multi_agent_math", about)]
struct Args {
    #[command(flatten)]
    #[serde(skip)]
    common: CommonArgs,
    /// Training objective.
    #[arg(long, value_enum, default_value_t = ObjectiveArg::Supervised)]
    objective: ObjectiveArg,
    /// Samples per problem with `--objective rl`.
    #[arg(long, default_value_t = 4)]
    group: usize,
}

const MAX_TOKENS: usize = 8;
const A: usize = 0;
const B: usize = 1;

/// MinT's prompts (raw text, no chat template).
fn prompt(role: usize, p: &Problem, a_answer: Option<&str>) -> String {
    match (role, a_answer) {
        (B, Some(a)) => format!(
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

/// One problem: A answers, then B sees A's answer and answers.
struct Exchange {
    problem: Problem,
    replies: Vec<Reply>,
}

impl Env for Exchange {
    fn initial_observations(&mut self) -> Vec<Observation> {
        vec![Observation::line(
            A,
            prompt(A, &self.problem, None),
            MAX_TOKENS,
        )]
    }

    fn step(&mut self, mut replies: Vec<Reply>) -> Vec<Observation> {
        self.replies.append(&mut replies);
        match self.replies.len() {
            1 => {
                let a = &self.replies[0].sample.text;
                vec![Observation::line(
                    B,
                    prompt(B, &self.problem, Some(a)),
                    MAX_TOKENS,
                )]
            }
            _ => Vec::new(),
        }
    }

    fn finish(self: Box<Self>) -> Episode {
        let answer = &self.problem.answer;
        let mut episode = Episode::default();
        for (role, reply) in self.replies.into_iter().enumerate() {
            let name = ["A", "B"][role];
            let text = &reply.sample.text;
            episode.metrics.insert(
                format!("{name}/accuracy"),
                rate(first_number_correct(text, answer)),
            );
            let reward = math_reward(text, answer);
            episode.transitions.push(
                Transition::new(role, reply, reward, 0).with_reference(format!(" {answer}\n")),
            );
        }
        episode
    }
}

struct MultiAgentMath {
    args: Args,
    train: Vec<Problem>,
    held_out: Vec<Problem>,
}

fn exchange(problem: &Problem) -> Box<dyn Env> {
    Box::new(Exchange {
        problem: problem.clone(),
        replies: Vec::new(),
    })
}

impl Recipe for MultiAgentMath {
    fn name(&self) -> &'static str {
        "multi_agent_math"
    }

    fn roles(&self) -> Vec<&'static str> {
        vec!["A", "B"]
    }

    fn objective(&self) -> Objective {
        match self.args.objective {
            ObjectiveArg::Supervised => Objective::Supervised,
            ObjectiveArg::Rl => {
                Objective::Rl(LossFn::ImportanceSampling, Credit::group(Normalise::Centre))
            }
        }
    }

    fn sampling(&self, _role: usize) -> Sampling {
        Sampling::at(self.args.common.temperature)
    }

    fn groups(&self, step: usize) -> Vec<EnvGroup> {
        let n = match self.args.objective {
            ObjectiveArg::Rl => self.args.group.max(2),
            ObjectiveArg::Supervised => 1,
        };
        batch_at(&self.train, step, self.args.common.batch)
            .iter()
            .map(|p| (0..n).map(|_| exchange(p)).collect())
            .collect()
    }

    fn held_out(&self) -> Vec<Box<dyn Env>> {
        self.held_out.iter().map(exchange).collect()
    }

    fn curves(&self) -> Vec<Curve> {
        vec![
            Curve::new("agent A", "A/accuracy"),
            Curve::new("agent B", "B/accuracy"),
        ]
    }

    fn criterion(&self, curves: &Curves) -> Criterion {
        let passed = ["agent A", "agent B"].iter().all(|c| {
            let (before, after) = curves.before_after(c);
            after - before >= 0.3 || after >= 0.9
        });
        Criterion {
            text: "each agent's held-out accuracy rises by >= 0.3 or reaches >= 0.9".into(),
            passed,
        }
    }

    fn settings(&self) -> Value {
        settings_of(&self.args)
    }

    fn summary_fields(&self) -> serde_json::Map<String, Value> {
        let objective = json!(self.args.objective);
        serde_json::Map::from_iter([("objective".to_string(), objective)])
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    init_tracing();
    let args: Args = parse_args(&[
        ("steps", "12"),
        ("lr", "5e-4"),
        ("batch", "8"),
        ("temperature", "0.7"),
        ("eval_every", "4"),
        ("eval_size", "40"),
    ]);
    let c = args.common.clone();
    // Two-digit sums: hard enough that a small model starts far below the criterion.
    let (train, held_out) = addition(10, 49, c.seed, c.eval_size);
    let recipe = MultiAgentMath {
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

    #[test]
    fn role_prompts_follow_mint() {
        let p = problem();
        assert_eq!(
            prompt(A, &p, None),
            "Agent A: answer the math question with only the number. What is 2 + 3?\nAnswer:"
        );
        assert!(prompt(B, &p, Some(" 5\n")).starts_with("Agent B: Agent A answered '5'."));
    }

    #[test]
    fn b_sees_a_and_both_are_graded() {
        let reply = |text: &str| Reply {
            prompt: vec![1],
            sample: Sample {
                tokens: vec![2],
                logprobs: vec![-0.1],
                text: text.into(),
            },
            version: 0,
        };
        let mut env = exchange(&problem());
        assert_eq!(env.initial_observations()[0].role, A);
        let next = env.step(vec![reply(" 6")]);
        assert_eq!(next.len(), 1);
        assert!(next[0].prompt.contains("Agent A answered '6'"));
        assert!(env.step(vec![reply(" 5")]).is_empty());
        let e = env.finish();
        let rewards: Vec<f64> = e.transitions.iter().map(|t| t.reward).collect();
        assert_eq!(rewards, vec![-0.25, 1.0]);
        assert_eq!(
            (e.metrics["A/accuracy"], e.metrics["B/accuracy"]),
            (0.0, 1.0)
        );
        assert_eq!(e.transitions[1].reference.as_deref(), Some(" 5\n"));
    }
}
