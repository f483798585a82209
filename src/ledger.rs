//! The ledger: the allocator's own account of every byte, by tag.
//!
//! Invariants (hold at every quiescent point; the allocator keeps them, `invariants` checks):
//! - Σ over tags of allocated bytes = allocated bytes (likewise requested bytes, counts);
//! - allocated ≤ active ≤ reserved; cached = reserved − allocated;
//! - every peak ≥ its current value.
//!
//! Counters are plain atomics, readable from any thread without taking the allocator's lock.
//! Each tag's counters share one cache line and the totals another, so an allocation touches
//! two lines. Peaks are only written when exceeded (a load first, so the common case does not
//! dirty the peak's line).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crossbeam::utils::CachePadded;
use serde::{Deserialize, Serialize};

use crate::tag::Tag;

/// A current value and its high-water mark.
#[derive(Default, Debug)]
pub(crate) struct Gauge {
    current: AtomicU64,
    peak: AtomicU64,
}

impl Gauge {
    #[inline]
    pub(crate) fn add(&self, n: u64) {
        let now = self.current.fetch_add(n, Relaxed) + n;
        if now > self.peak.load(Relaxed) {
            self.peak.fetch_max(now, Relaxed);
        }
    }

    #[inline]
    pub(crate) fn sub(&self, n: u64) {
        self.current.fetch_sub(n, Relaxed);
    }

    pub(crate) fn get(&self) -> u64 {
        self.current.load(Relaxed)
    }

    fn read(&self) -> Counter {
        // Peak after current: a concurrent add raises the peak before we could observe a
        // current above it, so the pair read here never shows peak < current.
        let current = self.current.load(Relaxed);
        let peak = self.peak.load(Relaxed).max(current);
        Counter { current, peak }
    }

    fn reset_peak(&self) {
        self.peak.store(self.current.load(Relaxed), Relaxed);
        // An add racing with the store above may have lost its peak update; restore it.
        self.peak.fetch_max(self.current.load(Relaxed), Relaxed);
    }
}

#[derive(Default, Debug)]
struct TagCells {
    allocated: Gauge,
    requested: Gauge,
    count: Gauge,
    total_allocs: AtomicU64,
}

impl TagCells {
    #[inline]
    fn alloc(&self, bytes: u64, requested: u64) {
        self.allocated.add(bytes);
        self.requested.add(requested);
        self.count.add(1);
        self.total_allocs.fetch_add(1, Relaxed);
    }

    #[inline]
    fn free(&self, bytes: u64, requested: u64) {
        self.allocated.sub(bytes);
        self.requested.sub(requested);
        self.count.sub(1);
    }

    fn read(&self) -> TagStats {
        let count = self.count.read();
        let total = self.total_allocs.load(Relaxed);
        TagStats {
            allocated_bytes: self.allocated.read(),
            requested_bytes: self.requested.read(),
            allocations: count,
            total_allocations: total,
            total_frees: total - count.current,
        }
    }

    fn reset_peaks(&self) {
        self.allocated.reset_peak();
        self.requested.reset_peak();
        self.count.reset_peak();
    }
}

/// Driver calls the allocator made, by what they cost.
#[derive(Default, Debug)]
pub(crate) struct DriverCounters {
    pub(crate) segment_allocs: AtomicU64,
    pub(crate) segment_frees: AtomicU64,
    pub(crate) maps: AtomicU64,
    pub(crate) unmaps: AtomicU64,
}

/// The live ledger of one allocator.
#[derive(Default, Debug)]
pub struct Ledger {
    tags: [CachePadded<TagCells>; Tag::COUNT],
    all: CachePadded<TagCells>,
    pub(crate) active: Gauge,
    pub(crate) reserved: Gauge,
    pub(crate) segments: Gauge,
    pub(crate) driver: DriverCounters,
    pub(crate) retries: AtomicU64,
    pub(crate) ooms: AtomicU64,
}

