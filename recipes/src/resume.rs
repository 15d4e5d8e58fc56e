//! What a run needs to continue exactly: `state.json` in its run directory, written after
//! every saved step, and the checkpoint names that let a bare `tinker://` URI find the
//! rest of its run.
//!
//! Everything random in a recipe (data order, sampling seeds, adapter seeds) is derived
//! from `--seed` and the step number, so the step counter is the whole RNG and data
//! state; the adapters and their Adam moments are in the server's checkpoints.

use std::path::{Path, PathBuf};

use anyhow::Context;
use lathe::types::{CheckpointKind, CheckpointUri};
use lathe::ServiceClient;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::run::LogLengths;

/// The file in a run directory.
pub const STATE_FILE: &str = "state.json";

/// A run's resumable state, as of its last saved step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunState {
    /// The recipe.
    pub recipe: String,
    /// The run's tag: part of every checkpoint name, so a URI finds its siblings.
    pub tag: String,
    /// How many times the run has been resumed (checkpoint names of a resumed run differ
    /// from those the killed one may have left after its last `state.json`).
    pub attempt: u32,
    /// Training steps done (the next step to run).
    pub completed_steps: usize,
    /// The run's settings as of this save (a JSON object of flags; a string from builds
    /// before 2026-11-26), for a warning when a resume differs.
    #[serde(default)]
    pub settings: Value,
    /// Per session label (`A`, `solver`, `shared`, ...): its training state URI.
    pub checkpoints: Vec<(String, String)>,
    /// The held-out curves so far.
    pub curves: Vec<(String, Vec<(usize, f64)>)>,
    /// Bytes of `metrics.jsonl` written up to this state (lines after it are dropped on
    /// resume: they belong to steps that will run again).
    pub metrics_bytes: u64,
    /// Bytes of `samples.jsonl` written up to this state.
    #[serde(default)]
    pub samples_bytes: u64,
    /// Per queued role: its learner's counters (its queue was drained before the save, so
    /// no reply was lost).
    #[serde(default)]
    pub learners: Vec<LearnerState>,
}

/// A queued role's learner, as saved.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LearnerState {
    /// The role.
    pub role: String,
    /// Its updates so far.
    pub updates: u64,
    /// Its position in its own environments' sequence ([`crate::rl::Recipe::learner_envs`]).
    pub cursor: usize,
}

impl RunState {
    /// The saved logs' lengths.
    pub fn log_lengths(&self) -> LogLengths {
        LogLengths {
            metrics: self.metrics_bytes,
            samples: self.samples_bytes,
        }
    }
}

impl RunState {
    /// Reads `dir/state.json`.
    pub fn read(dir: &Path) -> anyhow::Result<Self> {
        let path = dir.join(STATE_FILE);
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("cannot resume: no {}", path.display()))?;
        serde_json::from_str(&text)
            .with_context(|| format!("{} is not a run state", path.display()))
    }

    /// Writes `dir/state.json` atomically (a kill leaves the old state or the new one).
    pub fn write(&self, dir: &Path) -> anyhow::Result<()> {
        let tmp = dir.join(format!("{STATE_FILE}.tmp"));
        std::fs::write(&tmp, serde_json::to_string_pretty(self)?)?;
        std::fs::rename(&tmp, dir.join(STATE_FILE))?;
        Ok(())
    }
}

/// The name of a saved step's checkpoint: `<recipe>-<tag>-a<attempt>-s<step>-<label>`.
pub fn checkpoint_name(recipe: &str, tag: &str, attempt: u32, step: usize, label: &str) -> String {
    format!("{recipe}-{tag}-a{attempt}-s{step:06}-{label}")
}

/// The parts of a [`checkpoint_name`]: `(recipe-tag prefix, attempt, step, label)`.
pub fn parse_checkpoint_name(name: &str) -> Option<(&str, u32, usize, &str)> {
    let (head, label) = name.rsplit_once('-')?;
    let (head, step) = head.rsplit_once('-')?;
    let (prefix, attempt) = head.rsplit_once('-')?;
    let step = step.strip_prefix('s')?.parse().ok()?;
    let attempt = attempt.strip_prefix('a')?.parse().ok()?;
    Some((prefix, attempt, step, label))
}

/// Where `--resume` points.
#[derive(Debug, Clone, PartialEq)]
pub enum ResumeFrom {
    /// A run directory with a `state.json`.
    Dir(PathBuf),
    /// One of a run's training-state checkpoints.
    Uri(CheckpointUri),
}

impl std::str::FromStr for ResumeFrom {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s.starts_with("tinker://") {
            let uri: CheckpointUri = s.parse()?;
            if uri.kind != CheckpointKind::Training {
                return Err(format!(
                    "{s} is sampler weights; resume needs a training state (tinker://<run>/weights/<name>)"
                ));
            }
            Ok(Self::Uri(uri))
        } else {
            Ok(Self::Dir(PathBuf::from(s)))
        }
    }
}

