//! Wire types of MinT's extensions (`mindlab-toolkit` 0.2.0, `mint/_mintx.py`), served
//! by Lathe so that MinT users lose nothing.

use serde::{Deserialize, Serialize};

/// `POST /api/v1/mint/checkpoints/interpolate`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InterpolateCheckpointsRequest {
    /// `tinker://` checkpoints to sum (training or sampler weights), at least two.
    pub source_paths: Vec<String>,
    /// One finite coefficient per source.
    pub coefficients: Vec<f64>,
    /// The new checkpoint's name (default `mintx-<12 hex>`), saved under the first
    /// source's run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_path: Option<String>,
    /// `sampler`, the only kind MinT defines.
    #[serde(default = "sampler")]
    pub output_checkpoint_type: String,
}

fn sampler() -> String {
    "sampler".into()
}

/// Its result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InterpolateCheckpointsResponse {
    /// The new checkpoint's `tinker://` path.
    pub path: String,
    /// `sampler`.
    pub checkpoint_type: String,
    /// The sources, as asked.
    pub source_paths: Vec<String>,
    /// Their coefficients.
    pub coefficients: Vec<f64>,
    /// Always false (Lathe does not shard adapters by rank).
    pub has_rank_shards: bool,
    /// `mint_interpolate_checkpoints`.
    #[serde(rename = "type")]
    pub kind: String,
}
