//! Counting what a request's decoding and validation allocate, and the bound they must keep.

use super::*;

// ---------------------------------------------------------------- allocation counting

pub(crate) struct Counting;

thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

/// Records `alloc` new bytes held alongside the current ones, then `free` bytes released.
pub(crate) fn note(alloc: usize, free: usize) {
    let _ = LIVE.try_with(|live| {
        let high = live.get() + alloc as isize;
        let _ = PEAK.try_with(|p| p.set(p.get().max(high)));
        live.set(high - free as isize);
    });
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            note(layout.size(), 0);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(layout);
        if !p.is_null() {
            note(layout.size(), 0);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        note(0, layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = System.realloc(ptr, layout, new_size);
        if !p.is_null() {
            note(new_size, layout.size());
        }
        p
    }
}

#[global_allocator]
pub(crate) static GLOBAL: Counting = Counting;

/// Runs `f` and returns its result with the most bytes this thread held at once during
/// it, above what it held before (what `f` returns still counts: it is held at the end).
pub(crate) fn peak_alloc_during<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let start = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(start));
    let r = f();
    let peak = PEAK.with(Cell::get);
    (r, (peak - start).max(0) as usize)
}

/// Bytes decoding plus validation may hold per byte of body. Arrays of one-digit numbers
/// (`0,`: two bytes each) become `i64`s or `f64`s (8 bytes, 16 after `Vec` doubling, 24
/// while it reallocates) and then a copy or two for the engine's types: about 12 at
/// worst. The tightest typed path is a batch of minimal datums: each datum's
/// `loss_fn_inputs` map allocates a whole B-tree leaf (11 slots of `String` and
/// `TensorData`, about 1.4 KiB) for as little as 80 bytes of text, about 20 in all.
pub(crate) const ALLOC_FACTOR: usize = 24;
/// Bytes per byte of the fields serde buffers as a value tree (its private `Content`, or
/// `serde_json::Value`) before typing them: `StopCondition` (untagged),
/// `CreateSessionRequest::user_metadata` and the OpenAI requests' fields their
/// flattened sampling settings receive; and a custom loss's graph, a tree of 32-byte
/// `GraphArg`s (model input chunks decode in one streaming pass). A node is 32
/// bytes for as little as two bytes of text (`0,`), three times that while its `Vec`
/// doubles; a one-element list (`[0],`) allocates the minimum capacity of four nodes:
/// 128 bytes for four bytes of text, plus its own slot, about 56 in all. See
/// [`buffered_bytes`].
pub(crate) const BUFFERED_FACTOR: usize = 64;
/// Fixed slack: error messages, the serde_json scratch buffer, small maps.
pub(crate) const ALLOC_SLACK: usize = 64 * 1024;
/// Bytes per declared value of a loss input the loss reads: the `f64` of `to_dense`,
/// the `f32` or `u32` kept, and the vector's growth.
pub(crate) const EXPANDED_FACTOR: usize = 24;
/// The per-request limit these tests run under (the server's default).
pub(crate) fn limits() -> KeyLimits {
    KeyLimits::default()
}

/// The largest `peak / body` seen for bodies of at least 2 KiB, times 100, for bodies
/// mostly typed and for bodies mostly buffered (`REQUEST_PROPS_REPORT=1` prints each
/// new record).
pub(crate) static WORST_TYPED_X100: AtomicUsize = AtomicUsize::new(0);
pub(crate) static WORST_BUFFERED_X100: AtomicUsize = AtomicUsize::new(0);

pub(crate) fn check_alloc(
    what: &str,
    body_len: usize,
    buffered: usize,
    expanded: usize,
    peak: usize,
) -> Result<(), TestCaseError> {
    let worst = if 2 * buffered < body_len {
        &WORST_TYPED_X100
    } else {
        &WORST_BUFFERED_X100
    };
    if body_len >= 2048 {
        let ratio = peak * 100 / body_len;
        let old = worst.fetch_max(ratio, Ordering::Relaxed);
        if ratio > old && std::env::var_os("REQUEST_PROPS_REPORT").is_some() {
            eprintln!(
                "{what}: new worst ratio {:.2} ({peak} bytes for {body_len}, {buffered} buffered)",
                ratio as f64 / 100.0
            );
        }
    }
    let limit = ALLOC_FACTOR * body_len
        + (BUFFERED_FACTOR - ALLOC_FACTOR) * buffered
        + EXPANDED_FACTOR * expanded
        + ALLOC_SLACK;
    prop_assert!(
        peak <= limit,
        "{what}: held {peak} bytes for a {body_len}-byte body, {buffered} of it buffered \
         and {expanded} declared values to expand (limit {limit})"
    );
    Ok(())
}
