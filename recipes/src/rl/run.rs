//! [`run`]: the loop itself, its logs and its state.

use std::collections::BTreeMap;

use indicatif::ProgressBar;
use lathe::types::{AdamParams, CheckpointUri};
use lathe::{SamplingClient, Tokenizer};
use serde_json::{json, Value};
use tokio::sync::{mpsc, watch};

use super::learner::{queue, Learner, QueueHandle, QueuedEpisode};
use super::sessions::{open_team, publish, save_states, train_step, RoleSessions};
use super::{Curve, QueueTotals, Recipe, Saved, Summary};
use crate::env::{mean_metrics, Episode};
use crate::play::{mix_seed, play, Policy};
use crate::resume::{checkpoint_name, parse_checkpoint_name, sibling_states, ResumeFrom, RunState};
use crate::run::{progress, Curves, RunDir};
use crate::setup::{connect, CommonArgs, Connection};

/// Held-out episodes written to `samples.jsonl` per evaluation.
const EXAMPLES: usize = 4;

/// Runs `recipe` as `args` say; returns its summary (already written and printed), and
/// fails when `--check` is given and the criterion does not hold.
pub async fn run<R: Recipe>(recipe: &R, args: &CommonArgs) -> anyhow::Result<Summary> {
    let roles = recipe.roles();
    let (run, conn, state) = start(recipe, args).await?;
    let tok = conn.service.get_tokenizer(&conn.base_model).await?;
    let team = open_team(&conn, recipe, args, state.as_ref(), &roles).await?;
    let mode = team.mode(recipe.team());
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
    let curve_specs = recipe.curves();
    let curves = match &state {
        Some(s) => Curves::from_points(&s.curves),
        None => Curves::new(&curve_specs.iter().map(|c| c.label).collect::<Vec<_>>()),
    };
    let bar = progress(steps);
    bar.set_prefix(mode.clone());
    bar.set_position(start as u64);
    let (records_tx, records) = mpsc::unbounded_channel();
    let mut log = Log {
        before_eval: (run.metrics_bytes(), curves.points()),
        run,
        curves,
        training: Vec::new(),
        records,
        bar,
    };

    // Queued roles: a queue and a learner each, starting from their saved update count.
    let mut queues: Vec<Option<QueueHandle>> = Vec::new();
    let mut learners = Vec::new();
    for (r, name) in roles.iter().enumerate() {
        let Some(q) = recipe.queued(r) else {
            queues.push(None);
            continue;
        };
        let updates = state
            .as_ref()
            .and_then(|s| s.updates.iter().find(|(n, _)| n == name).map(|u| u.1))
            .unwrap_or(0);
        let sampler = team
            .trainer(team.of_role[r])
            .save_weights_and_get_sampling_client()
            .await?;
        let (handle, ends) = queue(q.capacity, (updates, sampler));
        queues.push(Some(handle));
        let learner = Learner {
            recipe,
            role: r,
            queued: q,
            team: &team,
            tok: &tok,
            context: conn.max_context,
            seed: args.seed,
            records: records_tx.clone(),
        };
        learners.push(learner.run(ends));
    }
    drop(records_tx);
    let latest: Vec<Option<watch::Receiver<(u64, SamplingClient)>>> = queues
        .iter()
        .map(|q| q.as_ref().map(|h| h.latest.clone()))
        .collect();
    let lp = Loop {
        recipe,
        args,
        team: &team,
        tok: &tok,
        context: conn.max_context,
        roles: &roles,
        curves: &curve_specs,
        mode: &mode,
        tag: state.as_ref().map_or_else(new_tag, |s| s.tag.clone()),
        attempt: state.as_ref().map_or(0, |s| s.attempt + 1),
        run_path: log.run.path.clone(),
    };

    // The steps, and the learners beside them; closing the queues at the end lets the
    // learners drain them and stop.
    let training = async {
        for step in start..steps {
            lp.step(step, &mut log, &mut queues, &latest).await?;
        }
        let sent: Vec<u64> = queues.iter().flatten().map(|q| q.sent).collect();
        drop(queues);
        Ok::<_, anyhow::Error>(sent)
    };
    let (sent, totals) = tokio::try_join!(training, futures::future::try_join_all(learners))?;
    log.bar.finish();

    // The final evaluation, with every role's final weights.
    log.before_eval = (log.run.metrics_bytes(), log.curves.points());
    lp.evaluate(steps, &mut log, &latest).await?;
    log.drain_records()?;
    let queue_totals: BTreeMap<String, QueueTotals> = roles
        .iter()
        .zip(&latest)
        .filter(|(_, l)| l.is_some())
        .map(|(name, _)| name.to_string())
        .zip(totals)
        .zip(sent)
        .map(|((name, t), sent)| (name, QueueTotals { sent, ..t }))
        .collect();
    let checkpoints = lp.save_final(steps, &mut log, &latest).await?;

    let criterion = recipe.criterion(&log.curves);
    let summary = Summary {
        recipe: recipe.name().into(),
        mode: mode.clone(),
        fallback_reason: team.sessions.fallback_reason.clone(),
        steps,
        resumed_from_step: state.as_ref().map(|s| s.completed_steps),
        base_model: conn.base_model.clone(),
        held_out: log.curves.to_json(),
        criterion: criterion.text.clone(),
        passed: criterion.passed,
        checkpoints,
        queues: queue_totals,
        recipe_fields: recipe.summary_fields(),
    };
    log.run.summary(&serde_json::to_value(&summary)?)?;
    let plotted = crate::plot::run_curves(
        &log.run.path.join("curves.png"),
        &format!("{} ({mode})", recipe.name()),
        &log.curves.series(),
        &log.training,
    )?;
    println!("mode: {mode}");
    log.curves.report(&log.run, plotted);
    for (label, saved) in &summary.checkpoints {
        println!("checkpoint {label}: {}", saved.state);
    }
    println!(
        "to continue: {} --resume {} --steps <more> (and this run's other flags)",
        recipe.name(),
        log.run.path.display()
    );
    if args.check && !criterion.passed {
        anyhow::bail!("criterion not met: {}", criterion.text);
    }
    Ok(summary)
}

