//! Statistics under PyTorch's `memory_stats()` keys, so that tools written for
//! `torch.cuda.memory_stats()` keep working under vram-ledger, plus per-tag keys.
//!
//! The `.all` keys come from the ledger (current, peak, allocated = total count or bytes ever
//! allocated, freed; the KV cache's region, which is mapped rather than allocated, is not in
//! the byte totals, and neither are reserved bytes). The `small_pool`/`large_pool` keys come from [`Allocator::pool_stats`],
//! a walk of the blocks when asked: current values only (their peak is reported as the
//! current value, and their allocated/freed totals as 0), since the ledger does not split by
//! pool. Device allocations and frees are the driver calls that obtain or return memory.

use std::collections::BTreeMap;

use crate::driver::Driver;
use crate::driver::DriverCall;
use crate::{Allocator, PoolStats, Tag};

/// Statistics of one allocator, keyed as `torch.cuda.memory_stats()` keys them.
pub fn memory_stats<D: Driver>(a: &Allocator<D>) -> BTreeMap<String, u64> {
    let s = a.snapshot();
    let calls = s.driver_calls;
    let mut m = BTreeMap::new();
    let mut put = |stat: &str, pool: &str, current: u64, peak: u64, allocated: u64, freed: u64| {
        m.insert(format!("{stat}.{pool}.current"), current);
        m.insert(format!("{stat}.{pool}.peak"), peak);
        m.insert(format!("{stat}.{pool}.allocated"), allocated);
        m.insert(format!("{stat}.{pool}.freed"), freed);
    };
    let all = &s.all;
    // Every block handed out was active once; it stops being active when it can be reused.
    let (bytes, requested) = (all.total_allocated_bytes, all.total_requested_bytes);
    // (stat, current and peak, total allocated, total freed); totals PyTorch keeps and the
    // ledger does not are 0.
    let totals = [
        (
            "allocation",
            all.allocations,
            all.total_allocations,
            all.total_frees,
        ),
        (
            "allocated_bytes",
            all.allocated_bytes,
            bytes,
            bytes - all.allocated_bytes.current.min(bytes),
        ),
        (
            "requested_bytes",
            all.requested_bytes,
            requested,
            requested - all.requested_bytes.current.min(requested),
        ),
        (
            "active_bytes",
            s.active_bytes,
            bytes,
            bytes - s.active_bytes.current.min(bytes),
        ),
        ("reserved_bytes", s.reserved_bytes, 0, 0),
        (
            "segment",
            s.segments,
            calls[DriverCall::AllocSegment],
            calls[DriverCall::FreeSegment],
        ),
    ];
    for (stat, c, allocated, freed) in totals {
        put(stat, "all", c.current, c.peak, allocated, freed);
    }

    // Per pool, and the split-but-inactive blocks, from the blocks themselves.
    let pools = a.pool_stats();
    let mut all = PoolStats::default();
    pools.iter().for_each(|p| all.add(p));
    for (stat, v) in [
        ("active", all.active),
        ("inactive_split", all.inactive_split),
        ("inactive_split_bytes", all.inactive_split_bytes),
    ] {
        put(stat, "all", v, v, 0, 0);
    }
    for (name, p) in [("small_pool", &pools[0]), ("large_pool", &pools[1])] {
        for (stat, v) in [
            ("allocation", p.allocations),
            ("allocated_bytes", p.allocated_bytes),
            ("requested_bytes", p.requested_bytes),
            ("active", p.active),
            ("active_bytes", p.active_bytes),
            ("inactive_split", p.inactive_split),
            ("inactive_split_bytes", p.inactive_split_bytes),
            ("segment", p.segments),
            ("reserved_bytes", p.reserved_bytes),
        ] {
            put(stat, name, v, v, 0, 0);
        }
    }
    m.insert("num_alloc_retries".into(), s.alloc_retries);
    m.insert("num_ooms".into(), s.ooms);
    m.insert("num_sync_all_streams".into(), 0);
    m.insert("num_device_alloc".into(), calls.memory_allocations());
    m.insert("num_device_free".into(), calls.memory_frees());
    // Not counted yet (they are blocks of at least max_split_size); PyTorch's memory_summary()
    // reads every one of these keys, so they are present, as 0.
    for stat in ["oversize_allocations", "oversize_segments"] {
        for field in ["current", "peak", "allocated", "freed"] {
            m.insert(format!("{stat}.{field}"), 0);
        }
    }
    for t in Tag::ALL {
        let x = &s.per_tag[t];
        for (key, v) in [
            ("allocated_bytes.current", x.allocated_bytes.current),
            ("allocated_bytes.peak", x.allocated_bytes.peak),
            ("requested_bytes.current", x.requested_bytes.current),
            ("requested_bytes.peak", x.requested_bytes.peak),
            ("allocation.current", x.allocations.current),
            ("allocation.peak", x.allocations.peak),
            ("allocation.allocated", x.total_allocations),
        ] {
            m.insert(format!("tag.{}.{key}", t.name()), v);
        }
    }
    m.insert("cached_bytes.all.current".into(), s.cached_bytes);
    m
}

/// Whether `key` is one of PyTorch's accumulated statistics (what
/// `torch.cuda.reset_accumulated_memory_stats` resets): the `allocated` and `freed` totals of
/// each statistic, and the counts of retries, out-of-memory failures, synchronisations and
/// device allocations and frees.
pub fn is_accumulated(key: &str) -> bool {
    key.ends_with(".allocated")
        || key.ends_with(".freed")
        || matches!(
            key,
            "num_alloc_retries"
                | "num_ooms"
                | "num_sync_all_streams"
                | "num_device_alloc"
                | "num_device_free"
        )
}

