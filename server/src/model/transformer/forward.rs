//! The forward pass over a packed multi-adapter batch, keeping a tape for the backward
//! pass when asked: the embedding, every block (norms, projections with their LoRA
//! deltas, attention per sequence or per run of equal neighbours, SwiGLU) and the final
//! norm; the output head is in [`super::head`].

use super::*;

impl Transformer {
    /// Log-probabilities of `targets` (`(rows, k)` u32) at every row of `batch`, and the
    /// tape for [`Transformer::backward`] when `keep_tape` is set.
    pub fn forward_logprobs(
        &self,
        batch: &PackedBatch,
        adapters: &[&Adapter],
        targets: &Tensor,
        keep_tape: bool,
    ) -> Result<(Tensor, Option<Tape>), ModelError> {
        let Hidden {
            xf,
            norm,
            tapes,
            cos,
            sin,
        } = self.hidden(batch, adapters, keep_tape)?;
        let (lp, head) =
            self.head_logprobs(&xf, batch, adapters, targets, keep_tape, 0, &mut Vec::new())?;
        let tape = keep_tape.then(|| Tape {
            layers: tapes,
            norm,
            xf,
            head,
            targets: targets.clone(),
            cos,
            sin,
            segments: batch.segments.clone(),
            n_adapters: adapters.len(),
        });
        Ok((lp, tape))
    }

    /// The final norm's output over `batch` (and each layer's tape when `keep_tape`).
    pub(super) fn hidden(
        &self,
        batch: &PackedBatch,
        adapters: &[&Adapter],
        keep_tape: bool,
    ) -> Result<Hidden, ModelError> {
        self.check_batch(batch, adapters)?;
        let (cos, sin) = self.rope.gather(&batch.positions)?;
        let mut h = self.weights.embed(&batch.tokens)?;
        let mut tapes = Vec::new();
        for (i, layer) in self.weights.layers.iter().enumerate() {
            let (next, tape) =
                self.layer_forward(i, layer, &h, batch, adapters, &cos, &sin, None, None)?;
            h = next;
            if keep_tape {
                tapes.push(tape);
            }
        }
        let (xf, norm) = ops::rms_norm(
            self.backend,
            &h,
            &self.weights.norm,
            self.config.rms_norm_eps,
        )?;
        Ok(Hidden {
            xf,
            norm,
            tapes,
            cos,
            sin,
        })
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn layer_forward(
        &self,
        index: usize,
        w: &LayerWeights,
        h: &Tensor,
        batch: &PackedBatch,
        adapters: &[&Adapter],
        cos: &Tensor,
        sin: &Tensor,
        caches: Option<&mut [&mut KvCache]>,
        dec: Option<&DecodeLayer>,
    ) -> Result<(Tensor, LayerTape), ModelError> {
        let cfg = &self.config;
        let segs = &batch.segments;
        let targets = BlockTargets::new(cfg, index);
        let BlockProjections {
            qkv,
            o,
            gate_up,
            down,
        } = self.projections(index, &targets, caches.is_some());
        let (qd, kvd) = (cfg.q_dim(), cfg.kv_dim());
        // The frozen products come from the f32 weights, or the decode weights when
        // those take this many rows (else the fused f32 path with its LoRA kernels).
        let project = |x: &Tensor,
                       p: &Projection,
                       quantized: Option<&DecodeLinear>|
         -> candle_core::Result<(Tensor, PartCaches)> {
            let arith = self.block_arith();
            match quantized.filter(|d| d.quantizes(x.dims()[0], arith)) {
                Some(d) => adapted::forward_decoded(x, d, arith, p.parts, segs, adapters),
                None => adapted::forward(x, p, segs, adapters),
            }
        };
        let n = h.dims()[0];
        let (hq, hkv, hd) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let (x1, norm1) = ops::rms_norm(self.backend, h, &w.input_layernorm, cfg.rms_norm_eps)?;
        let (y, lqkv) = project(&x1, &qkv, dec.map(|d| &d.qkv))?;
        let q = y.narrow(1, 0, qd)?;
        let k = y.narrow(1, qd, kvd)?;
        let v = y.narrow(1, qd + kvd, kvd)?;
        let mut q = q.reshape((n, hq, hd))?;
        let mut k = k.reshape((n, hkv, hd))?;
        let (mut q_norm, mut k_norm) = (None, None);
        if let (Some(qn), Some(kn)) = (&w.q_norm, &w.k_norm) {
            let (qq, sq) = ops::rms_norm(self.backend, &q, qn, cfg.rms_norm_eps)?;
            let (kk, sk) = ops::rms_norm(self.backend, &k, kn, cfg.rms_norm_eps)?;
            (q, k, q_norm, k_norm) = (qq, kk, Some(sq), Some(sk));
        }
        let q = ops::rope(self.backend, &q, cos, sin)?.reshape((n, hq * hd))?;
        let k = ops::rope(self.backend, &k, cos, sin)?.reshape((n, hkv * hd))?;
        let mut saved = Vec::new();
        let attn_out = match caches {
            Some(caches) => kv::cached_attention(
                self.backend,
                index,
                &q,
                &k,
                &v,
                &batch.seqs,
                caches,
                hq,
                hkv,
            )?,
            None => {
                let mut outs = Vec::with_capacity(batch.seqs.len());
                for run in self.attention_runs(&batch.seqs) {
                    let (start, rows) = (run[0].start, run.iter().map(|s| s.len).sum());
                    let (o, sv) = ops::attention_stacked(
                        self.backend,
                        &q.narrow(0, start, rows)?,
                        &k.narrow(0, start, rows)?,
                        &v.narrow(0, start, rows)?,
                        hq,
                        hkv,
                        run.len(),
                    )?;
                    outs.push(o);
                    saved.push(sv);
                }
                if outs.len() == 1 {
                    outs.pop().expect("one sequence")
                } else {
                    Tensor::cat(&outs, 0)?
                }
            }
        };
        let (o, lo) = project(&attn_out, &o, dec.map(|d| &d.o))?;
        let h2 = ops::add(self.backend, h, &o)?;
        let (x2, norm2) = ops::rms_norm(
            self.backend,
            &h2,
            &w.post_attention_layernorm,
            cfg.rms_norm_eps,
        )?;
        let (gate_up, lgu) = project(&x2, &gate_up, dec.map(|d| &d.gate_up))?;
        let act = ops::swiglu(self.backend, &gate_up)?;
        let (down, ldown) = project(&act, &down, dec.map(|d| &d.down))?;
        let h3 = ops::add(self.backend, &h2, &down)?;
        Ok((
            h3,
            LayerTape {
                norm1,
                x1,
                lqkv,
                q_norm,
                k_norm,
                attn: saved,
                attn_out,
                lo,
                norm2,
                x2,
                lgu,
                gate_up,
                act,
                ldown,
            },
        ))
    }

    /// The packed sequences in the runs whose attention runs as one
    /// ([`ops::attention_stacked`]): off the CPU fast path, neighbours of equal length
    /// with the same adapter slot (a unit of a training pass, so that what a datum's
    /// attention is summed with never depends on the other sessions' datums); on the CPU
    /// fast path, which is not bound by launches, each sequence alone.
    pub(super) fn attention_runs<'a>(&self, seqs: &'a [SeqSpan]) -> Vec<&'a [SeqSpan]> {
        if self.backend == Backend::Cpu {
            return seqs.chunks(1).collect();
        }
        seqs.chunk_by(|a, b| a.len == b.len && a.adapter == b.adapter)
            .collect()
    }
}
