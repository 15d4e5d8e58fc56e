//! Per-sampling-session completion queues for `retrieve_futures` (tinker 0.38 with
//! `sample_use_retrieve_futures`): one poller per sampling client learns which of its
//! samples finished, instead of one `retrieve_future` long-poll per sample.
//!
//! Each (sampling session, clone) target has a log of completions numbered by a cursor.
//! A poll returns the events after the client's previous cursor and trims those at or
//! before it. A log holds at most [`MAX_EVENTS`] (the oldest go first; a client that
//! never polls cannot grow it) and is dropped once idle for the futures' TTL.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

/// Most completions one target's log holds unpolled.
pub const MAX_EVENTS: usize = 4096;

/// Which log: a sampling session and the clone of its client (`seq_id / 10^9`).
pub type Target = (String, u64);

/// A finished sampling request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// Its request id.
    pub request_id: String,
    /// It failed (its result is the failure).
    pub failed: bool,
}

/// What a poll gets.
pub enum CompletionPoll {
    /// The events after the previous cursor (maybe none), and the cursor to send next.
    Ready(Vec<Completion>, u64),
    /// Nothing new yet: fires when something is recorded.
    Wait(oneshot::Receiver<()>),
}

#[derive(Default)]
struct Log {
    /// The cursor of the newest event (0: none yet).
    last: u64,
    events: VecDeque<(u64, Completion)>,
    waiters: Vec<oneshot::Sender<()>>,
    touched: Option<Instant>,
}

/// Every target's log, and which pending request reports to which target.
#[derive(Default)]
pub struct Completions {
    watched: HashMap<String, Target>,
    logs: HashMap<Target, Log>,
}

impl Completions {
    /// `request_id` reports its completion to `target`.
    pub fn watch(&mut self, request_id: &str, target: Target) {
        self.watched.insert(request_id.to_string(), target);
    }

    /// Records that `request_id` finished (if it is watched) and wakes its pollers.
    pub fn record(&mut self, request_id: &str, failed: bool) {
        let Some(target) = self.watched.remove(request_id) else {
            return;
        };
        let log = self.logs.entry(target).or_default();
        log.last += 1;
        log.events.push_back((
            log.last,
            Completion {
                request_id: request_id.to_string(),
                failed,
            },
        ));
        while log.events.len() > MAX_EVENTS {
            log.events.pop_front();
        }
        log.touched = Some(Instant::now());
        for w in log.waiters.drain(..) {
            let _ = w.send(());
        }
    }

    /// Events of `target` after `prev_cursor` (those at or before it are dropped), or,
    /// with none and `wait`, a signal for the next one.
    pub fn poll(&mut self, target: Target, prev_cursor: u64, wait: bool) -> CompletionPoll {
        let log = self.logs.entry(target).or_default();
        log.touched = Some(Instant::now());
        while log.events.front().is_some_and(|(c, _)| *c <= prev_cursor) {
            log.events.pop_front();
        }
        if log.events.is_empty() && wait {
            let (tx, rx) = oneshot::channel();
            log.waiters.retain(|w| !w.is_closed());
            log.waiters.push(tx);
            return CompletionPoll::Wait(rx);
        }
        let events: Vec<Completion> = log.events.iter().map(|(_, c)| c.clone()).collect();
        CompletionPoll::Ready(events, log.last.max(prev_cursor))
    }

    /// Drops logs idle for `ttl` with no poller waiting, and watches of requests that
    /// no longer exist.
    pub fn expire(&mut self, now: Instant, ttl: Duration, exists: impl Fn(&str) -> bool) {
        self.logs.retain(|_, log| {
            log.waiters.retain(|w| !w.is_closed());
            !log.waiters.is_empty()
                || log
                    .touched
                    .is_some_and(|t| now.saturating_duration_since(t) < ttl)
        });
        self.watched.retain(|id, _| exists(id));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t() -> Target {
        ("s:sample:0".into(), 0)
    }

    #[test]
    fn polls_see_each_completion_once_the_cursor_moves_on() {
        let mut c = Completions::default();
        c.watch("a", t());
        c.watch("b", t());
        c.watch("other", ("s:sample:0".into(), 7));
        c.record("a", false);
        c.record("unwatched", false);
        let CompletionPoll::Ready(ev, cursor) = c.poll(t(), 0, true) else {
            panic!("a is done")
        };
        assert_eq!(ev.len(), 1);
        assert_eq!((ev[0].request_id.as_str(), cursor), ("a", 1));
        let CompletionPoll::Wait(mut rx) = c.poll(t(), cursor, true) else {
            panic!("nothing new")
        };
        c.record("b", true);
        assert!(rx.try_recv().is_ok(), "the waiter is woken");
        let CompletionPoll::Ready(ev, cursor) = c.poll(t(), cursor, false) else {
            panic!()
        };
        assert_eq!((ev.len(), ev[0].failed, cursor), (1, true, 2));
        let CompletionPoll::Ready(ev, _) = c.poll(t(), 2, false) else {
            panic!()
        };
        assert!(ev.is_empty(), "the clone's log is separate");
    }

    #[test]
    fn a_log_never_polled_stays_bounded_and_idle_logs_go() {
        let mut c = Completions::default();
        for i in 0..MAX_EVENTS + 10 {
            c.watch(&i.to_string(), t());
            c.record(&i.to_string(), false);
        }
        let CompletionPoll::Ready(ev, cursor) = c.poll(t(), 0, false) else {
            panic!()
        };
        assert_eq!(ev.len(), MAX_EVENTS);
        assert_eq!(cursor, (MAX_EVENTS + 10) as u64);
        let later = Instant::now() + Duration::from_secs(7200);
        c.expire(later, Duration::from_secs(3600), |_| false);
        assert!(c.logs.is_empty());
    }
}
