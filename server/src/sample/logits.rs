//! Choosing the next token from a row of logits: temperature, top-k, top-p, seeded.

use rand::{rngs::StdRng, Rng};

use crate::model::cpu::vector_math::{exp_f32, exp_scaled, row_max, sum, sum_exp};

/// How to pick tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct Picker {
    /// Softmax temperature; 0 picks the most likely token.
    pub temperature: f64,
    /// Keep this many most likely tokens; `None` keeps all.
    pub top_k: Option<usize>,
    /// Keep the smallest set of tokens whose probability reaches this mass.
    pub top_p: f64,
}

impl Default for Picker {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: None,
            top_p: 1.0,
        }
    }
}

/// `log_softmax(logits)[token]`: the model's own log-probability, independent of
/// temperature and truncation. Computed as the trainer computes its log-softmax (f32,
/// the same vectorised `exp`, reductions and order of operations), so equal logits give
/// the trainer's value bit for bit.
pub fn token_logprob(logits: &[f32], token: usize) -> f64 {
    let max = row_max(logits);
    let lse = sum_exp(logits, max).ln() + max;
    (logits[token] - lse) as f64
}

/// Candidates first looked at for the nucleus; grown eightfold while their mass falls
/// short of `top_p`. A trained model's next-token mass sits in a few dozen tokens, so the
/// usual pick sorts 64 tokens instead of the whole vocabulary.
const NUCLEUS_START: usize = 64;

impl Picker {
    /// Whether this picks the most likely token: a temperature of 0, or one so small that
    /// `1 / T` overflows the f32 the softmax is scaled by (it would give `0 x inf` = NaN
    /// weights, and a pick of whatever token the walk ends on).
    pub fn greedy(&self) -> bool {
        self.temperature <= 0.0 || !((1.0 / self.temperature) as f32).is_finite()
    }

    /// Picks a token id from `logits`.
    ///
    /// Candidates are ranked by logit (ties: the lower id first); only as many are sorted
    /// as top-k and top-p need, so the pick is the one a full sort would give.
    pub fn pick(&self, logits: &[f32], rng: &mut StdRng) -> usize {
        if self.greedy() {
            return argmax(logits);
        }
        let rank = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b));
        let n = logits.len();
        // Candidate ids, ranked as far as top-k needs; `None` is the whole vocabulary in
        // id order (no truncation yet).
        let mut idx: Option<Vec<usize>> = None;
        let k = self.top_k.unwrap_or(n).clamp(1, n);
        if k < n {
            let mut top: Vec<usize> = (0..n).collect();
            top.select_nth_unstable_by(k - 1, rank);
            top.truncate(k);
            top.sort_unstable_by(rank);
            idx = Some(top);
        }
        // Unnormalised probabilities by token id, each computed once: over the whole
        // vocabulary this softmax is most of a pick's cost.
        let inv_t = (1.0 / self.temperature) as f32;
        let weights: Vec<f32> = match &idx {
            None => exp_scaled(logits, row_max(logits), inv_t),
            Some(top) => {
                let max = logits[top[0]];
                let mut w = vec![0f32; n];
                for &i in top {
                    w[i] = exp_f32((logits[i] - max) * inv_t);
                }
                w
            }
        };
        let total = sum(&weights) as f64;
        if self.top_p < 1.0 {
            let top = idx.get_or_insert_with(|| (0..n).collect());
            let keep = nucleus(top, self.top_p, |i| weights[i] as f64 / total, rank);
            top.truncate(keep);
        }
        // Walk the candidates' cumulative mass to a uniform point in it.
        let u = rng.random::<f64>();
        match &idx {
            Some(top) => {
                let mass: f64 = top.iter().map(|&i| weights[i] as f64).sum();
                walk(top.iter().copied(), &weights, u * mass)
            }
            None => walk(0..n, &weights, u * total),
        }
    }
}

/// The device's pick of this picker for a vocabulary of `vocab`, drawing its uniform
/// point from `rng` as [`Picker::pick`] would; `None` (drawing nothing) where the device
/// kernel does not pick as `pick` does: a nucleus over the whole vocabulary, or a top-k
/// above [`crate::model::cuda::PICK_MAX_K`].
#[cfg(feature = "cuda")]
impl Picker {
    /// Whether [`Picker::device_row`] gives a row for a vocabulary of `vocab`.
    pub fn on_device(&self, vocab: usize) -> bool {
        use crate::model::cuda::PICK_MAX_K;
        if self.greedy() {
            return true;
        }
        let k = self.top_k.unwrap_or(vocab).clamp(1, vocab.max(1));
        if k < vocab {
            k <= PICK_MAX_K
        } else {
            self.top_p >= 1.0
        }
    }

