//! Checkpoint downloads: a tar streamed from disk in bounded chunks, a bounded number at
//! a time.
//!
//! A rank-256 checkpoint of the default model with its optimizer state is about a
//! gigabyte. Building each download in memory let one key exhaust the process's memory
//! with a handful of slow downloads; streamed, each holds at most [`IN_FLIGHT`] chunks.
//! Each stream also holds a thread of tokio's blocking pool while its client reads, and
//! that pool runs every tenant's index and file work, so streams are capped server-wide
//! and per key ([`ArchiveSlots`]); past a cap the download answers 429 with
//! `Retry-After`. A download whose client takes no chunk for a minute, or averages under
//! [`MIN_BYTES_PER_S`] after its first minute, is ended, so a stalled or trickling reader
//! cannot hold its place for long.

use std::collections::HashMap;
use std::io::{self, Write};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::Stream;
use tokio::sync::mpsc;

use super::{EngineError, EngineHandle, LimitExceeded};

/// Downloads streaming at once, server-wide (four keys at their own limit).
pub const ARCHIVE_STREAMS: usize = 8;
/// Downloads one key may stream at once.
pub const ARCHIVE_STREAMS_PER_KEY: usize = 2;
/// Bytes per chunk handed to the response.
const CHUNK: usize = 256 << 10;
/// Chunks queued for the client beyond the one being written.
const IN_FLIGHT: usize = 2;
/// How long a download may go without the client taking a chunk before it is ended.
const STALL: Duration = Duration::from_secs(60);
/// The least average rate a download must keep after its first [`STALL`].
pub const MIN_BYTES_PER_S: u64 = 64 << 10;

/// How many downloads stream now, in all and per key.
#[derive(Debug, Default)]
pub struct ArchiveSlots {
    streams: Mutex<HashMap<String, usize>>,
}

/// One stream's place in [`ArchiveSlots`], given back when dropped.
#[derive(Debug)]
struct Slot {
    slots: Arc<ArchiveSlots>,
    owner: String,
}

impl ArchiveSlots {
    /// A place for one more of `owner`'s streams, or the limit it would pass.
    fn take(self: &Arc<Self>, owner: &str) -> Result<Slot, EngineError> {
        let mut streams = self.streams.lock().unwrap_or_else(|e| e.into_inner());
        let total: usize = streams.values().sum();
        let mine = streams.get(owner).copied().unwrap_or(0);
        let (limit, max) = if mine >= ARCHIVE_STREAMS_PER_KEY {
            ("archive_downloads_per_key", ARCHIVE_STREAMS_PER_KEY)
        } else if total >= ARCHIVE_STREAMS {
            ("archive_downloads", ARCHIVE_STREAMS)
        } else {
            *streams.entry(owner.to_string()).or_default() += 1;
            return Ok(Slot {
                slots: self.clone(),
                owner: owner.to_string(),
            });
        };
        Err(EngineError::Limit(LimitExceeded {
            limit,
            message: format!(
                "{max} checkpoint downloads are streaming already ({limit}); try again when one has finished"
            ),
            retry_after_s: 10,
        }))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut streams = self.slots.streams.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = streams.get_mut(&self.owner) {
            *n -= 1;
            if *n == 0 {
                streams.remove(&self.owner);
            }
        }
    }
}

/// Hands what is written to it to a channel in chunks of [`CHUNK`] bytes, waiting while
/// the channel is full; fails once the receiver is gone (the client left), takes nothing
/// for `stall`, or falls under `min_rate` bytes a second on average after the first
/// `stall`.
struct ChunkWriter {
    tx: mpsc::Sender<io::Result<Bytes>>,
    buf: Vec<u8>,
    started: Instant,
    /// Bytes the client has been handed.
    sent: u64,
    stall: Duration,
    min_rate: u64,
}

impl ChunkWriter {
    fn new(tx: mpsc::Sender<io::Result<Bytes>>) -> Self {
        Self::paced(tx, STALL, MIN_BYTES_PER_S)
    }

    fn paced(tx: mpsc::Sender<io::Result<Bytes>>, stall: Duration, min_rate: u64) -> Self {
        Self {
            tx,
            buf: Vec::with_capacity(CHUNK),
            started: Instant::now(),
            sent: 0,
            stall,
            min_rate,
        }
    }

    /// Whether the client has taken too little on average (the first `stall` is free).
    fn trickling(&self) -> bool {
        let paced = self.started.elapsed().saturating_sub(self.stall);
        (self.sent as f64) < paced.as_secs_f64() * self.min_rate as f64
    }

    fn send(&mut self) -> io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let len = self.buf.len() as u64;
        let mut chunk = Ok(Bytes::from(std::mem::replace(
            &mut self.buf,
            Vec::with_capacity(CHUNK),
        )));
        // A client that stops reading, or reads a trickle, must not keep its slot (and a
        // blocking thread) for long: the download ends once no chunk has left for the
        // stall limit, or the average falls under the minimum rate.
        let start = Instant::now();
        loop {
            if self.trickling() {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "the client read under {} KiB/s on average",
                        self.min_rate >> 10
                    ),
                ));
            }
            match self.tx.try_send(chunk) {
                Ok(()) => {
                    self.sent += len;
                    return Ok(());
                }
                Err(mpsc::error::TrySendError::Closed(_)) => {
                    return Err(io::Error::new(
                        io::ErrorKind::BrokenPipe,
                        "the download was closed",
                    ))
                }
                Err(mpsc::error::TrySendError::Full(c)) if start.elapsed() < self.stall => {
                    chunk = c;
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(mpsc::error::TrySendError::Full(_)) => {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("the client read nothing for {:?}", self.stall),
                    ))
                }
            }
        }
    }
}

