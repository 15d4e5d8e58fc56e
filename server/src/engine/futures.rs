//! The futures table: one entry per submitted request, pending until the worker answers,
//! then kept for a while so clients can re-poll after a network error.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::worker::Failure;

/// A finished request: the JSON result or the failure.
pub type FutureResult = Arc<Result<serde_json::Value, Failure>>;

/// What `retrieve_future` gets.
pub enum Poll {
    /// Finished.
    Ready(FutureResult),
    /// Still pending: resolves when it finishes.
    Wait(oneshot::Receiver<FutureResult>),
}

enum State {
    Pending(Vec<oneshot::Sender<FutureResult>>),
    Done(FutureResult, Instant),
}

struct Entry {
    owner: String,
    state: State,
}

/// All futures by request id.
#[derive(Default)]
pub struct Futures {
    map: HashMap<String, Entry>,
}

impl Futures {
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
    pub fn resolve(&mut self, request_id: &str, result: Result<serde_json::Value, Failure>) {
        if let Some(entry) = self.map.get_mut(request_id) {
            let result = Arc::new(result);
            if let State::Pending(waiters) = std::mem::replace(
                &mut entry.state,
                State::Done(result.clone(), Instant::now()),
            ) {
                for w in waiters {
                    let _ = w.send(result.clone());
                }
            }
        }
    }

    /// Polls a future owned by `owner`; `None` when unknown (or someone else's).
    pub fn poll(&mut self, request_id: &str, owner: &str) -> Option<Poll> {
        let entry = self.map.get_mut(request_id)?;
        if entry.owner != owner {
            return None;
        }
        Some(match &mut entry.state {
            State::Done(r, _) => Poll::Ready(r.clone()),
            State::Pending(waiters) => {
                let (tx, rx) = oneshot::channel();
                waiters.retain(|w| !w.is_closed());
                waiters.push(tx);
                Poll::Wait(rx)
            }
        })
    }

    /// Forgets finished futures older than `ttl`.
    pub fn expire(&mut self, now: Instant, ttl: Duration) {
        self.map.retain(|_, e| match e.state {
            State::Done(_, at) => now.duration_since(at) < ttl,
            State::Pending(_) => true,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn waiters_are_woken_and_results_stay_retrievable() {
        let mut f = Futures::default();
        f.insert("r1".into(), "alice");
        let Some(Poll::Wait(mut rx)) = f.poll("r1", "alice") else {
            panic!("pending")
        };
        assert!(f.poll("r1", "bob").is_none(), "other owners see nothing");
        f.resolve("r1", Ok(json!({"x": 1})));
        assert_eq!(*rx.try_recv().unwrap(), Ok(json!({"x": 1})));
        assert!(matches!(f.poll("r1", "alice"), Some(Poll::Ready(_))));
        f.expire(
            Instant::now() + Duration::from_secs(10),
            Duration::from_secs(5),
        );
        assert!(f.poll("r1", "alice").is_none());
    }
}
