//! The output head: target log-probabilities in bounded row chunks, the full logits of
//! rows (for losses over the whole vocabulary), and the head's backward pass.

use candle_core::{DType, Tensor};

use super::{Tape, Transformer};
use crate::model::batch::PackedBatch;
use crate::model::cpu::bf16;
use crate::model::lora::{lora_backward, lora_forward, Adapter, AdapterGrads, Segment, Target};
use crate::model::ops::{self, TopK};
use crate::model::weights::{matmul_input_grad, matmul_t};
use crate::model::ModelError;

/// Rows of the output head computed at once, bounding the `(rows, vocab)` logits buffer.
/// Larger chunks repack the `(vocab, hidden)` head weight for the matmul fewer times.
const HEAD_CHUNK_ROWS: usize = 256;

/// One row chunk of the output head's forward pass, kept for the backward.
pub(super) struct HeadChunk {
    pub(super) start: usize,
    pub(super) len: usize,
    pub(super) adapter: Option<usize>,
    pub(super) logits: Tensor,
    /// Log-sum-exp of each row of `logits`, `(len,)`.
    pub(super) lse: Tensor,
    pub(super) u: Option<Tensor>,
}

impl Tape {
    /// The full next-token logits of rows `start..start + len` of the forward pass,
    /// `(len, vocab)`, for losses over the whole vocabulary
    /// ([`Transformer::backward_from_logits`]).
    pub fn logits_rows(&self, start: usize, len: usize) -> Result<Tensor, ModelError> {
        let mut parts = Vec::new();
        for c in &self.head {
            let (lo, hi) = (start.max(c.start), (start + len).min(c.start + c.len));
            if lo < hi {
                parts.push(c.logits.narrow(0, lo - c.start, hi - lo)?);
            }
        }
        let rows: usize = parts.iter().map(|p| p.dims()[0]).sum();
        if rows != len {
            return Err(ModelError::Input(format!(
                "rows {start}..{} are outside the forward pass",
                start + len
            )));
        }
        Ok(Tensor::cat(&parts, 0)?)
    }
}

impl Transformer {
    /// `x Eᵀ`, the frozen head's logits of rows `x`: in bf16 when the model computes in
    /// bf16 (its weights are then f32 on the CPU, and so is `x`).
    pub(super) fn head_product(&self, x: &Tensor) -> Result<Tensor, ModelError> {
        match self.bf16_head() {
            Some(p) => Ok(bf16::matmul_t(x, p)?),
            None => Ok(matmul_t(self.backend, x, self.weights.lm_head())?),
        }
    }

    /// `dlogits E`, the frozen head's input gradient, like [`Self::head_product`].
    fn head_input_grad(&self, dlogits: &Tensor) -> Result<Tensor, ModelError> {
        match self.bf16_head() {
            Some(p) => Ok(bf16::input_grad(dlogits, p)?),
            None => Ok(matmul_input_grad(
                self.backend,
                dlogits,
                self.weights.lm_head(),
            )?),
        }
    }

    /// The full next-token logits of rows `start..start + len` of `batch`,
    /// `(len, vocab)`, keeping nothing for a backward pass (a frozen reference's
    /// distribution, say).
    pub fn forward_logits_rows(
        &self,
        batch: &PackedBatch,
        adapters: &[&Adapter],
        start: usize,
        len: usize,
    ) -> Result<Tensor, ModelError> {
        let xf = self.hidden(batch, adapters, false)?.xf;
        let mut parts = Vec::new();
        for seg in &batch.segments {
            let (lo, hi) = (start.max(seg.start), (start + len).min(seg.start + seg.len));
            if lo < hi {
                let x = xf.narrow(0, lo, hi - lo)?;
                let local = [Segment {
                    start: 0,
                    len: hi - lo,
                    adapter: seg.adapter,
                }];
                let (logits, _) = lora_forward(
                    self.backend,
                    &x,
                    self.head_product(&x)?,
                    Target::LmHead,
                    &local,
                    adapters,
                )?;
                parts.push(logits);
            }
        }
        let rows: usize = parts.iter().map(|p| p.dims()[0]).sum();
        if rows != len {
            return Err(ModelError::Input(format!(
                "rows {start}..{} are outside the batch",
                start + len
            )));
        }
        Ok(Tensor::cat(&parts, 0)?)
    }

