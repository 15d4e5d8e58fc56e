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
    /// The run's settings when it started (a JSON object of flags; a string from builds
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

/// What differs between the settings a run was saved with (`then`) and a resume's
/// (`now`), one line per flag (`lr: 0.0005 -> 0.0001`), or `None` when nothing does.
/// Settings saved before they were a JSON object (a string) or not at all are not
/// compared: a line says so.
pub fn changed_settings(then: &Value, now: &Value) -> Option<Vec<String>> {
    let (Value::Object(then), Value::Object(now)) = (then, now) else {
        return match then {
            Value::Null => None,
            _ => Some(vec![
                "(the run's settings were saved by an older build and cannot be compared)".into(),
            ]),
        };
    };
    let absent = Value::String("(absent)".into());
    let mut names: Vec<&String> = then.keys().chain(now.keys()).collect();
    names.sort();
    names.dedup();
    let changes: Vec<String> = names
        .into_iter()
        .filter_map(|name| {
            let (a, b) = (
                then.get(name).unwrap_or(&absent),
                now.get(name).unwrap_or(&absent),
            );
            (a != b).then(|| format!("{name}: {a} -> {b}"))
        })
        .collect();
    (!changes.is_empty()).then_some(changes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn changed_settings_name_each_flag_that_differs() {
        let then = json!({"lr": 0.0005, "group": 4, "loss": "Ppo"});
        assert_eq!(changed_settings(&then, &then.clone()), None);
        let now = json!({"lr": 0.0001, "group": 4, "drills": 2});
        assert_eq!(
            changed_settings(&then, &now).unwrap(),
            vec![
                "drills: \"(absent)\" -> 2",
                "loss: \"Ppo\" -> \"(absent)\"",
                "lr: 0.0005 -> 0.0001"
            ]
        );
        // A run saved by an older build (a string) is not compared; one saved with no
        // settings is not warned about.
        let old = changed_settings(&json!("group=4 seed=0"), &now).unwrap();
        assert!(old[0].contains("older build"), "{old:?}");
        assert_eq!(changed_settings(&Value::Null, &now), None);
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
