//! The allocator Lathe's binaries use, and how it is tuned for training.
//!
//! Tensors are large and short-lived. glibc's malloc returns large blocks to the OS as
//! soon as they are freed. mimalloc keeps them, but by default it still returns idle
//! memory after a delay of about a second. Either way, the next pass page-faults every
//! page back in, and the kernel zeroes each one first. Binaries declare
//! `#[global_allocator] static GLOBAL: lathe_server::memory::MiMalloc = MiMalloc;`, and
//! the server turns the delayed return off ([`keep_freed_memory`]).

pub use mimalloc::MiMalloc;

/// The index of mimalloc's `purge_delay` option. It is 15 in both its v2 and v3
/// headers; `libmimalloc-sys` does not name it.
const PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Keeps memory freed by mimalloc mapped, for the process's lifetime, instead of
/// returning it to the OS after a delay. The resident size stays at its peak, and the
/// next training pass needs that peak again anyway: a large pass that follows a quiet
/// spell would otherwise fault in, and zero, every page it uses (the README's
/// `bench serve` figures show what that cost).
///
/// An operator who wants memory back between bursts sets `MIMALLOC_PURGE_DELAY`
/// (milliseconds) in the environment, and that setting is left alone. This has no effect
/// unless mimalloc is the global allocator.
pub fn keep_freed_memory() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
        return;
    }
    // SAFETY: setting an option is thread-safe and valid at any time.
    unsafe { libmimalloc_sys::mi_option_set(PURGE_DELAY, -1) }
}

/// The memory this process may use, in bytes, where it can be read: the machine's
/// (`MemTotal` of `/proc/meminfo`), or the lowest memory limit of its cgroup and the
/// cgroups above it when that is lower, as in a container or a systemd unit (cgroup v2's
/// `memory.max`, v1's `memory.limit_in_bytes`).
pub fn physical_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let total = mem_total(&info)?;
    let cgroup = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let v2 = cgroup_dirs(&cgroup, "0::", "/sys/fs/cgroup")
        .into_iter()
        .map(|d| d.join("memory.max"));
    let v1 = cgroup_dirs(&cgroup, ":memory:", "/sys/fs/cgroup/memory")
        .into_iter()
        .map(|d| d.join("memory.limit_in_bytes"));
    let limit = v2
        .chain(v1)
        .filter_map(|file| std::fs::read_to_string(file).ok())
        .filter_map(|s| s.trim().parse::<u64>().ok())
        .min();
    Some(limit.map_or(total, |l| l.min(total)))
}

/// The directories under `root` of the cgroup that a `/proc/self/cgroup` text names on
/// its line holding `marker` (`0::` for v2, `:memory:` for v1), from the process's own
/// up to `root` (none without such a line).
fn cgroup_dirs(cgroup: &str, marker: &str, root: &str) -> Vec<std::path::PathBuf> {
    let root = std::path::Path::new(root);
    let Some(path) = cgroup
        .lines()
        .find_map(|l| l.find(marker).map(|i| &l[i + marker.len()..]))
    else {
        return Vec::new();
    };
    let mut dir = root.join(path.trim().trim_start_matches('/'));
    let mut dirs = Vec::new();
    while dir.starts_with(root) {
        dirs.push(dir.clone());
        if !dir.pop() {
            break;
        }
    }
    dirs
}

/// `MemTotal` of a `/proc/meminfo` text, in bytes.
fn mem_total(info: &str) -> Option<u64> {
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line
        .trim_start_matches("MemTotal:")
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    kib.checked_mul(1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cgroups_directories_run_up_to_the_root() {
        let dirs = cgroup_dirs("0::/system.slice/lathe.service\n", "0::", "/sys/fs/cgroup");
        let names: Vec<_> = dirs.iter().map(|d| d.display().to_string()).collect();
        assert_eq!(
            names,
            [
                "/sys/fs/cgroup/system.slice/lathe.service",
                "/sys/fs/cgroup/system.slice",
                "/sys/fs/cgroup"
            ]
        );
        assert_eq!(cgroup_dirs("0::/\n", "0::", "/sys/fs/cgroup").len(), 1);
        let v1 = "4:memory:/process_api/x\n0::/\n";
        let dirs = cgroup_dirs(v1, ":memory:", "/sys/fs/cgroup/memory");
        assert_eq!(
            dirs[0].display().to_string(),
            "/sys/fs/cgroup/memory/process_api/x"
        );
        assert_eq!(dirs.len(), 3);
        assert!(cgroup_dirs("", "0::", "/sys/fs/cgroup").is_empty());
    }

    #[test]
    fn mem_total_is_read_in_bytes() {
        let info = "MemTotal:       24571372 kB\nMemFree:         1000 kB\n";
        assert_eq!(mem_total(info), Some(24_571_372 * 1024));
        assert_eq!(mem_total("MemFree: 1 kB\n"), None);
        assert_eq!(mem_total("MemTotal: lots kB\n"), None);
    }
}
