//! Run bookkeeping: the output directory, per-step metrics and example episodes as JSON
//! lines, the summary, the held-out curves, a progress bar.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use indicatif::{ProgressBar, ProgressStyle};
use serde_json::Value;

/// Named series of `(step, value)` points: each agent's training reward and loss.
pub type Series = Vec<(String, Vec<(usize, f64)>)>;

/// Adds the point `(step, v)` to the series `name`, creating it.
pub fn push_series(series: &mut Series, name: &str, step: usize, v: f64) {
    match series.iter_mut().find(|(n, _)| n == name) {
        Some((_, pts)) => pts.push((step, v)),
        None => series.push((name.to_string(), vec![(step, v)])),
    }
}

/// Each agent's training reward and loss as the step lines of `metrics.jsonl` hold them
/// (`{"step", "agents": {name: {"reward_mean", "loss"}}}`): what a resumed run plots for
/// the steps before it. A missing file is an empty log.
pub fn agent_series(metrics: &Path) -> anyhow::Result<Series> {
    let mut series = Series::new();
    let text = match std::fs::read_to_string(metrics) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(series),
        Err(e) => return Err(e.into()),
    };
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let v: Value = serde_json::from_str(line)?;
        let (Some(step), Some(agents)) = (v["step"].as_u64(), v["agents"].as_object()) else {
            continue;
        };
        for (name, agent) in agents {
            for (key, field) in [("reward", "reward_mean"), ("loss", "loss")] {
                if let Some(x) = agent[field].as_f64() {
                    push_series(&mut series, &format!("{name} {key}"), step as usize, x);
                }
            }
        }
    }
    Ok(series)
}

/// Where a run writes.
pub struct RunDir {
    /// The directory.
    pub path: PathBuf,
    metrics: Appender,
    samples: Appender,
}

/// How much of a run's two logs belongs to a saved state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LogLengths {
    /// Bytes of `metrics.jsonl`.
    pub metrics: u64,
    /// Bytes of `samples.jsonl`.
    pub samples: u64,
}

/// A JSON-lines file appended to and flushed line by line, counting its bytes.
struct Appender {
    file: BufWriter<File>,
    bytes: u64,
}

impl Appender {
    /// Opens `path` cut to its first `keep` bytes (created empty when missing).
    fn open(path: &Path, keep: u64) -> anyhow::Result<Self> {
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(false)
            .open(path)?;
        let len = file.metadata()?.len();
        anyhow::ensure!(
            keep <= len,
            "{} is shorter ({len} bytes) than the saved state says ({keep})",
            path.display()
        );
        file.set_len(keep)?;
        std::io::Seek::seek(&mut file, std::io::SeekFrom::Start(keep))?;
        Ok(Self {
            file: BufWriter::new(file),
            bytes: keep,
        })
    }

    /// Appends one JSON line, flushed so a crash keeps it.
    fn line(&mut self, record: &Value) -> anyhow::Result<()> {
        let mut line = serde_json::to_vec(record)?;
        line.push(b'\n');
        self.file.write_all(&line)?;
        self.file.flush()?;
        self.bytes += line.len() as u64;
        Ok(())
    }
}

impl RunDir {
    /// Opens the run directory `path` (created when missing) with empty logs, or, with
    /// `keep` (a resumed run), its logs cut back to the saved state's lengths and
    /// appended to.
    pub fn open(path: &Path, keep: Option<LogLengths>) -> anyhow::Result<Self> {
        std::fs::create_dir_all(path)?;
        let keep = keep.unwrap_or_default();
        Ok(Self {
            path: path.to_path_buf(),
            metrics: Appender::open(&path.join("metrics.jsonl"), keep.metrics)?,
            samples: Appender::open(&path.join("samples.jsonl"), keep.samples)?,
        })
    }

    /// `out`, or `runs/<recipe>-<unix seconds>/`.
    pub fn path_for(recipe: &str, out: Option<&Path>) -> anyhow::Result<PathBuf> {
        Ok(match out {
            Some(p) => p.to_path_buf(),
            None => {
                let secs = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)?
                    .as_secs();
                PathBuf::from("runs").join(format!("{recipe}-{secs}"))
            }
        })
    }

    /// The logs' lengths so far (everything written is flushed).
    pub fn lengths(&self) -> LogLengths {
        LogLengths {
            metrics: self.metrics.bytes,
            samples: self.samples.bytes,
        }
    }

    /// Appends one JSON line to `metrics.jsonl`.
    pub fn log(&mut self, record: &Value) -> anyhow::Result<()> {
        self.metrics.line(record)
    }

    /// Appends one JSON line to `samples.jsonl`: example episodes, for reading what the
    /// agents actually say.
    pub fn sample(&mut self, record: &Value) -> anyhow::Result<()> {
        self.samples.line(record)
    }

    /// Writes `summary.json`.
    pub fn summary(&self, summary: &Value) -> anyhow::Result<()> {
        std::fs::write(
            self.path.join("summary.json"),
            serde_json::to_string_pretty(summary)?,
        )?;
        Ok(())
    }
}

