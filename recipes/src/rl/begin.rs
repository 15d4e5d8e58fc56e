//! Where a run starts: a new run directory, or the state of a saved run to continue
//! from (its directory, or a `tinker://` URI of one of its states), checked against the
//! flags before anything is changed.

use std::path::{Path, PathBuf};

use lathe::types::CheckpointUri;
use serde_json::Value;

use super::Recipe;
use crate::resume::{
    changed_settings, parse_checkpoint_name, sibling_states, ResumeFrom, RunState, STATE_FILE,
};
use crate::run::{LogLengths, RunDir};
use crate::setup::{connect, CommonArgs, Connection};

/// A run about to start: its directory, the connection, the state to continue from and
/// how much of the logs to keep.
pub(super) struct Begun {
    pub(super) path: PathBuf,
    pub(super) conn: Connection,
    pub(super) state: Option<RunState>,
    pub(super) keep: Option<LogLengths>,
}

/// Finds the run directory and the state to continue from, checks them, and connects.
/// Nothing in the directory is changed yet.
pub(super) async fn begin<R: Recipe>(recipe: &R, args: &CommonArgs) -> anyhow::Result<Begun> {
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
    let path = RunDir::path_for(recipe.name(), out.as_deref())?;
    let local = path
        .join(STATE_FILE)
        .exists()
        .then(|| RunState::read(&path))
        .transpose()?;
    if let (None, Some(s)) = (&resume, &local) {
        anyhow::bail!(
            "{} holds a {} run at step {}: continue it with --resume {}, or choose another --out",
            path.display(),
            s.recipe,
            s.completed_steps,
            path.display()
        );
    }
    if let Some(ResumeFrom::Dir(_)) = &resume {
        anyhow::ensure!(
            local.is_some(),
            "cannot resume: no {}",
            path.join(STATE_FILE).display()
        );
    }
    std::fs::create_dir_all(&path)?;
    eprintln!("{}: output in {}", recipe.name(), path.display());
    let conn = connect(args, &path).await?;
    eprintln!("endpoint {}, base model {}", conn.endpoint, conn.base_model);
    let (state, keep) = match &resume {
        None => (None, None),
        Some(ResumeFrom::Dir(_)) => {
            let keep = local.as_ref().map(RunState::log_lengths);
            (local, keep)
        }
        Some(ResumeFrom::Uri(uri)) => {
            let (state, same_run) = state_from_uri(&conn, uri, recipe, local).await?;
            let keep = if same_run {
                Some(state.log_lengths())
            } else {
                set_logs_aside(&path, &state)?;
                None
            };
            (Some(state), keep)
        }
    };
    if let Some(s) = &state {
        anyhow::ensure!(
            s.recipe == recipe.name(),
            "that run is {}, not {}",
            s.recipe,
            recipe.name()
        );
        anyhow::ensure!(
            s.completed_steps <= args.steps,
            "the run has done {} steps already; pass --steps {} or more",
            s.completed_steps,
            s.completed_steps
        );
        let check = changed_settings(&s.settings, &settings(recipe, args));
        if !check.changed.is_empty() {
            eprintln!(
                "warning: resuming with other settings than the run was saved with; it will not continue exactly:\n  {}",
                check.changed.join("\n  ")
            );
        }
        for note in &check.notes {
            eprintln!("note: {note}");
        }
    }
    Ok(Begun {
        path,
        conn,
        state,
        keep,
    })
}

/// Moves `metrics.jsonl` and `samples.jsonl` of `path` aside (a URI resume into a
/// directory whose logs belong to another point of the run): nothing is deleted.
fn set_logs_aside(path: &Path, state: &RunState) -> anyhow::Result<()> {
    for name in ["metrics", "samples"] {
        let log = path.join(format!("{name}.jsonl"));
        if log.metadata().is_ok_and(|m| m.len() > 0) {
            let aside = path.join(format!(
                "{name}.before-a{}-s{}.jsonl",
                state.attempt + 1,
                state.completed_steps
            ));
            eprintln!(
                "keeping the earlier {} as {}",
                log.display(),
                aside.display()
            );
            std::fs::rename(&log, &aside)?;
        }
    }
    Ok(())
}

/// What the resume check compares and the summary records: the recipe's own flags and
/// the common ones that change what a step computes, as one JSON object.
pub(super) fn settings<R: Recipe>(recipe: &R, args: &CommonArgs) -> Value {
    let Value::Object(mut all) = recipe.settings() else {
        panic!(
            "{}'s settings are not a JSON object of flags",
            recipe.name()
        );
    };
    let Value::Object(common) = super::settings_of(args) else {
        unreachable!("the common flags serialise to an object");
    };
    for (name, value) in common {
        let shadowed = all.insert(name.clone(), value);
        assert!(
            shadowed.is_none(),
            "{} has its own flag {name}, a common one",
            recipe.name()
        );
    }
    Value::Object(all)
}

/// A new run's tag: the start time and the process, in hex.
pub(super) fn new_tag() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format!("{secs:x}{:x}", std::process::id() & 0xfff)
}

/// The state named by a `tinker://` URI: its step and its siblings' URIs; with the
/// curves, log lengths and learner counters of `local` (and `true`) when that is the same
/// run's state at the same step. Its attempt counts on from both, so no checkpoint name
/// repeats.
async fn state_from_uri<R: Recipe>(
    conn: &Connection,
    uri: &CheckpointUri,
    recipe: &R,
    local: Option<RunState>,
) -> anyhow::Result<(RunState, bool)> {
    let (step, checkpoints) = sibling_states(&conn.service, uri).await?;
    let (prefix, attempt, _, _) =
        parse_checkpoint_name(&uri.name).expect("sibling_states parsed it");
    let tag = prefix
        .strip_prefix(recipe.name())
        .and_then(|t| t.strip_prefix('-'))
        .ok_or_else(|| anyhow::anyhow!("{uri} was not saved by {}", recipe.name()))?
        .to_string();
    if let Some(other) = local.as_ref().filter(|s| s.tag != tag) {
        anyhow::bail!(
            "--out holds another {} run (tag {}); resume {uri} into its own directory or a new one",
            other.recipe,
            other.tag
        );
    }
    let attempt = local.as_ref().map_or(attempt, |s| s.attempt.max(attempt));
    let same = local.filter(|s| s.completed_steps == step && s.checkpoints == checkpoints);
    let state = RunState {
        recipe: recipe.name().into(),
        tag,
        attempt,
        completed_steps: step,
        settings: same.as_ref().map_or(Value::Null, |s| s.settings.clone()),
        checkpoints,
        curves: same.as_ref().map_or_else(Vec::new, |s| s.curves.clone()),
        metrics_bytes: same.as_ref().map_or(0, |s| s.metrics_bytes),
        samples_bytes: same.as_ref().map_or(0, |s| s.samples_bytes),
        learners: same.as_ref().map_or_else(Vec::new, |s| s.learners.clone()),
    };
    Ok((state, same.is_some()))
}
