//! The ledger: the allocator's own account of every byte, by tag.
//!
//! Invariants (hold at every quiescent point; the allocator keeps them, `invariants` checks):
//! - Σ over tags of allocated bytes = allocated bytes (likewise requested bytes, counts);
//! - allocated ≤ active ≤ reserved + sleeping; cached = reserved + sleeping − allocated (an
//!   asleep tag's allocations stay allocated, and its memory is counted as sleeping, not
//!   reserved);
//! - every peak ≥ its current value.
//!
//! Layout, and why: the per-allocation counters live in one `ShardCells` per allocator
//! shard, written only by the thread holding that shard's lock. A single writer needs no
//! atomic read-modify-write (a lock-prefixed add costs about as much as the rest of a cached
//! allocation), and shards never share a cache line, so streams on different threads scale.
//! Readers, on any thread and without any lock, sum the shards. Peaks are kept per shard and
//! summed: exact whenever the allocations being measured come from one stream's shard (an
//! engine's forward pass), and an upper bound, never below the current value, when several
//! streams allocate at once. Reserved bytes and segments change only on the slow path and are
//! plain shared atomics; driver calls are counted by the driver adaptor, not here.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crossbeam::utils::CachePadded;
use serde::{Deserialize, Serialize};

use crate::driver::counting::{DriverCalls, DriverTime};

mod gauge;
use crate::tag::Tag;
pub(crate) use gauge::Gauge;
use gauge::LocalGauge;

impl Counter {
    fn plus(self, o: Counter) -> Counter {
        Counter {
            current: self.current + o.current,
            peak: self.peak + o.peak,
        }
    }
}

impl TagStats {
    fn plus(self, o: TagStats) -> TagStats {
        TagStats {
            allocated_bytes: self.allocated_bytes.plus(o.allocated_bytes),
            requested_bytes: self.requested_bytes.plus(o.requested_bytes),
            allocations: self.allocations.plus(o.allocations),
            total_allocations: self.total_allocations + o.total_allocations,
            total_frees: self.total_frees + o.total_frees,
            total_allocated_bytes: self.total_allocated_bytes + o.total_allocated_bytes,
            total_requested_bytes: self.total_requested_bytes + o.total_requested_bytes,
        }
    }
}

/// What a tag allocated ever: allocations, bytes handed out, bytes asked for.
#[derive(Clone, Copy, Debug, Default)]
struct Totals {
    allocations: u64,
    bytes: u64,
    requested: u64,
}

impl std::ops::AddAssign for Totals {
    fn add_assign(&mut self, o: Totals) {
        self.allocations += o.allocations;
        self.bytes += o.bytes;
        self.requested += o.requested;
    }
}

#[derive(Default, Debug)]
struct TagCells {
    allocated: LocalGauge,
    requested: LocalGauge,
    count: LocalGauge,
    /// Allocations ever made, and their bytes and requested bytes; kept per tag only (the
    /// totals are their sums).
    total_allocs: AtomicU64,
    total_bytes: AtomicU64,
    total_requested: AtomicU64,
}

impl TagCells {
    #[inline]
    fn alloc(&self, bytes: u64, requested: u64) {
        self.allocated.add(bytes);
        self.requested.add(requested);
        self.count.add(1);
    }

    #[inline]
    fn count_alloc(&self, bytes: u64, requested: u64) {
        // One writer at a time (the shard's lock): plain loads and stores.
        let bump = |c: &AtomicU64, n: u64| c.store(c.load(Relaxed) + n, Relaxed);
        bump(&self.total_allocs, 1);
        bump(&self.total_bytes, bytes);
        bump(&self.total_requested, requested);
    }

    fn totals(&self) -> Totals {
        Totals {
            allocations: self.total_allocs.load(Relaxed),
            bytes: self.total_bytes.load(Relaxed),
            requested: self.total_requested.load(Relaxed),
        }
    }

    #[inline]
    fn free(&self, bytes: u64, requested: u64) {
        self.allocated.sub(bytes);
        self.requested.sub(requested);
        self.count.sub(1);
    }

