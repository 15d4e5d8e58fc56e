//! The futures table: one entry per submitted request, pending until the worker answers,
//! then kept for a while so clients can re-poll after a network error.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::completions::Completions;
use crate::worker::{Failure, Reply};

/// A finished request: its result or the failure.
pub type FutureResult = Arc<Result<Reply, Failure>>;

/// How long a retrieved result stays, for a client that re-polls after losing the
/// response on the network.
pub const RETRIEVED_GRACE: Duration = Duration::from_secs(60);

/// Memory a finished entry holds besides its result (its id twice, its owner, its
/// slots in the map and in its key's queue), charged with the result so that results
/// of a few bytes (failures, cancels) cannot fill the table in their millions.
const ENTRY_BYTES: usize = 512;

/// Most finished results one key keeps: past it its oldest go, as past the byte budget.
/// Bounds the table that [`Futures::expire`] walks on every tick of the engine.
pub const MAX_FINISHED_PER_KEY: usize = 65_536;

/// What `retrieve_future` gets.
pub enum Poll {
    /// Finished.
    Ready(FutureResult),
    /// Still pending: resolves when it finishes.
    Wait(oneshot::Receiver<FutureResult>),
}

enum State {
    /// Waiters, each with whether its delivery counts as a retrieval.
    Pending(Vec<(oneshot::Sender<FutureResult>, bool)>),
    Done {
        result: FutureResult,
        at: Instant,
        bytes: usize,
        /// When a client first received it.
        retrieved: Option<Instant>,
    },
}

struct Entry {
    owner: String,
    state: State,
}

/// All futures by request id. Finished results are kept until retrieved (then for
/// [`RETRIEVED_GRACE`]) or until the TTL, and within a byte budget: past it, the API key
/// holding the most result bytes loses its oldest results first, so one key leaving
/// results unretrieved cannot push out another key's.
pub struct Futures {
    map: HashMap<String, Entry>,
    /// Each key's finished ids, oldest first (ids already gone are skipped when met).
    finished: HashMap<String, VecDeque<String>>,
    /// Bytes each key's finished results hold.
    held: HashMap<String, usize>,
    done_bytes: usize,
    budget: usize,
    /// Sampling sessions' completion queues (`retrieve_futures`).
    pub completions: Completions,
    /// Unretrieved results dropped since the last warning, and when that was: a key
    /// flooding the table is logged once a minute, not once a result.
    dropped_unretrieved: u64,
    warned_at: Option<Instant>,
}

/// How often dropping unretrieved results is logged at most.
const DROP_WARNING_EVERY: Duration = Duration::from_secs(60);

impl Default for Futures {
    fn default() -> Self {
        Self::with_budget(usize::MAX)
    }
}

impl Futures {
    /// A table whose finished results may hold `budget` bytes.
    pub fn with_budget(budget: usize) -> Self {
        Self {
            map: HashMap::new(),
            finished: HashMap::new(),
            held: HashMap::new(),
            done_bytes: 0,
            budget,
            completions: Completions::default(),
            dropped_unretrieved: 0,
            warned_at: None,
        }
    }

    /// Registers a new pending future.
    pub fn insert(&mut self, request_id: String, owner: &str) {
        self.map.insert(
            request_id,
            Entry {
                owner: owner.to_string(),
                state: State::Pending(Vec::new()),
            },
        );
    }