/// The accumulated statistics at the last reset, so that they read as counted since then
/// (the ledger's own totals are never reset: other readers, such as replay, keep them whole).
#[derive(Debug, Default)]
pub struct Accumulated(BTreeMap<String, u64>);

impl Accumulated {
    /// Count the accumulated statistics from their values in `now` on.
    pub fn reset(&mut self, now: &BTreeMap<String, u64>) {
        self.0 = now
            .iter()
            .filter(|(k, _)| is_accumulated(k))
            .map(|(k, &v)| (k.clone(), v))
            .collect();
    }

    /// `m` with its accumulated statistics counted since the last reset.
    pub fn apply(&self, m: &mut BTreeMap<String, u64>) {
        for (k, base) in &self.0 {
            if let Some(v) = m.get_mut(k) {
                *v = v.saturating_sub(*base);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::sim::SimDriver;
    use crate::{Config, StreamId};

    #[test]
    fn accumulated_statistics_count_from_their_reset_and_nothing_else_moves() {
        let a = Allocator::new(SimDriver::new(), Config::default()).unwrap();
        let x = a.allocate(3 << 20, StreamId::DEFAULT).unwrap();
        a.free(x.ptr).unwrap();
        let mut acc = Accumulated::default();
        acc.reset(&memory_stats(&a));
        let y = a.allocate(1000, StreamId::DEFAULT).unwrap();
        let mut m = memory_stats(&a);
        let whole = m.clone();
        acc.apply(&mut m);
        assert_eq!(
            m["allocation.all.allocated"], 1,
            "one allocation since the reset"
        );
        assert_eq!(m["allocation.all.freed"], 0);
        assert_eq!(
            whole["allocation.all.allocated"], 2,
            "the ledger's own total stays whole"
        );
        for (k, v) in &m {
            if !is_accumulated(k) {
                assert_eq!(*v, whole[k], "{k} is not accumulated and does not move");
            }
        }
        assert_eq!(m["allocation.all.current"], 1);
        a.free(y.ptr).unwrap();
    }

    #[test]
    fn byte_totals_count_what_was_handed_out_and_given_back() {
        let a = Allocator::new(SimDriver::new(), Config::default()).unwrap();
        let x = a.allocate(1000, StreamId::DEFAULT).unwrap();
        let y = a.allocate(3 << 20, StreamId::DEFAULT).unwrap();
        a.free(x.ptr).unwrap();
        let m = memory_stats(&a);
        let handed = x.size + y.size;
        assert_eq!(m["allocated_bytes.all.allocated"], handed);
        assert_eq!(m["allocated_bytes.all.freed"], x.size);
        assert_eq!(m["active_bytes.all.allocated"], handed);
        assert_eq!(m["active_bytes.all.freed"], x.size);
        assert_eq!(m["requested_bytes.all.allocated"], 1000 + (3 << 20));
        assert_eq!(m["requested_bytes.all.freed"], 1000);
        a.free(y.ptr).unwrap();
        let m = memory_stats(&a);
        assert_eq!(m["allocated_bytes.all.freed"], handed);
        assert_eq!(m["allocated_bytes.all.current"], 0);
    }

    #[test]
    fn pytorch_keys_are_all_there_and_add_up() {
        let a = Allocator::new(SimDriver::new(), Config::default()).unwrap();
        let x = a
            .allocate_tagged(1000, StreamId::DEFAULT, Tag::Weights)
            .unwrap();
        a.allocate_tagged(3 << 20, StreamId::DEFAULT, Tag::Activation)
            .unwrap();
        a.free(x.ptr).unwrap();
        let m = memory_stats(&a);
        for stat in [
            "allocation",
            "segment",
            "active",
            "inactive_split",
            "allocated_bytes",
            "reserved_bytes",
            "active_bytes",
            "inactive_split_bytes",
            "requested_bytes",
        ] {
            for pool in ["all", "small_pool", "large_pool"] {
                for field in ["current", "peak", "allocated", "freed"] {
                    assert!(
                        m.contains_key(&format!("{stat}.{pool}.{field}")),
                        "{stat}.{pool}.{field}"
                    );
                }
            }
        }
        assert_eq!(m["allocated_bytes.all.current"], 3 << 20);
        assert_eq!(m["allocated_bytes.all.peak"], (3 << 20) + 1024);
        assert_eq!(m["allocated_bytes.large_pool.current"], 3 << 20);
        assert_eq!(m["allocated_bytes.small_pool.current"], 0);
        assert_eq!(m["reserved_bytes.all.current"], (2 << 20) + (20 << 20));
        assert_eq!(
            m["reserved_bytes.small_pool.current"] + m["reserved_bytes.large_pool.current"],
            m["reserved_bytes.all.current"]
        );
        assert_eq!(m["allocation.all.allocated"], 2);
        assert_eq!(m["allocation.all.freed"], 1);
        assert_eq!(m["tag.weights.allocated_bytes.peak"], 1024);
        assert_eq!(
            m["inactive_split.all.current"], 1,
            "the 20 MiB segment's free tail"
        );
        // A freed block still used by another stream stays active, in its pool too.
        let y = a.allocate(4096, StreamId::DEFAULT).unwrap();
        a.record_stream(y.ptr, StreamId(0x100)).unwrap();
        a.driver().device().submit(StreamId(0x100));
        a.free(y.ptr).unwrap();
        let m = memory_stats(&a);
        assert_eq!(m["active_bytes.small_pool.current"], 4096);
        assert_eq!(m["active_bytes.all.current"], (3 << 20) + 4096);
    }
}
