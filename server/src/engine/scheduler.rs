//! Which queued work the worker runs next: a pure function, unit-tested without channels.
//!
//! Rules:
//! - Each training run offers at most its next operation in `seq_id` order (the engine
//!   only lists ready heads), so per-run order holds whatever the batch.
//! - Forward passes of different runs fuse into one multi-adapter pass, oldest first,
//!   while their tokens fit `max_batch_tokens` (the oldest always runs, however large).
//!   Passes with and without gradient are not mixed: the oldest decides which kind runs.
//! - Cheap operations (optimizer steps, saves, loads) ride along with every batch.
//! - Sampling requests join oldest first while their prompt tokens fit the budget and
//!   their streams fit `max_sample_streams`.
//!
//! Because candidates are taken oldest first and every batch takes the oldest forward
//! pass and the oldest sampling request, no run or sampler can starve another.

/// What a candidate is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A forward pass over `tokens` input tokens, with or without gradient.
    Forward {
        /// Input tokens.
        tokens: usize,
        /// Whether it accumulates gradients.
        with_grad: bool,
    },
    /// Any other run operation.
    Other,
    /// A sampling request.
    Sample {
        /// Prompt tokens.
        tokens: usize,
        /// Sequences it decodes.
        streams: usize,
    },
}

/// One piece of waiting work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    /// Caller's handle.
    pub key: usize,
    /// Submission order (smaller is older).
    pub arrival: u64,
    /// What it is.
    pub kind: Kind,
}

/// Batch limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Most input tokens of fused forward passes (and of sampling prompts).
    pub max_batch_tokens: usize,
    /// Most sequences decoded together.
    pub max_sample_streams: usize,
}

/// The keys of the candidates to run now, oldest first.
pub fn plan(candidates: &[Candidate], limits: Limits) -> Vec<usize> {
    let mut sorted: Vec<&Candidate> = candidates.iter().collect();
    sorted.sort_by_key(|c| c.arrival);
    let grad_kind = sorted.iter().find_map(|c| match c.kind {
        Kind::Forward { with_grad, .. } => Some(with_grad),
        _ => None,
    });
    let mut forward_tokens = 0usize;
    let mut forwards = 0usize;
    let mut sample_tokens = 0usize;
    let mut streams = 0usize;
    let mut samples = 0usize;
    let mut chosen = Vec::new();
    for c in sorted {
        let take = match c.kind {
            Kind::Other => true,
            Kind::Forward { tokens, with_grad } => {
                let fits = forwards == 0 || forward_tokens + tokens <= limits.max_batch_tokens;
                let ok = Some(with_grad) == grad_kind && fits;
                if ok {
                    forward_tokens += tokens;
                    forwards += 1;
                }
                ok
            }
            Kind::Sample { tokens, streams: n } => {
                let fits = samples == 0
                    || (sample_tokens + tokens <= limits.max_batch_tokens
                        && streams + n <= limits.max_sample_streams);
                if fits {
                    sample_tokens += tokens;
                    streams += n;
                    samples += 1;
                }
                fits
            }
        };
        if take {
            chosen.push(c.key);
        }
    }
    chosen
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        max_batch_tokens: 100,
        max_sample_streams: 8,
    };

    fn fwd(key: usize, arrival: u64, tokens: usize, with_grad: bool) -> Candidate {
        Candidate {
            key,
            arrival,
            kind: Kind::Forward { tokens, with_grad },
        }
    }

    fn sample(key: usize, arrival: u64, tokens: usize, streams: usize) -> Candidate {
        Candidate {
            key,
            arrival,
            kind: Kind::Sample { tokens, streams },
        }
    }

    #[test]
    fn forward_passes_fuse_within_the_token_budget_oldest_first() {
        let c = [
            fwd(1, 3, 40, true),
            fwd(2, 1, 50, true),
            fwd(3, 2, 40, true),
        ];
        // Oldest (2, 50 tokens) then 3 (40) fit; 1 would exceed 100.
        assert_eq!(plan(&c, LIMITS), vec![2, 3]);
    }

    #[test]
    fn an_oversized_oldest_pass_still_runs_alone() {
        let c = [fwd(1, 1, 500, true), fwd(2, 2, 10, true)];
        assert_eq!(plan(&c, LIMITS), vec![1]);
    }

    #[test]
    fn gradient_and_forward_only_passes_do_not_mix() {
        let c = [
            fwd(1, 1, 10, false),
            fwd(2, 2, 10, true),
            fwd(3, 3, 10, false),
        ];
        assert_eq!(plan(&c, LIMITS), vec![1, 3]);
    }

    #[test]
    fn cheap_ops_and_samples_ride_along() {
        let c = [
            Candidate {
                key: 9,
                arrival: 5,
                kind: Kind::Other,
            },
            fwd(1, 1, 10, true),
            sample(4, 2, 10, 4),
            sample(5, 3, 10, 4),
            sample(6, 4, 10, 1),
        ];
        // Streams: 4 + 4 = 8 fills the budget; sample 6 waits.
        assert_eq!(plan(&c, LIMITS), vec![1, 4, 5, 9]);
    }

    #[test]
    fn nothing_waits_forever() {
        // Whatever arrives later, the oldest candidate of each kind is always chosen.
        let mut c: Vec<Candidate> = (0..50).map(|i| fwd(i, 100 + i as u64, 30, true)).collect();
        c.push(fwd(99, 0, 90, true));
        c.push(sample(98, 1, 1000, 64));
        let chosen = plan(&c, LIMITS);
        assert!(chosen.contains(&99) && chosen.contains(&98));
    }

    #[test]
    fn empty_input_plans_nothing() {
        assert!(plan(&[], LIMITS).is_empty());
    }
}
