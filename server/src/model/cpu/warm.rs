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

    /// Task `task` (below `tasks`) of `tasks`' share of the lines, spread over `steps`
    /// calls of [`Trickle::step`] (as many as the task's kernel makes: one per weight
    /// row, or per block of a panel pair).
    pub fn share(&self, task: usize, tasks: usize, steps: usize) -> Trickle<'a> {
        let tasks = tasks.max(1);
        debug_assert!(task < tasks, "task {task} of {tasks}");
        let task = task.min(tasks);
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
            at: Cell::new(std::ptr::null()),
            // Nothing entered yet: the first step finds its region.
            limit: Cell::new(0),
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
    /// The region being read: its index and the number of its first line.
    region: Cell<(usize, usize)>,
    /// Where line `next` is, while it is before `limit`, the current region's end.
    at: Cell<*const f32>,
    limit: Cell<usize>,
}

impl Trickle<'_> {
    /// A trickle that prefetches nothing.
    pub fn none() -> Trickle<'static> {
        Warm::NONE.share(0, 1, 1)
    }

    /// Prefetches the next few lines of the share, if any are left. Inlined into the
    /// kernels' loops without a call (a call would make every vector register live
    /// across it go through memory); only moving on to the next region calls out.
    #[inline(always)]
    pub fn step(&self) {
        self.step_with(prefetch)
    }

    /// [`Trickle::step`] with `fetch` in place of the prefetch (tests observe it).
    #[inline(always)]
    fn step_with(&self, mut fetch: impl FnMut(*const f32)) {
        let mut next = self.next.get();
        let stop = (next + self.per_step).min(self.end);
        while next < stop {
            if next >= self.limit.get() && !self.enter(next) {
                next = self.end;
                break;
            }
            let at = self.at.get();
            fetch(at);
            self.at.set(at.wrapping_add(LINE_FLOATS));
            next += 1;
        }
        self.next.set(next);
    }

    /// Moves to the region holding line `next` (past `limit`); false when there is none.
    #[cold]
    #[inline(never)]
    fn enter(&self, next: usize) -> bool {
        let (mut r, mut first) = self.region.get();
        while let Some(region) = self.regions.get(r) {
            let lines = lines_of(region);
            if next < first + lines {
                self.region.set((r, first));
                self.at.set(region[(next - first) * LINE_FLOATS..].as_ptr());
                self.limit.set(first + lines);
                return true;
            }
            r += 1;
            first += lines;
        }
        self.region.set((r, first));
        false
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

    /// The shares of all tasks, stepped as often as they were made for, fetch the
    /// start of every line of every region exactly once, in order, whatever the number
    /// of tasks and steps; more steps fetch nothing more.
    #[test]
    fn shares_fetch_every_line_once() {
        let (a, b, c) = (vec![0f32; 100], vec![0f32; 16], vec![0f32; 1]);
        let regions: [&[f32]; 5] = [&a, &[], &b, &[], &c];
        let warm = Warm::new(&regions);
        assert_eq!(warm.lines, 7 + 1 + 1);
        let want: Vec<*const f32> = regions
            .iter()
            .flat_map(|r| r.chunks(LINE_FLOATS).map(|line| line.as_ptr()))
            .collect();
        for tasks in 1..5 {
            for steps in 1..4 {
                let mut got = Vec::new();
                for t in 0..tasks {
                    let share = warm.share(t, tasks, steps);
                    for _ in 0..steps + 2 {
                        share.step_with(|p| got.push(p));
                    }
                }
                assert_eq!(got, want, "{tasks} tasks of {steps} steps");
            }
        }
        let mut idle = Vec::new();
        Trickle::none().step_with(|p| idle.push(p));
        assert!(idle.is_empty());
    }
}
