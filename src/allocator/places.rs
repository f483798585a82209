//! Which shard holds an address, so that `free(ptr)` without a stream locks one shard and not
//! each in turn: a two-level table over 2 MiB granules of the address space, written when a
//! shard adds or removes a segment (the slow path), read with two loads.
//!
//! Invariant: a granule's entry counts the segments that overlap it, and names shard `s` only
//! when every one of them belongs to `s`; when segments of two shards share a granule it says
//! `MIXED` until none overlaps it any more. So an entry naming `s` proves that an address in
//! that granule, if it is live anywhere, is live in `s`; `MIXED`, an address above the table or
//! a granule never written sends the caller to search the shards. The table is a shortcut to
//! the owner, never the record of what is live (that stays in each shard's live map).
//!
//! Each entry is changed with one compare-and-swap loop, so shards add and remove segments
//! concurrently without a lock of the table's own; second-level tables are made on first use
//! and kept until the allocator is dropped.

use std::sync::atomic::{
    AtomicU32,
    Ordering::{AcqRel, Acquire},
};
use std::sync::OnceLock;

use crate::driver::DevicePtr;

/// 2 MiB: the driver's granularity for device memory, and the smallest native segment.
const GRANULE_SHIFT: u32 = 21;
/// One second-level table covers 64 GiB of addresses.
const LEAF_SHIFT: u32 = 36;
const LEAF_LEN: usize = 1 << (LEAF_SHIFT - GRANULE_SHIFT);
/// Addresses below 2^48: the 48-bit virtual addresses of x86-64 and AArch64 hosts and their GPUs.
const ROOTS: usize = 1 << (48 - LEAF_SHIFT);

/// The low byte of an entry: the shard, or that segments of several shards share the granule.
const MIXED: u32 = 0xff;
const ONE: u32 = 1 << 8;

/// Where to look for an address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Place {
    /// Only this shard can hold it.
    Shard(usize),
    /// No segment overlaps its granule: no shard holds it.
    Nowhere,
    /// Ask each shard.
    Search,
}

pub(crate) struct Places {
    roots: Box<[OnceLock<Box<[AtomicU32]>>]>,
}

impl Default for Places {
    fn default() -> Self {
        Places {
            roots: (0..ROOTS).map(|_| OnceLock::new()).collect(),
        }
    }
}

impl Places {
    /// Where `ptr` can be live.
    #[inline]
    pub(crate) fn find(&self, ptr: DevicePtr) -> Place {
        let Some(entry) = self.entry(ptr >> GRANULE_SHIFT, false) else {
            return Place::Search;
        };
        match entry.load(Acquire) {
            0 => Place::Nowhere,
            e if e & MIXED == MIXED => Place::Search,
            e => Place::Shard((e & MIXED) as usize),
        }
    }

    /// Shard `shard` added a segment of `size` bytes at `base`.
    pub(crate) fn add(&self, base: DevicePtr, size: u64, shard: usize) {
        debug_assert!((shard as u32) < MIXED);
        self.each(base, size, |e| {
            if e == 0 {
                ONE | shard as u32
            } else if e & MIXED == shard as u32 {
                e + ONE
            } else {
                (e | MIXED) + ONE
            }
        });
    }

    /// Shard `shard` removed the segment it added at `base`.
    pub(crate) fn remove(&self, base: DevicePtr, size: u64) {
        self.each(base, size, |e| if e < 2 * ONE { 0 } else { e - ONE });
    }

    /// Apply `change` to the entry of every granule `[base, base + size)` overlaps; granules
    /// above the table are left out (`find` searches for them).
    fn each(&self, base: DevicePtr, size: u64, change: impl Fn(u32) -> u32) {
        let first = base >> GRANULE_SHIFT;
        let last = base.saturating_add(size.max(1) - 1) >> GRANULE_SHIFT;
        // One second-level table at a time: its root is looked up once, not per granule.
        let mut g = first;
        while g <= last {
            let Some(leaf) = self.leaf(g, true) else {
                return;
            };
            let start = g as usize & (LEAF_LEN - 1);
            let end = (start as u64 + (last - g)).min(LEAF_LEN as u64 - 1) as usize;
            for entry in &leaf[start..=end] {
                let _ = entry.fetch_update(AcqRel, Acquire, |e| Some(change(e)));
            }
            g += (end - start) as u64 + 1;
        }
    }

    /// The entry of granule `g`; its table is made when `make` is set and it has none yet.
    #[inline]
    fn entry(&self, g: u64, make: bool) -> Option<&AtomicU32> {
        Some(&self.leaf(g, make)?[g as usize & (LEAF_LEN - 1)])
    }

    /// The second-level table holding granule `g`, made (zeroed) when `make` is set and it
    /// has none yet.
    #[inline]
    fn leaf(&self, g: u64, make: bool) -> Option<&[AtomicU32]> {
        let root = self
            .roots
            .get((g >> (LEAF_SHIFT - GRANULE_SHIFT)) as usize)?;
        match root.get() {
            Some(leaf) => Some(leaf),
            None if make => Some(root.get_or_init(zeroed_leaf)),
            None => None,
        }
    }
}

