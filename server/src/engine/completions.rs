//! Per-sampling-session completion queues for `retrieve_futures` (tinker 0.38 with
//! `sample_use_retrieve_futures`): one poller per sampling client learns which of its
//! samples finished, instead of one `retrieve_future` long-poll per sample.
//!
//! Each (sampling session, clone) target has a log of completions numbered by a cursor.
//! A poll returns the events after the client's previous cursor and trims those at or
//! before it. A log holds at most [`MAX_EVENTS`] (the oldest go first; a client that
//! never polls cannot grow it) and is dropped once idle for the futures' TTL. All the
//! logs of one API key hold at most [`MAX_EVENTS_PER_KEY`] together (its oldest event
//! goes first): a key has up to hundreds of sampling sessions, each with up to a
//! thousand client copies.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

/// Most completions one target's log holds unpolled.
pub const MAX_EVENTS: usize = 4096;

/// Most completions all of one key's logs hold unpolled.
pub const MAX_EVENTS_PER_KEY: usize = 65_536;

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
    /// The key whose requests it records.
    owner: String,
    /// The cursor of the newest event (0: none yet).
    last: u64,
    events: VecDeque<(u64, Completion)>,
    waiters: Vec<oneshot::Sender<()>>,
    touched: Option<Instant>,
}

/// One key's events in the order they were recorded, to find its oldest.
#[derive(Default)]
struct KeyEvents {
    /// Events its logs hold.
    held: usize,
    /// `(log, cursor)` of each event recorded, oldest first; entries whose event a poll
    /// or a log's own bound has already dropped are skipped when met (and compacted away
    /// when they outnumber the held ones).
    order: VecDeque<(Target, u64)>,
}

/// Every target's log, and which pending request reports to which target.
#[derive(Default)]
pub struct Completions {
    /// Pending request -> its log and the key it belongs to.
    watched: HashMap<String, (Target, String)>,
    logs: HashMap<Target, Log>,
    keys: HashMap<String, KeyEvents>,
}

impl Completions {
    /// `request_id`, of `owner`, reports its completion to `target`.
    pub fn watch(&mut self, request_id: &str, target: Target, owner: &str) {
        self.watched
            .insert(request_id.to_string(), (target, owner.to_string()));
    }

    /// Records that `request_id` finished (if it is watched) and wakes its pollers.
    pub fn record(&mut self, request_id: &str, failed: bool) {
        let Some((target, owner)) = self.watched.remove(request_id) else {
            return;
        };
        let log = self.logs.entry(target.clone()).or_default();
        log.owner.clone_from(&owner);
        log.last += 1;
        log.events.push_back((
            log.last,
            Completion {
                request_id: request_id.to_string(),
                failed,
            },
        ));
        let mut dropped = 0;
        while log.events.len() > MAX_EVENTS {
            log.events.pop_front();
            dropped += 1;
        }
        log.touched = Some(Instant::now());
        for w in log.waiters.drain(..) {
            let _ = w.send(());
        }
        let cursor = log.last;
        let key = self.keys.entry(owner).or_default();
        key.held = key.held + 1 - dropped;
        key.order.push_back((target, cursor));
        while key.held > MAX_EVENTS_PER_KEY {
            let Some((oldest, at)) = key.order.pop_front() else {
                break;
            };
            let Some(log) = self.logs.get_mut(&oldest) else {
                continue;
            };
            if log.events.front().is_some_and(|(c, _)| *c == at) {
                log.events.pop_front();
                key.held -= 1;
            }
        }
        if key.order.len() > 2 * key.held.max(MAX_EVENTS) {
            let logs = &self.logs;
            key.order.retain(|(t, c)| {
                logs.get(t)
                    .is_some_and(|l| l.events.front().is_some_and(|(f, _)| f <= c))
            });
        }
    }

