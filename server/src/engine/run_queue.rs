//! One training run's operations in `seq_id` order: a pure reorder buffer, tested without
//! channels (TGI's `queue.rs` habit). Clients number their operations and may submit
//! several before the first runs, in any order over the network; the run executes them
//! strictly in number order, waits a bounded time for a missing number, and answers a
//! repeated number with its first request.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use super::EngineError;
use crate::worker::RunOp;

/// How far ahead of a run's next operation a `seq_id` may be. A pipelined loop keeps two
/// or three in flight; a number further ahead is refused, which bounds the buffer and
/// keeps `seq_id + 1` far from overflow.
pub const MAX_SEQ_AHEAD: u64 = 1024;

/// Request ids remembered per run for answering repeated submissions.
const SEEN_WINDOW: usize = 4096;

/// A submitted operation waiting for its turn.
pub(super) struct Queued {
    pub request_id: String,
    pub arrival: u64,
    pub since: Instant,
    pub op: RunOp,
}

/// Where a submission goes.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Admit {
    /// A repeat of an earlier submission: answer with its request id.
    Repeat(String),
    /// A new operation at this `seq_id`.
    At(u64),
}

/// The position [`RunQueue::ready`] reports for an unordered operation (one submitted
/// without a `seq_id` that must not take one, such as MinT's reverse-KL step).
pub(super) const UNORDERED: u64 = u64::MAX;

/// A run's reorder buffer.
#[derive(Default)]
pub(super) struct RunQueue {
    /// Operations that take no `seq_id`, run before the next numbered one, oldest first.
    unordered: std::collections::VecDeque<Queued>,
    /// The next `seq_id` to execute.
    next_seq: u64,
    /// Submitted operations by `seq_id`, waiting for their turn.
    pending: BTreeMap<u64, Queued>,
    /// Request ids by `seq_id`, to answer a repeated submission with the same future.
    seen: BTreeMap<u64, String>,
    /// `seq_id`s whose submissions were refused: nothing will come for them.
    skipped: BTreeSet<u64>,
}

impl RunQueue {
    /// The next `seq_id` to execute.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// Operations waiting.
    pub fn len(&self) -> usize {
        self.pending.len() + self.unordered.len()
    }

    /// The request id of an earlier submission at `seq`.
    pub fn seen(&self, seq: u64) -> Option<&String> {
        self.seen.get(&seq)
    }

    /// Where a submission with `seq_id` goes (`None`: after everything queued).
    pub fn admit(&self, seq_id: Option<u64>, run_id: &str) -> Result<Admit, EngineError> {
        let seq = match seq_id {
            Some(s) => s,
            None => self
                .pending
                .keys()
                .next_back()
                .map_or(self.next_seq, |&k| k.saturating_add(1))
                .max(self.next_seq),
        };
        if let Some(existing) = self.seen.get(&seq) {
            return Ok(Admit::Repeat(existing.clone()));
        }
        if seq > self.next_seq.saturating_add(MAX_SEQ_AHEAD) {
            return Err(EngineError::BadRequest(format!(
                "seq_id {seq} of {run_id} is more than {MAX_SEQ_AHEAD} operations ahead of the \
                 next one to run ({}); wait for earlier operations to finish",
                self.next_seq
            )));
        }
        if seq < self.next_seq {
            return Err(EngineError::BadRequest(format!(
                "seq_id {seq} of {run_id} was already executed (next is {})",
                self.next_seq
            )));
        }
        Ok(Admit::At(seq))
    }

    /// Queues `q` at `seq` (from [`admit`](Self::admit)).
    pub fn push(&mut self, seq: u64, q: Queued) {
        self.skipped.remove(&seq);
        self.seen.insert(seq, q.request_id.clone());
        while self.seen.len() > SEEN_WINDOW {
            self.seen.pop_first();
        }
        self.pending.insert(seq, q);
    }

    /// Queues an operation that takes no `seq_id`: it runs at the run's next turn,
    /// before numbered operations that have not started.
    pub fn push_unordered(&mut self, q: Queued) {
        self.unordered.push_back(q);
    }

