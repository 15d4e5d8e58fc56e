//! Per-sampling-session completion queues for `retrieve_futures` (tinker 0.38 with
//! `sample_use_retrieve_futures`): one poller per sampling client learns which of its
//! samples finished, instead of one `retrieve_future` long-poll per sample.
//!
//! Each (sampling session, clone) target has a log of completions numbered by a cursor.
//! A poll returns the events after the client's previous cursor and trims those at or
//! before it. A log holds at most [`MAX_EVENTS`] (the oldest go first; a client that
//! never polls cannot grow it) and is dropped once idle for the futures' TTL or when
//! its sampling session closes. All the logs of one API key hold at most
//! [`MAX_EVENTS_PER_KEY`] together (its oldest event goes first), and a key has at most
//! [`MAX_LOGS_PER_KEY`] logs: it has up to hundreds of sampling sessions, each with up
//! to a thousand client copies. A poll returns at most [`MAX_PAGE`] events.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

/// Most completions one target's log holds unpolled.
pub const MAX_EVENTS: usize = 4096;

/// Most completions all of one key's logs hold unpolled.
pub const MAX_EVENTS_PER_KEY: usize = 65_536;

/// Most logs one key may have: a log is made by a completion or by a poll that waits
/// for one, and stays until idle for the futures' TTL or until its sampling session
/// ends, so without a bound a key's pollers over its thousands of client copies would
/// leave logs for the engine to walk on every tick.
pub const MAX_LOGS_PER_KEY: usize = 4096;

/// Most completions one poll returns (the cursor it answers is the last one's, so the
/// client gets the rest on its next poll): a poll costs the engine a bounded copy.
pub const MAX_PAGE: usize = 512;

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
    /// The cursor of its newest event (0: none yet). Cursors count over all logs.
    last: u64,
    events: VecDeque<(u64, Completion)>,
    waiters: Vec<oneshot::Sender<()>>,
    touched: Option<Instant>,
}

/// One key's events in the order they were recorded, to find its oldest.
#[derive(Default)]
struct KeyEvents {
    /// Logs it has.
    logs: usize,
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
    /// The newest event's cursor, over every log: a log made again (after it expired)
    /// numbers above any cursor a client of the old one was given.
    cursor: u64,
}

impl Completions {
    /// Whether `owner` may watch `target`: it has a log there, or may make one.
    pub fn may_watch(&self, target: &Target, owner: &str) -> bool {
        self.logs.contains_key(target)
            || self
                .keys
                .get(owner)
                .is_none_or(|k| k.logs < MAX_LOGS_PER_KEY)
    }

    /// `request_id`, of `owner`, reports its completion to `target`; the target's log
    /// is made now if need be (see [`Completions::may_watch`]).
    pub fn watch(&mut self, request_id: &str, target: Target, owner: &str) {
        self.log_of(&target, owner);
        self.watched
            .insert(request_id.to_string(), (target, owner.to_string()));
    }

    /// `target`'s log, made (and counted in `owner`'s logs) if it has none.
    fn log_of(&mut self, target: &Target, owner: &str) -> &mut Log {
        if !self.logs.contains_key(target) {
            self.keys.entry(owner.to_string()).or_default().logs += 1;
        }
        self.logs.entry(target.clone()).or_insert_with(|| Log {
            owner: owner.to_string(),
            // Kept at least the TTL, whether or not a poller comes.
            touched: Some(Instant::now()),
            ..Log::default()
        })
    }

