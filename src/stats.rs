//! Statistics under PyTorch's `memory_stats()` keys, so that tools written for
//! `torch.cuda.memory_stats()` keep working under vram-ledger, plus per-tag keys.
//!
//! The `.all` keys come from the ledger (current, peak, allocated = total count or bytes ever
//! allocated, freed). The `small_pool`/`large_pool` keys are computed from the allocator's
//! blocks when asked: current values only (their peak is reported as the current value, and
//! their allocated/freed totals as 0), since the ledger does not split by pool.

use std::collections::BTreeMap;

use crate::driver::Driver;
use crate::invariants::DumpState;
use crate::{Allocator, Tag};

/// Statistics of one allocator, keyed as `torch.cuda.memory_stats()` keys them.
pub fn memory_stats<D: Driver>(a: &Allocator<D>) -> BTreeMap<String, u64> {
    let s = a.snapshot();
    let dump = a.dump();
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
        s.segment_allocs,
        s.segment_frees,
    );

    // Per pool, and the split-but-inactive blocks, from the blocks themselves.
    #[derive(Default)]
    struct Pool {
        allocations: u64,
        allocated: u64,
        requested: u64,
        active: u64,
        active_bytes: u64,
        inactive_split: u64,
        inactive_split_bytes: u64,
        segments: u64,
        reserved: u64,
    }
    let mut pools = [Pool::default(), Pool::default()];
    let mut active_all = 0;
    let mut inactive_all = (0, 0);
    for seg in &dump.segments {
        let split = seg.blocks.len() > 1;
        for b in &seg.blocks {
            let p = &mut pools[seg.pool as usize];
            match b.state {
                DumpState::Allocated => {
                    p.allocations += 1;
                    p.allocated += b.size;
                    p.requested += b.requested;
                    p.active += 1;
                    p.active_bytes += b.size;
                    active_all += 1;
                }
                DumpState::Pending => {
                    p.active += 1;
                    p.active_bytes += b.size;
                    active_all += 1;
                }
                DumpState::Free if split => {
                    p.inactive_split += 1;
                    p.inactive_split_bytes += b.size;
                    inactive_all.0 += 1;
                    inactive_all.1 += b.size;
                }
                _ => {}
            }
        }
        pools[seg.pool as usize].segments += 1;
        pools[seg.pool as usize].reserved += seg.mapped.iter().map(|m| m.1).sum::<u64>();
    }
    put("active", "all", active_all, active_all, 0, 0);
    put(
        "inactive_split",
        "all",
        inactive_all.0,
        inactive_all.0,
        0,
        0,
    );
    put(
        "inactive_split_bytes",
        "all",
        inactive_all.1,
        inactive_all.1,
        0,
        0,
    );
    for (name, p) in [("small_pool", &pools[0]), ("large_pool", &pools[1])] {
        put("allocation", name, p.allocations, p.allocations, 0, 0);
        put("allocated_bytes", name, p.allocated, p.allocated, 0, 0);
        put("requested_bytes", name, p.requested, p.requested, 0, 0);
        put("active", name, p.active, p.active, 0, 0);
        put("active_bytes", name, p.active_bytes, p.active_bytes, 0, 0);
        put(
            "inactive_split",
            name,
            p.inactive_split,
            p.inactive_split,
            0,
            0,
        );
        put(
            "inactive_split_bytes",
            name,
            p.inactive_split_bytes,
            p.inactive_split_bytes,
            0,
            0,
        );
        put("segment", name, p.segments, p.segments, 0, 0);
        put("reserved_bytes", name, p.reserved, p.reserved, 0, 0);
    }
    m.insert("num_alloc_retries".into(), s.alloc_retries);
    m.insert("num_ooms".into(), s.ooms);
    m.insert("num_sync_all_streams".into(), 0);
    m.insert(
        "num_device_alloc".into(),
        s.segment_allocs + s.creates.max(s.maps),
    );
    m.insert(
        "num_device_free".into(),
        s.segment_frees + s.releases.max(s.unmaps),
    );
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