    /// Records that the submission at `seq` was refused for good, so later operations do
    /// not wait for it. Numbers outside the window are not remembered.
    pub fn skip(&mut self, seq: u64) {
        let window = self.next_seq..=self.next_seq.saturating_add(MAX_SEQ_AHEAD);
        if window.contains(&seq) && !self.seen.contains_key(&seq) {
            self.skipped.insert(seq);
        }
    }

    /// The operation to run next, if one is ready at `now`: the head when it is the next
    /// number, or when the missing numbers before it were waited for `timeout`.
    pub fn ready(&mut self, now: Instant, timeout: Duration) -> Option<(u64, &Queued)> {
        while self.skipped.remove(&self.next_seq) {
            self.next_seq += 1;
        }
        self.skipped.retain(|&s| s >= self.next_seq);
        let numbered = self.pending.first_key_value().filter(|(&seq, q)| {
            seq == self.next_seq || now.saturating_duration_since(q.since) >= timeout
        });
        // An unordered operation keeps its place in arrival order: it runs before the
        // numbered ones submitted after it, not before those submitted earlier.
        match (self.unordered.front(), numbered) {
            (Some(u), Some((_, n))) if n.arrival < u.arrival => numbered.map(|(&s, q)| (s, q)),
            (Some(u), _) => Some((UNORDERED, u)),
            (None, n) => n.map(|(&s, q)| (s, q)),
        }
    }

    /// The queued operation at `seq`.
    pub fn get_mut(&mut self, seq: u64) -> Option<&mut Queued> {
        if seq == UNORDERED {
            return self.unordered.front_mut();
        }
        self.pending.get_mut(&seq)
    }

    /// Commits the run to the head at `seq`: numbers before it that never came are past,
    /// and refused if they come late.
    pub fn commit_to(&mut self, seq: u64) {
        if seq != UNORDERED {
            self.next_seq = self.next_seq.max(seq);
        }
    }

    /// Removes the operation at `seq`; the run moves on to the number after it.
    pub fn take(&mut self, seq: u64) -> Option<Queued> {
        if seq == UNORDERED {
            return self.unordered.pop_front();
        }
        let q = self.pending.remove(&seq)?;
        self.next_seq = self.next_seq.max(seq.saturating_add(1));
        Some(q)
    }

    /// The `seq_id` of the head when it is `request_id`'s operation.
    pub fn head_of(&self, request_id: &str) -> Option<u64> {
        if self
            .unordered
            .front()
            .is_some_and(|q| q.request_id == request_id)
        {
            return Some(UNORDERED);
        }
        self.pending
            .first_key_value()
            .filter(|(_, q)| q.request_id == request_id)
            .map(|(&seq, _)| seq)
    }

