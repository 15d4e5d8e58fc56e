//! Packing several sequences, each with its own adapter and cached prefix, into one
//! `(rows, ...)` batch without padding.

use candle_core::{Device, Tensor};

use super::lora::Segment;
use super::ModelError;

/// One sequence of a packed batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqSpan {
    /// First row.
    pub start: usize,
    /// Number of rows.
    pub len: usize,
    /// Index of its adapter in the batch's adapter list (`None`: base model).
    pub adapter: Option<usize>,
}

/// Several sequences packed into one `(rows, ...)` batch.
#[derive(Debug, Clone)]
pub struct PackedBatch {
    /// Token ids, `(rows,)` u32.
    pub tokens: Tensor,
    /// Position of each row inside its sequence (offset by any cached prefix), `(rows,)`.
    pub positions: Tensor,
    /// The sequences, in row order.
    pub seqs: Vec<SeqSpan>,
    /// Runs of consecutive sequences that share an adapter.
    pub segments: Vec<Segment>,
}

impl PackedBatch {
    /// Packs sequences `(tokens, adapter, first_position)` in the given order. Callers
    /// that want one segment per adapter order the sequences by adapter first.
    pub fn new(
        seqs: &[(&[u32], Option<usize>, usize)],
        device: &Device,
    ) -> Result<Self, ModelError> {
        let mut tokens = Vec::new();
        let mut positions = Vec::new();
        let mut spans = Vec::with_capacity(seqs.len());
        let mut segments: Vec<Segment> = Vec::new();
        for &(toks, adapter, first_pos) in seqs {
            if toks.is_empty() {
                return Err(ModelError::Input("empty sequence".into()));
            }
            let start = tokens.len();
            tokens.extend_from_slice(toks);
            positions.extend((0..toks.len()).map(|i| (first_pos + i) as u32));
            spans.push(SeqSpan {
                start,
                len: toks.len(),
                adapter,
            });
            match segments.last_mut() {
                Some(seg) if seg.adapter == adapter => seg.len += toks.len(),
                _ => segments.push(Segment {
                    start,
                    len: toks.len(),
                    adapter,
                }),
            }
        }
        if tokens.is_empty() {
            return Err(ModelError::Input("empty batch".into()));
        }
        let n = tokens.len();
        Ok(Self {
            tokens: Tensor::from_vec(tokens, n, device)?,
            positions: Tensor::from_vec(positions, n, device)?,
            seqs: spans,
            segments,
        })
    }

    /// Total rows.
    pub fn rows(&self) -> usize {
        self.seqs.iter().map(|s| s.len).sum()
    }
}