/// Opens the run directory (a resumed run's own, its log cut back to the saved state),
/// connects, and finds the state to continue from.
async fn start<R: Recipe>(
    recipe: &R,
    args: &CommonArgs,
) -> anyhow::Result<(RunDir, Connection, Option<RunState>)> {
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
        Some(ResumeFrom::Uri(_)) => out.as_deref().and_then(|o| RunState::read(o).ok()),
        None => None,
    };
    let path = RunDir::path_for(recipe.name(), out.as_deref())?;
    std::fs::create_dir_all(&path)?;
    eprintln!("{}: output in {}", recipe.name(), path.display());
    let conn = connect(args, &path).await?;
    eprintln!("endpoint {}, base model {}", conn.endpoint, conn.base_model);
    let state = match &resume {
        None => None,
        Some(ResumeFrom::Dir(_)) => prior,
        Some(ResumeFrom::Uri(uri)) => Some(state_from_uri(&conn, uri, recipe, prior).await?),
    };
    // A resumed run keeps its log up to the saved state.
    let run = RunDir::open(
        recipe.name(),
        Some(&path),
        state.as_ref().map(|s| s.metrics_bytes),
    )?;
    if let Some(s) = &state {
        anyhow::ensure!(
            s.recipe == recipe.name(),
            "that run is {}, not {}",
            s.recipe,
            recipe.name()
        );
        let now = settings(recipe, args);
        if !s.settings.is_empty() && s.settings != now {
            eprintln!(
                "warning: resuming with other settings than the run started with; it will not continue exactly.\n  then: {}\n  now:  {now}",
                s.settings
            );
        }
    }
    Ok((run, conn, state))
}

/// Named series of `(step, value)` points.
type Points = Vec<(String, Vec<(usize, f64)>)>;

/// What the loop writes as it goes.
struct Log {
    run: RunDir,
    curves: Curves,
    /// Per agent: training reward and loss by step, for the plot.
    training: Vec<(String, Vec<(usize, f64)>)>,
    /// The learners' lines.
    records: mpsc::UnboundedReceiver<Value>,
    bar: ProgressBar,
    /// The log's length and the curves before the latest evaluation: the final state
    /// ends there, so a resume (which evaluates at its first step) repeats nothing.
    before_eval: (u64, Points),
}

impl Log {
    /// Writes the learners' lines so far.
    fn drain_records(&mut self) -> anyhow::Result<()> {
        while let Ok(record) = self.records.try_recv() {
            self.run.log(&record)?;
        }
        Ok(())
    }
}