impl Ledger {
    #[inline]
    pub(crate) fn on_alloc(&self, tag: Tag, bytes: u64, requested: u64) {
        self.tags[tag.index()].alloc(bytes, requested);
        self.all.alloc(bytes, requested);
        self.active.add(bytes);
    }

    /// A block stopped being allocated. `still_active` when it waits for other streams' events
    /// before it can be reused (it stays in `active` until [`Ledger::on_released`]).
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
        self.all.allocated.get()
    }

    /// Bytes currently held from the driver.
    pub fn reserved(&self) -> u64 {
        self.reserved.get()
    }

    /// Bytes of `tag` currently handed out.
    pub fn allocated_by(&self, tag: Tag) -> u64 {
        self.tags[tag.index()].allocated.get()
    }

    /// Peaks become the current values, for every counter.
    pub fn reset_peaks(&self) {
        for t in &self.tags {
            t.reset_peaks();
        }
        self.all.reset_peaks();
        self.active.reset_peak();
        self.reserved.reset_peak();
        self.segments.reset_peak();
    }

    /// Peaks of one tag become its current values.
    pub fn reset_tag_peaks(&self, tag: Tag) {
        self.tags[tag.index()].reset_peaks();
    }

    /// A consistent-at-quiescence copy of every counter.
    pub fn snapshot(&self) -> Snapshot {
        let per_tag = PerTag(std::array::from_fn(|i| self.tags[i].read()));
        let all = self.all.read();
        let reserved = self.reserved.read();
        Snapshot {
            cached_bytes: reserved.current.saturating_sub(all.allocated_bytes.current),
            per_tag,
            all,
            active_bytes: self.active.read(),
            reserved_bytes: reserved,
            segments: self.segments.read(),
            segment_allocs: self.driver.segment_allocs.load(Relaxed),
            segment_frees: self.driver.segment_frees.load(Relaxed),
            maps: self.driver.maps.load(Relaxed),
            unmaps: self.driver.unmaps.load(Relaxed),
            alloc_retries: self.retries.load(Relaxed),
            ooms: self.ooms.load(Relaxed),
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
    /// Reserved but not allocated: cache slack and fragmentation.
    pub cached_bytes: u64,
    pub segments: Counter,
    pub segment_allocs: u64,
    pub segment_frees: u64,
    pub maps: u64,
    pub unmaps: u64,
    pub alloc_retries: u64,
    pub ooms: u64,
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
    pub segment_allocs: u64,
    pub segment_frees: u64,
    pub maps: u64,
    pub unmaps: u64,
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
            segment_allocs: self.segment_allocs - earlier.segment_allocs,
            segment_frees: self.segment_frees - earlier.segment_frees,
            maps: self.maps - earlier.maps,
            unmaps: self.unmaps - earlier.unmaps,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peaks_follow_currents_and_reset() {
        let l = Ledger::default();
        l.on_alloc(Tag::Weights, 1024, 1000);
        l.on_alloc(Tag::Activation, 4096, 4000);
        l.on_free(Tag::Activation, 4096, 4000, false);
        let s = l.snapshot();
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
            l.snapshot().per_tag[Tag::Activation].allocated_bytes.peak,
            0
        );
        assert_eq!(l.snapshot().all.allocated_bytes.peak, 5120);
        l.reset_peaks();
        assert_eq!(l.snapshot().all.allocated_bytes.peak, 1024);
    }

    #[test]
    fn diff_and_serde_round_trip() {
        let l = Ledger::default();
        let before = l.snapshot();
        l.on_reserve(2 << 20, true);
        l.on_alloc(Tag::KvCache, 512, 100);
        let after = l.snapshot();
        let d = after.diff(&before);
        assert_eq!(d.allocated_bytes[Tag::KvCache], 512);
        assert_eq!(d.reserved_bytes, 2 << 20);
        assert_eq!(d.allocations, 1);
        assert_eq!(after.cached_bytes, (2 << 20) - 512);
        let json = serde_json::to_string(&after).unwrap();
        assert!(json.contains("\"kv_cache\""));
        let back: Snapshot = serde_json::from_str(&json).unwrap();
        assert_eq!(back, after);
    }
}