    fn read(&self, total: Totals) -> TagStats {
        let count = self.count.read();
        TagStats {
            allocated_bytes: self.allocated.read(),
            requested_bytes: self.requested.read(),
            allocations: count,
            total_allocations: total.allocations,
            total_frees: total.allocations.saturating_sub(count.current),
            total_allocated_bytes: total.bytes,
            total_requested_bytes: total.requested,
        }
    }

    fn reset_peaks(&self) {
        self.allocated.reset_peak();
        self.requested.reset_peak();
        self.count.reset_peak();
    }
}

/// The per-allocation counters of one shard. Written only under that shard's lock. The
/// figures of all tags together are gauges of their own (a peak of a sum is not the sum of the
/// peaks), but for the count of allocations ever made, which is the tags' sum.
#[derive(Default, Debug)]
pub(crate) struct ShardCells {
    tags: [TagCells; Tag::COUNT],
    all: TagCells,
    active: LocalGauge,
}

impl ShardCells {
    #[inline]
    pub(crate) fn on_alloc(&self, tag: Tag, bytes: u64, requested: u64) {
        let t = &self.tags[tag.index()];
        t.alloc(bytes, requested);
        t.count_alloc(bytes, requested);
        self.all.alloc(bytes, requested);
        self.active.add(bytes);
    }

    /// A block stopped being allocated. `still_active` when it waits for other streams' events
    /// before it can be reused (it stays in `active` until [`ShardCells::on_released`]).
    #[inline]
    pub(crate) fn on_free(&self, tag: Tag, bytes: u64, requested: u64, still_active: bool) {
        self.tags[tag.index()].free(bytes, requested);
        self.all.free(bytes, requested);
        if !still_active {
            self.active.sub(bytes);
        }
    }

    /// A block whose reuse waited on other streams became reusable.
    pub(crate) fn on_released(&self, bytes: u64) {
        self.active.sub(bytes);
    }
}

/// The live ledger of one allocator.
#[derive(Debug)]
pub struct Ledger {
    shards: Box<[CachePadded<ShardCells>]>,
    pub(crate) reserved: Gauge,
    pub(crate) segments: Gauge,
    pub(crate) retries: AtomicU64,
    pub(crate) ooms: AtomicU64,
    /// Driver failures absorbed while moving free memory before growing (compact, remap).
    pub(crate) move_failures: AtomicU64,
    /// Reads of this process's usage (for the budget contract) that failed, so that growth went
    /// on with the figure measured at profiling.
    pub(crate) usage_read_failures: AtomicU64,
    /// Bytes held from the driver for CUDA graph pools (mapped, or plain segments).
    pub(crate) graph_reserved: Gauge,
    /// Memory outside the allocator that appeared while graphs were captured and instantiated.
    pub(crate) graph_outside: AtomicU64,
    /// Bytes of each tag given back while it sleeps (not in `reserved`).
    sleeping: [AtomicU64; Tag::COUNT],
    /// The KV cache's address space, its mapped bytes (part of `reserved`), and the bytes of
    /// the blocks the engine may use.
    kv_reserved: AtomicU64,
    pub(crate) kv_mapped: Gauge,
    kv_usable: AtomicU64,
    /// The KV cache's bytes given back while the KV tag sleeps (still one allocation, as an
    /// asleep tag's allocations stay allocated).
    kv_asleep: AtomicU64,
    /// Bytes the driver may still hold for mappings whose undo failed (`allocator/stranded.rs`).
    pub(crate) lost: AtomicU64,
}

impl Default for Ledger {
    fn default() -> Self {
        Ledger::new(1)
    }
}