    /// Events of `target` after `prev_cursor` (those at or before it are dropped), or,
    /// with none and `wait`, a signal for the next one.
    pub fn poll(&mut self, target: Target, prev_cursor: u64, wait: bool) -> CompletionPoll {
        let log = self.logs.entry(target).or_default();
        log.touched = Some(Instant::now());
        let mut trimmed = 0;
        while log.events.front().is_some_and(|(c, _)| *c <= prev_cursor) {
            log.events.pop_front();
            trimmed += 1;
        }
        if trimmed > 0 {
            release(&mut self.keys, &log.owner, trimmed);
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
        let keys = &mut self.keys;
        self.logs.retain(|_, log| {
            log.waiters.retain(|w| !w.is_closed());
            let keep = !log.waiters.is_empty()
                || log
                    .touched
                    .is_some_and(|t| now.saturating_duration_since(t) < ttl);
            if !keep {
                release(keys, &log.owner, log.events.len());
            }
            keep
        });
        self.watched.retain(|id, _| exists(id));
    }
}

/// `owner`'s logs hold `n` fewer events; a key whose logs hold none is forgotten.
fn release(keys: &mut HashMap<String, KeyEvents>, owner: &str, n: usize) {
    if let Some(key) = keys.get_mut(owner) {
        key.held = key.held.saturating_sub(n);
        if key.held == 0 {
            keys.remove(owner);
        }
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
        c.watch("a", t(), "k");
        c.watch("b", t(), "k");
        c.watch("other", ("s:sample:0".into(), 7), "k");
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

    /// One key's logs together hold at most [`MAX_EVENTS_PER_KEY`], its oldest going
    /// first; polled events stop counting; another key's logs are untouched; the key is
    /// forgotten once its logs hold nothing.
    #[test]
    fn a_keys_logs_together_stay_bounded() {
        let mut c = Completions::default();
        c.watch("b0", ("s:sample:9".into(), 0), "b");
        c.record("b0", false);
        let clones = MAX_EVENTS_PER_KEY / MAX_EVENTS + 3;
        let mut n = 0;
        for clone in 0..clones as u64 {
            for _ in 0..MAX_EVENTS {
                let id = format!("a{n}");
                c.watch(&id, ("s:sample:0".into(), clone), "a");
                c.record(&id, false);
                n += 1;
            }
        }
        let held = |c: &Completions| -> usize { c.logs.values().map(|l| l.events.len()).sum() };
        assert_eq!(held(&c), MAX_EVENTS_PER_KEY + 1, "a's cap, and b's one");
        assert_eq!(c.keys["a"].held, MAX_EVENTS_PER_KEY);
        assert!(c.keys["a"].order.len() <= 2 * MAX_EVENTS_PER_KEY);
        // The oldest clones' logs were emptied first; the newest is whole.
        let newest = ("s:sample:0".to_string(), clones as u64 - 1);
        assert_eq!(c.logs[&newest].events.len(), MAX_EVENTS);
        assert!(c.logs[&("s:sample:0".to_string(), 0)].events.is_empty());
        let CompletionPoll::Ready(ev, _) = c.poll(("s:sample:9".into(), 0), 0, false) else {
            panic!()
        };
        assert_eq!(ev.len(), 1, "b's event stays");
        // Polling past a's events releases them.
        let CompletionPoll::Ready(_, cursor) = c.poll(newest.clone(), 0, false) else {
            panic!()
        };
        let _ = c.poll(newest, cursor, false);
        assert_eq!(c.keys["a"].held, MAX_EVENTS_PER_KEY - MAX_EVENTS);
        c.expire(
            Instant::now() + Duration::from_secs(7200),
            Duration::from_secs(1),
            |_| false,
        );
        assert!(c.keys.is_empty() && c.logs.is_empty());
    }

    #[test]
    fn a_log_never_polled_stays_bounded_and_idle_logs_go() {
        let mut c = Completions::default();
        for i in 0..MAX_EVENTS + 10 {
            c.watch(&i.to_string(), t(), "k");
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
