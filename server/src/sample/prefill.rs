//! Prefilling the prompts of requests joining the running decode: which prompts go
//! through one batched pass together, and what each gets back (its KV cache, the first
//! token's logits, its prompt scores when asked for).

use candle_core::{DType, Tensor};

use super::jobs::{DecodeMode, SampleJob};
use super::running::Admission;
use crate::model::transformer::TopK;
use crate::model::{Adapter, KvCache, ModelError, PackedBatch, Transformer};

/// What prefilling one prompt gives.
pub(super) struct Prefilled {
    pub cache: KvCache,
    /// The first sampled token's logits.
    pub first: Vec<f32>,
    pub prompt_logprobs: Option<Vec<Option<f32>>>,
    pub topk_prompt_logprobs: Option<Vec<Option<TopK>>>,
}

/// Generated tokens a device KV cache is first made for, beyond the prompt.
const FIRST_CACHED_TOKENS: usize = 256;

/// Whether a request can run on `model` at all.
pub(super) fn check(model: &Transformer, job: &SampleJob) -> Result<(), ModelError> {
    if job.prompt.is_empty() {
        return Err(ModelError::Input("empty prompt".into()));
    }
    if job.prompt.len().saturating_add(job.max_tokens) > model.max_seq_len() {
        return Err(ModelError::Input(format!(
            "prompt of {} tokens plus max_tokens {} exceeds the context limit of {}",
            job.prompt.len(),
            job.max_tokens,
            model.max_seq_len()
        )));
    }
    Ok(())
}

/// Admissions split by what their prefill computes: prompts not scored, prompts scored
/// without alternatives, prompts with top-k alternatives (in admission order within
/// each; empty groups left out). A prefill scores every row of its batch for the
/// largest request's asking, and top-k copies each row's logits to the host, so a
/// request that asks for scores must not impose them on prompts that did not.
pub(super) fn scoring_groups<K>(admissions: Vec<Admission<K>>) -> Vec<Vec<Admission<K>>> {
    let mut groups: [Vec<Admission<K>>; 3] = Default::default();
    for a in admissions {
        let g = if a.job.topk_prompt_logprobs > 0 {
            2
        } else if a.job.prompt_logprobs {
            1
        } else {
            0
        };
        groups[g].push(a);
    }
    groups.into_iter().filter(|g| !g.is_empty()).collect()
}

/// Prompts through the f32 weights in one batch, filling each one's KV cache and giving
/// the first token's logits (and the prompt's log-probabilities when asked for). The
/// product is compute-bound, and each prompt's cache is then exact whatever the batch.
pub(super) fn prefill<K>(
    model: &Transformer,
    admissions: &[Admission<K>],
    mode: DecodeMode,
) -> Result<Vec<Prefilled>, ModelError> {
    let dev = model.device();
    let mut adapters: Vec<&Adapter> = Vec::new();
    let seqs: Vec<(&[u32], Option<usize>, usize)> = admissions
        .iter()
        .map(|a| {
            let index = a.adapter.as_ref().map(|ad| {
                match adapters.iter().position(|b| std::ptr::eq(*b, ad.as_ref())) {
                    Some(i) => i,
                    None => {
                        adapters.push(ad.as_ref());
                        adapters.len() - 1
                    }
                }
            });
            (a.job.prompt.as_slice(), index, 0)
        })
        .collect();
    let batch = PackedBatch::new(&seqs, dev)?;
    // Device caches are made for the prompt and its first tokens at once (most samples
    // stop well before `max_tokens`; past this they double).
    let mut caches: Vec<KvCache> = admissions
        .iter()
        .map(|a| {
            let first = a.job.max_tokens.min(FIRST_CACHED_TOKENS);
            KvCache::with_capacity(a.job.prompt.len().saturating_add(first))
        })
        .collect();
    let mut refs: Vec<&mut KvCache> = caches.iter_mut().collect();
    let jobs = || admissions.iter().map(|a| &a.job);
    let topk = jobs().map(|j| j.topk_prompt_logprobs).max().unwrap_or(0);
    let scored = topk > 0 || jobs().any(|j| j.prompt_logprobs);
    let (first, lp, alternatives) = if scored {
        // Row i of a prompt predicts token i+1; the last row's target is a placeholder.
        let targets: Vec<u32> = jobs()
            .flat_map(|j| j.prompt[1..].iter().copied().chain([0]))
            .collect();
        let rows = targets.len();
        let targets = Tensor::from_vec(targets, (rows, 1), dev)?;
        let (logits, lp, alternatives) =
            model.forward_cached_topk(&batch, &adapters, &mut refs, &targets, topk)?;
        let lp: Vec<f32> = lp.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        (logits, lp, alternatives)
    } else {
        // Prompts may go through the decode weights only in fast mode and when those are
        // the f32 weights exactly; each product then picks its kernel by row count (a
        // short prompt is faster through the block kernels, a long one stays f32).
        let through_decode_weights =
            mode.on(model) == DecodeMode::Fast && model.decode_weights()?.exact();
        let logits = model.forward_cached(&batch, &adapters, &mut refs, through_decode_weights)?;
        (logits, Vec::new(), Vec::new())
    };
    drop(refs);
    let first: Vec<Vec<f32>> = first.to_dtype(DType::F32)?.to_vec2()?;
    let mut offset = 0;
    let mut out = Vec::with_capacity(admissions.len());
    for ((job, cache), first) in jobs().zip(caches).zip(first) {
        let n = job.prompt.len();
        let prompt_logprobs = job.prompt_logprobs.then(|| {
            std::iter::once(None)
                .chain(lp[offset..offset + n - 1].iter().map(|&x| Some(x)))
                .collect()
        });
        // Position i's alternatives come from row i - 1, like its log-probability.
        let topk_prompt_logprobs =
            (job.topk_prompt_logprobs > 0).then(|| {
                std::iter::once(None)
                    .chain(alternatives[offset..offset + n - 1].iter().map(|row| {
                        Some(row.iter().take(job.topk_prompt_logprobs).copied().collect())
                    }))
                    .collect()
            });
        offset += n;
        out.push(Prefilled {
            cache,
            first,
            prompt_logprobs,
            topk_prompt_logprobs,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::Picker;

    /// Scored prompts are prefilled apart from unscored ones, top-k apart from both.
    #[test]
    fn scoring_groups_keep_scores_to_the_prompts_that_ask() {
        let admission = |key: u32, scored: bool, topk: usize| Admission {
            key,
            job: SampleJob {
                prompt: vec![1, 2, 3],
                adapter: None,
                num_samples: 1,
                picker: Picker::default(),
                max_tokens: 1,
                stop_strings: vec![],
                stop_tokens: vec![],
                seed: Some(0),
                prompt_logprobs: scored,
                topk_prompt_logprobs: topk,
            },
            adapter: None,
            progress: None,
        };
        let keys = |groups: Vec<Vec<Admission<u32>>>| -> Vec<Vec<u32>> {
            groups
                .into_iter()
                .map(|g| g.into_iter().map(|a| a.key).collect())
                .collect()
        };
        let mixed = vec![
            admission(0, false, 1),
            admission(1, false, 0),
            admission(2, true, 0),
            admission(3, false, 0),
            admission(4, true, 5),
        ];
        assert_eq!(
            keys(scoring_groups(mixed)),
            vec![vec![1, 3], vec![2], vec![0, 4]]
        );
        let plain = vec![admission(7, false, 0), admission(8, false, 0)];
        assert_eq!(keys(scoring_groups(plain)), vec![vec![7, 8]]);
    }
}