impl Ledger {
    pub(crate) fn new(shards: usize) -> Ledger {
        Ledger {
            shards: (0..shards)
                .map(|_| CachePadded::new(ShardCells::default()))
                .collect(),
            reserved: Gauge::default(),
            segments: Gauge::default(),
            retries: AtomicU64::new(0),
            ooms: AtomicU64::new(0),
            move_failures: AtomicU64::new(0),
            usage_read_failures: AtomicU64::new(0),
            graph_reserved: Gauge::default(),
            graph_outside: AtomicU64::new(0),
            sleeping: Default::default(),
            kv_reserved: AtomicU64::new(0),
            kv_mapped: Gauge::default(),
            kv_usable: AtomicU64::new(0),
            kv_asleep: AtomicU64::new(0),
            lost: AtomicU64::new(0),
        }
    }

    pub(crate) fn kv_reserved(&self, bytes: u64) {
        self.kv_reserved.store(bytes, Relaxed);
    }

    pub(crate) fn kv_asleep(&self, bytes: u64) {
        self.kv_asleep.store(bytes, Relaxed);
    }

    pub(crate) fn kv_usable(&self, bytes: u64) {
        self.kv_usable.store(bytes, Relaxed);
    }

    pub(crate) fn sleeping_add(&self, tag: Tag, bytes: u64) {
        self.sleeping[tag.index()].fetch_add(bytes, Relaxed);
    }

    pub(crate) fn sleeping_sub(&self, tag: Tag, bytes: u64) {
        self.sleeping[tag.index()].fetch_sub(bytes, Relaxed);
    }

    /// Bytes of `tag` given back while it sleeps.
    pub fn sleeping(&self, tag: Tag) -> u64 {
        self.sleeping[tag.index()].load(Relaxed)
    }

    /// The counters of shard `i`; only the holder of that shard's lock may write them.
    #[inline]
    pub(crate) fn shard(&self, i: usize) -> &ShardCells {
        &self.shards[i]
    }

    pub(crate) fn on_reserve(&self, bytes: u64, new_segment: bool) {
        self.reserved.add(bytes);
        if new_segment {
            self.segments.add(1);
        }
    }

    pub(crate) fn on_unreserve(&self, bytes: u64, segment_gone: bool) {
        self.reserved.sub(bytes);
        if segment_gone {
            self.segments.sub(1);
        }
    }

    /// Bytes currently handed out to callers.
    pub fn allocated(&self) -> u64 {
        self.shards.iter().map(|s| s.all.allocated.get()).sum()
    }

    /// Bytes currently held from the driver.
    pub fn reserved(&self) -> u64 {
        self.reserved.get()
    }

    /// Bytes of `tag` currently handed out.
    pub fn allocated_by(&self, tag: Tag) -> u64 {
        self.shards
            .iter()
            .map(|s| s.tags[tag.index()].allocated.get())
            .sum()
    }

    /// Peaks become the current values, for every counter.
    pub fn reset_peaks(&self) {
        for s in self.shards.iter() {
            for t in &s.tags {
                t.reset_peaks();
            }
            s.all.reset_peaks();
            s.active.reset_peak();
        }
        self.reserved.reset_peak();
        self.segments.reset_peak();
        self.kv_mapped.reset_peak();
    }

    /// Peaks of one tag become its current values.
    pub fn reset_tag_peaks(&self, tag: Tag) {
        for s in self.shards.iter() {
            s.tags[tag.index()].reset_peaks();
        }
    }