impl Write for ChunkWriter {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        let take = data.len().min(CHUNK - self.buf.len());
        self.buf.extend_from_slice(&data[..take]);
        if self.buf.len() == CHUNK {
            self.send()?;
        }
        Ok(take)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.send()
    }
}

impl EngineHandle {
    /// A tar of a checkpoint `owner` may read, with its length where it is known,
    /// streamed: written on the blocking pool while the client reads it. A failure after
    /// the first chunk ends the stream with an error (the client sees a cut-off
    /// download, never a wrong one).
    pub async fn checkpoint_archive(
        &self,
        owner: String,
        uri: lathe_sdk::types::CheckpointUri,
    ) -> Result<
        (
            Option<u64>,
            impl Stream<Item = io::Result<Bytes>> + Send + 'static,
        ),
        EngineError,
    > {
        let slot = self.archives.take(&owner)?;
        let dir = self.checkpoint_dir(owner, uri).await??;
        // Its length first, which also answers a vanished checkpoint with an error
        // rather than a cut-off download.
        let at = dir.clone();
        let len = self
            .blocking(move |_| Ok(crate::store::checkpoints::archive_len(&at)?))
            .await?;
        let (tx, rx) = mpsc::channel(IN_FLIGHT);
        tokio::task::spawn_blocking(move || {
            let mut out = ChunkWriter::new(tx.clone());
            if let Err(e) = crate::store::checkpoints::archive_into(&dir, &mut out) {
                tracing::warn!(dir = %dir.display(), error = %e, "checkpoint download failed");
                // The slot and this thread go at once: a client too slow to take the
                // error (its channel full) gets a body shorter than its length instead.
                drop((slot, out));
                let _ = tx.try_send(Err(io::Error::other(e.to_string())));
            }
        });
        let chunks = futures::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|chunk| (chunk, rx))
        });
        Ok((len, chunks))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_capped_per_key_and_in_all_and_given_back() {
        let slots = Arc::new(ArchiveSlots::default());
        let a: Vec<Slot> = (0..ARCHIVE_STREAMS_PER_KEY)
            .map(|_| slots.take("a").unwrap())
            .collect();
        match slots.take("a") {
            Err(EngineError::Limit(l)) => assert_eq!(l.limit, "archive_downloads_per_key"),
            other => panic!("{other:?}"),
        }
        let b: Vec<Slot> = (ARCHIVE_STREAMS_PER_KEY..ARCHIVE_STREAMS)
            .map(|i| slots.take(&format!("k{i}")).unwrap())
            .collect();
        match slots.take("c") {
            Err(EngineError::Limit(l)) => assert_eq!(l.limit, "archive_downloads"),
            other => panic!("{other:?}"),
        }
        drop(a);
        drop(b);
        assert!(slots.streams.lock().unwrap().is_empty());
        slots.take("c").unwrap();
    }

    #[test]
    fn the_writer_chunks_and_fails_once_the_reader_is_gone() {
        let (tx, mut rx) = mpsc::channel(8);
        let mut w = ChunkWriter::new(tx);
        let data = vec![7u8; CHUNK + 10];
        w.write_all(&data).unwrap();
        w.flush().unwrap();
        let sizes: Vec<usize> = std::iter::from_fn(|| rx.try_recv().ok())
            .map(|c| c.unwrap().len())
            .collect();
        assert_eq!(sizes, [CHUNK, 10]);
        drop(rx);
        w.write_all(&[1]).unwrap();
        assert_eq!(w.flush().unwrap_err().kind(), io::ErrorKind::BrokenPipe);
    }

    /// A reader that keeps up is served whole; one taking a chunk now and then, each
    /// pause under the stall limit, is ended once its average falls under the minimum.
    #[test]
    fn a_trickling_reader_is_ended_and_a_steady_one_served() {
        let run = |pause: Duration| {
            let (tx, mut rx) = mpsc::channel::<io::Result<Bytes>>(1);
            let reader = std::thread::spawn(move || {
                let mut got = 0;
                while let Some(chunk) = rx.blocking_recv() {
                    got += chunk.unwrap().len();
                    std::thread::sleep(pause);
                }
                got
            });
            // Chunks of 256 KiB against 1 MiB/s after a free first second.
            let mut w = ChunkWriter::paced(tx, Duration::from_secs(1), 1 << 20);
            let written = w.write_all(&vec![0u8; 16 * CHUNK]).and_then(|()| w.flush());
            drop(w);
            (written, reader.join().unwrap())
        };
        let (steady, got) = run(Duration::from_millis(20));
        assert!(steady.is_ok(), "{steady:?}");
        assert_eq!(got, 16 * CHUNK);
        let (trickle, got) = run(Duration::from_millis(400));
        let err = trickle.expect_err("0.6 MiB/s, each pause under the stall limit");
        // (On a machine so loaded that a pause passes the stall limit, that ends it.)
        assert_eq!(err.kind(), io::ErrorKind::TimedOut, "{err}");
        assert!(got < 16 * CHUNK);
    }
}
