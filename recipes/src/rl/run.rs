//! [`run`]: the loop itself, its logs and its state.

use std::collections::BTreeMap;

use indicatif::ProgressBar;
use lathe::types::AdamParams;
use lathe::{SamplingClient, SamplingSource, Tokenizer};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::begin::{begin, new_tag, settings, Begun};
use super::learner::{queue, Learner, QueueHandle, QueuedEpisode};
use super::sessions::{open_team, save_states, train_step, AgentRecord, Kl, RoleSessions, Update};
use super::{Curve, QueueTotals, Recipe, Saved, Summary};
use crate::credit::Objective;
use crate::env::{mean_metrics, Episode, Transition};
use crate::play::{mix_seed, play, Policy};
use crate::resume::{checkpoint_name, LearnerState, RunState};
use crate::run::{agent_series, progress, push_series, Curves, RunDir, Series};
use crate::setup::CommonArgs;

/// Held-out episodes written to `samples.jsonl` per evaluation.
const EXAMPLES: usize = 4;

/// Runs `recipe` as `args` say; returns its summary (already written and printed), and
/// fails when `--check` is given and the criterion does not hold.
pub async fn run<R: Recipe>(recipe: &R, args: &CommonArgs) -> anyhow::Result<Summary> {
    let roles = recipe.roles();
    anyhow::ensure!(
        args.kl_coef.is_finite() && args.kl_coef >= 0.0,
        "--kl-coef must be a finite number >= 0, not {}",
        args.kl_coef
    );
    let any_rl = matches!(recipe.objective(), Objective::Rl(..))
        || (0..roles.len()).any(|r| recipe.queued(r).is_some());
    anyhow::ensure!(
        args.kl_coef == 0.0 || any_rl,
        "--kl-coef penalises RL updates, and this run's objective is supervised"
    );
    let Begun {
        path,
        conn,
        state,
        keep,
    } = begin(recipe, args).await?;
    let tok = conn.service.get_tokenizer(&conn.base_model).await?;
    let team = open_team(&conn, recipe, args, state.as_ref(), &roles).await?;
    let base = if args.kl_coef > 0.0 {
        let source = SamplingSource::BaseModel(conn.base_model.clone());
        Some(conn.service.create_sampling_client(source).await?)
    } else {
        None
    };
    let kl = base.as_ref().map(|base| Kl {
        coef: args.kl_coef,
        base,
        context: conn.max_context,
    });
    let mode = team.mode(recipe.team());
    let steps = args.steps;
    let start = state.as_ref().map_or(0, |s| s.completed_steps);
    let tag = state.as_ref().map_or_else(new_tag, |s| s.tag.clone());
    let attempt = state.as_ref().map_or(0, |s| s.attempt + 1);
    // Only now, with the sessions loaded, is the log cut back to the saved state; the
    // state is written again with this attempt's number at once, so a kill before the
    // first save never lets a later attempt reuse this one's checkpoint names.
    let run = RunDir::open(&path, keep)?;
    // A resumed run plots the steps before it too.
    let training = agent_series(&run.path.join("metrics.jsonl"))?;
    if let Some(s) = &state {
        eprintln!("resuming at step {start} of {steps} (attempt {attempt})");
        RunState {
            attempt,
            ..s.clone()
        }
        .write(&path)?;
    }
    let curve_specs = recipe.curves();
    let labels: Vec<&str> = curve_specs.iter().map(|c| c.label).collect();
    let curves = Curves::with_points(&labels, state.as_ref().map_or(&[][..], |s| &s.curves));
    let bar = progress(steps);
    bar.set_prefix(mode.clone());
    bar.set_position(start as u64);
    let (records_tx, records) = mpsc::unbounded_channel();
    let mut log = Log {
        run,
        curves,
        training,
        records,
        bar,
    };

    // Queued roles: a queue and a learner each, starting from their saved counters.
    let mut queues: Vec<Option<QueueHandle>> = Vec::new();
    let mut learners = Vec::new();
    for (r, name) in roles.iter().enumerate() {
        let Some(q) = recipe.queued(r) else {
            queues.push(None);
            continue;
        };
        let saved = state
            .as_ref()
            .and_then(|s| s.learners.iter().find(|l| l.role == *name));
        let sampler = team
            .trainer(team.of_role[r])
            .save_weights_and_get_sampling_client()
            .await?;
        let (handle, ends) = queue(
            q.capacity,
            (saved.map_or(0, |l| l.updates), sampler),
            saved.map_or(0, |l| l.cursor),
        );
        queues.push(Some(handle));
        let learner = Learner {
            recipe,
            role: r,
            queued: q,
            team: &team,
            tok: &tok,
            context: conn.max_context,
            seed: args.seed,
            kl,
            records: records_tx.clone(),
        };
        learners.push(learner.run(ends));
    }
    drop(records_tx);
    let lp = Loop {
        recipe,
        args,
        team: &team,
        tok: &tok,
        context: conn.max_context,
        roles: &roles,
        curves: &curve_specs,
        mode: &mode,
        kl,
        tag,
        attempt,
    };

    // The steps, and the learners beside them; closing the queues at the end lets the
    // learners drain them and stop.
    let training = async {
        for step in start..steps {
            lp.step(step, &mut log, &mut queues).await?;
        }
        for q in queues.iter_mut().flatten() {
            q.close();
        }
        Ok::<_, anyhow::Error>(queues)
    };
    let (queues, totals) = tokio::try_join!(training, futures::future::try_join_all(learners))?;
    log.bar.finish();

    // The final state, before the final evaluation: `--resume` with a larger `--steps`
    // trains further (and evaluates at this step only if it is due, as a straight run).
    log.drain_records()?;
    let uris = lp.save(steps, &log, &queues).await?;
    let sent: Vec<u64> = queues.iter().flatten().map(|q| q.sent).collect();
    let queue_totals: BTreeMap<String, QueueTotals> = roles
        .iter()
        .zip(&queues)
        .filter(|(_, q)| q.is_some())
        .map(|(name, _)| name.to_string())
        .zip(totals)
        .zip(sent)
        .map(|((name, t), sent)| (name, QueueTotals { sent, ..t }))
        .collect();
    // The final evaluation, with every role's final weights.
    let samplers = lp.samplers(&queues).await?;
    lp.evaluate(steps, &mut log, &samplers, &queues).await?;
    let checkpoints = lp.save_samplers(steps, uris).await?;

    let criterion = recipe.criterion(&log.curves);
    let summary = Summary {
        recipe: recipe.name().into(),
        mode: mode.clone(),
        fallback_reason: team.sessions.fallback_reason.clone(),
        steps,
        resumed_from_step: state.as_ref().map(|s| s.completed_steps),
        base_model: conn.base_model.clone(),
        settings: settings(recipe, args),
        held_out: log.curves.to_json(),
        criterion: criterion.text.clone(),
        passed: criterion.passed,
        upstream_bars: recipe.upstream_bars(&log.curves),
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
    for bar in &summary.upstream_bars {
        let met = match bar.met {
            Some(true) => "met",
            Some(false) => "not met",
            None => "not measured",
        };
        println!("upstream bar ({met}): {}", bar.text);
    }
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

/// What the loop writes as it goes.
struct Log {
    run: RunDir,
    curves: Curves,
    /// Per agent: training reward and loss by step, for the plot.
    training: Series,
    /// The learners' lines.
    records: mpsc::UnboundedReceiver<Value>,
    bar: ProgressBar,
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

/// Each role's queue, `None` for an on-policy role.
type Queues = [Option<QueueHandle>];

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
    /// The KL penalty, when there is one.
    kl: Option<Kl<'a>>,
    tag: String,
    attempt: u32,
}

impl<R: Recipe> Loop<'_, R> {
    /// Session `s`'s learning rate (`sessions::session_lr`).
    fn session_lr(&self, s: usize) -> f64 {
        super::sessions::session_lr(&self.team.of_role, |r| self.recipe.lr(r), s, self.args.lr)
    }

    /// The policy of `role`: its queued learner's newest weights, or its session's
    /// `samplers` entry (published at the start of the step).
    fn policy(
        &self,
        role: usize,
        samplers: &[Option<SamplingClient>],
        queues: &Queues,
        eval: bool,
    ) -> Policy {
        let sampling = if eval {
            self.recipe.eval_sampling(role)
        } else {
            self.recipe.sampling(role)
        };
        let (version, sampler) = match &queues[role] {
            Some(q) => q.latest.borrow().clone(),
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

    /// Samplers on the current weights of the sessions that on-policy roles sample from
    /// (`None` for a session only queued roles use: their learners publish).
    async fn samplers(&self, queues: &Queues) -> anyhow::Result<Vec<Option<SamplingClient>>> {
        let mut out = Vec::with_capacity(self.team.count());
        for s in 0..self.team.count() {
            let used =
                (0..self.roles.len()).any(|r| self.team.of_role[r] == s && queues[r].is_none());
            out.push(if used {
                Some(
                    self.team
                        .trainer(s)
                        .save_weights_and_get_sampling_client()
                        .await?,
                )
            } else {
                None
            });
        }
        Ok(out)
    }

    /// Plays the held-out environments and logs the evaluation at `step`.
    async fn evaluate(
        &self,
        step: usize,
        log: &mut Log,
        samplers: &[Option<SamplingClient>],
        queues: &Queues,
    ) -> anyhow::Result<()> {
        let episodes = self
            .play_held_out(self.eval_policies(samplers, queues))
            .await?;
        self.log_evaluation(step, log, &episodes)
    }

    /// Every role's held-out policy as it is now.
    fn eval_policies(&self, samplers: &[Option<SamplingClient>], queues: &Queues) -> Vec<Policy> {
        (0..self.roles.len())
            .map(|r| self.policy(r, samplers, queues, true))
            .collect()
    }

    /// The held-out episodes under `policies` (one per role).
    async fn play_held_out(&self, policies: Vec<Policy>) -> anyhow::Result<Vec<Episode>> {
        play(
            self.recipe.held_out(),
            &|r| policies[r].clone(),
            self.tok,
            self.context,
            self.recipe.eval_seed(),
        )
        .await
    }

    /// Logs the held-out `episodes` as the evaluation at `step`.
    fn log_evaluation(
        &self,
        step: usize,
        log: &mut Log,
        episodes: &[Episode],
    ) -> anyhow::Result<()> {
        let metrics = mean_metrics(episodes);
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

    /// Training step `step`: play, queue the queued roles' replies, train the others, and
    /// beside them evaluate when due; then log, and save when due.
    ///
    /// The evaluation overlaps the step: it samples from the weights published at the
    /// step's start, as the step's own play does, and the server's numbers for a sequence
    /// do not depend on what shares its pass, so for on-policy roles the overlap changes
    /// no number; the server batches the two plays' sequences together. A queued role is
    /// evaluated on its learner's newest weights at the step's start, all through the
    /// evaluation. An error in either ends the step; a resume repeats it from the last
    /// save.
    async fn step(&self, step: usize, log: &mut Log, queues: &mut Queues) -> anyhow::Result<()> {
        let samplers = self.samplers(queues).await?;
        let due = step.is_multiple_of(self.args.eval_every.max(1));
        let policies = due.then(|| self.eval_policies(&samplers, queues));
        let held_out = async {
            match policies {
                Some(p) => self.play_held_out(p).await.map(Some),
                None => Ok(None),
            }
        };
        let (held_out, trained) = tokio::try_join!(held_out, self.train(step, &samplers, queues))?;
        if let Some(episodes) = held_out {
            self.log_evaluation(step, log, &episodes)?;
        }
        let (groups, record) = trained;
        for (name, agent) in &record {
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
        let every = self.args.save_every;
        if every > 0 && done.is_multiple_of(every) && done < self.args.steps {
            for q in queues.iter_mut().flatten() {
                q.drain().await?;
            }
            log.drain_records()?;
            self.save(done, log, queues).await?;
        }
        Ok(())
    }

    /// Step `step`'s play and training: the episodes by group and each role's record.
    async fn train(
        &self,
        step: usize,
        samplers: &[Option<SamplingClient>],
        queues: &mut Queues,
    ) -> anyhow::Result<(Vec<Vec<Episode>>, BTreeMap<String, AgentRecord>)> {
        let groups = self.recipe.groups(step);
        let sizes: Vec<usize> = groups.iter().map(Vec::len).collect();
        let episodes = play(
            groups.into_iter().flatten().collect(),
            &|r| self.policy(r, samplers, queues, false),
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
        let adam: Vec<AdamParams> = (0..self.team.count())
            .map(|s| AdamParams {
                learning_rate: self.session_lr(s),
                ..Default::default()
            })
            .collect();
        let objective = self.recipe.objective();
        // The penalty covers the on-policy roles' replies (the queued ones' learners
        // take their own).
        let penalty = match (self.kl, &objective) {
            (Some(kl), Objective::Rl(_, credit)) => {
                let on_policy = |t: &Transition| !queued[t.role];
                Some(
                    kl.penalty(&groups, credit, self.roles.len(), on_policy)
                        .await?,
                )
            }
            _ => None,
        };
        let update = Update {
            objective: &objective,
            adam: &adam,
            penalty: penalty.as_ref(),
        };
        let mut record =
            train_step(self.team, &groups, update, self.roles, &queued, self.tok).await?;
        for (r, name) in self.roles.iter().enumerate() {
            if queued[r] {
                record.get_mut(*name).expect("a record per role").queued = Some(sent[r]);
            }
        }
        Ok((groups, record))
    }

    /// Saves every session's state as step `done` and writes `state.json` with the logs
    /// as they are now; returns the `(label, URI)` pairs. Queues must be drained.
    async fn save(
        &self,
        done: usize,
        log: &Log,
        queues: &Queues,
    ) -> anyhow::Result<Vec<(String, String)>> {
        let uris =
            save_states(self.team, self.recipe.name(), &self.tag, self.attempt, done).await?;
        let lengths = log.run.lengths();
        RunState {
            recipe: self.recipe.name().into(),
            tag: self.tag.clone(),
            attempt: self.attempt,
            completed_steps: done,
            settings: settings(self.recipe, self.args),
            checkpoints: uris.clone(),
            curves: log.curves.points(),
            metrics_bytes: lengths.metrics,
            samples_bytes: lengths.samples,
            learners: self
                .roles
                .iter()
                .zip(queues)
                .filter_map(|(name, q)| {
                    q.as_ref().map(|q| LearnerState {
                        role: name.to_string(),
                        updates: q.latest.borrow().0,
                        cursor: q.cursor(),
                    })
                })
                .collect(),
        }
        .write(&log.run.path)?;
        Ok(uris)
    }

    /// Sampler weights of every session beside its final state `uris`.
    async fn save_samplers(
        &self,
        steps: usize,
        uris: Vec<(String, String)>,
    ) -> anyhow::Result<BTreeMap<String, Saved>> {
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

/// Splits a flat list of episodes back into groups of `sizes`.
fn regroup(episodes: Vec<Episode>, sizes: &[usize]) -> Vec<Vec<Episode>> {
    let mut it = episodes.into_iter();
    sizes
        .iter()
        .map(|&n| it.by_ref().take(n).collect())
        .collect()
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