    /// Completes a future and wakes its waiters. Unknown ids are ignored (internal work
    /// such as unloading an expired run has no future).
    pub fn resolve(&mut self, request_id: &str, result: Result<Reply, Failure>) {
        let Some(entry) = self.map.get_mut(request_id) else {
            return;
        };
        let State::Pending(waiters) = &mut entry.state else {
            return;
        };
        let bytes = ENTRY_BYTES
            + match &result {
                Ok(r) => r.approx_bytes(),
                Err(f) => f.message.len(),
            };
        self.completions.record(request_id, result.is_err());
        let result = Arc::new(result);
        let mut delivered = false;
        for (w, marks) in waiters.drain(..) {
            delivered |= w.send(result.clone()).is_ok() && marks;
        }
        let now = Instant::now();
        entry.state = State::Done {
            result,
            at: now,
            bytes,
            retrieved: delivered.then_some(now),
        };
        let owner = entry.owner.clone();
        self.done_bytes += bytes;
        *self.held.entry(owner.clone()).or_default() += bytes;
        let queue = self.finished.entry(owner.clone()).or_default();
        queue.push_back(request_id.to_string());
        if queue.len() > MAX_FINISHED_PER_KEY {
            let oldest = queue.pop_front().expect("the queue is not empty");
            self.drop_finished(
                &owner,
                &oldest,
                "the key has more finished results than MAX_FINISHED_PER_KEY",
            );
        }
        self.enforce_budget();
    }

    /// Drops `owner`'s finished result `id` (if it is still kept), warning when its
    /// client never received it.
    fn drop_finished(&mut self, owner: &str, id: &str, why: &str) {
        if let Some(Entry {
            state: State::Done {
                bytes, retrieved, ..
            },
            ..
        }) = self.map.get(id)
        {
            let unretrieved = retrieved.is_none();
            let bytes = *bytes;
            if unretrieved {
                self.dropped_unretrieved += 1;
                let now = Instant::now();
                if self
                    .warned_at
                    .is_none_or(|at| now.duration_since(at) >= DROP_WARNING_EVERY)
                {
                    tracing::warn!(
                        request = %id,
                        owner = %owner,
                        dropped = self.dropped_unretrieved,
                        "dropping unretrieved results (this one's key's): {why}"
                    );
                    self.dropped_unretrieved = 0;
                    self.warned_at = Some(now);
                }
            }
            self.done_bytes -= bytes;
            self.release(owner, bytes);
            self.map.remove(id);
        }
    }

    /// Drops finished results until they fit the budget, each time the oldest of the key
    /// holding the most bytes.
    fn enforce_budget(&mut self) {
        while self.done_bytes > self.budget {
            let Some(owner) = self
                .held
                .iter()
                .max_by_key(|(_, b)| **b)
                .map(|(o, _)| o.clone())
            else {
                break;
            };
            let Some(id) = self.finished.get_mut(&owner).and_then(VecDeque::pop_front) else {
                // Nothing left to drop for this key: its count is stale.
                self.held.remove(&owner);
                continue;
            };
            self.drop_finished(&owner, &id, "finished results exceed --max-result-bytes");
        }
    }

    /// `bytes` of `owner`'s results are gone.
    fn release(&mut self, owner: &str, bytes: usize) {
        if let Some(held) = self.held.get_mut(owner) {
            *held = held.saturating_sub(bytes);
            if *held == 0 {
                self.held.remove(owner);
                self.finished.remove(owner);
            }
        }
    }

    /// Whether `owner`'s request is still pending (`None`: no such request of theirs).
    pub fn is_pending(&self, request_id: &str, owner: &str) -> Option<bool> {
        let entry = self.map.get(request_id).filter(|e| e.owner == owner)?;
        Some(matches!(entry.state, State::Pending(_)))
    }

    /// `owner`'s future `request_id`: finished, or a receiver for its result. With
    /// `mark`, a finished result (or one delivered to this receiver) counts as retrieved
    /// at once; without, only when [`Futures::mark_retrieved`] says it was handed over.
    pub fn poll(&mut self, request_id: &str, owner: &str, mark: bool) -> Option<Poll> {
        let entry = self.map.get_mut(request_id)?;
        if entry.owner != owner {
            return None;
        }
        Some(match &mut entry.state {
            State::Done {
                result, retrieved, ..
            } => {
                if mark {
                    retrieved.get_or_insert_with(Instant::now);
                }
                Poll::Ready(result.clone())
            }
            State::Pending(waiters) => {
                let (tx, rx) = oneshot::channel();
                waiters.retain(|(w, _)| !w.is_closed());
                waiters.push((tx, mark));
                Poll::Wait(rx)
            }
        })
    }

