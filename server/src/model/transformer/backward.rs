//! The hand-written backward pass: from `dLoss/dlogprob` through the head, every block
//! and the final norm, to each adapter's LoRA gradients (frozen weights get none).

use super::*;

impl Transformer {
    /// Backward pass: given `dlp = dLoss/dlogprob` (same shape as the targets), returns
    /// the LoRA gradients of each adapter of the forward pass (in its order).
    pub fn backward(
        &self,
        tape: Tape,
        adapters: &[&Adapter],
        dlp: &Tensor,
    ) -> Result<Vec<AdapterGrads>, ModelError> {
        if adapters.len() != tape.n_adapters {
            return Err(ModelError::Input(
                "backward needs the adapters of the forward pass".into(),
            ));
        }
        let dlogits = |c: &HeadChunk| -> Result<Tensor, ModelError> {
            let d = dlp.narrow(0, c.start, c.len)?.contiguous()?;
            let t = tape.targets.narrow(0, c.start, c.len)?.contiguous()?;
            Ok(ops::logprobs_at_backward(
                self.backend,
                &c.logits,
                &c.lse,
                &t,
                &d,
            )?)
        };
        let mut grads = vec![AdapterGrads::default(); adapters.len()];
        let dxf = self.head_backward(&tape, adapters, dlogits, &mut grads)?;
        self.backward_below_head(tape, adapters, dxf, grads)
    }

    /// The backward pass from the final norm's output gradient down.
    pub(super) fn backward_below_head(
        &self,
        tape: Tape,
        adapters: &[&Adapter],
        dxf: Tensor,
        mut grads: Vec<AdapterGrads>,
    ) -> Result<Vec<AdapterGrads>, ModelError> {
        let Tape {
            layers,
            norm,
            cos,
            sin,
            segments,
            ..
        } = tape;
        let mut dh = ops::rms_norm_backward(&dxf, &self.weights.norm, &norm)?;
        for (i, lt) in layers.into_iter().enumerate().rev() {
            dh = self.layer_backward(i, lt, dh, &segments, adapters, &cos, &sin, &mut grads)?;
        }
        Ok(grads)
    }

    #[allow(clippy::too_many_arguments)]
    fn layer_backward(
        &self,
        index: usize,
        t: LayerTape,
        dh: Tensor,
        segs: &[Segment],
        adapters: &[&Adapter],
        cos: &Tensor,
        sin: &Tensor,
        grads: &mut [AdapterGrads],
    ) -> Result<Tensor, ModelError> {
        let cfg = &self.config;
        let w = &self.weights.layers[index];
        let targets = BlockTargets::new(cfg, index);
        // A training pass: never the few-rows kernels (see `Projection::few_rows`).
        let p = self.projections(index, &targets, false);
        let back = |x: &Tensor,
                    dy: &Tensor,
                    p: &Projection,
                    caches: &[LoraCache],
                    grads: &mut [AdapterGrads]| {
            adapted::backward(x, dy, p, segs, adapters, caches, grads)
        };
        let n = dh.dims()[0];
        let (hq, hkv, hd) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        // MLP
        let dact = back(&t.act, &dh, &p.down, &t.ldown, grads)?;
        let dgu = ops::swiglu_backward(self.backend, &dact, &t.gate_up)?;
        let dx2 = back(&t.x2, &dgu, &p.gate_up, &t.lgu, grads)?;
        let dh2 = ops::add(
            self.backend,
            &dh,
            &ops::rms_norm_backward(&dx2, &w.post_attention_layernorm, &t.norm2)?,
        )?;
        // attention
        let dattn = back(&t.attn_out, &dh2, &p.o, &t.lo, grads)?;
        let (mut dqs, mut dks, mut dvs) = (Vec::new(), Vec::new(), Vec::new());
        let mut start = 0;
        for saved in &t.attn {
            let rows = saved.rows()?;
            let (dq, dk, dv) =
                ops::attention_backward(self.backend, &dattn.narrow(0, start, rows)?, saved)?;
            start += rows;
            dqs.push(dq);
            dks.push(dk);
            dvs.push(dv);
        }
        let dq = Tensor::cat(&dqs, 0)?.reshape((n, hq, hd))?;
        let dk = Tensor::cat(&dks, 0)?.reshape((n, hkv, hd))?;
        let dv = Tensor::cat(&dvs, 0)?;
        let mut dq = ops::rope_backward(self.backend, &dq, cos, sin)?;
        let mut dk = ops::rope_backward(self.backend, &dk, cos, sin)?;
        if let (Some(qn), Some(kn), Some(sq), Some(sk)) =
            (&w.q_norm, &w.k_norm, &t.q_norm, &t.k_norm)
        {
            dq = ops::rms_norm_backward(&dq, qn, sq)?;
            dk = ops::rms_norm_backward(&dk, kn, sk)?;
        }
        let dqkv = Tensor::cat(
            &[dq.reshape((n, hq * hd))?, dk.reshape((n, hkv * hd))?, dv],
            1,
        )?;
        let dx1 = back(&t.x1, &dqkv, &p.qkv, &t.lqkv, grads)?;
        Ok(ops::add(
            self.backend,
            &dh2,
            &ops::rms_norm_backward(&dx1, &w.input_layernorm, &t.norm1)?,
        )?)
    }
}
