//! Cached decoding: prompts prefilled and new tokens run against each sequence's KV
//! cache, returning the next-token logits of each sequence's last row (and, for
//! scoring, the log-probabilities of given tokens).

use super::*;

impl Transformer {
    /// Runs `batch` through the model appending to each sequence's KV cache, and returns
    /// the next-token logits of each sequence's last row, `(seqs, vocab)`. With
    /// `quantized`, the frozen projections use the block-quantized decode weights (a part
    /// of the CPU backend: callers ask for them through `DecodeMode::on`).
    pub fn forward_cached(
        &self,
        batch: &PackedBatch,
        adapters: &[&Adapter],
        caches: &mut [&mut KvCache],
        quantized: bool,
    ) -> Result<Tensor, ModelError> {
        let dec = if quantized {
            Some(self.decode_weights()?)
        } else {
            None
        };
        let h = self.cached_hidden(batch, adapters, caches, dec)?;
        self.last_row_logits(&h, batch, adapters, dec)
    }

    /// Like [`Transformer::forward_cached`] with the f32 weights, and also the
    /// log-probabilities of `targets` (`(rows, 1)` u32) at every row: one pass both
    /// prefills prompts and scores them, or scores tokens that continue cached prompts.
    /// Returns `(last-row logits, logprobs)`.
    pub fn forward_cached_logprobs(
        &self,
        batch: &PackedBatch,
        adapters: &[&Adapter],
        caches: &mut [&mut KvCache],
        targets: &Tensor,
    ) -> Result<(Tensor, Tensor), ModelError> {
        let (logits, lp, _) = self.forward_cached_topk(batch, adapters, caches, targets, 0)?;
        Ok((logits, lp))
    }

    /// [`Transformer::forward_cached_logprobs`], also returning the `k` most likely next
    /// tokens of every row with their log-probabilities, most likely first (empty rows
    /// when `k` is 0).
    pub fn forward_cached_topk(
        &self,
        batch: &PackedBatch,
        adapters: &[&Adapter],
        caches: &mut [&mut KvCache],
        targets: &Tensor,
        k: usize,
    ) -> Result<(Tensor, Tensor, Vec<TopK>), ModelError> {
        let h = self.cached_hidden(batch, adapters, caches, None)?;
        let logits = self.last_row_logits(&h, batch, adapters, None)?;
        let (xf, _) = ops::rms_norm(
            self.backend,
            &h,
            &self.weights.norm,
            self.config.rms_norm_eps,
        )?;
        let mut topk = Vec::new();
        let (lp, _) = self.head_logprobs(&xf, batch, adapters, targets, false, k, &mut topk)?;
        Ok((logits, lp, topk))
    }

    /// Next-token logits of each sequence's last row, `(seqs, vocab)`: one head matmul
    /// for all rows, then each row's adapter (rows follow the sequences, which are
    /// grouped by adapter).
    fn last_row_logits(
        &self,
        h: &Tensor,
        batch: &PackedBatch,
        adapters: &[&Adapter],
        dec: Option<&DecodeWeights>,
    ) -> Result<Tensor, ModelError> {
        let last: Vec<u32> = batch
            .seqs
            .iter()
            .map(|s| (s.start + s.len - 1) as u32)
            .collect();
        let idx = Tensor::new(last.as_slice(), h.device())?;
        let h_last = h.index_select(&idx, 0)?;
        let (xf, _) = ops::rms_norm(
            self.backend,
            &h_last,
            &self.weights.norm,
            self.config.rms_norm_eps,
        )?;
        // The block weights where they take these rows, else the trainer's own product.
        let base = match dec
            .map(|d| &d.lm_head)
            .filter(|l| l.quantizes(last.len(), self.block_arith()))
        {
            Some(l) => l.forward(&xf, self.block_arith())?,
            None => self.head_product(&xf)?,
        };
        let mut segs: Vec<Segment> = Vec::new();
        for (i, s) in batch.seqs.iter().enumerate() {
            match segs.last_mut() {
                Some(g) if g.adapter == s.adapter => g.len += 1,
                _ => segs.push(Segment {
                    start: i,
                    len: 1,
                    adapter: s.adapter,
                }),
            }
        }
        let (logits, _) = lora_forward(self.backend, &xf, base, Target::LmHead, &segs, adapters)?;
        Ok(logits)
    }

    /// The residual stream after the last block for every row of `batch`, appending to
    /// the sequences' KV caches.
    fn cached_hidden(
        &self,
        batch: &PackedBatch,
        adapters: &[&Adapter],
        caches: &mut [&mut KvCache],
        dec: Option<&DecodeWeights>,
    ) -> Result<Tensor, ModelError> {
        self.check_batch(batch, adapters)?;
        if caches.len() != batch.seqs.len() {
            return Err(ModelError::Input(
                "one KV cache per sequence is required".into(),
            ));
        }
        let (cos, sin) = self.rope.gather(&batch.positions)?;
        let mut h = self.weights.embed(&batch.tokens)?;
        for (i, layer) in self.weights.layers.iter().enumerate() {
            let (next, _) = self.layer_forward(
                i,
                layer,
                &h,
                batch,
                adapters,
                &cos,
                &sin,
                Some(&mut *caches),
                dec.map(|d| &d.layers[i]),
            )?;
            h = next;
        }
        Ok(h)
    }
}
