//! Serving HTTP connections with limits that hold before any key is known: a bounded
//! number of open connections, a deadline on each request's head (which also closes
//! idle keep-alive connections), and a stall limit on request bodies and on responses a
//! client does not take.
//!
//! Without these, anyone who can reach the port (no key needed) could hold the server's
//! memory and file descriptors: connections that send half a request head and wait
//! (slowloris), bodies that send a byte a minute, or requests whose answers are never
//! read (each answer stays in memory until its connection ends). `axum::serve` sets none
//! of these, so the accept loop is written here on hyper's HTTP/1 connection builder.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::time::Sleep;

/// Limits on HTTP connections.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Most connections open at once; past it new ones wait in the listen backlog until
    /// one closes.
    pub max_connections: usize,
    /// Longest wait for a request's head, from the end of the previous answer (or the
    /// connection's start): an idle keep-alive connection closes after it too.
    pub header_timeout: Duration,
    /// Longest a request body may send nothing while the server reads it, and longest a
    /// response may wait for the client to take any of it; past either the connection
    /// closes.
    pub stall_timeout: Duration,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            max_connections: 512,
            header_timeout: Duration::from_secs(30),
            stall_timeout: Duration::from_secs(60),
        }
    }
}

/// Serves `app` on `listener` under `limits` until `shutdown` resolves, then stops
/// accepting and waits for the open connections' answers to finish (each connection
/// closes after its current answer).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    shutdown: impl Future<Output = ()>,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let graceful = GracefulShutdown::new();
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let slot = tokio::select! {
            _ = &mut shutdown => break,
            slot = wait_for_slot(&slots, limits.max_connections) => slot,
        };
        let stream = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    accept_failed(e).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let io = TokioIo::new(WriteStallGuard::new(stream, limits.stall_timeout));
        let connection =
            graceful.watch(builder.serve_connection(io, TowerToHyperService::new(app.clone())));
        tokio::spawn(async move {
            let _slot = slot;
            if let Err(e) = connection.await {
                tracing::debug!("connection ended: {e}");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

/// One connection's slot, waiting (and saying so once) while every slot is taken.
async fn wait_for_slot(
    slots: &Arc<Semaphore>,
    max_connections: usize,
) -> tokio::sync::OwnedSemaphorePermit {
    if let Ok(slot) = slots.clone().try_acquire_owned() {
        return slot;
    }
    tracing::warn!(
        "{max_connections} connections are open (--max-connections): new connections wait \
         until one closes"
    );
    slots
        .clone()
        .acquire_owned()
        .await
        .expect("the connection semaphore is never closed")
}

/// An accept error: a connection that failed before it was accepted is skipped; running
/// out of file descriptors or memory waits a moment (retrying at once would spin).
async fn accept_failed(e: io::Error) {
    use io::ErrorKind::*;
    if matches!(
        e.kind(),
        ConnectionAborted | ConnectionRefused | ConnectionReset | Interrupted
    ) {
        return;
    }
    tracing::error!("accepting a connection failed (waiting 1 s): {e}");
    tokio::time::sleep(Duration::from_secs(1)).await;
}

/// A stream whose writes fail with `TimedOut` once the peer has taken nothing for the
/// stall limit: a write, flush or shutdown that stays pending that long. Reads are
/// untouched (a client waiting for a long-polled answer sends nothing, rightly).
pub struct WriteStallGuard<T> {
    io: T,
    limit: Duration,
    /// Armed while the peer takes nothing.
    stalled: Option<Pin<Box<Sleep>>>,
}

impl<T> WriteStallGuard<T> {
    /// Guards `io` with the stall limit `limit`.
    pub fn new(io: T, limit: Duration) -> Self {
        Self {
            io,
            limit,
            stalled: None,
        }
    }

    /// Passes a write's readiness through, arming the stall clock while it is pending
    /// and failing once the clock runs out.
    fn watch<R>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<io::Result<R>>,
    ) -> Poll<io::Result<R>> {
        if polled.is_ready() {
            self.stalled = None;
            return polled;
        }
        let limit = self.limit;
        let clock = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        if clock.as_mut().poll(cx).is_ready() {
            self.stalled = None;
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("the client took nothing for {limit:?}"),
            )));
        }
        Poll::Pending
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for WriteStallGuard<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for WriteStallGuard<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_write(cx, buf);
        this.watch(cx, polled)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        this.watch(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_flush(cx);
        this.watch(cx, polled)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_shutdown(cx);
        this.watch(cx, polled)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A peer that reads nothing fails the writer after the stall limit, not before.
    #[tokio::test(start_paused = true)]
    async fn a_peer_that_takes_nothing_fails_the_write_after_the_limit() {
        let (near, _far) = tokio::io::duplex(64);
        let mut guarded = WriteStallGuard::new(near, Duration::from_secs(60));
        let started = tokio::time::Instant::now();
        let written = guarded.write_all(&[7u8; 1024]).await;
        let err = written.expect_err("nobody reads: the write must fail");
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert_eq!(started.elapsed(), Duration::from_secs(60));
    }

    /// A slow peer that keeps taking bytes, each pause shorter than the limit, is never
    /// cut off however long the whole write takes.
    #[tokio::test(start_paused = true)]
    async fn a_slow_reader_that_keeps_reading_is_served() {
        let (near, mut far) = tokio::io::duplex(64);
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            let mut buf = [0u8; 64];
            loop {
                tokio::time::sleep(Duration::from_secs(40)).await;
                match far.read(&mut buf).await.unwrap() {
                    0 => return got,
                    n => got.extend_from_slice(&buf[..n]),
                }
            }
        });
        let mut guarded = WriteStallGuard::new(near, Duration::from_secs(60));
        let data: Vec<u8> = (0..1024u32).map(|i| i as u8).collect();
        guarded.write_all(&data).await.expect("the reader keeps up");
        guarded.shutdown().await.unwrap();
        drop(guarded);
        assert_eq!(reader.await.unwrap(), data);
    }
}
