//! The one training loop every synchronous recipe runs: per step, publish each session's
//! weights to a sampler, evaluate on held-out environments when due, play the step's
//! environment groups, credit the replies, train every session on its roles' datums
//! (all sessions' steps in flight together, so the server fuses them), log, and save
//! the state every `--save-every` steps so that `--resume` continues exactly.
//!
//! A recipe is a [`Recipe`]: its roles, environments, objective and criterion. The loop
//! owns the run directory, the sessions (one per role, one per team, or one playing every
//! role when no more can be created), the logs, the plots, the summary and resuming.

use std::collections::BTreeMap;

use lathe::types::{AdamParams, CheckpointUri, Datum};
use lathe::{Tokenizer, TrainingClient};
use serde::Serialize;
use serde_json::{json, Value};

use crate::credit::{role_data, Objective};
use crate::env::{mean_metrics, Env, EnvGroup, Episode};
use crate::play::{mix_seed, play, Policy, Sampling};
use crate::resume::{checkpoint_name, parse_checkpoint_name, sibling_states, ResumeFrom, RunState};
use crate::rollout::{ratio_mean, submit_step, Step, StepOutcome};
use crate::run::{progress, Curves, RunDir};
use crate::setup::{connect, AgentSessions, CommonArgs, Connection};

/// A held-out curve: its label in the plot and summary, and the episode metric it
/// follows.
#[derive(Debug, Clone, Copy)]
pub struct Curve {
    /// The label.
    pub label: &'static str,
    /// The name of the mean episode metric plotted.
    pub metric: &'static str,
}

/// What a recipe promises and whether the run kept it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Criterion {
    /// The promise, in words.
    pub text: String,
    /// Whether it held.
    pub passed: bool,
}

/// How a recipe's roles map onto training sessions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Team {
    /// One session per role (falling back to one for all when no more can be created).
    PerRole,
    /// One session trained on every role's replies by design (Miles' shared policy).
    SharedPolicy,
}

/// A recipe for [`run`]: roles, environments, objective, held-out evaluation and
/// criterion. Everything random must derive from the step number and the seed the recipe
/// was built with, so a resumed run continues exactly.
pub trait Recipe {
    /// The recipe's name (run directory, checkpoint names, summary).
    fn name(&self) -> &'static str;
    /// The role names, in index order.
    fn roles(&self) -> Vec<&'static str>;
    /// How roles map onto sessions.
    fn team(&self) -> Team {
        Team::PerRole
    }
    /// What the step trains on.
    fn objective(&self) -> Objective;
    /// How `role` samples its training replies.
    fn sampling(&self, role: usize) -> Sampling;
    /// How `role` samples on held-out environments (greedy unless the recipe says).
    fn eval_sampling(&self, _role: usize) -> Sampling {
        Sampling::GREEDY
    }
    /// The sampling seed of held-out evaluations (one for all, so evaluations differ
    /// only by the weights).
    fn eval_seed(&self) -> u64 {
        0
    }
    /// The environment groups of training step `step`.
    fn groups(&self, step: usize) -> Vec<EnvGroup>;
    /// The held-out environments.
    fn held_out(&self) -> Vec<Box<dyn Env>>;
    /// The held-out curves; the first is the one the progress bar shows.
    fn curves(&self) -> Vec<Curve>;
    /// The recipe's criterion over the finished curves.
    fn criterion(&self, curves: &Curves) -> Criterion;
    /// The recipe's own settings, in words (a resume with other settings is warned).
    fn settings(&self) -> String;
    /// Recipe-specific fields of `summary.json`.
    fn summary_fields(&self) -> serde_json::Map<String, Value> {
        serde_json::Map::new()
    }
}

