//! The allocator option the server sets is the one it means to set.

/// In a fresh process (this test binary runs only this test), the option index that
/// `keep_freed_memory` sets holds mimalloc's documented `purge_delay` default of 1000 ms,
/// which no neighbouring option has; afterwards it holds -1, "never purge".
#[test]
fn keep_freed_memory_sets_mimallocs_purge_delay_to_never() {
    const PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
        eprintln!("MIMALLOC_PURGE_DELAY is set in the environment, which the server keeps");
        return;
    }
    // SAFETY: reading an option is valid at any time.
    assert_eq!(unsafe { libmimalloc_sys::mi_option_get(PURGE_DELAY) }, 1000);
    lathe_server::memory::keep_freed_memory();
    // SAFETY: as above.
    assert_eq!(unsafe { libmimalloc_sys::mi_option_get(PURGE_DELAY) }, -1);
}
