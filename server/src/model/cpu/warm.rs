//! Pulling memory that is read next toward the caches while a compute-bound product runs.
//!
//! A decode step of several rows multiplies them by the block weights, which keeps the
//! FMA units busy and leaves memory bandwidth spare (so does one row through the bf16
//! panel copy, whose weights take more arithmetic to form), and then adds each row's
//! LoRA delta, which reads that row's adapter factors and does almost no arithmetic. With a distinct
//! adapter per row the factors do not stay in cache from one step to the next, so the
//! deltas wait on memory with nothing to overlap. [`Warm`] names the factors the deltas
//! will read; the product's parallel tasks each take a share ([`Warm::share`]) and
//! prefetch a few of its cache lines per weight row they compute ([`Trickle::step`]), so
//! the reads overlap the product's arithmetic and the deltas find their data in cache.
//!
//! Prefetches change nothing but the caches: a wrong or stale address costs time, never
//! a result.

use std::cell::Cell;

/// f32 values per 64-byte cache line.
const LINE_FLOATS: usize = 16;

/// Memory to pull toward the caches during a product: whole slices, each from its first
/// element's line to its last.
#[derive(Debug, Clone, Copy)]
pub struct Warm<'a> {
    regions: &'a [&'a [f32]],
    lines: usize,
}

impl<'a> Warm<'a> {
    /// Nothing to warm.
    pub const NONE: Warm<'static> = Warm {
        regions: &[],
        lines: 0,
    };

    /// The cache lines of `regions`.
    pub fn new(regions: &'a [&'a [f32]]) -> Self {
        let lines = regions.iter().map(|r| lines_of(r)).sum();
        Self { regions, lines }
    }

    /// Task `task` of `tasks`' share of the lines, spread over `steps` calls of
    /// [`Trickle::step`] (one per weight row the task computes).
    pub fn share(&self, task: usize, tasks: usize, steps: usize) -> Trickle<'a> {
        let tasks = tasks.max(1);
        let (start, end) = (
            self.lines * task / tasks,
            self.lines * (task + 1).min(tasks) / tasks,
        );
        Trickle {
            regions: self.regions,
            next: Cell::new(start),
            end,
            per_step: (end - start).div_ceil(steps.max(1)),
            region: Cell::new((0, 0)),
        }
    }
}

fn lines_of(r: &[f32]) -> usize {
    r.len().div_ceil(LINE_FLOATS)
}

/// One task's share of a [`Warm`], prefetched a few lines per [`Trickle::step`].
#[derive(Debug)]
pub struct Trickle<'a> {
    regions: &'a [&'a [f32]],
    /// The next line to prefetch, counted over all regions.
    next: Cell<usize>,
    end: usize,
    per_step: usize,
    /// The region that holds line `next` or an earlier one, and its first line's number.
    region: Cell<(usize, usize)>,
}

impl Trickle<'_> {
    /// A trickle that prefetches nothing.
    pub fn none() -> Trickle<'static> {
        Warm::NONE.share(0, 1, 1)
    }

    /// Prefetches the next few lines of the share, if any are left.
    #[inline(always)]
    pub fn step(&self) {
        // Small enough to inline into a kernel's loop without making it too large to
        // inline in turn.
        if self.next.get() < self.end {
            self.advance();
        }
    }

    #[inline(never)]
    fn advance(&self) {
        let (mut next, end) = (self.next.get(), self.end);
        let stop = (next + self.per_step).min(end);
        let (mut r, mut first) = self.region.get();
        while next < stop {
            let Some(region) = self.regions.get(r) else {
                break;
            };
            let lines = lines_of(region);
            if next >= first + lines {
                r += 1;
                first += lines;
                continue;
            }
            prefetch(region[(next - first) * LINE_FLOATS..].as_ptr());
            next += 1;
        }
        self.next.set(next);
        self.region.set((r, first));
    }
}

#[inline]
fn prefetch(p: *const f32) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        // SAFETY: a prefetch never faults and changes nothing but the cache.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(p.cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shares of all tasks cover every line of every region once, whatever the
    /// number of tasks and steps (the trickle's bookkeeping, checked through its cursor).
    #[test]
    fn shares_cover_every_line_once() {
        let (a, b, c) = (vec![0f32; 100], vec![0f32; 16], vec![0f32; 1]);
        let regions: [&[f32]; 4] = [&a, &[], &b, &c];
        let warm = Warm::new(&regions);
        assert_eq!(warm.lines, 7 + 1 + 1);
        for tasks in 1..5 {
            let mut covered = 0;
            for t in 0..tasks {
                let tr = warm.share(t, tasks, 3);
                let start = tr.next.get();
                assert_eq!(
                    start, covered,
                    "task {t} of {tasks} starts where the last ended"
                );
                for _ in 0..3 {
                    tr.step();
                }
                assert_eq!(
                    tr.next.get(),
                    tr.end,
                    "task {t} of {tasks} finished its share"
                );
                covered = tr.end;
            }
            assert_eq!(covered, warm.lines);
        }
        let idle = Trickle::none();
        idle.step();
        assert_eq!(idle.next.get(), 0);
    }
}
