//! Wire types of MinT's extensions (`mindlab-toolkit` 0.2.0, `mint/_mintx.py`), served
//! by Lathe so that MinT users lose nothing.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{ModelInput, TensorData};

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

/// One datum of MinT's reverse-KL step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReverseKlDatum {
    /// The student's prompt.
    pub student_input: ModelInput,
    /// The reference's prompt.
    pub reference_input: ModelInput,
    /// The completion both prompts continue with.
    pub target_tokens: TensorData,
    /// One weight per completion token.
    pub weights: TensorData,
}

/// `POST /api/v1/mint/forward_backward_reverse_kl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ForwardBackwardReverseKlRequest {
    /// The training run (the student).
    pub model_id: String,
    /// The reference: a `tinker://` checkpoint, or the base model's name.
    pub reference_model_path: String,
    /// The datums.
    pub data: Vec<ReverseKlDatum>,
    /// Softmax temperature of both distributions.
    #[serde(default = "one")]
    pub temperature: f64,
    /// The run's operation number, or `None` (MinT's default): then the step takes no
    /// number and runs at the run's next turn.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq_id: Option<u64>,
}

fn one() -> f64 {
    1.0
}

/// One datum's output.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReverseKlItemOutput {
    /// The datum's loss, one value.
    pub loss: TensorData,
}

/// The reverse-KL step's result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ForwardBackwardReverseKlResponse {
    /// One per datum.
    pub outputs: Vec<ReverseKlItemOutput>,
    /// `loss:mean`, `reverse_kl:mean`, `num_samples:sum`, `num_tokens:sum`.
    pub metrics: BTreeMap<String, f64>,
    /// `mint_forward_backward_reverse_kl`.
    #[serde(rename = "type")]
    pub kind: String,
}