/// The end of a run, as written to `summary.json`.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    /// The recipe.
    pub recipe: String,
    /// `two-agent`, `fallback`, `shared-policy`, ...
    pub mode: String,
    /// Why one session plays every role, in fallback mode.
    pub fallback_reason: Option<String>,
    /// Training steps done.
    pub steps: usize,
    /// The step this run resumed from, if it did.
    pub resumed_from_step: Option<usize>,
    /// The base model.
    pub base_model: String,
    /// The held-out curves: `{label: {before, after, curve}}`.
    pub held_out: Value,
    /// The criterion and whether it held.
    pub criterion: String,
    /// Whether it held.
    pub passed: bool,
    /// Per session label: the final state and sampler URIs.
    pub checkpoints: BTreeMap<String, Saved>,
    /// Recipe-specific fields.
    #[serde(flatten)]
    pub recipe_fields: serde_json::Map<String, Value>,
}

/// A session's final checkpoints.
#[derive(Debug, Clone, Serialize)]
pub struct Saved {
    /// Training state (with optimizer): `--resume` or `load_state_with_optimizer`.
    pub state: String,
    /// Sampler weights.
    pub sampler: String,
}

/// The sessions of a run and which plays which role.
struct RoleSessions {
    sessions: AgentSessions,
    /// Session index of each role.
    of_role: Vec<usize>,
    /// Each session's label in checkpoint names.
    labels: Vec<String>,
}

