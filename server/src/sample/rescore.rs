//! Rescoring: the trainer's log-probabilities of tokens sampled from other weights (fast
//! decoding from 8-bit copies of f32 or bf16 weights), in bounded passes.

use candle_core::{DType, Tensor};

use super::jobs::{Generated, SampleJob};
use crate::model::{Adapter, KvCache, ModelError, PackedBatch, Transformer};

/// Replaces each sequence's log-probabilities with the trainer's (its f32 weights, with
/// their products in bf16 when the model computes in bf16), one bounded pass at a time.
/// The first token was drawn from the prefill's logits, so its log-probability is
/// already the trainer's; the others are scored in batched passes over the generated
/// tokens, continuing copies of the prompt's KV cache, of at most the model's training
/// pass size ([`crate::train::pass_tokens`]): a request's samples together may hold
/// hundreds of thousands of tokens, whose activations in one pass would not fit in
/// memory, and whose passes back to back would hold every other tenant's work. The
/// running decode runs one pass per step, so the scheduler charges and interleaves them.
pub(super) struct Rescorer {
    /// The request's sequences, in sample order; their log-probabilities are replaced.
    pub sequences: Vec<Generated>,
    /// Sequences with tokens to score, in order.
    order: Vec<usize>,
    /// Position in `order` of the sequence scored next, and how many of its rows are done.
    cursor: usize,
    done: usize,
    /// The cache of a sequence cut at the end of the last pass, which the next continues.
    carried: Option<KvCache>,
    /// Most rows of one pass.
    max_rows: usize,
}

impl Rescorer {
    /// Rescoring of `sequences` in passes of at most `max_rows` rows: whole sequences
    /// packed in order, a longer one in consecutive pieces that continue its cache (each
    /// row's numbers do not depend on the rows beside it in a pass).
    pub fn new(sequences: Vec<Generated>, max_rows: usize) -> Self {
        let order = (0..sequences.len())
            .filter(|&i| sequences[i].tokens.len() >= 2)
            .collect();
        Self {
            sequences,
            order,
            cursor: 0,
            done: 0,
            carried: None,
            max_rows: max_rows.max(1),
        }
    }

    /// Whether every token is scored.
    pub fn is_done(&self) -> bool {
        self.cursor >= self.order.len()
    }

    /// Rows (tokens) the next pass scores: 0 once done.
    pub fn next_rows(&self) -> usize {
        let mut rows = 0;
        let mut done = self.done;
        for &i in &self.order[self.cursor.min(self.order.len())..] {
            rows += self.sequences[i].tokens.len() - 1 - done;
            done = 0;
            if rows >= self.max_rows {
                return self.max_rows;
            }
        }
        rows
    }

