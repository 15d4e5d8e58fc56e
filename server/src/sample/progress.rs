//! A live view of a request's sampled tokens, for clients that stream them.
//!
//! The decode pushes each picked token into the request's [`TokenProgress`]; a watcher
//! sees the latest state, never a queue: a slow reader skips to the newest tokens
//! instead of holding a growing backlog, so nothing it does can slow the decode or use
//! unbounded memory. The sender is dropped when the request leaves the decode, which
//! tells the watcher to fetch the final result.

use std::sync::Arc;

use tokio::sync::watch;

/// Each sample's tokens so far, in sample order.
pub type Tokens = Vec<Vec<u32>>;

/// The sending side, carried with a sampling request into the decode.
#[derive(Debug, Clone)]
pub struct TokenProgress(Arc<watch::Sender<Tokens>>);

impl TokenProgress {
    /// A progress for `num_samples` samples and the watcher that reads it.
    pub fn new(num_samples: usize) -> (Self, watch::Receiver<Tokens>) {
        let (tx, rx) = watch::channel(vec![Vec::new(); num_samples]);
        (Self(Arc::new(tx)), rx)
    }

    /// Records that sample `sample` picked `token` (ignored for a sample it does not
    /// have).
    pub fn push(&self, sample: usize, token: u32) {
        self.0.send_modify(|all| {
            if let Some(tokens) = all.get_mut(sample) {
                tokens.push(token);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_watcher_sees_every_pushed_token_and_the_end() {
        let (progress, mut rx) = TokenProgress::new(2);
        progress.push(1, 7);
        progress.push(0, 3);
        progress.push(1, 8);
        progress.push(5, 9);
        assert!(rx.has_changed().unwrap());
        assert_eq!(*rx.borrow_and_update(), vec![vec![3], vec![7, 8]]);
        drop(progress);
        assert!(rx.has_changed().is_err(), "a dropped sender ends the watch");
    }
}