impl RoleSessions {
    fn new(sessions: AgentSessions, roles: &[&'static str], team: Team) -> Self {
        let distinct = sessions.distinct();
        let of_role: Vec<usize> = (0..roles.len())
            .map(|r| if distinct == 1 { 0 } else { r })
            .collect();
        let labels = if distinct == 1 && roles.len() > 1 {
            vec![match team {
                Team::SharedPolicy => "policy".to_string(),
                Team::PerRole => "shared".to_string(),
            }]
        } else {
            roles[..distinct].iter().map(|r| r.to_string()).collect()
        };
        Self {
            sessions,
            of_role,
            labels,
        }
    }

    fn trainer(&self, session: usize) -> &TrainingClient {
        self.sessions.trainer(session)
    }

    fn count(&self) -> usize {
        self.labels.len()
    }

    fn mode(&self, team: Team) -> String {
        match team {
            Team::SharedPolicy => "shared-policy".into(),
            Team::PerRole => self.sessions.mode().into(),
        }
    }
}

/// Runs `recipe` as `args` say; returns its summary (already written and printed), and
/// fails when `--check` is given and the criterion does not hold.
pub async fn run<R: Recipe>(recipe: &R, args: &CommonArgs) -> anyhow::Result<Summary> {
    let roles = recipe.roles();
    let team_kind = recipe.team();
    let resume = args.resume.clone();
    let out = match &resume {
        Some(ResumeFrom::Dir(dir)) => {
            if let Some(o) = args.out.as_ref().filter(|o| *o != dir) {
                anyhow::bail!(
                    "--resume {} continues in its own directory; drop --out {}",
                    dir.display(),
                    o.display()
                );
            }
            Some(dir.clone())
        }
        _ => args.out.clone(),
    };
    let prior = match &resume {
        Some(ResumeFrom::Dir(dir)) => Some(RunState::read(dir)?),
        _ => out
            .as_deref()
            .and_then(|o| RunState::read(o).ok())
            .filter(|_| resume.is_some()),
    };
    let mut run = RunDir::open(
        recipe.name(),
        out.as_deref(),
        prior.as_ref().map(|s| s.metrics_bytes),
    )?;
    eprintln!("{}: output in {}", recipe.name(), run.path.display());
    let conn = connect(args, &run.path).await?;
    eprintln!("endpoint {}, base model {}", conn.endpoint, conn.base_model);
    let tok = conn.service.get_tokenizer(&conn.base_model).await?;

    // The state to continue from: the run directory's, or the URI's siblings (with the
    // curves of the run directory when it belongs to the same run).
    let state = match &resume {
        None => None,
        Some(ResumeFrom::Dir(_)) => prior.clone(),
        Some(ResumeFrom::Uri(uri)) => {
            Some(state_from_uri(&conn, uri, recipe, prior.clone()).await?)
        }
    };
    if let Some(s) = &state {
        anyhow::ensure!(
            s.recipe == recipe.name(),
            "that run is {}, not {}",
            s.recipe,
            recipe.name()
        );
        if s.settings != settings(recipe, args) {
            eprintln!(
                "warning: resuming with other settings than the run started with; it will not continue exactly.\n  then: {}\n  now:  {}",
                s.settings,
                settings(recipe, args)
            );
        }
    }
    let team = open_team(&conn, recipe, args, state.as_ref(), &roles).await?;
    let mode = team.mode(team_kind);
    let steps = args.steps;
    let start = state.as_ref().map_or(0, |s| s.completed_steps);
    anyhow::ensure!(
        start <= steps,
        "the run has done {start} steps already; pass --steps {start} or more"
    );
    if let Some(s) = &state {
        eprintln!(
            "resuming at step {start} of {steps} (attempt {})",
            s.attempt + 1
        );
    }
    let tag = state.as_ref().map_or_else(new_tag, |s| s.tag.clone());
    let attempt = state.as_ref().map_or(0, |s| s.attempt + 1);
    let curve_specs = recipe.curves();
    let mut curves = match &state {
        Some(s) => Curves::from_points(&s.curves),
        None => Curves::new(&curve_specs.iter().map(|c| c.label).collect::<Vec<_>>()),
    };
    let mut training: Vec<(String, Vec<(usize, f64)>)> = Vec::new();
    let adam = AdamParams {
        learning_rate: args.lr,
        ..Default::default()
    };
    let objective = recipe.objective();

    let bar = progress(steps);
    bar.set_prefix(mode.clone());
    bar.set_position(start as u64);
    // What the log and the curves hold before the last evaluation: the final state
    // ends there, so a resume (which evaluates at its first step) repeats nothing.
    let mut before_eval = (run.metrics_bytes(), curves.points());
    for step in start..=steps {
        before_eval = (run.metrics_bytes(), curves.points());
        let samplers = publish(&team).await?;
        let policy = |role: usize, sampling: Sampling| Policy {
            sampler: samplers[team.of_role[role]].clone(),
            version: 0,
            sampling,
        };
        if step % args.eval_every.max(1) == 0 || step == steps {
            let eval = play(
                recipe.held_out(),
                &|r| policy(r, recipe.eval_sampling(r)),
                &tok,
                conn.max_context,
                recipe.eval_seed(),
            )
            .await?;
            let metrics = mean_metrics(&eval);
            for c in &curve_specs {
                if let Some(v) = metrics.get(c.metric) {
                    curves.push(c.label, step, *v);
                }
            }
            run.log(&json!({"step": step, "eval": metrics}))?;
            if let Some(first) = eval.first() {
                run.sample(&json!({"step": step, "episode": example(first, &roles)}))?;
            }
            bar.set_message(
                curve_specs
                    .iter()
                    .filter_map(|c| metrics.get(c.metric).map(|v| format!("{} {v:.2}", c.label)))
                    .collect::<Vec<_>>()
                    .join(", "),
            );
        }
        if step == steps {
            break;
        }
        let groups = recipe.groups(step);
        let sizes: Vec<usize> = groups.iter().map(Vec::len).collect();
        let episodes = play(
            groups.into_iter().flatten().collect(),
            &|r| policy(r, recipe.sampling(r)),
            &tok,
            conn.max_context,
            mix_seed(args.seed, &[step as u64]),
        )
        .await?;
        let groups = regroup(episodes, &sizes);
        let record = train_step(&team, &groups, &objective, &roles, adam, &tok).await?;
        for (role, agent) in &record {
            for (key, value) in [("reward", agent.reward_mean), ("loss", agent.loss)] {
                if let Some(v) = value {
                    push_series(&mut training, &format!("{role} {key}"), step + 1, v);
                }
            }
        }
        let mut line = json!({"step": step + 1, "mode": mode, "agents": record});
        for (k, v) in mean_metrics(groups.iter().flatten()) {
            line[k] = json!(v);
        }
        run.log(&line)?;
        bar.inc(1);
        let done = step + 1;
        if args.save_every > 0 && done % args.save_every == 0 && done < steps {
            let uris = save_states(&team, recipe.name(), &tag, attempt, done).await?;
            RunState {
                recipe: recipe.name().into(),
                tag: tag.clone(),
                attempt,
                completed_steps: done,
                settings: settings(recipe, args),
                checkpoints: uris,
                curves: curves.points(),
                metrics_bytes: run.metrics_bytes(),
            }
            .write(&run.path)?;
        }
    }
    bar.finish();

    // The final state: `--resume` with a larger `--steps` trains further (and evaluates
    // step `steps` again, as a straight run would have only if it was due).
    let uris = save_states(&team, recipe.name(), &tag, attempt, steps).await?;
    let mut checkpoints = BTreeMap::new();
    for (s, (label, state_uri)) in uris.iter().enumerate() {
        let name = checkpoint_name(recipe.name(), &tag, attempt, steps, label);
        let sampler = team
            .trainer(s)
            .save_weights_for_sampler(&name)
            .await?
            .result()
            .await?;
        checkpoints.insert(
            label.clone(),
            Saved {
                state: state_uri.clone(),
                sampler: sampler.to_string(),
            },
        );
    }
    RunState {
        recipe: recipe.name().into(),
        tag: tag.clone(),
        attempt,
        completed_steps: steps,
        settings: settings(recipe, args),
        checkpoints: uris,
        curves: before_eval.1,
        metrics_bytes: before_eval.0,
    }
    .write(&run.path)?;

    let criterion = recipe.criterion(&curves);
    let summary = Summary {
        recipe: recipe.name().into(),
        mode: mode.clone(),
        fallback_reason: team.sessions.fallback_reason.clone(),
        steps,
        resumed_from_step: state.as_ref().map(|s| s.completed_steps),
        base_model: conn.base_model.clone(),
        held_out: curves.to_json(),
        criterion: criterion.text.clone(),
        passed: criterion.passed,
        checkpoints,
        recipe_fields: recipe.summary_fields(),
    };
    run.summary(&serde_json::to_value(&summary)?)?;
    let plotted = crate::plot::run_curves(
        &run.path.join("curves.png"),
        &format!("{} ({mode})", recipe.name()),
        &curves.series(),
        &training,
    )?;
    println!("mode: {mode}");
    curves.report(&run, plotted);
    for (label, saved) in &summary.checkpoints {
        println!("checkpoint {label}: {}", saved.state);
    }
    println!(
        "resume: {} --resume {} --steps <more>",
        recipe.name(),
        run.path.display()
    );
    if args.check && !criterion.passed {
        anyhow::bail!("criterion not met: {}", criterion.text);
    }
    Ok(summary)
}

/// What the resume check compares: the recipe's settings and the common flags that
/// change what a step does.
fn settings<R: Recipe>(recipe: &R, args: &CommonArgs) -> String {
    format!(
        "{} seed={} rank={} lr={} batch={} temperature={}",
        recipe.settings(),
        args.seed,
        args.rank,
        args.lr,
        args.batch,
        args.temperature
    )
}

/// A new run's tag: the start time and the process, in hex.
fn new_tag() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format!("{secs:x}{:x}", std::process::id() & 0xfff)
}