/// A progress bar over `steps` on stderr.
pub fn progress(steps: usize) -> ProgressBar {
    let bar = ProgressBar::new(steps as u64);
    bar.set_style(
        ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {elapsed_precise} {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar
}

/// Held-out curves: named series of `(step, value)` points.
#[derive(Debug, Default)]
pub struct Curves {
    series: Vec<(String, Vec<(usize, f64)>)>,
}

impl Curves {
    /// Empty curves named `names`, in this order.
    pub fn new(names: &[&str]) -> Self {
        Self {
            series: names.iter().map(|n| (n.to_string(), Vec::new())).collect(),
        }
    }

    /// Curves named `names` holding the points `saved` has for them (as
    /// [`Curves::points`] returned them).
    pub fn with_points(names: &[&str], saved: &[(String, Vec<(usize, f64)>)]) -> Self {
        let mut curves = Self::new(names);
        for (name, pts) in saved {
            for &(step, v) in pts {
                curves.push(name, step, v);
            }
        }
        curves
    }

    /// Every series with its points.
    pub fn points(&self) -> Vec<(String, Vec<(usize, f64)>)> {
        self.series.clone()
    }

    /// Every series, borrowed, for plotting.
    pub fn series(&self) -> Vec<(&str, &[(usize, f64)])> {
        self.series
            .iter()
            .map(|(n, p)| (n.as_str(), p.as_slice()))
            .collect()
    }

    /// Adds a point to `name` (which must be one of the names given to [`Curves::new`]).
    pub fn push(&mut self, name: &str, step: usize, value: f64) {
        if let Some((_, pts)) = self.series.iter_mut().find(|(n, _)| n == name) {
            pts.push((step, value));
        }
    }

    /// The `(first, last)` values of `name` (NaN when it has no point).
    pub fn before_after(&self, name: &str) -> (f64, f64) {
        let pts = self
            .series
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, p)| p.as_slice())
            .unwrap_or_default();
        (
            pts.first().map_or(f64::NAN, |p| p.1),
            pts.last().map_or(f64::NAN, |p| p.1),
        )
    }

    /// `{name: {"before", "after", "curve"}}`.
    pub fn to_json(&self) -> Value {
        let map: serde_json::Map<String, Value> = self
            .series
            .iter()
            .map(|(name, pts)| {
                let (before, after) = self.before_after(name);
                (
                    name.clone(),
                    serde_json::json!({"before": before, "after": after, "curve": pts}),
                )
            })
            .collect();
        Value::Object(map)
    }

    /// Prints the before/after table and where the outputs are.
    pub fn report(&self, run: &RunDir, plotted: bool) {
        let width = self
            .series
            .iter()
            .map(|(n, _)| n.len())
            .max()
            .unwrap_or(6)
            .max(6);
        println!("{:<width$}  before  after", "held-out");
        for (name, _) in &self.series {
            let (before, after) = self.before_after(name);
            println!("{name:<width$}  {before:>6.2}  {after:>5.2}");
        }
        println!("metrics: {}", run.path.join("metrics.jsonl").display());
        println!("summary: {}", run.path.join("summary.json").display());
        if plotted {
            println!("curves:  {}", run.path.join("curves.png").display());
        }
    }
}

/// Mean of `values`, `None` when empty: for a metric that may have nothing to average
/// (a JSON `null`, not a misleading 0).
pub fn mean_of(values: &[f64]) -> Option<f64> {
    (!values.is_empty()).then(|| mean(values))
}

/// Mean of `values` (0 when empty).
pub fn mean(values: &[f64]) -> f64 {
    if values.is_empty() {
        0.0
    } else {
        values.iter().sum::<f64>() / values.len() as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agent_series_come_back_from_the_step_lines() {
        let dir = std::env::temp_dir().join(format!("lathe-series-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("metrics.jsonl");
        std::fs::write(
            &path,
            concat!(
                r#"{"eval":{"acc":0.5},"step":0}"#, "\n",
                r#"{"agents":{"a":{"reward_mean":0.25,"loss":1.5},"b":{"reward_mean":0.5,"loss":null}},"mode":"two-agent","step":1}"#, "\n",
                r#"{"agents":{"b":{"reward_mean":0.75}},"role":"b","update":1}"#, "\n",
                r#"{"agents":{"a":{"reward_mean":0.5,"loss":1.0}},"mode":"two-agent","step":2}"#, "\n",
            ),
        )
        .unwrap();
        let series = agent_series(&path).unwrap();
        assert_eq!(
            series,
            vec![
                ("a reward".to_string(), vec![(1, 0.25), (2, 0.5)]),
                ("a loss".to_string(), vec![(1, 1.5), (2, 1.0)]),
                ("b reward".to_string(), vec![(1, 0.5)]),
            ]
        );
        assert!(agent_series(&dir.join("none.jsonl")).unwrap().is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