    /// A copy of every counter, with the driver calls and their time counted elsewhere (the
    /// allocator's counting driver); consistent when no allocation is in flight.
    pub(crate) fn snapshot(&self, driver_calls: DriverCalls, driver_time: DriverTime) -> Snapshot {
        let mut per_tag = PerTag::<TagStats>::default();
        let mut all = TagStats::default();
        let mut active = Counter::default();
        for s in self.shards.iter() {
            let mut total = Totals::default();
            for t in Tag::ALL {
                let cells = &s.tags[t.index()];
                let n = cells.totals();
                total += n;
                per_tag[t] = per_tag[t].plus(cells.read(n));
            }
            all = all.plus(s.all.read(total));
            active = active.plus(s.active.read());
        }
        // The KV cache is one allocation of the KV tag, of its mapped bytes. Its peak adds to
        // the shards' peaks: an upper bound, exact while the KV cache does not change.
        let kv = self.kv_mapped.read();
        let asleep = self.kv_asleep.load(Relaxed);
        // Asleep it still counts, even where a reset of the peaks came after it fell asleep.
        if kv.peak > 0 || asleep > 0 {
            let current = kv.current + asleep;
            let held = Counter {
                current,
                peak: kv.peak.max(current),
            };
            let region = TagStats {
                allocated_bytes: held,
                requested_bytes: held,
                allocations: Counter {
                    current: u64::from(held.current > 0),
                    peak: 1,
                },
                total_allocations: 0,
                total_frees: 0,
                total_allocated_bytes: 0,
                total_requested_bytes: 0,
            };
            per_tag[Tag::KvCache] = per_tag[Tag::KvCache].plus(region);
            all = all.plus(region);
            active = active.plus(held);
        }
        let reserved = self.reserved.read();
        let sleeping = PerTag(std::array::from_fn(|i| self.sleeping[i].load(Relaxed)));
        // Asleep allocations stay allocated; their memory is counted as sleeping, not reserved.
        let backed = reserved.current + sleeping.0.iter().sum::<u64>();
        Snapshot {
            cached_bytes: backed.saturating_sub(all.allocated_bytes.current),
            sleeping_bytes: sleeping,
            per_tag,
            all,
            active_bytes: active,
            reserved_bytes: reserved,
            segments: self.segments.read(),
            driver_calls,
            driver_time,
            alloc_retries: self.retries.load(Relaxed),
            ooms: self.ooms.load(Relaxed),
            move_failures: self.move_failures.load(Relaxed),
            usage_read_failures: self.usage_read_failures.load(Relaxed),
            graph_reserved_bytes: self.graph_reserved.read(),
            graph_outside_bytes: self.graph_outside.load(Relaxed),
            lost_bytes: self.lost.load(Relaxed),
            kv_cache: KvBytes {
                reserved: self.kv_reserved.load(Relaxed),
                mapped: kv,
                usable: self.kv_usable.load(Relaxed),
            },
        }
    }
}

/// A current value and its peak since the last reset.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counter {
    pub current: u64,
    pub peak: u64,
}

/// Counters of one tag (or of all tags together).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TagStats {
    /// Bytes handed out, after rounding.
    pub allocated_bytes: Counter,
    /// Bytes the callers asked for.
    pub requested_bytes: Counter,
    /// Live allocations.
    pub allocations: Counter,
    pub total_allocations: u64,
    pub total_frees: u64,
    /// Bytes ever handed out and asked for.
    #[serde(default)]
    pub total_allocated_bytes: u64,
    #[serde(default)]
    pub total_requested_bytes: u64,
}

/// One value per tag, serialised as a map keyed by tag name.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PerTag<T>(pub [T; Tag::COUNT]);

impl<T> std::ops::Index<Tag> for PerTag<T> {
    type Output = T;
    fn index(&self, tag: Tag) -> &T {
        &self.0[tag.index()]
    }
}

impl<T> std::ops::IndexMut<Tag> for PerTag<T> {
    fn index_mut(&mut self, tag: Tag) -> &mut T {
        &mut self.0[tag.index()]
    }
}

impl<T: Serialize> Serialize for PerTag<T> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(Tag::COUNT))?;
        for t in Tag::ALL {
            m.serialize_entry(t.name(), &self[t])?;
        }
        m.end()
    }
}

impl<'de, T: Deserialize<'de> + Default> Deserialize<'de> for PerTag<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let map = std::collections::BTreeMap::<String, T>::deserialize(d)?;
        let mut out = PerTag::<T>(Default::default());
        for (k, v) in map {
            let tag: Tag = k.parse().map_err(serde::de::Error::custom)?;
            out[tag] = v;
        }
        Ok(out)
    }
}

