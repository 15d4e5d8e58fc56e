//! Which queued work the worker runs next: pure functions, unit-tested without channels.
//!
//! The worker runs one batch at a time: the engine offers each run's next piece of work
//! (a forward request is cut into passes of whole datums of at most the pass budget, see
//! `dispatch.rs`), every waiting sampling request, and a decode step of the sequences
//! being decoded, and [`plan`] picks the next batch. Between any two passes or decode
//! steps the choice is made again, so a request of millions of tokens, or of thousands of
//! sampled tokens, holds the worker one pass or one step at a time, as iteration-level
//! schedulers (Orca, TGI, vLLM) do.
//!
//! Rules:
//! - Fair share across API keys, in tokens: candidates are taken in order of their key's
//!   service level ([`Service`], the tokens run for it while it has had work waiting),
//!   then age. Each pick charges its tokens to its key, so a key with many runs does not
//!   take every slot of a pass, and a key that was idle goes ahead of a key with a
//!   backlog: it waits at most about one pass.
//! - One budget of `max_batch_tokens` per batch, shared by forward passes, the prompts of
//!   new sampling requests and a decode step (one token per live sequence); the first
//!   pick always runs, however large. So a decode step and a training backlog alternate
//!   by fair share: a key decoding 8 sequences is charged 8 tokens a step and gets about
//!   `max_batch_tokens / 8` steps for each full pass of another key's backlog.
//! - Each training run offers at most its next operation in `seq_id` order (the engine
//!   only lists ready heads), so per-run order holds whatever the batch.
//! - Forward passes of different runs fuse into one multi-adapter pass while their tokens
//!   fit. Passes with and without gradient are not mixed: the first forward pick decides
//!   which kind runs.
//! - Cheap operations (optimizer steps, snapshots, loads of small adapters) ride along
//!   with every batch, each charged [`MIN_CHARGE`]; saves (which sync files whatever
//!   their size) and those of large adapters are [`Kind::Solo`] with their work in
//!   tokens (`dispatch::adapter_work`), scheduled like a pass.
//! - New sampling requests join the running decode while their streams fit
//!   `max_sample_streams` beside the live ones. Once the most deserving waiting request
//!   does not fit, later ones wait behind it, so the live streams drain until it does (a
//!   large request is never starved by a stream of small ones).
//! - The first candidate a plan passes over (it did not fit the budget or the streams, or
//!   was of the other gradient kind) while its key was at the front by fair share (the
//!   least-served waiting key, or within a token of it) is [`Reserved`]: the next plan
//!   takes it first, ahead of keys that came back from idle since. Without that, a key
//!   returning just below the waiting ones, again and again, could keep a large pass or
//!   sample from ever fitting. The decode step is never reserved.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

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
    /// A run operation that runs by itself in the worker over `tokens` tokens (MinT's
    /// reverse KL): it takes its tokens of the batch budget and is charged them.
    Solo {
        /// Tokens it reads.
        tokens: usize,
    },
    /// Any other run operation.
    Other,
    /// A new sampling request: its prompt is prefilled and its sequences join the decode.
    Sample {
        /// Prompt tokens.
        tokens: usize,
        /// Sequences it decodes.
        streams: usize,
        /// Reading its checkpoint adapter in the worker, in tokens (0 when the worker
        /// holds it).
        read: usize,
    },
    /// One decode step of every live sequence (one token each).
    Decode {
        /// Live sequences.
        streams: usize,
    },
    /// One pass of rescoring a finished sampling request's tokens.
    Rescore {
        /// Tokens scored.
        rows: usize,
    },
}

/// The least a pick is charged (a decode step excepted: it is charged per sequence):
/// every pick has a fixed cost in the worker, so a key sending one-token requests is not
/// served a thousand of them for each of another key's full passes.
pub const MIN_CHARGE: u64 = 64;

impl Kind {
    /// The service a pick of this kind is charged, in tokens.
    pub fn charge(&self) -> u64 {
        match *self {
            Kind::Forward { tokens, .. } | Kind::Solo { tokens } => (tokens as u64).max(MIN_CHARGE),
            Kind::Sample { tokens, read, .. } => {
                (tokens as u64).max(MIN_CHARGE).saturating_add(read as u64)
            }
            Kind::Other => MIN_CHARGE,
            Kind::Rescore { rows } => (rows as u64).max(MIN_CHARGE),
            Kind::Decode { streams } => streams as u64,
        }
    }