    /// Removes every waiting operation.
    pub fn drain(&mut self) -> Vec<Queued> {
        let mut all: Vec<Queued> = self.unordered.drain(..).collect();
        all.extend(std::mem::take(&mut self.pending).into_values());
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(id: &str, since: Instant) -> Queued {
        Queued {
            request_id: id.into(),
            arrival: 0,
            since,
            op: RunOp::Unload,
        }
    }

    const WAIT: Duration = Duration::from_secs(30);

    fn submit(
        q: &mut RunQueue,
        seq: Option<u64>,
        id: &str,
        now: Instant,
    ) -> Result<Admit, EngineError> {
        let admit = q.admit(seq, "r")?;
        if let Admit::At(s) = admit {
            q.push(s, op(id, now));
        }
        Ok(admit)
    }

    #[test]
    fn unordered_operations_keep_their_arrival_place_and_take_no_number() {
        let (mut q, now) = (RunQueue::default(), Instant::now());
        let at = |id: &str, arrival: u64| Queued {
            arrival,
            ..op(id, now)
        };
        q.push(0, at("a", 1));
        q.take(0);
        q.push_unordered(at("kl", 5));
        q.push(1, at("b", 6));
        let (seq, head) = q.ready(now, WAIT).unwrap();
        assert_eq!((seq, head.request_id.as_str()), (UNORDERED, "kl"));
        assert_eq!(q.head_of("kl"), Some(UNORDERED));
        q.commit_to(seq);
        assert_eq!(q.take(seq).unwrap().request_id, "kl");
        assert_eq!(q.next_seq(), 1, "the numbered sequence is untouched");
        // Behind a numbered operation that arrived first, and found as its run's head
        // whichever queue holds it.
        q.push_unordered(at("late-kl", 9));
        assert_eq!(q.ready(now, WAIT).unwrap().1.request_id, "b");
        assert_eq!(q.head_of("b"), Some(1));
        assert_eq!(q.head_of("late-kl"), Some(UNORDERED));
        q.take(1);
        assert_eq!(q.ready(now, WAIT).unwrap().0, UNORDERED);
    }

    #[test]
    fn operations_run_in_number_order_whatever_the_arrival_order() {
        let (mut q, now) = (RunQueue::default(), Instant::now());
        submit(&mut q, Some(1), "b", now).unwrap();
        assert!(q.ready(now, WAIT).is_none(), "0 is missing");
        submit(&mut q, Some(0), "a", now).unwrap();
        let (seq, head) = q.ready(now, WAIT).unwrap();
        assert_eq!((seq, head.request_id.as_str()), (0, "a"));
        q.take(0);
        assert_eq!(q.ready(now, WAIT).unwrap().0, 1);
        q.take(1);
        assert_eq!(q.next_seq(), 2);
        // No number: after everything queued.
        assert_eq!(submit(&mut q, None, "c", now).unwrap(), Admit::At(2));
    }

    #[test]
    fn repeats_answer_with_the_first_request_and_old_or_far_numbers_are_refused() {
        let (mut q, now) = (RunQueue::default(), Instant::now());
        submit(&mut q, Some(0), "a", now).unwrap();
        assert_eq!(q.admit(Some(0), "r").unwrap(), Admit::Repeat("a".into()));
        q.take(0);
        assert_eq!(
            q.admit(Some(0), "r").unwrap(),
            Admit::Repeat("a".into()),
            "still remembered"
        );
        for far in [MAX_SEQ_AHEAD + 2, u64::MAX] {
            assert!(q
                .admit(Some(far), "r")
                .unwrap_err()
                .message()
                .contains("ahead"));
        }
        let mut fresh = RunQueue::default();
        submit(&mut fresh, Some(3), "x", now).unwrap();
        fresh.ready(now + WAIT, WAIT).unwrap();
        fresh.commit_to(3);
        assert!(fresh
            .admit(Some(1), "r")
            .unwrap_err()
            .message()
            .contains("already executed"));
    }

    #[test]
    fn refused_numbers_are_skipped_and_missing_ones_waited_for_a_bounded_time() {
        let (mut q, now) = (RunQueue::default(), Instant::now());
        submit(&mut q, Some(2), "c", now).unwrap();
        q.skip(0);
        assert!(q.ready(now, WAIT).is_none(), "1 is still missing");
        assert_eq!(q.next_seq(), 1);
        // After the wait, the head runs anyway.
        assert_eq!(q.ready(now + WAIT, WAIT).unwrap().0, 2);
        // A number outside the window is not remembered.
        q.skip(u64::MAX);
        assert!(q.skipped.len() <= 1);
    }

    #[test]
    fn the_head_of_a_request_is_found_and_drained() {
        let (mut q, now) = (RunQueue::default(), Instant::now());
        submit(&mut q, Some(0), "a", now).unwrap();
        submit(&mut q, Some(1), "b", now).unwrap();
        assert_eq!(q.head_of("a"), Some(0));
        assert_eq!(q.head_of("b"), None);
        assert_eq!(q.len(), 2);
        assert_eq!(q.drain().len(), 2);
        assert_eq!(q.len(), 0);
    }
}
