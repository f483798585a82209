//! How much host memory may be pinned now: what the kernel says is available
//! (`MemAvailable`), less what the process's memory cgroup still allows, less a reserve for the
//! rest of the host.
//!
//! Pinning faults pages in; a page fault that finds no memory does not fail, it wakes the OOM
//! killer, which may end this process (or another). So pinning asks first and refuses what
//! would not fit, with an error that says so. The answer is a snapshot: memory taken by others
//! between the question and the pinning is not seen, and the reserve is what covers it.

use crate::units::GIB;

/// Bytes left to the rest of the host: 1 GiB, or 1/50 of its memory if that is more.
fn reserve(total: u64) -> u64 {
    GIB.max(total / 50)
}

/// A `/proc/meminfo` field, in bytes.
fn meminfo_field(meminfo: &str, name: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with(name))?;
    let kib: u64 = line[name.len()..]
        .trim_start_matches(':')
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    kib.checked_mul(1024)
}

/// What a memory cgroup still allows: its limit less its usage (`max` for the limit: none).
fn cgroup_left(limit: &str, usage: &str) -> Option<u64> {
    let limit: u64 = limit.trim().parse().ok()?;
    let usage: u64 = usage.trim().parse().ok()?;
    Some(limit.saturating_sub(usage))
}

/// What may be pinned, from the texts of `/proc/meminfo` and of the cgroup's limit and usage
/// files when there are any; `None` when `meminfo` says nothing usable.
pub(super) fn pinnable(meminfo: &str, cgroup: Option<(&str, &str)>) -> Option<u64> {
    let available = meminfo_field(meminfo, "MemAvailable")?;
    let total = meminfo_field(meminfo, "MemTotal").unwrap_or(available);
    let mut room = available;
    if let Some(left) = cgroup.and_then(|(limit, usage)| cgroup_left(limit, usage)) {
        room = room.min(left);
    }
    Some(room.saturating_sub(reserve(total)))
}

/// [`pinnable`] for this process now (cgroup v2, else v1); `None` when the host does not say.
pub(super) fn pinnable_now() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let read = |p: &str| std::fs::read_to_string(p).ok();
    let cgroup = [
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ]
    .iter()
    .find_map(|&(l, u)| Some((read(l)?, read(u)?)));
    pinnable(
        &meminfo,
        cgroup.as_ref().map(|(l, u)| (l.as_str(), u.as_str())),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const MEMINFO: &str =
        "MemTotal:       131072000 kB\nMemFree:         1000000 kB\nMemAvailable:   100000000 kB\n";

    #[test]
    fn room_is_what_is_available_less_the_reserve() {
        let total = 131_072_000 * 1024;
        let available = 100_000_000 * 1024;
        assert_eq!(pinnable(MEMINFO, None), Some(available - total / 50));
        // A cgroup with less left than the host: the cgroup decides.
        let left = 20 * GIB;
        let limit = (30 * GIB).to_string();
        let usage = (10 * GIB).to_string();
        assert_eq!(
            pinnable(MEMINFO, Some((&limit, &usage))),
            Some(left - total / 50)
        );
        // No limit ("max"), or a usage above the limit.
        assert_eq!(
            pinnable(MEMINFO, Some(("max\n", "5\n"))),
            Some(available - total / 50)
        );
        assert_eq!(pinnable(MEMINFO, Some(("5", "9"))), Some(0));
    }

    #[test]
    fn a_small_host_keeps_a_gib_and_bad_text_says_nothing() {
        let small = "MemTotal: 4194304 kB\nMemAvailable: 1572864 kB\n";
        assert_eq!(pinnable(small, None), Some(1536 * 1024 * 1024 - GIB));
        assert_eq!(pinnable("MemTotal: 1 kB\n", None), None);
        assert_eq!(pinnable("MemAvailable: lots\n", None), None);
        assert!(
            pinnable_now().is_some(),
            "this Linux host reports /proc/meminfo"
        );
    }
}