    /// Tokens it takes of a batch's budget.
    fn tokens(&self) -> usize {
        match *self {
            Kind::Forward { tokens, .. } | Kind::Solo { tokens } => tokens,
            Kind::Sample { tokens, read, .. } => tokens.saturating_add(read),
            Kind::Decode { streams } => streams,
            Kind::Rescore { rows } => rows,
            Kind::Other => 0,
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
    /// Most tokens of one batch: forward passes, new prompts and a decode step together.
    pub max_batch_tokens: usize,
    /// Most sequences decoded together.
    pub max_sample_streams: usize,
    /// Sequences decoding now.
    pub live_streams: usize,
}

/// The candidate (by its `arrival`) that the last plan passed over first, which the next
/// plan takes first. Kept by the caller from plan to plan.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Reserved(Option<u64>);

/// The keys of the candidates to run now, in the order they were picked. `levels[o]` is
/// the service level of owner `o` (see [`Service::levels`]); `reserved` is taken first if
/// it is still a candidate, and is then set to the first candidate this plan passed over.
/// Takes `O(n log n)` for `n` candidates: each key's candidates are a queue by age, and
/// the keys a heap by (reservation, level, age).
pub fn plan(
    candidates: &[Candidate],
    limits: Limits,
    levels: &[u64],
    reserved: &mut Reserved,
) -> Vec<usize> {
    let mut charge: Vec<u64> = levels.to_vec();
    let mut chosen: Vec<usize> = candidates
        .iter()
        .filter(|c| c.kind == Kind::Other)
        .map(|c| c.key)
        .collect();
    // Each key's candidates, oldest last (popped first).
    let mut queues: Vec<Vec<&Candidate>> = vec![Vec::new(); levels.len()];
    for c in candidates.iter().filter(|c| c.kind != Kind::Other) {
        queues[c.owner].push(c);
    }
    // A key's oldest candidate is the reserved one if any is: each key runs oldest first.
    let first = |c: &Candidate| u8::from(Some(c.arrival) != reserved.0);
    let mut heap = BinaryHeap::new();
    for (owner, q) in queues.iter_mut().enumerate() {
        q.sort_unstable_by_key(|c| Reverse(c.arrival));
        if let Some(c) = q.last() {
            heap.push(Reverse((first(c), charge[owner], c.arrival, owner)));
        }
    }
    // Only a candidate that fair share had at (or within a token of) the front is
    // reserved: that is the one a key returning from idle (started just below the
    // waiting keys) can push out again and again. A more-served key's work, or the
    // decode step, waits its turn by level as before.
    let front = queues
        .iter()
        .enumerate()
        .filter(|(_, q)| !q.is_empty())
        .map(|(owner, _)| levels[owner])
        .min()
        .unwrap_or(0);
    let mut passed_over = None;
    let mut grad_kind: Option<bool> = None;
    let (mut used, mut picks, mut admitted) = (0usize, 0usize, 0usize);
    let mut sample_blocked = false;
    while let Some(Reverse((_, _, _, owner))) = heap.pop() {
        let c = queues[owner].pop().expect("a queued candidate");
        let fits = picks == 0 || used.saturating_add(c.kind.tokens()) <= limits.max_batch_tokens;
        let take = fits
            && match c.kind {
                Kind::Forward { with_grad, .. } => *grad_kind.get_or_insert(with_grad) == with_grad,
                Kind::Sample { streams: n, .. } => {
                    let decoding = limits.live_streams + admitted;
                    let room = !sample_blocked
                        && (decoding == 0
                            || decoding.saturating_add(n) <= limits.max_sample_streams);
                    if room {
                        admitted += n;
                    } else {
                        sample_blocked = true;
                    }
                    room
                }
                Kind::Decode { .. } | Kind::Solo { .. } | Kind::Rescore { .. } => true,
                Kind::Other => unreachable!("taken above"),
            };
        if take {
            used = used.saturating_add(c.kind.tokens());
            picks += 1;
            charge[owner] = charge[owner].saturating_add(c.kind.charge());
            chosen.push(c.key);
        } else {
            let reservable =
                !matches!(c.kind, Kind::Decode { .. }) && levels[owner] <= front.saturating_add(1);
            if reservable {
                passed_over = passed_over.or(Some(c.arrival));
            }
        }
        if let Some(next) = queues[owner].last() {
            heap.push(Reverse((first(next), charge[owner], next.arrival, owner)));
        }
    }
    *reserved = Reserved(passed_over);
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

    #[test]
    fn a_samples_adapter_read_is_charged_beyond_the_minimum_and_takes_batch_room() {
        let sample = |tokens, read| Kind::Sample {
            tokens,
            streams: 1,
            read,
        };
        assert_eq!(sample(3, 0).charge(), MIN_CHARGE);
        assert_eq!(sample(3, 300).charge(), MIN_CHARGE + 300);
        assert_eq!(sample(100, 300).charge(), 400);
        assert_eq!(sample(3, 300).tokens(), 303);
    }

    const LIMITS: Limits = Limits {
        max_batch_tokens: 100,
        max_sample_streams: 8,
        live_streams: 0,
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
                read: 0,
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
        assert_eq!(plan(&c, LIMITS, &[0], &mut Reserved::default()), vec![2, 3]);
    }

    #[test]
    fn an_oversized_first_pass_still_runs_alone() {
        let c = [fwd(1, 1, 500, true), fwd(2, 2, 10, true)];
        assert_eq!(plan(&c, LIMITS, &[0], &mut Reserved::default()), vec![1]);
    }

    #[test]
    fn gradient_and_forward_only_passes_do_not_mix() {
        let c = [
            fwd(1, 1, 10, false),
            fwd(2, 2, 10, true),
            fwd(3, 3, 10, false),
        ];
        assert_eq!(plan(&c, LIMITS, &[0], &mut Reserved::default()), vec![1, 3]);
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
        assert_eq!(
            sorted(plan(&c, LIMITS, &[0], &mut Reserved::default())),
            vec![1, 4, 5, 9]
        );
    }

    #[test]
    fn the_least_served_key_goes_first_and_a_backlog_shares_the_pass() {
        // Key 0 has a backlog of four runs; key 1's one pass arrived last.
        let mut c: Vec<Candidate> = (0..4)
            .map(|i| owned(fwd(i, i as u64, 40, true), 0))
            .collect();
        c.push(owned(fwd(9, 10, 40, true), 1));
        // Key 0 has been served more: key 1 goes first, key 0 fills the rest.
        assert_eq!(
            plan(&c, LIMITS, &[1000, 0], &mut Reserved::default()),
            vec![9, 0]
        );
        // Equal levels: charging each pick alternates the keys.
        let c = [
            owned(fwd(1, 1, 30, true), 0),
            owned(fwd(2, 2, 30, true), 0),
            owned(fwd(3, 3, 30, true), 1),
        ];
        assert_eq!(
            plan(&c, LIMITS, &[0, 0], &mut Reserved::default()),
            vec![1, 3, 2]
        );
    }

    #[test]
    fn nothing_waits_forever() {
        // Whatever arrives later, the least-served key's oldest work runs first: the large
        // sampling request does not fit beside the old pass, and is first in the next batch.
        let mut c: Vec<Candidate> = (0..50).map(|i| fwd(i, 100 + i as u64, 30, true)).collect();
        c.push(fwd(99, 0, 90, true));
        c.push(sample(98, 1, 1000, 64));
        assert_eq!(plan(&c, LIMITS, &[0], &mut Reserved::default())[0], 99);
        c.retain(|c| c.key != 99);
        assert_eq!(plan(&c, LIMITS, &[0], &mut Reserved::default()), vec![98]);
    }

    fn decode(key: usize, owner: usize, streams: usize) -> Candidate {
        Candidate {
            key,
            arrival: 0,
            owner,
            kind: Kind::Decode { streams },
        }
    }

    #[test]
    fn new_sampling_requests_join_a_decode_while_their_streams_fit() {
        let limits = Limits {
            live_streams: 6,
            ..LIMITS
        };
        let c = [decode(0, 0, 6), sample(1, 1, 10, 2), sample(2, 2, 10, 1)];
        // 6 live + 2 fills the 8 streams: the second request waits for a sequence to end.
        assert_eq!(plan(&c, limits, &[0], &mut Reserved::default()), vec![0, 1]);
        // The oldest request needs 3 streams, 2 are free: it waits, and the smaller one
        // behind it waits too rather than taking the room it needs.
        let c = [decode(0, 0, 6), sample(1, 1, 10, 3), sample(2, 2, 10, 1)];
        assert_eq!(plan(&c, limits, &[0], &mut Reserved::default()), vec![0]);
        // Nothing live and a request larger than the limit: it runs alone.
        let c = [sample(1, 1, 10, 20), sample(2, 2, 10, 1)];
        assert_eq!(plan(&c, LIMITS, &[0], &mut Reserved::default()), vec![1]);
    }

    #[test]
    fn a_decode_and_another_keys_training_backlog_share_the_worker_by_tokens() {
        // Key 0 has an endless backlog of full passes; key 1 decodes 4 sequences. Batch
        // after batch, each key is served about the same number of tokens.
        let mut service = Service::default();
        let mut reserved = Reserved::default();
        let mut served = [0u64; 2];
        let (mut passes, mut steps) = (0, 0);
        for _ in 0..2000 {
            // One long request: its passes keep its arrival.
            let c = [owned(fwd(1, 1, 100, true), 0), decode(2, 1, 4)];
            let levels = service.levels(&["hog", "sampler"]);
            for key in plan(&c, LIMITS, &levels, &mut reserved) {
                let (owner, name) = if key == 1 { (0, "hog") } else { (1, "sampler") };
                let charge = c[key - 1].kind.charge();
                service.charge(name, charge);
                served[owner] += charge;
                if key == 1 {
                    passes += 1;
                } else {
                    steps += 1;
                }
            }
        }
        let ratio = served[0] as f64 / served[1] as f64;
        assert!((0.9..1.1).contains(&ratio), "{served:?}");
        // About 25 decode steps (of 4 tokens) for each pass of 100 tokens, never both in
        // one batch (they would exceed the budget).
        assert_eq!(passes + steps, 2000);
        assert!(
            (20..=30).contains(&(steps / passes)),
            "{steps} steps, {passes} passes"
        );
    }

    #[test]
    fn empty_input_plans_nothing() {
        assert!(plan(&[], LIMITS, &[], &mut Reserved::default()).is_empty());
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

    /// Keys that come back from idle again and again, each just below the waiting key,
    /// do not keep a large pass or sample from ever fitting: the first candidate passed
    /// over goes first in the next plan.
    #[test]
    fn a_large_request_is_not_starved_by_keys_returning_from_idle() {
        // Key "big" waits with a 90-token pass; each round a returning key brings a
        // 20-token pass, and the two do not fit one 100-token batch together.
        let mut service = Service::default();
        service.levels(&["big"]);
        service.charge("big", 500);
        let mut reserved = Reserved::default();
        let mut ran_big = None;
        for round in 0..10u64 {
            let c = [
                owned(fwd(1, 1, 90, true), 0),
                owned(fwd(2, 10 + round, 20, true), 1),
            ];
            let name = format!("returning-{}", round % 2);
            let levels = service.levels(&["big", &name]);
            let chosen = plan(&c, LIMITS, &levels, &mut reserved);
            for &key in &chosen {
                let owner = if key == 1 { "big" } else { name.as_str() };
                service.charge(owner, c[key - 1].kind.charge());
            }
            if chosen.contains(&1) {
                ran_big = Some(round);
                break;
            }
            // The returning key idles until its next request.
            service.levels(&["big"]);
        }
        // The returning key goes first once (it is less served), then the large pass.
        assert_eq!(ran_big, Some(1));
        // The same for a sampling request that needs every stream: the live ones drain.
        let limits = Limits {
            live_streams: 4,
            ..LIMITS
        };
        let mut reserved = Reserved::default();
        // Key 0 waits with a request for 8 streams, key 1 decodes 4, key 2 returns with
        // a request for 1.
        let c = [
            decode(0, 1, 4),
            owned(sample(1, 1, 10, 8), 0),
            owned(sample(2, 5, 10, 1), 2),
        ];
        // The large request's key is the least served but one token (levels 1, the
        // decode's 5, a returning key's 0): the returning key's small request goes first
        // and fits, the large one does not and is reserved. From then on it is first, and
        // nothing joins the decode until it fits.
        let levels = [1, 5, 0];
        assert_eq!(plan(&c, limits, &levels, &mut reserved), vec![2, 0]);
        assert_eq!(reserved, Reserved(Some(1)));
        assert_eq!(plan(&c, limits, &levels, &mut reserved), vec![0]);
        assert_eq!(reserved, Reserved(Some(1)));
        let drained = Limits {
            live_streams: 0,
            ..LIMITS
        };
        let c = [c[1], c[2]];
        assert_eq!(plan(&c, drained, &levels, &mut reserved), vec![1]);
        // A more-served key's work passed over is not reserved: it waits its turn.
        let mut reserved = Reserved::default();
        let c = [owned(fwd(1, 1, 90, true), 0), owned(fwd(2, 2, 20, true), 1)];
        assert_eq!(plan(&c, LIMITS, &[500, 0], &mut reserved), vec![2]);
        assert_eq!(reserved, Reserved::default());
    }
}