    /// Records that `request_id` finished (if it is watched) and wakes its pollers.
    pub fn record(&mut self, request_id: &str, failed: bool) {
        let Some((target, owner)) = self.watched.remove(request_id) else {
            return;
        };
        // Its log was made by the watch, unless it expired or its session closed
        // meanwhile.
        self.cursor += 1;
        let cursor = self.cursor;
        let log = self.log_of(&target, &owner);
        log.last = cursor;
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

    /// Events of `owner`'s `target` after `prev_cursor` (those at or before it are
    /// dropped), at most [`MAX_PAGE`], or, with none and `wait`, a signal for the next
    /// one. `None`: waiting would make the key a log past [`MAX_LOGS_PER_KEY`].
    pub fn poll(
        &mut self,
        target: Target,
        owner: &str,
        prev_cursor: u64,
        wait: bool,
    ) -> Option<CompletionPoll> {
        if !self.logs.contains_key(&target) {
            if !wait {
                return Some(CompletionPoll::Ready(Vec::new(), prev_cursor));
            }
            if !self.may_watch(&target, owner) {
                return None;
            }
        }
        self.log_of(&target, owner);
        let log = self.logs.get_mut(&target).expect("made above");
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
            return Some(CompletionPoll::Wait(rx));
        }
        let page = log.events.iter().take(MAX_PAGE);
        let cursor = match log.events.get(MAX_PAGE) {
            // More than a page: the client asks again from the page's last event.
            Some(_) => log.events[MAX_PAGE - 1].0,
            None => log.last.max(prev_cursor),
        };
        let events: Vec<Completion> = page.map(|(_, c)| c.clone()).collect();
        Some(CompletionPoll::Ready(events, cursor))
    }

    /// The sampling sessions `sampler_ids` closed: their logs and watches go.
    pub fn forget_samplers(&mut self, sampler_ids: &std::collections::HashSet<String>) {
        if sampler_ids.is_empty() {
            return;
        }
        let keys = &mut self.keys;
        self.logs.retain(|(sampler, _), log| {
            let keep = !sampler_ids.contains(sampler);
            if !keep {
                forget_log(keys, &log.owner, log.events.len());
            }
            keep
        });
        self.watched
            .retain(|_, ((sampler, _), _)| !sampler_ids.contains(sampler));
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
                forget_log(keys, &log.owner, log.events.len());
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
        if key.held == 0 && key.logs == 0 {
            keys.remove(owner);
        }
    }
}

