//! Data carried inside requests: tensors, model inputs, datums, hyper-parameters.
//!
//! Field names and defaults follow the official Python SDK (`tinker` 0.22), which
//! serialises with `exclude_none`: an absent field and `null` mean the same thing, so every
//! optional field here is an `Option` skipped when `None`. Unknown fields are ignored on
//! input, because newer SDKs add fields.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// A tensor as it travels on the wire: a flat row-major array plus an optional shape.
/// `int64` values are written as JSON integers, as the Python SDK writes them.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct TensorData {
    /// The flattened values (non-zero values only when the sparse indices are present).
    pub data: Vec<f64>,
    /// `"int64"` or `"float32"`.
    pub dtype: TensorDtype,
    /// Dense shape; absent means one-dimensional.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shape: Option<Vec<usize>>,
    /// CSR row pointers, when the SDK chose the sparse encoding for a 2-D tensor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sparse_crow_indices: Option<Vec<i64>>,
    /// CSR column indices, paired with `sparse_crow_indices`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sparse_col_indices: Option<Vec<i64>>,
}

impl Serialize for TensorData {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;

        /// The values, as integers for an `int64` tensor.
        struct Values<'a>(&'a [f64], TensorDtype);
        impl Serialize for Values<'_> {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                match self.1 {
                    TensorDtype::Int64 => {
                        if let Some(v) = self.0.iter().find(|v| !is_int64(**v)) {
                            return Err(serde::ser::Error::custom(format!(
                                "an int64 tensor holds {v}, which is not an integer"
                            )));
                        }
                        s.collect_seq(self.0.iter().map(|&v| v as i64))
                    }
                    TensorDtype::Float32 => s.collect_seq(self.0),
                }
            }
        }

        let optional = [
            self.shape.is_some(),
            self.sparse_crow_indices.is_some(),
            self.sparse_col_indices.is_some(),
        ];
        let len = 2 + optional.iter().filter(|&&b| b).count();
        let mut st = serializer.serialize_struct("TensorData", len)?;
        st.serialize_field("data", &Values(&self.data, self.dtype))?;
        st.serialize_field("dtype", &self.dtype)?;
        if let Some(shape) = &self.shape {
            st.serialize_field("shape", shape)?;
        }
        if let Some(crow) = &self.sparse_crow_indices {
            st.serialize_field("sparse_crow_indices", crow)?;
        }
        if let Some(col) = &self.sparse_col_indices {
            st.serialize_field("sparse_col_indices", col)?;
        }
        st.end()
    }
}

/// Whether `v` is an integer an `int64` tensor can hold exactly.
pub fn is_int64(v: f64) -> bool {
    v.fract() == 0.0 && v >= i64::MIN as f64 && v < i64::MAX as f64
}

/// The element types the Tinker SDK sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TensorDtype {
    /// 64-bit integers (token ids).
    Int64,
    /// 32-bit floats (weights, advantages, log-probabilities).
    Float32,
}

impl TensorData {
    /// A one-dimensional `int64` tensor.
    pub fn int64(values: Vec<i64>) -> Self {
        Self::dense(
            values.into_iter().map(|v| v as f64).collect(),
            TensorDtype::Int64,
        )
    }

    /// A one-dimensional `float32` tensor.
    pub fn float32(values: Vec<f32>) -> Self {
        Self::dense(
            values.into_iter().map(f64::from).collect(),
            TensorDtype::Float32,
        )
    }

    fn dense(data: Vec<f64>, dtype: TensorDtype) -> Self {
        Self {
            data,
            dtype,
            shape: None,
            sparse_crow_indices: None,
            sparse_col_indices: None,
        }
    }

    /// The dense shape (one-dimensional when the wire gave none).
    pub fn dims(&self) -> Vec<usize> {
        self.shape.clone().unwrap_or_else(|| vec![self.data.len()])
    }