/// The state named by a `tinker://` URI: its step and its siblings' URIs, with the
/// curves of `local` when that is the same run's directory.
async fn state_from_uri<R: Recipe>(
    conn: &Connection,
    uri: &CheckpointUri,
    recipe: &R,
    local: Option<RunState>,
) -> anyhow::Result<RunState> {
    let (step, checkpoints) = sibling_states(&conn.service, uri).await?;
    let (prefix, attempt, _, _) =
        parse_checkpoint_name(&uri.name).expect("sibling_states parsed it");
    let tag = prefix
        .strip_prefix(recipe.name())
        .and_then(|t| t.strip_prefix('-'))
        .ok_or_else(|| anyhow::anyhow!("{uri} was not saved by {}", recipe.name()))?
        .to_string();
    let same_run = local.filter(|s| s.tag == tag && s.completed_steps == step);
    Ok(RunState {
        recipe: recipe.name().into(),
        tag,
        attempt,
        completed_steps: step,
        settings: same_run
            .as_ref()
            .map_or_else(String::new, |s| s.settings.clone()),
        checkpoints,
        curves: same_run
            .as_ref()
            .map_or_else(Vec::new, |s| s.curves.clone()),
        metrics_bytes: same_run.map_or(0, |s| s.metrics_bytes),
    })
}