/// Every counter of a ledger at one moment. Serialisable; two snapshots can be diffed.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshot {
    pub per_tag: PerTag<TagStats>,
    pub all: TagStats,
    /// Allocated bytes plus freed blocks still waiting for another stream's work.
    pub active_bytes: Counter,
    /// Bytes held from the driver (segments, or mapped pages).
    pub reserved_bytes: Counter,
    /// Reserved but not allocated: cache slack and fragmentation. While a tag sleeps, its
    /// allocations stay allocated and its memory is in `sleeping_bytes`, not reserved: this is
    /// reserved + sleeping − allocated.
    pub cached_bytes: u64,
    /// Plain segments held.
    pub segments: Counter,
    /// Every driver call the allocator made, by name.
    pub driver_calls: DriverCalls,
    /// The time the allocator's threads spent in those calls, by name.
    #[serde(default)]
    pub driver_time: DriverTime,
    pub alloc_retries: u64,
    pub ooms: u64,
    /// Driver failures absorbed while moving free memory before growing (the allocation then
    /// took new memory instead).
    pub move_failures: u64,
    /// Failed reads of this process's usage before a growth under the budget contract (the
    /// growth then assumed the memory outside the allocator measured at profiling).
    pub usage_read_failures: u64,
    /// Bytes held for CUDA graph pools: what allocations made during captures got (part of
    /// `reserved_bytes`).
    #[serde(default)]
    pub graph_reserved_bytes: Counter,
    /// Memory outside the allocator that appeared while graphs were captured and instantiated
    /// (measured from this process's usage at each capture's begin and end; 0 without it).
    #[serde(default)]
    pub graph_outside_bytes: u64,
    /// Device memory the driver may still hold for this process that nothing uses: mappings
    /// whose undo failed after a failed map (not in `reserved_bytes`; retried when the cache is
    /// given back).
    #[serde(default)]
    pub lost_bytes: u64,
    /// Bytes of each tag given back to the driver while it sleeps (not in `reserved_bytes`;
    /// its allocations stay allocated).
    #[serde(default)]
    pub sleeping_bytes: PerTag<u64>,
    /// The KV cache in reserved address space ([`crate::Allocator::reserve_kv`]): its mapped
    /// bytes are part of `reserved_bytes` and of the KV tag's allocated bytes.
    #[serde(default)]
    pub kv_cache: KvBytes,
}

/// The KV cache's bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvBytes {
    /// Address space reserved for it (its largest size).
    pub reserved: u64,
    /// Physical memory mapped into it.
    pub mapped: Counter,
    /// The bytes of the blocks the engine may use (at most `mapped`).
    pub usable: u64,
}

/// What changed between two snapshots (later − earlier) in the current values and totals.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotDiff {
    pub allocated_bytes: PerTag<i64>,
    pub allocated_bytes_all: i64,
    pub requested_bytes_all: i64,
    pub reserved_bytes: i64,
    pub active_bytes: i64,
    pub allocations: u64,
    pub frees: u64,
    pub driver_calls: DriverCalls,
    #[serde(default)]
    pub driver_time: DriverTime,
}

fn delta(later: u64, earlier: u64) -> i64 {
    later as i64 - earlier as i64
}