    /// How many elements the declared shape holds, or `None` when the product of its
    /// dimensions overflows `usize`. This is what [`to_dense`](Self::to_dense) would
    /// allocate: a receiver checks it against its own bounds before expanding.
    pub fn num_elements(&self) -> Option<usize> {
        match &self.shape {
            None => Some(self.data.len()),
            Some(dims) => dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)),
        }
    }

    /// The values as a dense row-major array, expanding the sparse CSR form if used.
    ///
    /// Fails with a message, before allocating anything, when the declared shape
    /// disagrees with the data: a dense tensor whose shape does not hold exactly its
    /// values, a shape whose size overflows, or sparse indices inconsistent with the
    /// shape. A sparse tensor expands to `num_elements()` values, which the data does not
    /// bound: callers that take tensors from untrusted peers must check
    /// [`num_elements`](Self::num_elements) first.
    pub fn to_dense(&self) -> Result<Vec<f64>, String> {
        let dims = self.dims();
        let size = self
            .num_elements()
            .ok_or_else(|| format!("tensor shape {dims:?} is too large"))?;
        let (Some(crow), Some(col)) = (&self.sparse_crow_indices, &self.sparse_col_indices) else {
            if size != self.data.len() {
                return Err(format!(
                    "tensor shape {dims:?} holds {size} values but {} were sent",
                    self.data.len()
                ));
            }
            return Ok(self.data.clone());
        };
        if dims.len() != 2 {
            return Err(format!("sparse tensor must be 2-D, got shape {dims:?}"));
        }
        let (rows, cols) = (dims[0], dims[1]);
        if rows.checked_add(1) != Some(crow.len()) || col.len() != self.data.len() {
            return Err("sparse tensor indices do not match its shape".into());
        }
        // Check every index before allocating the dense array.
        for r in 0..rows {
            let (lo, hi) = (crow[r], crow[r + 1]);
            if lo < 0 || hi < lo || hi as u64 > col.len() as u64 {
                return Err("sparse tensor row pointers are not monotone".into());
            }
            if let Some(c) = col[lo as usize..hi as usize]
                .iter()
                .find(|&&c| c < 0 || c as u64 >= cols as u64)
            {
                return Err(format!("sparse column index {c} out of range"));
            }
        }
        let mut dense = vec![0.0; size];
        for r in 0..rows {
            let (lo, hi) = (crow[r] as usize, crow[r + 1] as usize);
            for (&c, &value) in col[lo..hi].iter().zip(&self.data[lo..hi]) {
                dense[r * cols + c as usize] = value;
            }
        }
        Ok(dense)
    }
}

/// One chunk of a model input.
///
/// Decoded through [`RawChunk`], every variant's fields in one struct, rather than as
/// an internally tagged enum: serde buffers an internally tagged value as a tree of
/// 32-byte nodes before it reads the tag (the tag may come last, as Python clients
/// write it), many times the bytes of a chunk of token ids.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", try_from = "RawChunk")]
pub enum ModelInputChunk {
    /// Token ids.
    EncodedText {
        /// The token ids of this chunk.
        tokens: Vec<i64>,
    },
    /// An inline image (not supported by text-only base models; kept so such requests
    /// parse and get a clear error instead of a decode failure).
    Image {
        /// Base64 image bytes.
        data: String,
        /// `png` or `jpeg`.
        format: String,
        /// How many tokens the client expects the image to take.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        expected_tokens: Option<i64>,
    },
    /// A pointer to an image stored elsewhere.
    ImageAssetPointer {
        /// Where the image is.
        location: String,
        /// `png` or `jpeg`.
        format: String,
        /// How many tokens the client expects the image to take.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        expected_tokens: Option<i64>,
    },
}

/// A chunk as it comes off the wire: the tag and every variant's fields.
#[derive(Deserialize)]
struct RawChunk {
    #[serde(rename = "type")]
    kind: String,
    tokens: Option<Vec<i64>>,
    data: Option<String>,
    location: Option<String>,
    format: Option<String>,
    expected_tokens: Option<i64>,
}

impl TryFrom<RawChunk> for ModelInputChunk {
    type Error = String;

    fn try_from(raw: RawChunk) -> Result<Self, String> {
        let missing = |field: &str| format!("a {} chunk needs `{field}`", raw.kind);
        Ok(match raw.kind.as_str() {
            "encoded_text" => ModelInputChunk::EncodedText {
                tokens: raw.tokens.ok_or_else(|| missing("tokens"))?,
            },
            "image" => ModelInputChunk::Image {
                data: raw.data.ok_or_else(|| missing("data"))?,
                format: raw.format.ok_or_else(|| missing("format"))?,
                expected_tokens: raw.expected_tokens,
            },
            "image_asset_pointer" => ModelInputChunk::ImageAssetPointer {
                location: raw.location.ok_or_else(|| missing("location"))?,
                format: raw.format.ok_or_else(|| missing("format"))?,
                expected_tokens: raw.expected_tokens,
            },
            other => {
                return Err(format!(
                    "unknown chunk type {other:?}, expected encoded_text, image or \
                     image_asset_pointer"
                ))
            }
        })
    }
}