/// The run's sessions: resumed from `state`'s checkpoints, or new.
async fn open_team<R: Recipe>(
    conn: &Connection,
    recipe: &R,
    args: &CommonArgs,
    state: Option<&RunState>,
    roles: &[&'static str],
) -> anyhow::Result<RoleSessions> {
    let team = recipe.team();
    let wanted = match team {
        Team::SharedPolicy => 1,
        Team::PerRole => roles.len(),
    };
    let sessions = match state {
        None => AgentSessions::open(conn, wanted, args.force_fallback, |i| args.lora(i)).await?,
        Some(s) => {
            let mut trainers = Vec::with_capacity(s.checkpoints.len());
            for (label, uri) in &s.checkpoints {
                eprintln!("loading {label} from {uri}");
                trainers.push(
                    conn.service
                        .create_training_client_from_state_with_optimizer(
                            &uri.parse()
                                .map_err(|e: String| anyhow::anyhow!("{uri}: {e}"))?,
                        )
                        .await?,
                );
            }
            let fallback = (trainers.len() == 1 && wanted > 1)
                .then(|| "the resumed run had one session for every role".to_string());
            anyhow::ensure!(
                trainers.len() == 1 || trainers.len() == wanted,
                "the run saved {} sessions; {} has {wanted}",
                trainers.len(),
                recipe.name()
            );
            AgentSessions::from_trainers(trainers, wanted, fallback)
        }
    };
    Ok(RoleSessions::new(sessions, roles, team))
}

/// A sampler on each session's current weights.
async fn publish(team: &RoleSessions) -> anyhow::Result<Vec<lathe::SamplingClient>> {
    let mut out = Vec::with_capacity(team.count());
    for s in 0..team.count() {
        out.push(
            team.trainer(s)
                .save_weights_and_get_sampling_client()
                .await?,
        );
    }
    Ok(out)
}

/// Splits a flat list of episodes back into groups of `sizes`.
fn regroup(episodes: Vec<Episode>, sizes: &[usize]) -> Vec<Vec<Episode>> {
    let mut it = episodes.into_iter();
    sizes
        .iter()
        .map(|&n| it.by_ref().take(n).collect())
        .collect()
}

/// One role's numbers of a training step.
#[derive(Debug, Clone, Default, Serialize)]
pub struct AgentRecord {
    /// Mean reward of its replies (`null` without replies).
    pub reward_mean: Option<f64>,
    /// Its session's loss per datum (`null` when the session trained on nothing).
    pub loss: Option<f64>,
    /// Datums it trained on.
    pub datums: usize,
    /// Mean `exp(train logprob − sampler logprob)` over its sampled tokens: 1.0 when
    /// trainer and sampler agree (`null` without sampled tokens).
    pub ratio_mean: Option<f64>,
}

/// Which datums of a session's step are which role's: `(role, index range)`.
type RoleRanges = Vec<(usize, std::ops::Range<usize>)>;

/// Credits the step's replies, trains every session on its roles' datums and measures
/// the trainer/sampler agreement per role.
async fn train_step(
    team: &RoleSessions,
    groups: &[Vec<Episode>],
    objective: &Objective,
    roles: &[&'static str],
    adam: AdamParams,
    tok: &Tokenizer,
) -> anyhow::Result<BTreeMap<String, AgentRecord>> {
    let per_role = role_data(groups, objective, roles.len(), tok)?;
    let mut records: Vec<AgentRecord> = (0..roles.len())
        .map(|r| {
            let rewards: Vec<f64> = groups
                .iter()
                .flatten()
                .flat_map(|e| &e.transitions)
                .filter(|t| t.role == r)
                .map(|t| t.reward)
                .collect();
            AgentRecord {
                reward_mean: crate::run::mean_of(&rewards),
                datums: per_role[r].len(),
                ..Default::default()
            }
        })
        .collect();
    // A role whose datums hold no sampled tokens (none at all, or supervised ones) is
    // checked with a forward pass over a few of its replies, before any update; the
    // others from their own training pass.
    let own_pass = matches!(objective, Objective::Rl(..));
    for (r, record) in records.iter_mut().enumerate() {
        if record.datums == 0 || !own_pass {
            let replies: Vec<(&[i64], &crate::rollout::Sample)> = groups
                .iter()
                .flatten()
                .flat_map(|e| &e.transitions)
                .filter(|t| t.role == r && !t.reply.sample.tokens.is_empty())
                .take(16)
                .map(|t| (&t.reply.prompt[..], &t.reply.sample))
                .collect();
            record.ratio_mean = ratio_mean(team.trainer(team.of_role[r]), &replies).await?;
        }
    }
    // Each session's datums: its roles' in role order, with each role's index range.
    let mut pending: Vec<(RoleRanges, Step)> = Vec::new();
    for s in 0..team.count() {
        let mut data: Vec<Datum> = Vec::new();
        let mut ranges = Vec::new();
        for (r, role_data) in per_role.iter().enumerate() {
            if team.of_role[r] == s {
                ranges.push((r, data.len()..data.len() + role_data.len()));
                data.extend(role_data.iter().cloned());
            }
        }
        if let Some(step) = submit_step(team.trainer(s), &data, objective.loss_fn(), adam).await? {
            pending.push((ranges, step));
        }
    }
    for (ranges, step) in pending {
        let outcome: StepOutcome = step.finish().await?;
        for (r, range) in ranges {
            records[r].loss = Some(outcome.loss);
            if records[r].datums > 0 && own_pass {
                records[r].ratio_mean = outcome.ratio_mean_where(|i| range.contains(&i));
            }
        }
    }
    Ok(roles.iter().map(|r| r.to_string()).zip(records).collect())
}

/// Saves every session's training state as step `done`; returns `(label, URI)` pairs.
async fn save_states(
    team: &RoleSessions,
    recipe: &str,
    tag: &str,
    attempt: u32,
    done: usize,
) -> anyhow::Result<Vec<(String, String)>> {
    let mut pending = Vec::new();
    for (s, label) in team.labels.iter().enumerate() {
        let name = checkpoint_name(recipe, tag, attempt, done, label);
        pending.push((label.clone(), team.trainer(s).save_state(&name).await?));
    }
    let mut out = Vec::new();
    for (label, future) in pending {
        out.push((label, future.result().await?.to_string()));
    }
    Ok(out)
}

/// Appends `(step, value)` to the series `name`.
fn push_series(series: &mut Vec<(String, Vec<(usize, f64)>)>, name: &str, step: usize, v: f64) {
    match series.iter_mut().find(|(n, _)| n == name) {
        Some((_, pts)) => pts.push((step, v)),
        None => series.push((name.to_string(), vec![(step, v)])),
    }
}

/// An episode for `samples.jsonl`: every reply's role, text and reward.
fn example(e: &Episode, roles: &[&'static str]) -> Value {
    json!({
        "turns": e.transitions.iter().map(|t| json!({
            "role": roles.get(t.role).copied().unwrap_or("?"),
            "reply": t.reply.sample.text,
            "reward": t.reward,
        })).collect::<Vec<_>>(),
        "metrics": e.metrics,
    })
}
