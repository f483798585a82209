//! Statistics under PyTorch's `memory_stats()` keys, so that tools written for
//! `torch.cuda.memory_stats()` keep working under vram-ledger, plus per-tag keys.
//!
//! The `.all` keys come from the ledger (current, peak, allocated = total count or bytes ever
//! allocated, freed). The `small_pool`/`large_pool` keys come from [`Allocator::pool_stats`],
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
    let (allocated_total, freed_total) = (all.total_allocations, all.total_frees);
    put(
        "allocation",
        "all",
        all.allocations.current,
        all.allocations.peak,
        allocated_total,
        freed_total,
    );
    put(
        "allocated_bytes",
        "all",
        all.allocated_bytes.current,
        all.allocated_bytes.peak,
        0,
        0,
    );
    put(
        "requested_bytes",
        "all",
        all.requested_bytes.current,
        all.requested_bytes.peak,
        0,
        0,
    );
    put(
        "active_bytes",
        "all",
        s.active_bytes.current,
        s.active_bytes.peak,
        0,
        0,
    );
    put(
        "reserved_bytes",
        "all",
        s.reserved_bytes.current,
        s.reserved_bytes.peak,
        0,
        0,
    );
    put(
        "segment",
        "all",
        s.segments.current,
        s.segments.peak,
        calls[DriverCall::AllocSegment],
        calls[DriverCall::FreeSegment],
    );

    // Per pool, and the split-but-inactive blocks, from the blocks themselves.
    let pools = a.pool_stats();
    let mut all = PoolStats::default();
    pools.iter().for_each(|p| all.add(p));
    put("active", "all", all.active, all.active, 0, 0);
    put(
        "inactive_split",
        "all",
        all.inactive_split,
        all.inactive_split,
        0,
        0,
    );
    put(
        "inactive_split_bytes",
        "all",
        all.inactive_split_bytes,
        all.inactive_split_bytes,
        0,
        0,
    );
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
    m.insert("oversize_allocations.current".into(), 0);
    m.insert("oversize_segments.current".into(), 0);
    for t in Tag::ALL {
        let x = &s.per_tag[t];
        m.insert(
            format!("tag.{}.allocated_bytes.current", t.name()),
            x.allocated_bytes.current,
        );
        m.insert(
            format!("tag.{}.allocated_bytes.peak", t.name()),
            x.allocated_bytes.peak,
        );
        m.insert(
            format!("tag.{}.requested_bytes.current", t.name()),
            x.requested_bytes.current,
        );
        m.insert(
            format!("tag.{}.requested_bytes.peak", t.name()),
            x.requested_bytes.peak,
        );
        m.insert(
            format!("tag.{}.allocation.current", t.name()),
            x.allocations.current,
        );
        m.insert(
            format!("tag.{}.allocation.peak", t.name()),
            x.allocations.peak,
        );
        m.insert(
            format!("tag.{}.allocation.allocated", t.name()),
            x.total_allocations,
        );
    }
    m.insert("cached_bytes.all.current".into(), s.cached_bytes);
    m
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::sim::SimDriver;
    use crate::{Config, StreamId};

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