    /// Scores the next pass's rows (nothing once done).
    pub fn pass(
        &mut self,
        model: &Transformer,
        adapter: Option<&Adapter>,
        job: &SampleJob,
        prompt_cache: &KvCache,
    ) -> Result<(), ModelError> {
        let adapters: Vec<&Adapter> = adapter.into_iter().collect();
        let which = adapter.map(|_| 0);
        // (sequence, first row, end row, cache) of this pass.
        let mut pass: Vec<(usize, usize, usize, KvCache)> = Vec::new();
        let mut rows = 0;
        while rows < self.max_rows && !self.is_done() {
            let i = self.order[self.cursor];
            let n = self.sequences[i].tokens.len() - 1;
            let take = (n - self.done).min(self.max_rows - rows);
            let cache = match self.carried.take() {
                Some(c) => c,
                None => prompt_cache.try_clone()?,
            };
            pass.push((i, self.done, self.done + take, cache));
            rows += take;
            self.done += take;
            if self.done == n {
                (self.cursor, self.done) = (self.cursor + 1, 0);
            }
        }
        if pass.is_empty() {
            return Ok(());
        }
        let sequences = &mut self.sequences;
        let seqs: Vec<(&[u32], Option<usize>, usize)> = pass
            .iter()
            .map(|&(i, from, to, _)| {
                (
                    &sequences[i].tokens[from..to],
                    which,
                    job.prompt.len() + from,
                )
            })
            .collect();
        let batch = PackedBatch::new(&seqs, model.device())?;
        let targets: Vec<u32> = pass
            .iter()
            .flat_map(|&(i, from, to, _)| sequences[i].tokens[from + 1..to + 1].iter().copied())
            .collect();
        let targets = Tensor::from_vec(targets, (rows, 1), model.device())?;
        let mut refs: Vec<&mut KvCache> = pass.iter_mut().map(|p| &mut p.3).collect();
        let (_, lp) = model.forward_cached_logprobs(&batch, &adapters, &mut refs, &targets)?;
        let lp: Vec<f32> = lp.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        let mut offset = 0;
        let cut = (self.done > 0).then(|| self.order[self.cursor]);
        for (i, from, to, cache) in pass {
            sequences[i].logprobs[from + 1..to + 1]
                .copy_from_slice(&lp[offset..offset + to - from]);
            offset += to - from;
            // A sequence cut at the end of this pass goes on from its cache.
            if cut == Some(i) {
                self.carried = Some(cache);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::tiny::tiny_model;
    use crate::model::Arch;
    use crate::sample::jobs::Stop;
    use crate::sample::Picker;

    /// Rescoring in passes of a few rows (sequences packed together, a long one cut and
    /// continued from its cache) gives each token the log-probability one pass gives it.
    #[test]
    fn rescoring_in_small_passes_equals_one_pass() {
        let model = tiny_model(Arch::Llama, 7, &candle_core::Device::Cpu).unwrap();
        let t = &model.transformer;
        let prompt = vec![3u32, 9, 4, 12];
        let mut prompt_cache = KvCache::with_capacity(64);
        let batch = PackedBatch::new(&[(&prompt[..], None, 0)], t.device()).unwrap();
        let targets =
            Tensor::from_vec(vec![1u32; prompt.len()], (prompt.len(), 1), t.device()).unwrap();
        t.forward_cached_logprobs(&batch, &[], &mut [&mut prompt_cache], &targets)
            .unwrap();
        let job = SampleJob {
            prompt,
            adapter: None,
            num_samples: 4,
            picker: Picker::default(),
            max_tokens: 9,
            stop_strings: vec![],
            stop_tokens: vec![],
            seed: Some(0),
            prompt_logprobs: false,
            topk_prompt_logprobs: 0,
        };
        let generated = |tokens: &[u32]| Generated {
            tokens: tokens.to_vec(),
            logprobs: vec![f32::NAN; tokens.len()],
            stop: Stop::Length,
        };
        let sequences = vec![
            generated(&[5, 6, 7, 8, 9, 10, 11, 2, 14]),
            generated(&[4]),
            generated(&[8, 3]),
            generated(&[20, 21, 22, 23, 24, 25, 26]),
        ];
        let scored = |max_rows| {
            let mut r = Rescorer::new(sequences.clone(), max_rows);
            let rows: usize = sequences.iter().map(|g| g.tokens.len().max(1) - 1).sum();
            let mut passes = 0;
            let mut scored_rows = 0;
            while !r.is_done() {
                let next = r.next_rows();
                assert!(
                    next >= 1 && next <= max_rows,
                    "{next} rows in passes of {max_rows}"
                );
                r.pass(t, None, &job, &prompt_cache).unwrap();
                scored_rows += next;
                passes += 1;
            }
            assert_eq!(r.next_rows(), 0);
            assert_eq!(scored_rows, rows, "every row scored once");
            assert_eq!(
                passes,
                rows.div_ceil(max_rows),
                "passes of {max_rows} rows are full"
            );
            r.sequences
        };
        let whole = scored(1000);
        assert!(whole
            .iter()
            .all(|g| g.logprobs[1..].iter().all(|l| l.is_finite())));
        for max_rows in [1, 3, 5] {
            let pieces = scored(max_rows);
            for (a, b) in whole.iter().zip(&pieces) {
                assert_eq!(a.logprobs.len(), b.logprobs.len());
                for (x, y) in a.logprobs[1..].iter().zip(&b.logprobs[1..]) {
                    assert!(
                        (x - y).abs() < 1e-5,
                        "passes of {max_rows}: {x} against {y}"
                    );
                }
                assert!(b.logprobs[0].is_nan(), "the first token's is the prefill's");
            }
        }
    }
}