/// The tokens a model reads, as a list of chunks.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ModelInput {
    /// The chunks, concatenated in order.
    pub chunks: Vec<ModelInputChunk>,
}

impl ModelInput {
    /// A model input made of one chunk of token ids.
    pub fn from_ints(tokens: Vec<i64>) -> Self {
        Self {
            chunks: vec![ModelInputChunk::EncodedText { tokens }],
        }
    }

    /// All token ids, concatenated; `None` if a chunk is not text.
    pub fn to_ints(&self) -> Option<Vec<i64>> {
        let mut out = Vec::new();
        for chunk in &self.chunks {
            match chunk {
                ModelInputChunk::EncodedText { tokens } => out.extend_from_slice(tokens),
                _ => return None,
            }
        }
        Some(out)
    }

    /// Number of positions (token chunks only; images count their expected tokens),
    /// saturating: `expected_tokens` comes from the wire, and a sum that would overflow
    /// is too long for any model anyway.
    pub fn length(&self) -> usize {
        self.chunks
            .iter()
            .map(|c| match c {
                ModelInputChunk::EncodedText { tokens } => tokens.len(),
                ModelInputChunk::Image {
                    expected_tokens, ..
                }
                | ModelInputChunk::ImageAssetPointer {
                    expected_tokens, ..
                } => usize::try_from(expected_tokens.unwrap_or(0).max(0)).unwrap_or(usize::MAX),
            })
            .fold(0usize, usize::saturating_add)
    }
}

/// One training example: the input and the per-position loss inputs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Datum {
    /// The tokens the model reads; position `i` predicts `target_tokens[i]`.
    pub model_input: ModelInput,
    /// Loss inputs by name: `target_tokens`, `weights`, `advantages`, `logprobs`, ...
    pub loss_fn_inputs: BTreeMap<String, TensorData>,
}

impl Datum {
    /// A supervised example that teaches `completion` after `prompt`: the model reads
    /// `prompt + completion` (minus the last token) and is scored, with weight 1, only on
    /// the completion's tokens.
    pub fn supervised(prompt: &[i64], completion: &[i64]) -> Self {
        let ids: Vec<i64> = prompt.iter().chain(completion).copied().collect();
        let n = ids.len().saturating_sub(1);
        let weights = (1..=n)
            .map(|i| if i >= prompt.len() { 1.0 } else { 0.0 })
            .collect();
        Self::cross_entropy(
            ModelInput::from_ints(ids[..n].to_vec()),
            ids[1..].to_vec(),
            weights,
        )
    }

    /// A supervised example for the `cross_entropy` loss.
    pub fn cross_entropy(model_input: ModelInput, targets: Vec<i64>, weights: Vec<f32>) -> Self {
        let mut inputs = BTreeMap::new();
        inputs.insert("target_tokens".to_string(), TensorData::int64(targets));
        inputs.insert("weights".to_string(), TensorData::float32(weights));
        Self {
            model_input,
            loss_fn_inputs: inputs,
        }
    }
}

/// The built-in losses, with Tinker's semantics (plain sums, no normalisation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossFn {
    /// `-sum w * logp`.
    CrossEntropy,
    /// `-sum exp(logp - q) * A`.
    ImportanceSampling,
    /// Clipped surrogate objective.
    Ppo,
    /// Clipped importance-sampling policy optimisation (stop-gradient on the ratio).
    Cispo,
    /// Direct reward optimisation with a quadratic penalty.
    Dro,
    /// Group sequence policy optimisation (GSPO-token): PPO's clipping on each datum's
    /// sequence ratio, over the positions `sequence_ratio_mask` marks.
    Gspo,
}

