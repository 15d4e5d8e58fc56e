//! Which queued work the worker runs next: pure functions, unit-tested without channels.
//!
//! The worker runs one *pass* at a time: the engine offers each run's next piece of work
//! (a forward request is cut into passes of whole datums of at most the pass budget, see
//! `state.rs`) and every waiting sampling request, and [`plan`] picks the next batch. Between
//! any two passes the choice is made again, so a request of millions of tokens holds the
//! worker one pass at a time, as iteration-level schedulers (Orca, TGI, vLLM) do.
//!
//! Rules:
//! - Fair share across API keys, in tokens: candidates are taken in order of their key's
//!   service level ([`Service`], the tokens run for it while it has had work waiting),
//!   then age. Each pick charges its tokens to its key, so a key with many runs does not
//!   take every slot of a pass, and a key that was idle goes ahead of a key with a
//!   backlog: it waits at most about one pass.
//! - Each training run offers at most its next operation in `seq_id` order (the engine
//!   only lists ready heads), so per-run order holds whatever the batch.
//! - Forward passes of different runs fuse into one multi-adapter pass while their tokens
//!   fit the pass budget (the first pick always runs, however large). Passes with and
//!   without gradient are not mixed: the first forward pick decides which kind runs.
//! - Cheap operations (optimizer steps, saves, loads) ride along with every batch.
//! - Sampling requests join in the same fair order while their prompt tokens fit the
//!   budget and their streams fit `max_sample_streams`; the first always runs.

use std::collections::HashMap;

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
        /// Tokens it costs: `streams x (prompt + max_tokens)`.
        cost: usize,
    },
}

/// The least a forward pass or sampling request is charged: every pick has a fixed cost
/// in the worker, so a key sending one-token requests is not served a thousand of them
/// for each of another key's full passes.
pub const MIN_CHARGE: u64 = 64;

impl Kind {
    /// The service a pick of this kind is charged, in tokens.
    pub fn charge(&self) -> u64 {
        match *self {
            Kind::Forward { tokens, .. } => (tokens as u64).max(MIN_CHARGE),
            Kind::Other => 0,
            Kind::Sample { cost, .. } => (cost as u64).max(MIN_CHARGE),
        }
    }
}

/// One piece of waiting work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    /// Caller's handle.
    pub key: usize,
    /// Submission order (smaller is older).
    pub arrival: u64,
    /// Index of its API key in the `levels` given to [`plan`].
    pub owner: usize,
    /// What it is.
    pub kind: Kind,
}

/// Batch limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Most input tokens of one pass of fused forward passes (and of sampling prompts).
    pub max_batch_tokens: usize,
    /// Most sequences decoded together.
    pub max_sample_streams: usize,
}