    /// The row for [`crate::model::cuda::pick_tokens`], drawing from `rng` exactly what
    /// `pick` draws; `None` (drawing nothing) where [`Picker::on_device`] is false.
    pub fn device_row(
        &self,
        vocab: usize,
        rng: &mut StdRng,
    ) -> Option<crate::model::cuda::PickRow> {
        use crate::model::cuda::PickRow;
        if !self.on_device(vocab) {
            return None;
        }
        if self.greedy() {
            return Some(PickRow {
                inv_temperature: 0.0,
                top_k: None,
                top_p: 1.0,
                u: 0.0,
            });
        }
        let k = self.top_k.unwrap_or(vocab).clamp(1, vocab.max(1));
        Some(PickRow {
            inv_temperature: 1.0 / self.temperature,
            top_k: (k < vocab).then_some(k),
            top_p: self.top_p,
            u: rng.random::<f64>(),
        })
    }
}

/// What the device's pick of a decode step gives one stream.
#[cfg(feature = "cuda")]
pub enum StepPick {
    /// The token and its log-probability, picked on the device.
    Chosen(u32, f32),
    /// The stream's row of logits, for the host to pick from.
    Logits(Vec<f32>),
}

/// Picks the next token on the GPU (`model::cuda::pick_tokens`) for every stream of
/// `streams` (its picker and generator) whose picker the kernel implements, copying back
/// only their tokens and log-probabilities, and copies the logits rows of the others for
/// the host; where the fused kernels run on `logits` (`(streams, vocab)`, f32, on `be`)
/// and at least one picker qualifies. `None` (nothing drawn, picked or copied) otherwise.
#[cfg(feature = "cuda")]
pub fn pick_on_device(
    be: crate::model::Backend,
    logits: &candle_core::Tensor,
    streams: &mut [(&Picker, &mut StdRng)],
) -> candle_core::Result<Option<Vec<StepPick>>> {
    use crate::model::cuda;
    let vocab = logits.dim(1)?;
    let on_device: Vec<bool> = streams.iter().map(|(p, _)| p.on_device(vocab)).collect();
    if !be.cuda(logits) || !cuda::pick_enabled() || !on_device.contains(&true) {
        return Ok(None);
    }
    let device_rows: Vec<u32> = (0..streams.len() as u32)
        .filter(|&i| on_device[i as usize])
        .collect();
    let rows: Vec<cuda::PickRow> = device_rows
        .iter()
        .map(|&i| {
            let (p, rng) = &mut streams[i as usize];
            p.device_row(vocab, rng).expect("checked on_device")
        })
        .collect();
    let mut chosen = if device_rows.len() == streams.len() {
        cuda::pick_tokens(logits, &rows)?
    } else {
        let idx = candle_core::Tensor::new(device_rows.as_slice(), logits.device())?;
        cuda::pick_tokens(&logits.index_select(&idx, 0)?, &rows)?
    }
    .into_iter();
    (0..streams.len())
        .map(|i| match on_device[i] {
            true => {
                let (token, logprob) = chosen.next().expect("one pick per device row");
                Ok(StepPick::Chosen(token, logprob))
            }
            false => Ok(StepPick::Logits(logits.get(i)?.to_vec1()?)),
        })
        .collect::<candle_core::Result<_>>()
        .map(Some)
}

/// The candidate at which the cumulative weight of `candidates` (in order) passes `u`;
/// the last one if rounding leaves `u` beyond them all.
fn walk(candidates: impl Iterator<Item = usize>, weights: &[f32], mut u: f64) -> usize {
    let mut last = 0;
    for i in candidates {
        let w = weights[i] as f64;
        if u < w {
            return i;
        }
        u -= w;
        last = i;
    }
    last
}