impl LossFn {
    /// The wire name, e.g. `"cross_entropy"`.
    pub fn as_str(self) -> &'static str {
        match self {
            LossFn::CrossEntropy => "cross_entropy",
            LossFn::ImportanceSampling => "importance_sampling",
            LossFn::Ppo => "ppo",
            LossFn::Cispo => "cispo",
            LossFn::Dro => "dro",
            LossFn::Gspo => "gspo",
        }
    }
}

/// AdamW hyper-parameters, with the Tinker SDK's defaults.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AdamParams {
    /// Step size.
    #[serde(default = "default_lr")]
    pub learning_rate: f64,
    /// First-moment decay.
    #[serde(default = "default_beta1")]
    pub beta1: f64,
    /// Second-moment decay.
    #[serde(default = "default_beta2")]
    pub beta2: f64,
    /// Denominator epsilon.
    #[serde(default = "default_eps")]
    pub eps: f64,
    /// Decoupled weight decay (as `torch.optim.AdamW`).
    #[serde(default)]
    pub weight_decay: f64,
    /// Global-norm gradient clipping; 0 disables it.
    #[serde(default)]
    pub grad_clip_norm: f64,
}

fn default_lr() -> f64 {
    1e-4
}
fn default_beta1() -> f64 {
    0.9
}
fn default_beta2() -> f64 {
    0.95
}
fn default_eps() -> f64 {
    1e-12
}

impl Default for AdamParams {
    fn default() -> Self {
        Self {
            learning_rate: default_lr(),
            beta1: default_beta1(),
            beta2: default_beta2(),
            eps: default_eps(),
            weight_decay: 0.0,
            grad_clip_norm: 0.0,
        }
    }
}

/// Which projections of the base model get an adapter, and its rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoraConfig {
    /// Adapter rank.
    pub rank: usize,
    /// Seed for the random initialisation of the A matrices.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// Adapt the output projection (lm_head).
    #[serde(default)]
    pub train_unembed: bool,
    /// Adapt gate, up and down projections.
    #[serde(default = "yes")]
    pub train_mlp: bool,
    /// Adapt q, k, v and o projections.
    #[serde(default = "yes")]
    pub train_attn: bool,
}

fn yes() -> bool {
    true
}

impl Default for LoraConfig {
    fn default() -> Self {
        Self {
            rank: 32,
            seed: None,
            train_unembed: true,
            train_mlp: true,
            train_attn: true,
        }
    }
}

/// Stop conditions: a string, several strings, or several token ids.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum StopCondition {
    /// One stop string.
    Text(String),
    /// Several stop strings.
    Texts(Vec<String>),
    /// Stop token ids.
    Tokens(Vec<i64>),
}

/// How to sample.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// Maximum number of new tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<usize>,
    /// Seed for reproducible sampling.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// Where to stop.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<StopCondition>,
    /// Softmax temperature; 0 is greedy.
    #[serde(default = "one")]
    pub temperature: f64,
    /// Keep the k most likely tokens; -1 keeps all.
    #[serde(default = "minus_one")]
    pub top_k: i64,
    /// Nucleus sampling mass, in (0, 1].
    #[serde(default = "one")]
    pub top_p: f64,
}

fn one() -> f64 {
    1.0
}
fn minus_one() -> i64 {
    -1
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            max_tokens: None,
            seed: None,
            stop: None,
            temperature: 1.0,
            top_k: -1,
            top_p: 1.0,
        }
    }
}

/// Why a sampled sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// A stop string or token was produced.
    Stop,
    /// `max_tokens` was reached.
    Length,
}

