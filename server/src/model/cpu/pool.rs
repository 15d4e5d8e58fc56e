//! Running model work on rayon's thread pool.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Runs `work` on a thread of rayon's global pool and returns its result, with the
/// pool's other threads kept awake for it.
///
/// Model work is a long series of parallel regions: a decode step has about 150 (four
/// products, the LoRA deltas and attention per block). Started from a thread outside the
/// pool (the engine's worker thread, a benchmark's main thread), every region is handed
/// to the pool while the caller sleeps until it is done: two thread wake-ups per region.
/// Started from a pool thread, a region is split with the other pool threads by work
/// stealing and the starting thread does its share, so only this one call pays the
/// hand-off.
///
/// Between regions an idle rayon thread soon goes to sleep, and the next region waits
/// for the kernel to wake it, which can take longer than a decode step's region lasts.
/// So while `work` runs, every other thread of the pool runs a keeper ([`keep_busy`])
/// that takes the regions' work as it appears and otherwise spins, as OpenMP's threads
/// do in llama.cpp.
pub fn on_pool<R: Send>(work: impl FnOnce() -> R + Send) -> R {
    let done = AtomicBool::new(false);
    rayon::scope(|s| {
        let owner = rayon::current_thread_index();
        for _ in 1..rayon::current_num_threads() {
            let done = &done;
            s.spawn(move |_| keep_busy(done, owner));
        }
        // Set even if `work` panics: the scope waits for the keepers.
        let _finish = Finish(&done);
        work()
    })
}

/// Most time a keeper spins without finding work before it lets its thread sleep: well
/// above the serial stretches between a decode step's regions (sampling a token, the
/// LoRA deltas of one row), so that a keeper stays for a whole generation.
///
/// This bounds the CPU a keeper burns while `work` runs a long serial stretch. It also
/// keeps every case live: a keeper that was started in the middle of another job on its
/// thread (possible when the pool is shared with other callers) returns to that job
/// within this time once nothing else is left to do.
const KEEP_BUSY_IDLE: Duration = Duration::from_millis(50);

/// Keeps a pool thread taking work (rayon's `yield_now`) until `done` or until it finds
/// none for [`KEEP_BUSY_IDLE`]. Returns at once on the thread that runs the work
/// itself, which must never wait for its own work to finish.
fn keep_busy(done: &AtomicBool, owner: Option<usize>) {
    if rayon::current_thread_index() == owner {
        return;
    }
    let mut idle_since: Option<Instant> = None;
    let mut spins = 0u32;
    while !done.load(Ordering::Acquire) {
        match rayon::yield_now() {
            Some(rayon::Yield::Executed) => idle_since = None,
            Some(rayon::Yield::Idle) => {
                spins = spins.wrapping_add(1);
                // Every 64th time: give the core to any other thread that is ready to
                // run (the server's network threads), and look at the clock.
                if spins.is_multiple_of(64) {
                    let since = *idle_since.get_or_insert_with(Instant::now);
                    if since.elapsed() > KEEP_BUSY_IDLE {
                        return;
                    }
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
            None => return,
        }
    }
}

/// Sets its flag when dropped.
struct Finish<'a>(&'a AtomicBool);

impl Drop for Finish<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;

    #[test]
    fn work_runs_returns_and_its_panics_propagate_with_keepers_stopped() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        let sum: u64 = pool.install(|| on_pool(|| (0..10_000u64).into_par_iter().sum()));
        assert_eq!(sum, 49_995_000);
        // Nested calls, and calls from several outside threads at once, finish.
        let total: u64 = pool.install(|| {
            (0..8u64)
                .into_par_iter()
                .map(|i| on_pool(|| (0..1000u64).into_par_iter().map(|x| x * i).sum::<u64>()))
                .sum()
        });
        assert_eq!(total, 28 * 499_500);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    let n: usize = pool.install(|| on_pool(|| (0..5000).into_par_iter().count()));
                    assert_eq!(n, 5000);
                });
            }
        });
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.install(|| on_pool(|| panic!("contained")))
        }));
        assert!(panicked.is_err());
        // The pool still works after the panic: no keeper was left spinning on it.
        let n: usize = pool.install(|| on_pool(|| (0..100).into_par_iter().count()));
        assert_eq!(n, 100);
    }
}