    /// `owner`'s finished `request_id` was handed to its client: it goes
    /// [`RETRIEVED_GRACE`] from now (or from an earlier hand-over).
    pub fn mark_retrieved(&mut self, request_id: &str, owner: &str) {
        if let Some(Entry {
            owner: o,
            state: State::Done { retrieved, .. },
        }) = self.map.get_mut(request_id)
        {
            if o == owner {
                retrieved.get_or_insert_with(Instant::now);
            }
        }
    }

    /// Forgets finished futures retrieved more than [`RETRIEVED_GRACE`] ago, or finished
    /// more than `ttl` ago.
    pub fn expire(&mut self, now: Instant, ttl: Duration) {
        let mut freed: Vec<(String, usize)> = Vec::new();
        self.map.retain(|_, e| match &e.state {
            State::Done {
                at,
                bytes,
                retrieved,
                ..
            } => {
                let keep = now.saturating_duration_since(*at) < ttl
                    && retrieved.is_none_or(|r| now.saturating_duration_since(r) < RETRIEVED_GRACE);
                if !keep {
                    freed.push((e.owner.clone(), *bytes));
                }
                keep
            }
            State::Pending(_) => true,
        });
        for (owner, bytes) in freed {
            self.done_bytes -= bytes;
            self.release(&owner, bytes);
        }
        let map = &self.map;
        for queue in self.finished.values_mut() {
            queue.retain(|id| map.contains_key(id));
        }
        self.completions.expire(now, ttl, |id| map.contains_key(id));
    }