/// Orders the head of `idx` by `rank` and returns how many of its most likely tokens
/// first reach probability mass `top_p` (all of them if none do).
fn nucleus(
    idx: &mut [usize],
    top_p: f64,
    prob: impl Fn(usize) -> f64,
    rank: impl Fn(&usize, &usize) -> std::cmp::Ordering + Copy,
) -> usize {
    let mut head = NUCLEUS_START.min(idx.len());
    loop {
        if head < idx.len() {
            idx.select_nth_unstable_by(head - 1, rank);
        }
        idx[..head].sort_unstable_by(rank);
        let mut mass = 0.0;
        for (n, &i) in idx[..head].iter().enumerate() {
            mass += prob(i);
            if mass >= top_p {
                return n + 1;
            }
        }
        if head == idx.len() {
            return head;
        }
        head = (head * 8).min(idx.len());
    }
}

fn argmax(logits: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    /// A positive temperature too small for `1 / T` in f32 picks as greedy does, not
    /// whichever token NaN weights would walk to.
    #[test]
    fn a_vanishing_temperature_is_greedy() {
        let logits = [0.5f32, 3.0, -1.0, 2.0];
        for t in [1e-39, f64::MIN_POSITIVE] {
            let p = Picker {
                temperature: t,
                ..Default::default()
            };
            assert!(p.greedy());
            let mut rng = StdRng::seed_from_u64(1);
            assert_eq!(p.pick(&logits, &mut rng), 1);
        }
        assert!(!Picker::default().greedy());
    }

    #[test]
    fn greedy_picks_the_argmax() {
        let p = Picker {
            temperature: 0.0,
            ..Default::default()
        };
        let mut rng = StdRng::seed_from_u64(0);
        assert_eq!(p.pick(&[0.1, 3.0, -1.0, 2.9], &mut rng), 1);
    }

    #[test]
    fn top_k_one_is_greedy_and_top_p_truncates() {
        let mut rng = StdRng::seed_from_u64(1);
        let logits = [1.0f32, 5.0, 4.9, -3.0];
        let k1 = Picker {
            top_k: Some(1),
            ..Default::default()
        };
        assert!((0..50).all(|_| k1.pick(&logits, &mut rng) == 1));
        // Token 1 and 2 hold ~99.9 % of the mass; top_p 0.9 keeps only them.
        let p = Picker {
            top_p: 0.9,
            ..Default::default()
        };
        assert!((0..200).all(|_| matches!(p.pick(&logits, &mut rng), 1 | 2)));
    }

    /// The nucleus of a long, flat-tailed row needs more than the first 64 candidates;
    /// it must equal the one a full sort gives, at every mass.
    #[test]
    fn nucleus_equals_a_full_sort() {
        let mut rng = StdRng::seed_from_u64(3);
        let logits: Vec<f32> = (0..5000)
            .map(|i| {
                if i % 7 == 0 {
                    2.0
                } else {
                    rng.random::<f32>() * 4.0 - 2.0
                }
            })
            .collect();
        let mut sorted: Vec<usize> = (0..logits.len()).collect();
        sorted.sort_unstable_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        let max = logits[sorted[0]] as f64;
        let total: f64 = logits.iter().map(|&x| (x as f64 - max).exp()).sum();
        let prob = |i: usize| (logits[i] as f64 - max).exp() / total;
        for top_p in [0.001, 0.1, 0.5, 0.9, 0.999, 1.5] {
            let mut mass = 0.0;
            let want = sorted
                .iter()
                .position(|&i| {
                    mass += prob(i);
                    mass >= top_p
                })
                .map_or(sorted.len(), |n| n + 1);
            let mut idx: Vec<usize> = (0..logits.len()).collect();
            let rank = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b));
            let keep = nucleus(&mut idx, top_p, prob, rank);
            assert_eq!(keep, want, "top_p {top_p}");
            assert_eq!(idx[..keep], sorted[..keep], "top_p {top_p}");
        }
    }

    #[test]
    fn sampling_follows_the_softmax() {
        let mut rng = StdRng::seed_from_u64(2);
        let logits = [0.0f32, (3.0f32).ln()]; // probabilities 0.25 / 0.75
        let p = Picker::default();
        let ones = (0..4000).filter(|_| p.pick(&logits, &mut rng) == 1).count();
        assert!((2850..3150).contains(&ones), "{ones}");
    }

    #[test]
    fn token_logprob_is_log_softmax() {
        let lp = token_logprob(&[1.0, 2.0, 3.0], 2);
        let want = 3.0 - (1f64.exp() + 2f64.exp() + 3f64.exp()).ln();
        assert!((lp - want).abs() < 1e-6);
    }
}
