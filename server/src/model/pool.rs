//! Running model work on rayon's thread pool.

/// Runs `work` on a thread of rayon's global pool and returns its result.
///
/// Model work is a long series of parallel regions: a decode step has about 150 (four
/// products, the LoRA deltas and attention per block). Started from a thread outside the
/// pool (the engine's worker thread, a benchmark's main thread), every region is handed
/// to the pool while the caller sleeps until it is done: two thread wake-ups per region.
/// Started from a pool thread, a region is split with the other pool threads by work
/// stealing and the starting thread does its share, so only this one call pays the
/// hand-off.
pub fn on_pool<R: Send>(work: impl FnOnce() -> R + Send) -> R {
    rayon::scope(|_| work())
}