    /// Bytes finished results hold now.
    #[cfg(test)]
    pub fn done_bytes(&self) -> usize {
        self.done_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small result.
    fn reply() -> Reply {
        Reply::WeightsLoaded {
            path: "tinker://r/weights/x".into(),
        }
    }

    /// What a small result is charged of the budget.
    fn charged() -> usize {
        ENTRY_BYTES + reply().approx_bytes()
    }

    #[test]
    fn a_key_keeps_its_newest_finished_results_past_the_count_limit() {
        let mut f = Futures::default();
        f.insert("bobs".into(), "bob");
        f.resolve("bobs", Err(Failure::user("x")));
        let n = MAX_FINISHED_PER_KEY + 10;
        for i in 0..n {
            let id = i.to_string();
            f.insert(id.clone(), "alice");
            f.resolve(&id, Err(Failure::user("cancelled")));
        }
        assert!(f.poll("9", "alice", true).is_none(), "the oldest went");
        assert!(f.poll("10", "alice", true).is_some());
        assert!(f.poll(&(n - 1).to_string(), "alice", true).is_some());
        assert!(f.poll("bobs", "bob", true).is_some(), "another key's stays");
        assert_eq!(f.map.len(), MAX_FINISHED_PER_KEY + 1);
        assert_eq!(
            f.done_bytes(),
            (MAX_FINISHED_PER_KEY + 1) * ENTRY_BYTES + MAX_FINISHED_PER_KEY * 9 + 1,
            "every result is charged its entry"
        );
    }

    #[test]
    fn waiters_are_woken_and_results_stay_retrievable() {
        let mut f = Futures::default();
        f.insert("r1".into(), "alice");
        let Some(Poll::Wait(mut rx)) = f.poll("r1", "alice", true) else {
            panic!("pending")
        };
        assert!(
            f.poll("r1", "bob", true).is_none(),
            "other owners see nothing"
        );
        f.resolve("r1", Ok(reply()));
        assert_eq!(*rx.try_recv().unwrap(), Ok(reply()));
        assert!(matches!(f.poll("r1", "alice", true), Some(Poll::Ready(_))));
        f.expire(
            Instant::now() + Duration::from_secs(10),
            Duration::from_secs(5),
        );
        assert!(f.poll("r1", "alice", true).is_none());
        assert_eq!(f.done_bytes(), 0);
    }

    #[test]
    fn retrieved_results_go_after_a_grace_and_the_budget_drops_the_oldest() {
        let mut f = Futures::with_budget(3 * charged());
        for id in ["a", "b", "c"] {
            f.insert(id.into(), "alice");
            f.resolve(id, Ok(reply()));
        }
        assert!(matches!(f.poll("a", "alice", true), Some(Poll::Ready(_))));
        let later = Instant::now() + RETRIEVED_GRACE + Duration::from_secs(1);
        f.expire(later, Duration::from_secs(3600));
        assert!(
            f.poll("a", "alice", true).is_none(),
            "retrieved, then freed"
        );
        assert!(f.poll("b", "alice", true).is_some(), "not retrieved: kept");
        // Two more results exceed the budget: the oldest unretrieved one goes.
        for id in ["d", "e"] {
            f.insert(id.into(), "alice");
            f.resolve(id, Ok(reply()));
        }
        assert!(f.poll("b", "alice", true).is_none());
        assert!(f.poll("c", "alice", true).is_some() && f.poll("e", "alice", true).is_some());
        assert!(f.done_bytes() <= 3 * charged());
    }

    /// A poll that does not mark leaves a result as if never polled, past the grace;
    /// a hand-over marks it; another key cannot mark it.
    #[test]
    fn only_a_handed_over_result_goes_after_the_grace() {
        let mut f = Futures::default();
        for id in ["kept", "taken", "waited"] {
            f.insert(id.into(), "alice");
        }
        let Some(Poll::Wait(_rx)) = f.poll("waited", "alice", false) else {
            panic!("pending")
        };
        for id in ["kept", "taken", "waited"] {
            f.resolve(id, Ok(reply()));
        }
        for id in ["kept", "taken"] {
            assert!(matches!(f.poll(id, "alice", false), Some(Poll::Ready(_))));
        }
        f.mark_retrieved("kept", "mallory");
        f.mark_retrieved("taken", "alice");
        let later = Instant::now() + RETRIEVED_GRACE + Duration::from_secs(1);
        f.expire(later, Duration::from_secs(3600));
        assert!(f.poll("kept", "alice", true).is_some());
        assert!(
            f.poll("waited", "alice", true).is_some(),
            "delivered, not handed over"
        );
        assert!(f.poll("taken", "alice", true).is_none());
    }

    #[test]
    fn a_key_flooding_the_result_budget_loses_its_own_results_not_another_keys() {
        let one = charged();
        let mut f = Futures::with_budget(4 * one);
        f.insert("victim-1".into(), "victim");
        f.resolve("victim-1", Ok(reply()));
        // The hog finishes many results after the victim's and retrieves none.
        for i in 0..20 {
            let id = format!("hog-{i}");
            f.insert(id.clone(), "hog");
            f.resolve(&id, Ok(reply()));
        }
        assert!(f.done_bytes() <= 4 * one);
        assert!(
            matches!(f.poll("victim-1", "victim", true), Some(Poll::Ready(_))),
            "the older result of the key holding less survives"
        );
        // The hog keeps its newest three.
        assert!(f.poll("hog-16", "hog", true).is_none());
        assert!((17..20).all(|i| f.poll(&format!("hog-{i}"), "hog", true).is_some()));
        // Expiry keeps the per-key counts right: everything retrieved, then freed.
        let later = Instant::now() + RETRIEVED_GRACE + Duration::from_secs(1);
        f.expire(later, Duration::from_secs(3600));
        assert_eq!(f.done_bytes(), 0);
        assert!(f.held.is_empty() && f.finished.is_empty());
    }
}
