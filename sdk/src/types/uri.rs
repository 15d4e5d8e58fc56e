//! `tinker://<run>/<kind>/<name>` checkpoint URIs.

use std::fmt;
use std::str::FromStr;

/// The two kinds of checkpoint a training run saves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CheckpointKind {
    /// Adapter and optimizer state (`weights/<name>`), loadable by `load_state`.
    Training,
    /// Adapter only (`sampler_weights/<name>`), for sampling.
    Sampler,
}

impl CheckpointKind {
    /// The URI path segment: `weights` or `sampler_weights`.
    pub fn segment(self) -> &'static str {
        match self {
            CheckpointKind::Training => "weights",
            CheckpointKind::Sampler => "sampler_weights",
        }
    }

    /// The REST `checkpoint_type`: `training` or `sampler`.
    pub fn type_name(self) -> &'static str {
        match self {
            CheckpointKind::Training => "training",
            CheckpointKind::Sampler => "sampler",
        }
    }

    /// Parses a URI segment (`weights` / `sampler_weights`).
    pub fn from_segment(s: &str) -> Option<Self> {
        match s {
            "weights" => Some(CheckpointKind::Training),
            "sampler_weights" => Some(CheckpointKind::Sampler),
            _ => None,
        }
    }
}

/// Longest checkpoint name accepted.
pub const MAX_CHECKPOINT_NAME_LEN: usize = 128;

/// Checks a checkpoint name: non-empty, at most [`MAX_CHECKPOINT_NAME_LEN`] bytes, no
/// `/`, no `..`, no control characters — it becomes a directory name on the server.
pub fn validate_checkpoint_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("checkpoint name must not be empty".into());
    }
    if name.len() > MAX_CHECKPOINT_NAME_LEN {
        return Err(format!(
            "checkpoint name is {} bytes; the limit is {MAX_CHECKPOINT_NAME_LEN}",
            name.len()
        ));
    }
    if name.contains('/') || name.contains('\\') || name.contains("..") || name.starts_with('.') {
        return Err(format!(
            "checkpoint name {name:?} must not contain '/', '\\' or '..' nor start with '.'"
        ));
    }
    if name.chars().any(char::is_control) {
        return Err("checkpoint name must not contain control characters".into());
    }
    Ok(())
}

/// A parsed checkpoint URI, `tinker://<training_run_id>/<weights|sampler_weights>/<name>`.
/// The run id may contain `:` (`<session>:train:0`); the name may not contain `/`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CheckpointUri {
    /// The training run that saved it.
    pub run_id: String,
    /// Training state or sampler weights.
    pub kind: CheckpointKind,
    /// The name given at save time.
    pub name: String,
}

impl CheckpointUri {
    /// The REST checkpoint id, `weights/<name>` or `sampler_weights/<name>`.
    pub fn checkpoint_id(&self) -> String {
        format!("{}/{}", self.kind.segment(), self.name)
    }
}

impl fmt::Display for CheckpointUri {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tinker://{}/{}", self.run_id, self.checkpoint_id())
    }
}

impl FromStr for CheckpointUri {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let rest = s
            .strip_prefix("tinker://")
            .ok_or_else(|| format!("checkpoint URI {s:?} must start with tinker://"))?;
        // At most four pieces: a path of thousands of slashes must not become a list.
        let parts: Vec<&str> = rest.splitn(4, '/').collect();
        let [run_id, kind, name] = parts[..] else {
            return Err(format!(
                "checkpoint URI {s:?} must be tinker://<run>/<weights|sampler_weights>/<name>"
            ));
        };
        if run_id.is_empty() {
            return Err(format!("checkpoint URI {s:?} has an empty run id"));
        }
        let kind = CheckpointKind::from_segment(kind).ok_or_else(|| {
            format!("checkpoint URI {s:?}: kind must be weights or sampler_weights, got {kind:?}")
        })?;
        validate_checkpoint_name(name).map_err(|e| format!("checkpoint URI {s:?}: {e}"))?;
        Ok(Self {
            run_id: run_id.to_string(),
            kind,
            name: name.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uri_round_trips_with_colons_in_the_run_id() {
        let uri: CheckpointUri = "tinker://s1:train:0/weights/step-3".parse().unwrap();
        assert_eq!(uri.run_id, "s1:train:0");
        assert_eq!(uri.kind, CheckpointKind::Training);
        assert_eq!(uri.name, "step-3");
        assert_eq!(uri.to_string(), "tinker://s1:train:0/weights/step-3");
        let s: CheckpointUri = "tinker://r/sampler_weights/x".parse().unwrap();
        assert_eq!(s.checkpoint_id(), "sampler_weights/x");
    }

    #[test]
    fn bad_uris_are_rejected() {
        for bad in [
            "http://r/weights/x",
            "tinker://r/weights",
            "tinker://r/other/x",
            "tinker://r/weights/a/b",
            "tinker:///weights/x",
            "tinker://r/weights/..",
            "tinker://r/weights/",
        ] {
            assert!(bad.parse::<CheckpointUri>().is_err(), "{bad}");
        }
    }

    #[test]
    fn names_are_checked() {
        assert!(validate_checkpoint_name("ok-name_1.2").is_ok());
        assert!(validate_checkpoint_name(&"x".repeat(129)).is_err());
        assert!(validate_checkpoint_name("a/b").is_err());
        assert!(validate_checkpoint_name("a..b").is_err());
    }
}
