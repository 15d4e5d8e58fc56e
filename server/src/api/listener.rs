//! Serving HTTP connections with limits that hold before any key is known: a bounded
//! number of open connections in all and from one remote address, a deadline on each
//! request's head (which also closes idle keep-alive connections), a pace that request
//! bodies must keep, and a stall limit on responses a client does not take.
//!
//! Without these, anyone who can reach the port (no key needed) could hold the server's
//! memory and file descriptors: connections that send half a request head and wait
//! (slowloris), bodies that send a byte a minute, or requests whose answers are never
//! read (each answer stays in memory until its connection ends). `axum::serve` sets none
//! of these, so the accept loop is written here on hyper's HTTP/1 connection builder.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::time::Sleep;

/// Limits on HTTP connections.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Most connections open at once; past it new ones wait in the listen backlog until
    /// one closes.
    pub max_connections: usize,
    /// Most connections open at once from one remote (non-loopback) address; past it
    /// a new one is closed at once. Loopback peers (a reverse proxy on the same host,
    /// local clients) count only towards `max_connections`.
    pub max_connections_per_ip: usize,
    /// Longest wait for a request's head, from the end of the previous answer (or the
    /// connection's start): an idle keep-alive connection closes after it too.
    pub header_timeout: Duration,
    /// Longest a request body may send nothing while the server reads it (after which
    /// it must also keep an average of [`MIN_BODY_BYTES_PER_S`]), and longest a response
    /// may wait for the client to take any of it; past either the request fails and
    /// the connection closes.
    pub stall_timeout: Duration,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            max_connections: 1024,
            max_connections_per_ip: 256,
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
    let per_ip = PerIp::new(limits.max_connections_per_ip);
    let full = Throttle::default();
    let graceful = GracefulShutdown::new();
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let slot = tokio::select! {
            _ = &mut shutdown => break,
            slot = wait_for_slot(&slots, limits.max_connections, &full) => slot,
        };
        let (stream, peer) = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    accept_failed(e).await;
                    continue;
                }
            },
        };
        let Some(peer_slot) = per_ip.take(peer.ip()) else {
            // Closed at once: its slot is free for others.
            continue;
        };
        tune(&stream);
        let io = TokioIo::new(WriteStallGuard::new(stream, limits.stall_timeout));
        let connection =
            graceful.watch(builder.serve_connection(io, TowerToHyperService::new(app.clone())));
        tokio::spawn(async move {
            let _slots = (slot, peer_slot);
            if let Err(e) = connection.await {
                tracing::debug!("connection ended: {e}");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

/// One connection's slot, waiting (and saying so, now and then) while every slot is
/// taken.
async fn wait_for_slot(
    slots: &Arc<Semaphore>,
    max_connections: usize,
    full: &Throttle,
) -> tokio::sync::OwnedSemaphorePermit {
    if let Ok(slot) = slots.clone().try_acquire_owned() {
        return slot;
    }
    if full.ready() {
        tracing::warn!(
            "{max_connections} connections are open (--max-connections): new connections \
             wait until one closes"
        );
    }
    slots
        .clone()
        .acquire_owned()
        .await
        .expect("the connection semaphore is never closed")
}

/// At most one `true` per [`Throttle::EVERY`]: a warning repeated under a flood of
/// connections is logged now and then, not once per connection.
#[derive(Default)]
struct Throttle {
    last: Mutex<Option<std::time::Instant>>,
}

impl Throttle {
    const EVERY: Duration = Duration::from_secs(10);

    fn ready(&self) -> bool {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        let now = std::time::Instant::now();
        if last.is_some_and(|t| now.duration_since(t) < Self::EVERY) {
            return false;
        }
        *last = Some(now);
        true
    }
}

/// Open connections per remote address, bounded (loopback addresses excepted).
#[derive(Clone)]
struct PerIp {
    max: usize,
    open: Arc<Mutex<HashMap<IpAddr, usize>>>,
    refused: Arc<Throttle>,
}

/// One connection's place in its address's count, given back when dropped.
struct PeerSlot {
    ip: Option<IpAddr>,
    open: Arc<Mutex<HashMap<IpAddr, usize>>>,
}

impl PerIp {
    fn new(max: usize) -> Self {
        Self {
            max: max.max(1),
            open: Arc::default(),
            refused: Arc::default(),
        }
    }

    /// A place for a connection from `ip`, or `None` when that address (an IPv6
    /// address's /64) has `max` open.
    fn take(&self, ip: IpAddr) -> Option<PeerSlot> {
        let counted = !ip.is_loopback() && !ip.to_canonical().is_loopback();
        let ip = peer_group(ip);
        if counted {
            let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
            let n = open.entry(ip).or_insert(0);
            if *n >= self.max {
                if self.refused.ready() {
                    tracing::warn!(
                        "{ip} has {} connections open (--max-connections-per-ip): closing \
                         new ones",
                        self.max
                    );
                }
                return None;
            }
            *n += 1;
        }
        Some(PeerSlot {
            ip: counted.then_some(ip),
            open: self.open.clone(),
        })
    }
}

/// The address a connection counts under: an IPv4 address (also written as IPv6) as it
/// is, an IPv6 address as its /64, which one host is usually given whole. An IPv4 host
/// reaching the server through NAT64 counts as its IPv4 address where the address says
/// where that is: in the well-known prefix `64:ff9b::/96` (RFC 6052) it is the low 32
/// bits, and so it is under the local-use `64:ff9b:1::/48` (RFC 8215) when the
/// translator's prefix is a /96, the only RFC 6052 layout with anything in the low 24
/// bits (shorter prefixes leave them zero, and stay grouped by their /64, which holds
/// the IPv4 address's first bits). As a /64 every IPv4 client behind a /96 translator
/// would share one count.
fn peer_group(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => {
            let bits = u128::from(v6);
            let well_known = bits >> 32 == 0x0064_ff9b_u128 << 64;
            let local_use = bits >> 80 == 0x0064_ff9b_0001 && bits & 0x00ff_ffff != 0;
            if well_known || local_use {
                // The low 32 bits are the IPv4 address.
                return IpAddr::V4(std::net::Ipv4Addr::from(bits as u32));
            }
            IpAddr::V6((bits & !((1u128 << 64) - 1)).into())
        }
        v4 => v4,
    }
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let Some(ip) = self.ip else { return };
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = open.get_mut(&ip) {
            *n -= 1;
            if *n == 0 {
                open.remove(&ip);
            }
        }
    }
}

/// Bytes of unsent answer the kernel queues before a write waits (Linux's
/// `TCP_NOTSENT_LOWAT`): a write that waits then resumes as the client takes bytes, so
/// the stall limit measures the client's progress, and an unread answer holds at most
/// this much kernel memory beyond what is in flight.
#[cfg(target_os = "linux")]
const NOT_SENT_LOW_WATER: i32 = 128 * 1024;

/// Socket options of an accepted connection.
fn tune(stream: &TcpStream) {
    let _ = stream.set_nodelay(true);
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        let value = NOT_SENT_LOW_WATER;
        // SAFETY: a valid socket descriptor, an option value of the size given.
        let _ = unsafe {
            libc::setsockopt(
                stream.as_raw_fd(),
                libc::IPPROTO_TCP,
                libc::TCP_NOTSENT_LOWAT,
                (&value as *const i32).cast(),
                std::mem::size_of::<i32>() as libc::socklen_t,
            )
        };
    }
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

    /// Each remote address gets at most its share of connections, given back as they
    /// close; loopback peers are not counted.
    #[test]
    fn one_address_gets_at_most_its_connections() {
        let per_ip = PerIp::new(2);
        let (a, b): (IpAddr, IpAddr) = ("192.0.2.1".parse().unwrap(), "192.0.2.2".parse().unwrap());
        let first = per_ip.take(a).expect("first");
        let _second = per_ip.take(a).expect("second");
        assert!(per_ip.take(a).is_none(), "a third from the same address");
        assert!(per_ip.take(b).is_some(), "another address is not affected");
        drop(first);
        assert!(
            per_ip.take(a).is_some(),
            "a closed connection frees its place"
        );
        let local: Vec<PeerSlot> = (0..5)
            .map(|_| per_ip.take("127.0.0.1".parse().unwrap()).expect("loopback"))
            .collect();
        assert_eq!(local.len(), 5);
        assert!(per_ip.take("::ffff:127.0.0.1".parse().unwrap()).is_some());
        // One IPv6 /64 is one host's: its addresses share a count; IPv4 written as
        // IPv6 counts as itself.
        let v6 = |s: &str| -> IpAddr { s.parse().unwrap() };
        let _one = per_ip.take(v6("2001:db8:1:2::1")).expect("first");
        let _two = per_ip.take(v6("2001:db8:1:2:ffff::9")).expect("second");
        assert!(
            per_ip.take(v6("2001:db8:1:2::77")).is_none(),
            "the /64's third"
        );
        assert!(per_ip.take(v6("2001:db8:1:3::1")).is_some(), "another /64");
        let _b1 = per_ip.take(v6("::ffff:192.0.2.2")).expect("b as IPv6");
        let _b2 = per_ip.take(b).expect("b");
        assert!(per_ip.take(v6("::ffff:192.0.2.2")).is_none(), "b's third");
    }

    /// IPv4 hosts behind a NAT64 translator count as their own IPv4 addresses, not as
    /// one /64 shared by every such host.
    #[test]
    fn nat64_clients_count_as_their_ipv4_addresses() {
        let ip = |s: &str| -> IpAddr { s.parse().unwrap() };
        assert_eq!(peer_group(ip("64:ff9b::c000:202")), ip("192.0.2.2"));
        assert_eq!(peer_group(ip("64:ff9b::192.0.2.3")), ip("192.0.2.3"));
        assert_eq!(
            peer_group(ip("64:ff9b:1::198.51.100.7")),
            ip("198.51.100.7")
        );
        // Under the local-use /48 with a shorter translator prefix (here a /48: the IPv4
        // address 198.51.100.7 in bits 48-63 and 72-87, the low bits zero), the /64.
        assert_eq!(
            peer_group(ip("64:ff9b:1:c633:64:700::")),
            ip("64:ff9b:1:c633::")
        );
        // Not NAT64: a /64 as before, whatever the low bits.
        assert_eq!(peer_group(ip("64:ff9b:0:1::c000:202")), ip("64:ff9b:0:1::"));
        assert_eq!(peer_group(ip("64:ff9c::c000:202")), ip("64:ff9c::"));
        let per_ip = PerIp::new(1);
        let _first = per_ip.take(ip("64:ff9b::192.0.2.2")).expect("one host");
        assert!(
            per_ip.take(ip("64:ff9b::192.0.2.9")).is_some(),
            "another IPv4 host through the same translator"
        );
        assert!(
            per_ip.take(ip("192.0.2.2")).is_none(),
            "the same IPv4 host, reached directly"
        );
    }

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