/// One sampled continuation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SampledSequence {
    /// Why it ended.
    pub stop_reason: StopReason,
    /// The new tokens (including a stop token, as Tinker does).
    pub tokens: Vec<i64>,
    /// Log-probability of each new token under the sampling weights.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<Vec<f64>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Image chunks' declared sizes from the wire saturate instead of overflowing.
    #[test]
    fn a_model_inputs_length_saturates() {
        let image = |n: i64| ModelInputChunk::ImageAssetPointer {
            location: "x".into(),
            format: "png".into(),
            expected_tokens: Some(n),
        };
        let input = ModelInput {
            chunks: vec![
                ModelInputChunk::EncodedText { tokens: vec![1, 2] },
                image(i64::MAX),
                image(i64::MAX),
                image(-5),
            ],
        };
        assert_eq!(input.length(), usize::MAX);
        let small = ModelInput {
            chunks: vec![
                ModelInputChunk::EncodedText { tokens: vec![1, 2] },
                image(3),
            ],
        };
        assert_eq!(small.length(), 5);
    }

    #[test]
    fn sparse_tensor_expands_to_dense() {
        let t = TensorData {
            data: vec![5.0, 7.0],
            dtype: TensorDtype::Float32,
            shape: Some(vec![2, 3]),
            sparse_crow_indices: Some(vec![0, 1, 2]),
            sparse_col_indices: Some(vec![2, 0]),
        };
        assert_eq!(t.to_dense().unwrap(), vec![0.0, 0.0, 5.0, 7.0, 0.0, 0.0]);
    }

    #[test]
    fn bad_sparse_indices_are_an_error() {
        let t = TensorData {
            data: vec![5.0],
            dtype: TensorDtype::Float32,
            shape: Some(vec![1, 3]),
            sparse_crow_indices: Some(vec![0, 1]),
            sparse_col_indices: Some(vec![9]),
        };
        assert!(t.to_dense().is_err());
    }

    #[test]
    fn shapes_that_disagree_with_the_data_are_refused_before_allocating() {
        // The 600-byte request that once aborted the server: a sparse [1, 2^50] target
        // with no values. `num_elements` lets a receiver refuse it; `to_dense` of an
        // overflowing shape refuses by itself.
        let huge = TensorData {
            data: vec![],
            dtype: TensorDtype::Int64,
            shape: Some(vec![1, 1 << 50]),
            sparse_crow_indices: Some(vec![0, 0]),
            sparse_col_indices: Some(vec![]),
        };
        assert_eq!(huge.num_elements(), Some(1 << 50));
        let overflow = TensorData {
            shape: Some(vec![1 << 40, 1 << 40]),
            ..huge.clone()
        };
        assert_eq!(overflow.num_elements(), None);
        assert!(overflow.to_dense().unwrap_err().contains("too large"));
        let dense = TensorData {
            data: vec![1.0, 2.0],
            dtype: TensorDtype::Float32,
            shape: Some(vec![3]),
            sparse_crow_indices: None,
            sparse_col_indices: None,
        };
        assert!(dense.to_dense().unwrap_err().contains("holds 3 values"));
        let rows_overflow = TensorData {
            shape: Some(vec![usize::MAX, 1]),
            ..huge
        };
        assert!(rows_overflow.to_dense().is_err());
    }

    #[test]
    fn supervised_datums_weigh_only_the_completion() {
        let d = Datum::supervised(&[1, 2, 3], &[4, 5]);
        assert_eq!(d.model_input.to_ints().unwrap(), vec![1, 2, 3, 4]);
        assert_eq!(
            d.loss_fn_inputs["target_tokens"].data,
            vec![2.0, 3.0, 4.0, 5.0]
        );
        assert_eq!(d.loss_fn_inputs["weights"].data, vec![0.0, 0.0, 1.0, 1.0]);
    }

    #[test]
    fn adam_params_default_like_tinker_and_parse_partial_json() {
        let p: AdamParams = serde_json::from_str(r#"{"learning_rate": 0.001}"#).unwrap();
        assert_eq!(p.learning_rate, 0.001);
        assert_eq!(p.beta2, 0.95);
        assert_eq!(p.eps, 1e-12);
    }

    #[test]
    fn model_input_chunks_round_trip() {
        let json = r#"{"chunks":[{"type":"encoded_text","tokens":[1,2,3]}]}"#;
        let mi: ModelInput = serde_json::from_str(json).unwrap();
        assert_eq!(mi.to_ints().unwrap(), vec![1, 2, 3]);
        assert_eq!(serde_json::to_string(&mi).unwrap(), json);
    }

    #[test]
    fn stop_condition_accepts_every_wire_form() {
        let s: StopCondition = serde_json::from_str(r#""\n""#).unwrap();
        assert_eq!(s, StopCondition::Text("\n".into()));
        let s: StopCondition = serde_json::from_str(r#"[2, 3]"#).unwrap();
        assert_eq!(s, StopCondition::Tokens(vec![2, 3]));
        let s: StopCondition = serde_json::from_str(r#"["a", "b"]"#).unwrap();
        assert_eq!(s, StopCondition::Texts(vec!["a".into(), "b".into()]));
    }
}
