//! Run bookkeeping: the output directory, per-step metrics as JSON lines, the summary,
//! a progress bar.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use indicatif::{ProgressBar, ProgressStyle};
use serde_json::Value;

/// Where a run writes.
pub struct RunDir {
    /// The directory.
    pub path: PathBuf,
    metrics: BufWriter<File>,
    metrics_bytes: u64,
}

impl RunDir {
    /// Creates `out`, or `runs/<recipe>-<unix seconds>/`, with an empty `metrics.jsonl`;
    /// with `keep = Some(n)` (a resumed run) the existing `metrics.jsonl` is kept up to
    /// its first `n` bytes, the lines of the saved steps, and appended to.
    pub fn open(recipe: &str, out: Option<&Path>, keep: Option<u64>) -> anyhow::Result<Self> {
        let path = Self::path_for(recipe, out)?;
        std::fs::create_dir_all(&path)?;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(false)
            .open(path.join("metrics.jsonl"))?;
        let len = file.metadata()?.len();
        let keep = keep.unwrap_or(0);
        anyhow::ensure!(
            keep <= len,
            "metrics.jsonl is shorter ({len} bytes) than the saved state says ({keep})"
        );
        file.set_len(keep)?;
        let mut file = file;
        std::io::Seek::seek(&mut file, std::io::SeekFrom::Start(keep))?;
        Ok(Self {
            path,
            metrics: BufWriter::new(file),
            metrics_bytes: keep,
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

    /// Bytes of `metrics.jsonl` written so far (flushed).
    pub fn metrics_bytes(&self) -> u64 {
        self.metrics_bytes
    }

    /// Appends one JSON line to `metrics.jsonl` (flushed, so a crash keeps it).
    pub fn log(&mut self, record: &Value) -> anyhow::Result<()> {
        let mut line = serde_json::to_vec(record)?;
        line.push(b'\n');
        self.metrics.write_all(&line)?;
        self.metrics.flush()?;
        self.metrics_bytes += line.len() as u64;
        Ok(())
    }

    /// Appends one JSON line to `samples.jsonl`: example rollouts, for reading what the
    /// agents actually say.
    pub fn sample(&self, record: &Value) -> anyhow::Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.path.join("samples.jsonl"))?;
        serde_json::to_writer(&mut f, record)?;
        f.write_all(b"\n")?;
        Ok(())
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

    /// Curves with the points of `points` (as [`Curves::points`] returns them).
    pub fn from_points(points: &[(String, Vec<(usize, f64)>)]) -> Self {
        Self {
            series: points.to_vec(),
        }
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