impl Snapshot {
    /// `self − earlier`.
    pub fn diff(&self, earlier: &Snapshot) -> SnapshotDiff {
        SnapshotDiff {
            allocated_bytes: PerTag(std::array::from_fn(|i| {
                delta(
                    self.per_tag.0[i].allocated_bytes.current,
                    earlier.per_tag.0[i].allocated_bytes.current,
                )
            })),
            allocated_bytes_all: delta(
                self.all.allocated_bytes.current,
                earlier.all.allocated_bytes.current,
            ),
            requested_bytes_all: delta(
                self.all.requested_bytes.current,
                earlier.all.requested_bytes.current,
            ),
            reserved_bytes: delta(self.reserved_bytes.current, earlier.reserved_bytes.current),
            active_bytes: delta(self.active_bytes.current, earlier.active_bytes.current),
            allocations: self.all.total_allocations - earlier.all.total_allocations,
            frees: self.all.total_frees - earlier.all.total_frees,
            driver_calls: self.driver_calls.since(&earlier.driver_calls),
            driver_time: self.driver_time.since(&earlier.driver_time),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peaks_are_summed_over_shards() {
        let l = Ledger::new(2);
        // Two streams peak at different moments: the sum of peaks bounds the true peak.
        l.shard(0).on_alloc(Tag::Activation, 1000, 1000);
        l.shard(0).on_free(Tag::Activation, 1000, 1000, false);
        l.shard(1).on_alloc(Tag::Activation, 512, 512);
        let a = l
            .snapshot(DriverCalls::default(), DriverTime::default())
            .per_tag[Tag::Activation]
            .allocated_bytes;
        assert_eq!(
            a,
            Counter {
                current: 512,
                peak: 1512
            }
        );
        l.reset_peaks();
        assert_eq!(
            l.snapshot(DriverCalls::default(), DriverTime::default())
                .per_tag[Tag::Activation]
                .allocated_bytes
                .peak,
            512
        );
    }

    #[test]
    fn peaks_follow_currents_and_reset() {
        let l = Ledger::new(2);
        l.shard(0).on_alloc(Tag::Weights, 1024, 1000);
        l.shard(1).on_alloc(Tag::Activation, 4096, 4000);
        l.shard(1).on_free(Tag::Activation, 4096, 4000, false);
        let s = l.snapshot(DriverCalls::default(), DriverTime::default());
        assert_eq!(
            s.all.allocated_bytes,
            Counter {
                current: 1024,
                peak: 5120
            }
        );
        assert_eq!(
            s.per_tag[Tag::Activation].allocated_bytes,
            Counter {
                current: 0,
                peak: 4096
            }
        );
        assert_eq!(s.per_tag[Tag::Weights].requested_bytes.current, 1000);
        assert_eq!(s.all.total_allocations, 2);
        assert_eq!(s.all.total_frees, 1);
        l.reset_tag_peaks(Tag::Activation);
        assert_eq!(
            l.snapshot(DriverCalls::default(), DriverTime::default())
                .per_tag[Tag::Activation]
                .allocated_bytes
                .peak,
            0
        );
        assert_eq!(
            l.snapshot(DriverCalls::default(), DriverTime::default())
                .all
                .allocated_bytes
                .peak,
            5120
        );
        l.reset_peaks();
        assert_eq!(
            l.snapshot(DriverCalls::default(), DriverTime::default())
                .all
                .allocated_bytes
                .peak,
            1024
        );
    }

    #[test]
    fn diff_and_serde_round_trip() {
        let l = Ledger::default();
        let before = l.snapshot(DriverCalls::default(), DriverTime::default());
        l.on_reserve(2 << 20, true);
        l.shard(0).on_alloc(Tag::KvCache, 512, 100);
        // Time in a driver call, from a counting driver whose call waits.
        use crate::driver::{counting::Counting, sim::SimDriver, Driver, DriverCall};
        let drv = Counting::new(SimDriver::new());
        let wait = std::time::Duration::from_millis(2);
        drv.inner().stall_nth(DriverCall::MemInfo, 1, wait);
        drv.mem_info().unwrap();
        let after = l.snapshot(DriverCalls::default(), drv.time());
        let d = after.diff(&before);
        assert_eq!(d.allocated_bytes[Tag::KvCache], 512);
        assert_eq!(d.reserved_bytes, 2 << 20);
        assert_eq!(d.allocations, 1);
        assert!(d.driver_time.nanos(DriverCall::MemInfo) >= wait.as_nanos() as u64);
        assert_eq!(after.cached_bytes, (2 << 20) - 512);
        let json = serde_json::to_string(&after).unwrap();
        assert!(json.contains("\"kv_cache\""));
        let back: Snapshot = serde_json::from_str(&json).unwrap();
        assert_eq!(back, after);
        // A snapshot written before driver time was kept still reads, with none.
        let mut old: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert!(old.as_object_mut().unwrap().remove("driver_time").is_some());
        let back: Snapshot = serde_json::from_value(old).unwrap();
        assert_eq!(back.driver_time, DriverTime::default());
        assert_eq!(back.driver_calls, after.driver_calls);
    }
}
