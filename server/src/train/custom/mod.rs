//! Server-side custom losses (tinker 0.38's `create_custom_loss`).
//!
//! The client traces a per-datum loss `(logprobs, *inputs) -> (loss, metrics)` with
//! `torch.fx` and sends the graph as data. [`CustomLoss::compile`] rebuilds it from this
//! module's own allow-list of torch, `operator` and tensor-method functions (anything
//! else is refused by name, and nothing is ever looked up or executed by name), and
//! [`CustomLoss::evaluate`] runs it on one datum in f64 with reverse-mode
//! differentiation back to `logprobs`, whose gradient the model's backward pass then
//! takes, as it does a built-in loss's.
//!
//! Hand-written because no crate interprets torch.fx graphs: a tensor library would
//! still need this allow-list and binder, and the arrays here are tiny (one datum's
//! target log-probabilities). Every tensor is bounded ([`MAX_ELEMENTS`] each,
//! [`MAX_TOTAL_ELEMENTS`] per evaluation), so no graph can make the server allocate
//! without limit.

mod array;
mod compile;
mod elementwise;
mod eval;
mod shape;
mod value;

use lathe_sdk::types::{CustomLossGraph, CustomLossInput};
use sha2::Digest;

pub use array::{checked_shape, Array, Kind};
pub use eval::Evaluated;

/// Most nodes in a graph.
pub const MAX_NODES: usize = 1024;
/// Most inputs of a loss, `logprobs` included (the SDK's limit).
pub const MAX_INPUTS: usize = 16;
/// Most metrics a loss returns.
pub const MAX_METRICS: usize = 64;
/// Most elements of one tensor while a loss runs.
pub const MAX_ELEMENTS: usize = 1 << 22;
/// Most elements of all the tensors of one evaluation.
pub const MAX_TOTAL_ELEMENTS: usize = 1 << 24;
/// Most elements of all the tensors of the evaluations of one adapter's datums in one
/// pass over the model (a scheduled slice of a request), so that no request's loss can
/// hold the worker much longer than its model pass does.
pub const MAX_PASS_ELEMENTS: usize = 1 << 26;
/// Most dimensions of a tensor while a loss runs.
pub const MAX_RANK: usize = 8;
/// Most constants and node references in the arguments of one graph.
pub const MAX_ARGS: usize = 16_384;

/// Why a graph was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{0}")]
pub struct CompileError(pub String);

/// Why a loss failed on a datum.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{0}")]
pub struct EvalError(pub String);

/// A compiled custom loss. Two are equal when they were compiled from the same
/// declaration and graph (a client's retry), compared by digest: a graph holding a NaN
/// constant equals itself.
#[derive(Debug, Clone)]
pub struct CustomLoss {
    name: String,
    inputs: Vec<CustomLossInput>,
    program: compile::Program,
    digest: [u8; 32],
}

impl PartialEq for CustomLoss {
    fn eq(&self, other: &Self) -> bool {
        self.digest == other.digest
    }
}

impl CustomLoss {
    /// Checks the loss's declaration and rebuilds its graph from the allow-list.
    pub fn compile(
        name: &str,
        inputs: &[CustomLossInput],
        graph: &CustomLossGraph,
    ) -> Result<Self, CompileError> {
        if name.is_empty() || name.len() > 128 {
            return Err(CompileError(
                "a custom loss's name must have 1 to 128 characters".into(),
            ));
        }
        match inputs.first() {
            Some(first) if first.name == "logprobs" && matches!(first.rank, 1 | 2) => {}
            _ => {
                return Err(CompileError(
                    "a custom loss's first input is logprobs, with rank 1 ([T]) or 2 ([T, K])"
                        .into(),
                ))
            }
        }
        if inputs.len() > MAX_INPUTS {
            return Err(CompileError(format!(
                "a custom loss takes at most {MAX_INPUTS} inputs, logprobs included; got {}",
                inputs.len()
            )));
        }
        for (i, input) in inputs.iter().enumerate() {
            if !input_name(&input.name) {
                return Err(CompileError(format!(
                    "input {:?} must be a lowercase name of letters, digits and underscores",
                    input.name
                )));
            }
            if input.rank > 2 {
                return Err(CompileError(format!(
                    "input {:?} has rank {}; ranks are 0, 1 or 2",
                    input.name, input.rank
                )));
            }
            if inputs[..i].iter().any(|x| x.name == input.name) {
                return Err(CompileError(format!(
                    "input {:?} is declared twice",
                    input.name
                )));
            }
        }
        let program = compile::compile(graph, inputs)?;
        let source = serde_json::to_vec(&(name, inputs, graph))
            .map_err(|e| CompileError(format!("the graph cannot be re-encoded: {e}")))?;
        Ok(Self {
            name: name.to_string(),
            inputs: inputs.to_vec(),
            program,
            digest: sha2::Sha256::digest(&source).into(),
        })
    }

    /// The loss's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its inputs, `logprobs` first.
    pub fn inputs(&self) -> &[CustomLossInput] {
        &self.inputs
    }

    /// The keys of the metrics [`evaluate`](Self::evaluate) returns, in its order.
    pub fn metric_keys(&self) -> impl Iterator<Item = &str> {
        self.program.metrics.iter().map(|(k, _)| k.as_str())
    }

    /// Runs the loss on one datum: `logprobs` (shaped as the datum's targets), then the
    /// other inputs in declaration order.
    pub fn evaluate(&self, logprobs: Array, inputs: Vec<Array>) -> Result<Evaluated, EvalError> {
        let mut all = Vec::with_capacity(1 + inputs.len());
        all.push(logprobs);
        all.extend(inputs);
        debug_assert_eq!(all.len(), self.inputs.len());
        for (array, input) in all.iter().zip(&self.inputs) {
            if array.rank() != usize::from(input.rank) {
                return Err(EvalError(format!(
                    "input {:?} has rank {}, but the loss declared rank {}",
                    input.name,
                    array.rank(),
                    input.rank
                )));
            }
        }
        eval::run(&self.program, all)
            .map_err(|e| EvalError(format!("custom loss {:?}: {}", self.name, e.0)))
    }
}

/// The SDK's rule for input names: `[a-z_][a-z0-9_]{0,63}`.
fn input_name(name: &str) -> bool {
    let mut bytes = name.bytes();
    matches!(bytes.next(), Some(b'a'..=b'z' | b'_'))
        && name.len() <= 64
        && bytes.all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_'))
}

#[cfg(test)]
mod tests;
