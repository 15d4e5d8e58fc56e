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
}

impl RunDir {
    /// Creates `out`, or `runs/<recipe>-<unix seconds>/`.
    pub fn create(recipe: &str, out: Option<&Path>) -> anyhow::Result<Self> {
        let path = match out {
            Some(p) => p.to_path_buf(),
            None => {
                let secs = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)?
                    .as_secs();
                PathBuf::from("runs").join(format!("{recipe}-{secs}"))
            }
        };
        std::fs::create_dir_all(&path)?;
        let metrics = BufWriter::new(File::create(path.join("metrics.jsonl"))?);
        Ok(Self { path, metrics })
    }

    /// Appends one JSON line to `metrics.jsonl` (flushed, so a crash keeps it).
    pub fn log(&mut self, record: &Value) -> anyhow::Result<()> {
        serde_json::to_writer(&mut self.metrics, record)?;
        self.metrics.write_all(b"\n")?;
        self.metrics.flush()?;
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