    /// Target log-probabilities, computed in row chunks that never cross an adapter
    /// boundary so the `(rows, vocab)` logits stay bounded.
    /// With `k > 0`, also appends each row's `k` most likely tokens to `topk`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn head_logprobs(
        &self,
        xf: &Tensor,
        batch: &PackedBatch,
        adapters: &[&Adapter],
        targets: &Tensor,
        keep: bool,
        k: usize,
        topk: &mut Vec<TopK>,
    ) -> Result<(Tensor, Vec<HeadChunk>), ModelError> {
        let mut lps = Vec::new();
        let mut chunks = Vec::new();
        for seg in &batch.segments {
            let mut start = seg.start;
            while start < seg.start + seg.len {
                let len = HEAD_CHUNK_ROWS.min(seg.start + seg.len - start);
                let x = xf.narrow(0, start, len)?;
                let local = [Segment {
                    start: 0,
                    len,
                    adapter: seg.adapter,
                }];
                let (logits, mut cache) = lora_forward(
                    self.backend,
                    &x,
                    self.head_product(&x)?,
                    Target::LmHead,
                    &local,
                    adapters,
                )?;
                let t = targets.narrow(0, start, len)?.contiguous()?;
                let (lp, lse) = ops::logprobs_at(self.backend, &logits, &t)?;
                if k > 0 {
                    let rows: Vec<Vec<f32>> = logits.to_dtype(DType::F32)?.to_vec2()?;
                    let lse: Vec<f32> = lse.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
                    topk.extend(rows.iter().zip(lse).map(|(row, z)| ops::top_k(row, z, k)));
                }
                lps.push(lp);
                if keep {
                    chunks.push(HeadChunk {
                        start,
                        len,
                        adapter: seg.adapter,
                        logits,
                        lse,
                        u: cache.pop().flatten(),
                    });
                }
                start += len;
            }
        }
        Ok((Tensor::cat(&lps, 0)?, chunks))
    }

    /// Backward pass from the gradient of the loss with respect to the logits, for
    /// losses over the whole vocabulary: `dlogits(start, len)` gives rows
    /// `start..start + len`, `(len, vocab)`, in the model's dtype. Returns the LoRA
    /// gradients of each adapter of the forward pass (in its order).
    pub fn backward_from_logits(
        &self,
        tape: Tape,
        adapters: &[&Adapter],
        mut dlogits: impl FnMut(usize, usize) -> Result<Tensor, ModelError>,
    ) -> Result<Vec<AdapterGrads>, ModelError> {
        if adapters.len() != tape.n_adapters {
            return Err(ModelError::Input(
                "backward needs the adapters of the forward pass".into(),
            ));
        }
        let mut grads = vec![AdapterGrads::default(); adapters.len()];
        let dxf = self.head_backward(&tape, adapters, |c| dlogits(c.start, c.len), &mut grads)?;
        self.backward_below_head(tape, adapters, dxf, grads)
    }

    /// The head's backward, one row chunk at a time (`dlogits` gives each chunk's
    /// logits gradient, so only one chunk's is alive at once).
    pub(super) fn head_backward(
        &self,
        tape: &Tape,
        adapters: &[&Adapter],
        mut dlogits_of: impl FnMut(&HeadChunk) -> Result<Tensor, ModelError>,
        grads: &mut [AdapterGrads],
    ) -> Result<Tensor, ModelError> {
        let mut dxs = Vec::with_capacity(tape.head.len());
        for c in &tape.head {
            let dlogits = dlogits_of(c)?;
            let x = tape.xf.narrow(0, c.start, c.len)?;
            let mut dx = self.head_input_grad(&dlogits)?;
            let local = [Segment {
                start: 0,
                len: c.len,
                adapter: c.adapter,
            }];
            if let Some(extra) = lora_backward(
                &x,
                &dlogits,
                Target::LmHead,
                &local,
                adapters,
                &vec![c.u.clone()],
                grads,
            )? {
                dx = (dx + extra)?;
            }
            dxs.push(dx);
        }
        Ok(Tensor::cat(&dxs, 0)?)
    }
}
