//! Request bodies that must keep arriving. A body that sends nothing for the stall
//! limit fails, and so does one that, after that first stretch, averages less than
//! [`MIN_BODY_BYTES_PER_S`]: otherwise a client sending a byte a minute holds its
//! connection (and a slot of `--max-connections`) for as long as it likes. A failed body
//! answers 408 with a JSON body, which the SDKs retry.

use std::error::Error;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::Request;
use http_body::{Frame, SizeHint};
use tokio::time::{Instant, Sleep};

/// The least average rate a request body must keep once its first stall limit has
/// passed.
pub const MIN_BODY_BYTES_PER_S: u64 = 16 * 1024;

/// Why a paced body failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BodyTooSlow {
    /// The stall limit it was held to.
    pub stall: Duration,
}

impl fmt::Display for BodyTooSlow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the request body arrived too slowly (nothing for {:?}, or under {} KiB/s on \
             average after that)",
            self.stall,
            MIN_BODY_BYTES_PER_S / 1024
        )
    }
}

impl Error for BodyTooSlow {}

/// Whether `error` (or an error it wraps) is a [`BodyTooSlow`].
pub fn is_too_slow(error: &(dyn Error + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(e) = next {
        if e.is::<BodyTooSlow>() {
            return true;
        }
        next = e.source();
    }
    false
}

/// Paces `req`'s body with the stall limit `stall`.
pub fn pace(req: Request, stall: Duration) -> Request {
    req.map(|body| Body::new(PacedBody::new(body, stall)))
}

/// A body held to a stall limit and a minimum average rate, from its first poll.
pub struct PacedBody {
    inner: Body,
    stall: Duration,
    /// When it was first polled, and when a frame last came.
    started: Option<Instant>,
    last_frame: Option<Instant>,
    received: u64,
    clock: Pin<Box<Sleep>>,
}

impl PacedBody {
    /// `inner`, held to `stall`.
    pub fn new(inner: Body, stall: Duration) -> Self {
        Self {
            inner,
            stall,
            started: None,
            last_frame: None,
            received: 0,
            clock: Box::pin(tokio::time::sleep(stall)),
        }
    }

    /// When the body fails unless more of it comes: a stall limit after the last frame,
    /// or once its average since the start would fall under the minimum rate (the first
    /// stall limit being free).
    fn deadline(&self, started: Instant) -> Instant {
        let stalled = self.last_frame.unwrap_or(started) + self.stall;
        let paced = started
            + self.stall
            + Duration::from_secs_f64(self.received as f64 / MIN_BODY_BYTES_PER_S as f64);
        stalled.min(paced)
    }
}

impl http_body::Body for PacedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = self.get_mut();
        let started = *this.started.get_or_insert_with(Instant::now);
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.received = this.received.saturating_add(data.len() as u64);
                }
                this.last_frame = Some(Instant::now());
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Pending => {
                let deadline = this.deadline(started);
                if this.clock.deadline() != deadline {
                    this.clock.as_mut().reset(deadline);
                }
                match this.clock.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Some(Err(axum::Error::new(BodyTooSlow {
                        stall: this.stall,
                    })))),
                    Poll::Pending => Poll::Pending,
                }
            }
            ended => ended,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;

    /// A body fed by `chunks`: (pause before it, its size).
    fn fed(chunks: Vec<(Duration, usize)>) -> Body {
        let stream = futures::stream::iter(chunks).then(|(pause, size)| async move {
            tokio::time::sleep(pause).await;
            Ok::<_, std::io::Error>(Bytes::from(vec![1u8; size]))
        });
        Body::from_stream(stream)
    }

    async fn read(body: Body) -> Result<usize, axum::Error> {
        let paced = Body::new(PacedBody::new(body, Duration::from_secs(60)));
        Ok(axum::body::to_bytes(paced, usize::MAX).await?.len())
    }

    /// A steady upload, however long, arrives whole.
    #[tokio::test(start_paused = true)]
    async fn a_steady_body_arrives_whole() {
        let chunks = vec![(Duration::from_secs(1), 32 * 1024); 600];
        assert_eq!(read(fed(chunks)).await.unwrap(), 600 * 32 * 1024);
    }

    /// Nothing for the stall limit fails the body.
    #[tokio::test(start_paused = true)]
    async fn a_body_that_stops_fails_after_the_stall_limit() {
        let started = Instant::now();
        let chunks = vec![(Duration::ZERO, 1024), (Duration::from_secs(61), 1024)];
        let err = read(fed(chunks)).await.expect_err("a minute of nothing");
        assert!(is_too_slow(&err), "{err}");
        assert_eq!(started.elapsed(), Duration::from_secs(60));
    }

    /// A byte every 59 seconds never stalls for a minute, but falls under the minimum
    /// average rate once the first minute has passed.
    #[tokio::test(start_paused = true)]
    async fn a_trickle_under_the_minimum_rate_fails() {
        let started = Instant::now();
        let chunks = vec![(Duration::from_secs(59), 1); 100];
        let err = read(fed(chunks)).await.expect_err("a byte a minute");
        assert!(is_too_slow(&err), "{err}");
        assert!(
            started.elapsed() < Duration::from_secs(61),
            "{:?}",
            started.elapsed()
        );
    }
}