/// The keys of the candidates to run now, in the order they were picked. `levels[o]` is
/// the service level of owner `o` (see [`Service::levels`]).
pub fn plan(candidates: &[Candidate], limits: Limits, levels: &[u64]) -> Vec<usize> {
    let mut charge: Vec<u64> = levels.to_vec();
    let mut left: Vec<&Candidate> = candidates.iter().collect();
    let mut chosen: Vec<usize> = left
        .iter()
        .filter(|c| c.kind == Kind::Other)
        .map(|c| c.key)
        .collect();
    left.retain(|c| c.kind != Kind::Other);
    let mut grad_kind: Option<bool> = None;
    let (mut forward_tokens, mut forwards) = (0usize, 0usize);
    let (mut sample_tokens, mut streams, mut samples) = (0usize, 0usize, 0usize);
    while !left.is_empty() {
        let at = (0..left.len())
            .min_by_key(|&i| (charge[left[i].owner], left[i].arrival))
            .expect("not empty");
        let c = left.swap_remove(at);
        let take = match c.kind {
            Kind::Forward { tokens, with_grad } => {
                let kind_ok = *grad_kind.get_or_insert(with_grad) == with_grad;
                let fits = forwards == 0 || forward_tokens + tokens <= limits.max_batch_tokens;
                let ok = kind_ok && fits;
                if ok {
                    forward_tokens += tokens;
                    forwards += 1;
                }
                ok
            }
            Kind::Sample {
                tokens, streams: n, ..
            } => {
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
            Kind::Other => unreachable!("taken above"),
        };
        if take {
            charge[c.owner] = charge[c.owner].saturating_add(c.kind.charge());
            chosen.push(c.key);
        }
    }
    chosen
}

/// Tokens run for each API key while it has had work waiting: the fair-share clock.
///
/// A key that becomes idle is forgotten; when it has work again it starts just below the
/// least-served key that is waiting (start-time fair queueing's virtual time), so idling
/// earns no credit to hog with later, and a returning key goes ahead of a backlog.
#[derive(Debug, Default)]
pub struct Service {
    served: HashMap<String, u64>,
}

impl Service {
    /// The service levels of `active` (the keys with work waiting now), in their order.
    pub fn levels(&mut self, active: &[&str]) -> Vec<u64> {
        self.served.retain(|k, _| active.contains(&k.as_str()));
        let floor = self.served.values().min().copied().unwrap_or(0);
        active
            .iter()
            .map(|&k| {
                *self
                    .served
                    .entry(k.to_string())
                    .or_insert(floor.saturating_sub(1))
            })
            .collect()
    }

    /// Charges `tokens` of service to `key`.
    pub fn charge(&mut self, key: &str, tokens: u64) {
        if let Some(s) = self.served.get_mut(key) {
            *s = s.saturating_add(tokens);
        }
    }
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
            owner: 0,
            kind: Kind::Forward { tokens, with_grad },
        }
    }

    fn sample(key: usize, arrival: u64, tokens: usize, streams: usize) -> Candidate {
        Candidate {
            key,
            arrival,
            owner: 0,
            kind: Kind::Sample {
                tokens,
                streams,
                cost: tokens * streams,
            },
        }
    }

    fn owned(mut c: Candidate, owner: usize) -> Candidate {
        c.owner = owner;
        c
    }

    fn sorted(mut v: Vec<usize>) -> Vec<usize> {
        v.sort_unstable();
        v
    }

    #[test]
    fn forward_passes_fuse_within_the_token_budget_oldest_first() {
        let c = [
            fwd(1, 3, 40, true),
            fwd(2, 1, 50, true),
            fwd(3, 2, 40, true),
        ];
        // Oldest (2, 50 tokens) then 3 (40) fit; 1 would exceed 100.
        assert_eq!(plan(&c, LIMITS, &[0]), vec![2, 3]);
    }

    #[test]
    fn an_oversized_first_pass_still_runs_alone() {
        let c = [fwd(1, 1, 500, true), fwd(2, 2, 10, true)];
        assert_eq!(plan(&c, LIMITS, &[0]), vec![1]);
    }

    #[test]
    fn gradient_and_forward_only_passes_do_not_mix() {
        let c = [
            fwd(1, 1, 10, false),
            fwd(2, 2, 10, true),
            fwd(3, 3, 10, false),
        ];
        assert_eq!(plan(&c, LIMITS, &[0]), vec![1, 3]);
    }

    #[test]
    fn cheap_ops_and_samples_ride_along() {
        let c = [
            Candidate {
                key: 9,
                arrival: 5,
                owner: 0,
                kind: Kind::Other,
            },
            fwd(1, 1, 10, true),
            sample(4, 2, 10, 4),
            sample(5, 3, 10, 4),
            sample(6, 4, 10, 1),
        ];
        // Streams: 4 + 4 = 8 fills the budget; sample 6 waits.
        assert_eq!(sorted(plan(&c, LIMITS, &[0])), vec![1, 4, 5, 9]);
    }

    #[test]
    fn the_least_served_key_goes_first_and_a_backlog_shares_the_pass() {
        // Key 0 has a backlog of four runs; key 1's one pass arrived last.
        let mut c: Vec<Candidate> = (0..4)
            .map(|i| owned(fwd(i, i as u64, 40, true), 0))
            .collect();
        c.push(owned(fwd(9, 10, 40, true), 1));
        // Key 0 has been served more: key 1 goes first, key 0 fills the rest.
        assert_eq!(plan(&c, LIMITS, &[1000, 0]), vec![9, 0]);
        // Equal levels: charging each pick alternates the keys.
        let c = [
            owned(fwd(1, 1, 30, true), 0),
            owned(fwd(2, 2, 30, true), 0),
            owned(fwd(3, 3, 30, true), 1),
        ];
        assert_eq!(plan(&c, LIMITS, &[0, 0]), vec![1, 3, 2]);
    }

    #[test]
    fn nothing_waits_forever() {
        // Whatever arrives later, the least-served key's oldest work of each kind runs.
        let mut c: Vec<Candidate> = (0..50).map(|i| fwd(i, 100 + i as u64, 30, true)).collect();
        c.push(fwd(99, 0, 90, true));
        c.push(sample(98, 1, 1000, 64));
        let chosen = plan(&c, LIMITS, &[0]);
        assert!(chosen.contains(&99) && chosen.contains(&98));
    }

    #[test]
    fn empty_input_plans_nothing() {
        assert!(plan(&[], LIMITS, &[]).is_empty());
    }

    #[test]
    fn a_returning_key_starts_just_below_the_waiting_ones_and_earns_no_credit_idle() {
        let mut s = Service::default();
        assert_eq!(s.levels(&["hog"]), vec![0]);
        s.charge("hog", 5000);
        // The victim arrives: it goes ahead of the hog's backlog, by one token's worth.
        assert_eq!(s.levels(&["hog", "victim"]), vec![5000, 4999]);
        s.charge("victim", 100);
        assert_eq!(s.levels(&["hog", "victim"]), vec![5000, 5099]);
        // The victim idles while the hog runs on; coming back, it starts level again.
        assert_eq!(s.levels(&["hog"]), vec![5000]);
        s.charge("hog", 100_000);
        assert_eq!(s.levels(&["victim", "hog"]), vec![104_999, 105_000]);
    }
}