/// The training-state URIs saved with `uri` (the same run, attempt and step), by session
/// label, found in the caller's checkpoint listing.
pub async fn sibling_states(
    service: &ServiceClient,
    uri: &CheckpointUri,
) -> anyhow::Result<(usize, Vec<(String, String)>)> {
    let (prefix, attempt, step, _) = parse_checkpoint_name(&uri.name).with_context(|| {
        format!(
            "{uri} was not saved by a recipe (names look like <recipe>-<tag>-a<attempt>-s<step>-<role>)"
        )
    })?;
    let rest = service.create_rest_client();
    let mut found = Vec::new();
    let page = 100;
    for offset in (0..).step_by(page) {
        let listing = rest.list_user_checkpoints(page, offset).await?;
        let n = listing.checkpoints.len();
        for c in listing.checkpoints {
            let Ok(other) = c.tinker_path.parse::<CheckpointUri>() else {
                continue;
            };
            if other.kind != CheckpointKind::Training {
                continue;
            }
            if let Some((p, a, s, label)) = parse_checkpoint_name(&other.name) {
                if (p, a, s) == (prefix, attempt, step) {
                    found.push((label.to_string(), other.to_string()));
                }
            }
        }
        if n < page {
            break;
        }
    }
    found.sort();
    found.dedup();
    anyhow::ensure!(
        found.iter().any(|(_, u)| *u == uri.to_string()),
        "{uri} is not among your checkpoints (with the embedded server, pass the run's directory as --out: its checkpoints live there)"
    );
    if let Some(w) = found.windows(2).find(|w| w[0].0 == w[1].0) {
        anyhow::bail!(
            "two checkpoints of {uri}'s run and step are labelled {}: {} and {}; resume from the run directory instead",
            w[0].0,
            w[0].1,
            w[1].1
        );
    }
    Ok((step, found))
}

/// How a resume's settings compare with those the run was saved with.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SettingsCheck {
    /// Flags with another value now, one line each (`lr: 0.0005 -> 0.0001`): the run
    /// will not continue exactly.
    pub changed: Vec<String>,
    /// What could not be compared: flags the saving build did not have (their value now),
    /// flags it had that this build lacks, or settings from before they were recorded
    /// flag by flag.
    pub notes: Vec<String>,
}

/// Compares the settings a run was saved with (`then`, the JSON object of its flags)
/// with a resume's (`now`). A flag only one of them has is a note, not a change: a build
/// that added a flag (at its default) still continues a run saved before it exactly.
/// Settings saved as a string (builds before 2026-11-26) are not compared; none saved
/// (`null`) gives nothing to say.
pub fn changed_settings(then: &Value, now: &Value) -> SettingsCheck {
    let mut check = SettingsCheck::default();
    let (Value::Object(then), Value::Object(now)) = (then, now) else {
        if !then.is_null() {
            check.notes.push(
                "the run's settings were saved by an earlier build and cannot be compared".into(),
            );
        }
        return check;
    };
    let mut names: Vec<&String> = then.keys().chain(now.keys()).collect();
    names.sort();
    names.dedup();
    for name in names {
        match (then.get(name), now.get(name)) {
            (Some(a), Some(b)) if a != b => check.changed.push(format!("{name}: {a} -> {b}")),
            (None, Some(b)) => check
                .notes
                .push(format!("{name} is new since the run was saved (now {b})")),
            (Some(a), None) => check
                .notes
                .push(format!("{name} (then {a}) is not a flag of this build")),
            _ => {}
        }
    }
    check
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn changed_settings_name_each_flag_that_differs() {
        let then = json!({"lr": 0.0005, "group": 4, "loss": "ppo"});
        assert_eq!(
            changed_settings(&then, &then.clone()),
            SettingsCheck::default()
        );
        let now = json!({"lr": 0.0001, "group": 4, "drills": 2});
        let check = changed_settings(&then, &now);
        assert_eq!(check.changed, vec!["lr: 0.0005 -> 0.0001"]);
        // A flag only one side has is a note, not a change.
        assert_eq!(
            check.notes,
            vec![
                "drills is new since the run was saved (now 2)",
                "loss (then \"ppo\") is not a flag of this build"
            ]
        );
        // A run saved by an earlier build (a string) is not compared; one saved with no
        // settings gives nothing to say.
        let old = changed_settings(&json!("group=4 seed=0"), &now);
        assert!(
            old.changed.is_empty() && old.notes[0].contains("earlier build"),
            "{old:?}"
        );
        assert_eq!(
            changed_settings(&Value::Null, &now),
            SettingsCheck::default()
        );
    }

    #[test]
    fn checkpoint_names_round_trip() {
        let name = checkpoint_name("multi_agent_math", "1764-ab12", 2, 40, "A");
        assert_eq!(name, "multi_agent_math-1764-ab12-a2-s000040-A");
        assert_eq!(
            parse_checkpoint_name(&name),
            Some(("multi_agent_math-1764-ab12", 2, 40, "A"))
        );
        assert_eq!(parse_checkpoint_name("final"), None);
        assert_eq!(parse_checkpoint_name("x-y-a1-sQ-A"), None);
    }

    #[test]
    fn resume_targets_parse() {
        assert_eq!(
            "runs/x".parse::<ResumeFrom>(),
            Ok(ResumeFrom::Dir("runs/x".into()))
        );
        assert!(matches!(
            "tinker://r:train:0/weights/n".parse::<ResumeFrom>(),
            Ok(ResumeFrom::Uri(_))
        ));
        let err = "tinker://r:train:0/sampler_weights/n"
            .parse::<ResumeFrom>()
            .unwrap_err();
        assert!(err.contains("training state"), "{err}");
    }

    #[test]
    fn state_writes_atomically_and_reads_back() {
        let dir = std::env::temp_dir().join(format!("lathe-state-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let state = RunState {
            recipe: "r".into(),
            tag: "t".into(),
            attempt: 1,
            completed_steps: 4,
            settings: json!({"group": 4}),
            checkpoints: vec![("A".into(), "tinker://x/weights/y".into())],
            curves: vec![("acc".into(), vec![(0, 0.25)])],
            metrics_bytes: 10,
            samples_bytes: 20,
            learners: vec![LearnerState {
                role: "patient".into(),
                updates: 3,
                cursor: 7,
            }],
        };
        state.write(&dir).unwrap();
        assert_eq!(RunState::read(&dir).unwrap(), state);
        assert!(!dir.join("state.json.tmp").exists());
        std::fs::remove_dir_all(dir).unwrap();
    }
}