/// What every step of a run shares.
struct Loop<'a, R: Recipe> {
    recipe: &'a R,
    args: &'a CommonArgs,
    team: &'a RoleSessions,
    tok: &'a Tokenizer,
    context: Option<usize>,
    roles: &'a [&'static str],
    curves: &'a [Curve],
    mode: &'a str,
    tag: String,
    attempt: u32,
    run_path: std::path::PathBuf,
}

impl<R: Recipe> Loop<'_, R> {
    /// The policy of `role`: its queued learner's newest weights, or its session's
    /// `samplers` entry (published at the start of the step).
    fn policy(
        &self,
        role: usize,
        samplers: &[Option<SamplingClient>],
        latest: &[Option<watch::Receiver<(u64, SamplingClient)>>],
        eval: bool,
    ) -> Policy {
        let sampling = if eval {
            self.recipe.eval_sampling(role)
        } else {
            self.recipe.sampling(role)
        };
        let (version, sampler) = match &latest[role] {
            Some(l) => l.borrow().clone(),
            None => (
                0,
                samplers[self.team.of_role[role]]
                    .clone()
                    .expect("an on-policy role's session is published"),
            ),
        };
        Policy {
            sampler,
            version,
            sampling,
        }
    }

    /// Samplers on the weights of the sessions that on-policy roles train.
    async fn samplers(
        &self,
        latest: &[Option<watch::Receiver<(u64, SamplingClient)>>],
    ) -> anyhow::Result<Vec<Option<SamplingClient>>> {
        let all = publish(self.team).await?;
        Ok(all
            .into_iter()
            .enumerate()
            .map(|(s, sampler)| {
                (0..self.roles.len())
                    .any(|r| self.team.of_role[r] == s && latest[r].is_none())
                    .then_some(sampler)
            })
            .collect())
    }

    /// Plays the held-out environments and logs the evaluation at `step`.
    async fn evaluate(
        &self,
        step: usize,
        log: &mut Log,
        latest: &[Option<watch::Receiver<(u64, SamplingClient)>>],
    ) -> anyhow::Result<()> {
        let samplers = self.samplers(latest).await?;
        let episodes = play(
            self.recipe.held_out(),
            &|r| self.policy(r, &samplers, latest, true),
            self.tok,
            self.context,
            self.recipe.eval_seed(),
        )
        .await?;
        let metrics = mean_metrics(&episodes);
        for c in self.curves {
            if let Some(v) = metrics.get(c.metric) {
                log.curves.push(c.label, step, *v);
            }
        }
        log.drain_records()?;
        log.run.log(&json!({"step": step, "eval": metrics}))?;
        let examples: Vec<Value> = episodes
            .iter()
            .take(EXAMPLES)
            .map(|e| example(e, self.roles))
            .collect();
        log.run
            .sample(&json!({"step": step, "episodes": examples}))?;
        log.bar.set_message(
            self.curves
                .iter()
                .filter_map(|c| metrics.get(c.metric).map(|v| format!("{} {v:.2}", c.label)))
                .collect::<Vec<_>>()
                .join(", "),
        );
        Ok(())
    }

    /// Training step `step`: evaluate when due, play, queue the queued roles' replies,
    /// train the others, log, save when due.
    async fn step(
        &self,
        step: usize,
        log: &mut Log,
        queues: &mut [Option<QueueHandle>],
        latest: &[Option<watch::Receiver<(u64, SamplingClient)>>],
    ) -> anyhow::Result<()> {
        log.before_eval = (log.run.metrics_bytes(), log.curves.points());
        if step.is_multiple_of(self.args.eval_every.max(1)) {
            self.evaluate(step, log, latest).await?;
        }
        let samplers = self.samplers(latest).await?;
        let groups = self.recipe.groups(step);
        let sizes: Vec<usize> = groups.iter().map(Vec::len).collect();
        let episodes = play(
            groups.into_iter().flatten().collect(),
            &|r| self.policy(r, &samplers, latest, false),
            self.tok,
            self.context,
            mix_seed(self.args.seed, &[step as u64]),
        )
        .await?;
        let groups = regroup(episodes, &sizes);

        // Queued roles' replies go to their learners while the others train.
        let mut sent = vec![0usize; self.roles.len()];
        for (r, q) in queues.iter_mut().enumerate() {
            let Some(q) = q else { continue };
            let current = q.latest.borrow().0;
            for e in groups.iter().flatten() {
                let transitions: Vec<_> = e
                    .transitions
                    .iter()
                    .filter(|t| t.role == r)
                    .cloned()
                    .collect();
                let version = transitions
                    .iter()
                    .map(|t| t.reply.version)
                    .min()
                    .unwrap_or(current);
                q.send(QueuedEpisode {
                    transitions,
                    source: e.source,
                    version,
                })
                .await?;
                sent[r] += 1;
            }
        }
        let queued: Vec<bool> = queues.iter().map(Option::is_some).collect();
        let adam = AdamParams {
            learning_rate: self.args.lr,
            ..Default::default()
        };
        let objective = self.recipe.objective();
        let mut record = train_step(
            self.team, &groups, &objective, self.roles, &queued, adam, self.tok,
        )
        .await?;
        for (r, name) in self.roles.iter().enumerate() {
            let agent = record.get_mut(*name).expect("a record per role");
            if queued[r] {
                agent.queued = Some(sent[r]);
            }
            for (key, value) in [("reward", agent.reward_mean), ("loss", agent.loss)] {
                if let Some(v) = value {
                    push_series(&mut log.training, &format!("{name} {key}"), step + 1, v);
                }
            }
        }
        let mut line = json!({"step": step + 1, "mode": self.mode, "agents": record});
        for (k, v) in mean_metrics(groups.iter().flatten()) {
            line[k] = json!(v);
        }
        log.drain_records()?;
        log.run.log(&line)?;
        log.bar.inc(1);
        let done = step + 1;
        if self.args.save_every > 0 && done.is_multiple_of(self.args.save_every) && done < self.args.steps {
            for q in queues.iter_mut().flatten() {
                q.drain().await?;
            }
            log.drain_records()?;
            let bytes = log.run.metrics_bytes();
            let curves = log.curves.points();
            self.save(done, bytes, curves, latest).await?;
        }
        Ok(())
    }

    /// Saves every session's state as step `done` and writes `state.json`.
    async fn save(
        &self,
        done: usize,
        metrics_bytes: u64,
        curves: Vec<(String, Vec<(usize, f64)>)>,
        latest: &[Option<watch::Receiver<(u64, SamplingClient)>>],
    ) -> anyhow::Result<Vec<(String, String)>> {
        let uris =
            save_states(self.team, self.recipe.name(), &self.tag, self.attempt, done).await?;
        RunState {
            recipe: self.recipe.name().into(),
            tag: self.tag.clone(),
            attempt: self.attempt,
            completed_steps: done,
            settings: settings(self.recipe, self.args),
            checkpoints: uris.clone(),
            curves,
            metrics_bytes,
            updates: self
                .roles
                .iter()
                .zip(latest)
                .filter_map(|(name, l)| l.as_ref().map(|l| (name.to_string(), l.borrow().0)))
                .collect(),
        }
        .write(&self.run_path)?;
        Ok(uris)
    }

    /// The final state (so `--resume` with a larger `--steps` trains further) and
    /// sampler weights of every session.
    async fn save_final(
        &self,
        steps: usize,
        log: &mut Log,
        latest: &[Option<watch::Receiver<(u64, SamplingClient)>>],
    ) -> anyhow::Result<BTreeMap<String, Saved>> {
        let (bytes, curves) = log.before_eval.clone();
        let uris = self.save(steps, bytes, curves, latest).await?;
        let mut checkpoints = BTreeMap::new();
        for (s, (label, state)) in uris.into_iter().enumerate() {
            let name = checkpoint_name(self.recipe.name(), &self.tag, self.attempt, steps, &label);
            let sampler = self
                .team
                .trainer(s)
                .save_weights_for_sampler(&name)
                .await?
                .result()
                .await?;
            checkpoints.insert(
                label,
                Saved {
                    state,
                    sampler: sampler.to_string(),
                },
            );
        }
        Ok(checkpoints)
    }
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
/// curves, log length and learner counts of `local` when that is the same run's state at
/// the same step.
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
        metrics_bytes: same_run.as_ref().map_or(0, |s| s.metrics_bytes),
        updates: same_run.map_or_else(Vec::new, |s| s.updates),
    })
}

/// Splits a flat list of episodes back into groups of `sizes`.
fn regroup(episodes: Vec<Episode>, sizes: &[usize]) -> Vec<Vec<Episode>> {
    let mut it = episodes.into_iter();
    sizes
        .iter()
        .map(|&n| it.by_ref().take(n).collect())
        .collect()
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