/// A second-level table of zero entries, from zeroed memory: no pass writing its 128 KiB, and
/// the pages no granule's entry touches are never faulted in.
fn zeroed_leaf() -> Box<[AtomicU32]> {
    // SAFETY: all-zero bytes are a valid `AtomicU32` (it has the bit validity of `u32`).
    unsafe { Box::<[AtomicU32]>::new_zeroed_slice(LEAF_LEN).assume_init() }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn a_granule_names_its_shard_until_another_shares_it() {
        let p = Places::default();
        assert_eq!(p.find(0x7f00_0000_0000), Place::Search, "never written");
        p.add(0x7f00_0000_0000, 20 * MIB, 3);
        assert_eq!(p.find(0x7f00_0000_0000 + 19 * MIB), Place::Shard(3));
        assert_eq!(p.find(0x7f00_0000_0000 + 20 * MIB), Place::Nowhere);
        // A 1 MiB segment of shard 5 in the last granule of shard 3's.
        p.add(0x7f00_0000_0000 + 19 * MIB, MIB, 5);
        assert_eq!(p.find(0x7f00_0000_0000 + 18 * MIB), Place::Search);
        assert_eq!(p.find(0x7f00_0000_0000), Place::Shard(3));
        p.remove(0x7f00_0000_0000 + 19 * MIB, MIB);
        assert_eq!(
            p.find(0x7f00_0000_0000 + 18 * MIB),
            Place::Search,
            "still conservative"
        );
        p.remove(0x7f00_0000_0000, 20 * MIB);
        assert_eq!(p.find(0x7f00_0000_0000 + 18 * MIB), Place::Nowhere);
        assert_eq!(p.find(0x7f00_0000_0000), Place::Nowhere);
        assert_eq!(p.find(1 << 48), Place::Search, "above the table");
        p.add(u64::MAX - MIB, MIB, 1);
    }

    /// In every mode, on sixteen streams: each live allocation's granule names its stream's
    /// shard or asks for a search, never another shard or none; once the cache is empty, no
    /// granule names a shard.
    #[test]
    fn every_live_allocation_is_found_in_its_shard() {
        use crate::driver::sim::SimDriver;
        // Every mode, each policy's growth (modes are matched only in config.rs and growth/).
        use crate::{Allocator, Config, SegmentMode as Mode, StreamId};
        for mode in Mode::ALL {
            let a = Allocator::new(SimDriver::new(), Config::with_mode(mode)).unwrap();
            let mut live = Vec::new();
            for i in 0..160u64 {
                let stream = StreamId(i % 16);
                let size = [512, 4096, 1 << 20, 3 << 20, 40 << 20][i as usize % 5];
                live.push((a.allocate(size, stream).unwrap().ptr, a.shard_of(stream)));
            }
            let mut searched = 0;
            for &(ptr, shard) in &live {
                match a.core.places.find(ptr) {
                    Place::Shard(s) => assert_eq!(s, shard, "{mode}: {ptr:#x}"),
                    Place::Search => searched += 1,
                    Place::Nowhere => panic!("{mode}: {ptr:#x} is live in shard {shard}"),
                }
                a.free(ptr).unwrap();
            }
            assert!(searched < live.len() / 10, "{mode}: {searched} searched");
            a.empty_cache().unwrap();
            for &(ptr, _) in &live {
                assert!(matches!(
                    a.core.places.find(ptr),
                    Place::Nowhere | Place::Search
                ));
            }
        }
    }

    #[test]
    fn a_segment_across_two_tables_is_counted_in_both() {
        let p = Places::default();
        let edge = 1u64 << LEAF_SHIFT;
        p.add(edge - 4 * MIB, 8 * MIB, 7);
        for a in [edge - 4 * MIB, edge - 1, edge, edge + 4 * MIB - 1] {
            assert_eq!(p.find(a), Place::Shard(7), "{a:#x}");
        }
        assert_eq!(p.find(edge - 6 * MIB), Place::Nowhere);
        assert_eq!(p.find(edge + 4 * MIB), Place::Nowhere);
        p.remove(edge - 4 * MIB, 8 * MIB);
        for a in [edge - 4 * MIB, edge, edge + 4 * MIB - 1] {
            assert_eq!(p.find(a), Place::Nowhere, "{a:#x}");
        }
    }

    #[test]
    fn two_segments_of_one_shard_share_a_granule() {
        let p = Places::default();
        p.add(0x1000, MIB, 2);
        p.add(0x1000 + MIB, MIB, 2);
        p.remove(0x1000, MIB);
        assert_eq!(p.find(0x1000 + MIB), Place::Shard(2));
        p.remove(0x1000 + MIB, MIB);
        assert_eq!(p.find(0x1000 + MIB), Place::Nowhere);
    }
}