/// One of `owner`'s logs, holding `events`, went.
fn forget_log(keys: &mut HashMap<String, KeyEvents>, owner: &str, events: usize) {
    if let Some(key) = keys.get_mut(owner) {
        key.logs = key.logs.saturating_sub(1);
    }
    release(keys, owner, events);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t() -> Target {
        ("s:sample:0".into(), 0)
    }

    /// Polls `target` page by page until it has nothing more; returns how many events
    /// came.
    fn drain(c: &mut Completions, target: &Target, owner: &str) -> usize {
        let (mut cursor, mut seen) = (0, 0);
        loop {
            let Some(CompletionPoll::Ready(ev, next)) =
                c.poll(target.clone(), owner, cursor, false)
            else {
                panic!("a poll that does not wait is answered")
            };
            if ev.is_empty() {
                return seen;
            }
            seen += ev.len();
            cursor = next;
        }
    }

    #[test]
    fn a_log_made_again_after_it_expired_numbers_above_the_old_cursors() {
        let mut c = Completions::default();
        for id in ["a", "b", "c"] {
            c.watch(id, t(), "k");
            c.record(id, false);
        }
        let Some(CompletionPoll::Ready(_, cursor)) = c.poll(t(), "k", 0, false) else {
            panic!()
        };
        assert_eq!(cursor, 3);
        let later = Instant::now() + Duration::from_secs(7200);
        c.expire(later, Duration::from_secs(3600), |_| false);
        assert!(c.logs.is_empty());
        // The client polls on from its cursor and still sees the new completion.
        c.watch("d", t(), "k");
        c.record("d", false);
        let Some(CompletionPoll::Ready(ev, next)) = c.poll(t(), "k", cursor, false) else {
            panic!()
        };
        assert_eq!(ev.len(), 1, "{ev:?}");
        assert!(next > cursor);
    }

    #[test]
    fn sampling_requests_make_logs_within_the_keys_bound_too() {
        let mut c = Completions::default();
        for clone in 0..MAX_LOGS_PER_KEY as u64 {
            let target = ("s".to_string(), clone);
            assert!(c.may_watch(&target, "k"));
            c.watch(&clone.to_string(), target, "k");
        }
        assert!(!c.may_watch(&("s".into(), u64::MAX), "k"), "past the cap");
        assert!(c.may_watch(&("s".into(), 0), "k"), "a log it has");
        assert!(c.may_watch(&("s".into(), u64::MAX), "other"));
        // Logs made by watches are kept, not expired at the next tick.
        c.expire(Instant::now(), Duration::from_secs(3600), |_| true);
        assert_eq!(c.logs.len(), MAX_LOGS_PER_KEY);
    }

    #[test]
    fn only_waiting_polls_make_logs_and_a_key_makes_a_bounded_number() {
        let mut c = Completions::default();
        assert!(matches!(
            c.poll(t(), "k", 0, false),
            Some(CompletionPoll::Ready(ref ev, 0)) if ev.is_empty()
        ));
        assert!(
            c.logs.is_empty(),
            "a poll that does not wait leaves nothing"
        );
        for clone in 0..MAX_LOGS_PER_KEY as u64 {
            let target = ("s".to_string(), clone);
            assert!(matches!(
                c.poll(target, "k", 0, true),
                Some(CompletionPoll::Wait(_))
            ));
        }
        assert!(
            c.poll(("s".into(), u64::MAX), "k", 0, true).is_none(),
            "past the cap"
        );
        assert!(
            c.poll(("s".into(), 0), "k", 0, true).is_some(),
            "a log the key has already is polled"
        );
        assert!(
            c.poll(("t".into(), 0), "other", 0, true).is_some(),
            "another key's"
        );
        // The session's end takes its logs and their watches.
        c.watch("pending", ("s".into(), 3), "k");
        c.forget_samplers(&["s".to_string()].into_iter().collect());
        assert_eq!(c.logs.len(), 1);
        assert!(c.watched.is_empty());
        assert!(
            !c.keys.contains_key("k"),
            "the key is forgotten with its logs"
        );
    }

    #[test]
    fn polls_see_each_completion_once_the_cursor_moves_on() {
        let mut c = Completions::default();
        c.watch("a", t(), "k");
        c.watch("b", t(), "k");
        c.watch("other", ("s:sample:0".into(), 7), "k");
        c.record("a", false);
        c.record("unwatched", false);
        let CompletionPoll::Ready(ev, cursor) = c.poll(t(), "k", 0, true).unwrap() else {
            panic!("a is done")
        };
        assert_eq!(ev.len(), 1);
        assert_eq!((ev[0].request_id.as_str(), cursor), ("a", 1));
        let CompletionPoll::Wait(mut rx) = c.poll(t(), "k", cursor, true).unwrap() else {
            panic!("nothing new")
        };
        c.record("b", true);
        assert!(rx.try_recv().is_ok(), "the waiter is woken");
        let CompletionPoll::Ready(ev, cursor) = c.poll(t(), "k", cursor, false).unwrap() else {
            panic!()
        };
        assert_eq!((ev.len(), ev[0].failed, cursor), (1, true, 2));
        let CompletionPoll::Ready(ev, _) = c.poll(t(), "k", 2, false).unwrap() else {
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
        let CompletionPoll::Ready(ev, _) = c.poll(("s:sample:9".into(), 0), "k", 0, false).unwrap()
        else {
            panic!()
        };
        assert_eq!(ev.len(), 1, "b's event stays");
        // Polling past a's events releases them.
        assert_eq!(drain(&mut c, &newest, "a"), MAX_EVENTS);
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
        let CompletionPoll::Ready(ev, cursor) = c.poll(t(), "k", 0, false).unwrap() else {
            panic!()
        };
        assert_eq!(ev.len(), MAX_PAGE, "a page at a time");
        assert_eq!(cursor, (10 + MAX_PAGE) as u64, "the page's last event");
        assert_eq!(
            drain(&mut c, &t(), "k"),
            MAX_EVENTS,
            "every event, page by page"
        );
        let later = Instant::now() + Duration::from_secs(7200);
        c.expire(later, Duration::from_secs(3600), |_| false);
        assert!(c.logs.is_empty());
    }
}
