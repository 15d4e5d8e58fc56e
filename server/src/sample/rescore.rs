//! Rescoring: the trainer's log-probabilities of tokens sampled from other weights (fast
//! decoding from 8-bit copies of f32 or bf16 weights), in bounded passes.

use candle_core::{DType, Tensor};

use super::jobs::{Generated, SampleJob};
use crate::model::{Adapter, KvCache, ModelError, PackedBatch, Transformer};

/// Replaces each sequence's log-probabilities with the trainer's (its f32 weights, with
/// their products in bf16 when the model computes in bf16). The first token was drawn
/// from the prefill's logits, so its log-probability is already the trainer's; the
/// others are scored in batched passes over the generated tokens, continuing copies of
/// the prompt's KV cache, of at most the model's training pass size
/// ([`crate::train::pass_tokens`]): a request's samples together may hold hundreds of
/// thousands of tokens, whose activations in one pass would not fit in memory.
pub(super) fn rescore(
    model: &Transformer,
    adapter: Option<&Adapter>,
    job: &SampleJob,
    prompt_cache: &KvCache,
    sequences: &mut [Generated],
) -> Result<(), ModelError> {
    rescore_in_passes(
        model,
        adapter,
        job,
        prompt_cache,
        sequences,
        crate::train::pass_tokens(model),
    )
}

/// [`rescore`] in passes of at most `max_rows` rows: whole sequences packed in order, a
/// longer one in consecutive pieces that continue its cache (each row's numbers do not
/// depend on the rows beside it in a pass).
fn rescore_in_passes(
    model: &Transformer,
    adapter: Option<&Adapter>,
    job: &SampleJob,
    prompt_cache: &KvCache,
    sequences: &mut [Generated],
    max_rows: usize,
) -> Result<(), ModelError> {
    let max_rows = max_rows.max(1);
    let order: Vec<usize> = (0..sequences.len())
        .filter(|&i| sequences[i].tokens.len() >= 2)
        .collect();
    let adapters: Vec<&Adapter> = adapter.into_iter().collect();
    let which = adapter.map(|_| 0);
    // The sequence being scored next, how many of its rows are done, and its cache.
    let (mut cursor, mut done) = (0, 0);
    let mut carried: Option<KvCache> = None;
    while cursor < order.len() {
        // (sequence, first row, end row, cache) of this pass.
        let mut pass: Vec<(usize, usize, usize, KvCache)> = Vec::new();
        let mut rows = 0;
        while rows < max_rows && cursor < order.len() {
            let i = order[cursor];
            let n = sequences[i].tokens.len() - 1;
            let take = (n - done).min(max_rows - rows);
            let cache = match carried.take() {
                Some(c) => c,
                None => prompt_cache.try_clone()?,
            };
            pass.push((i, done, done + take, cache));
            rows += take;
            done += take;
            if done == n {
                (cursor, done) = (cursor + 1, 0);
            }
        }
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
        for (i, from, to, cache) in pass {
            sequences[i].logprobs[from + 1..to + 1]
                .copy_from_slice(&lp[offset..offset + to - from]);
            offset += to - from;
            // A sequence cut at the end of this pass goes on from its cache.
            if done > 0 && i == order[cursor] {
                carried = Some(cache);
            }
        }
    }
    Ok(())
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
            let mut s = sequences.clone();
            rescore_in_passes(t, None, &job, &prompt_cache, &mut s, max_rows).unwrap();
            s
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
