//! Which shard holds an address, so that `free(ptr)` without a stream locks one shard and not
//! each in turn: tables over 2 MiB granules of the address space, written when a shard adds or
//! removes a segment (the slow path), read with a few loads.
//!
//! A segment's granules are cut into aligned blocks of 1, 512 or 512² granules (2 MiB, 1 GiB,
//! 512 GiB), each as large as fits, and each block counts the segment in one entry of its
//! level. So a 157 GiB reservation writes at most about two thousand entries (157 when its
//! ends are whole GiB), not eighty thousand, and a granule's segments are those counted in
//! the one entry per level whose block holds it. The levels form a tree: a 512 GiB block's
//! entry beside the table of its 1 GiB blocks, each 1 GiB block's beside the table of its
//! granules.
//!
//! Invariant: an entry counts the segments it was given, and names shard `s` only when every
//! one of them belongs to `s`; when segments of two shards share it, it says `MIXED` until none
//! is left. `find` reads the entry of each level that holds the address's granule: when the
//! non-zero ones all name `s`, that proves that the address, if it is live anywhere, is live in
//! `s`; `MIXED`, two shards, an address above the tables, or a granule whose table was never
//! made sends the caller to search the shards. The tables are a shortcut to the owner, never
//! the record of what is live (that stays in each shard's live map). Adding and removing a
//! segment cut it into the same blocks, since the cut depends only on its base and size.
//!
//! Shards add and remove segments one at a time, under a lock of the tables' own (the slow
//! path: a segment's driver calls cost far more); `find` takes no lock, and reads entries each
//! written with one store. Tables are made on first use, by a writer (one store installs
//! each), and kept until the allocator is dropped.

use std::sync::atomic::{
    AtomicPtr, AtomicU32,
    Ordering::{Acquire, Relaxed, Release},
};

use parking_lot::{Mutex, MutexGuard};

use crate::driver::DevicePtr;

/// 2 MiB: the driver's granularity for device memory, and the smallest native segment.
const GRANULE_SHIFT: u32 = 21;
/// Addresses below 2^48: the 48-bit virtual addresses of x86-64 and AArch64 hosts and their GPUs.
const GRANULES: u64 = 1 << (48 - GRANULE_SHIFT);
/// Each level's blocks are 512 of the level below's: 2 MiB, 1 GiB and 512 GiB.
const FAN_SHIFT: u32 = 9;
const FAN: usize = 1 << FAN_SHIFT;
const LEVELS: usize = 3;

/// The low byte of an entry: the shard, or that segments of several shards share the entry.
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

/// The granules of one 1 GiB block (2 KiB).
type Granules = [AtomicU32; FAN];

/// A 1 GiB block: its entry, and its granules' table once made.
struct Gib {
    entry: AtomicU32,
    granules: AtomicPtr<Granules>,
}

/// The 1 GiB blocks of one 512 GiB block (8 KiB).
type Gibs = [Gib; FAN];

/// A 512 GiB block: its entry, and its 1 GiB blocks' table once made.
struct Top {
    entry: AtomicU32,
    gibs: AtomicPtr<Gibs>,
}

/// A tree of tables, each made on first use: so a reservation in fresh addresses costs a few
/// KiB of zeroed tables, and a new allocator 8 KiB.
pub(crate) struct Places {
    tops: Box<[Top]>,
    /// Held while a segment is added or removed: its few thousand entries at most are then
    /// written with plain stores (a compare-and-swap per entry costs 15% of a small trace's
    /// replay). Readers take no lock.
    writers: Mutex<()>,
}

impl Default for Places {
    fn default() -> Self {
        Places {
            tops: zeroed_slice((GRANULES >> (2 * FAN_SHIFT)) as usize),
            writers: Mutex::new(()),
        }
    }
}

impl Places {
    /// Where `ptr` can be live.
    #[inline]
    pub(crate) fn find(&self, ptr: DevicePtr) -> Place {
        let g = ptr >> GRANULE_SHIFT;
        if g >= GRANULES {
            return Place::Search;
        }
        let top = &self.tops[(g >> (2 * FAN_SHIFT)) as usize];
        let mut entries = [top.entry.load(Acquire), 0, 0];
        let mut own_table = false;
        if let Some(gibs) = made(&top.gibs) {
            let gib = &gibs[(g >> FAN_SHIFT) as usize & (FAN - 1)];
            entries[1] = gib.entry.load(Acquire);
            if let Some(granules) = made(&gib.granules) {
                own_table = true;
                entries[2] = granules[g as usize & (FAN - 1)].load(Acquire);
            }
        }
        let mut named = 0;
        for e in entries {
            if e != 0 {
                if named != 0 && (e ^ named) & MIXED != 0 {
                    return Place::Search;
                }
                named = e;
            }
        }
        match named {
            // A granule whose own table was never made is searched for.
            0 if !own_table => Place::Search,
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

    /// Apply `change` to the entry of each block the granules `[base, base + size)` overlaps
    /// are cut into; granules above the tables are left out (`find` searches for them).
    fn each(&self, base: DevicePtr, size: u64, change: impl Fn(u32) -> u32) {
        let first = base >> GRANULE_SHIFT;
        let last = (base.saturating_add(size.max(1) - 1) >> GRANULE_SHIFT).min(GRANULES - 1);
        let writer = self.writers.lock();
        let mut g = first;
        while g <= last {
            // The largest aligned block that starts at `g` and ends by `last`.
            let level = (1..LEVELS)
                .rev()
                .find(|&l| {
                    let shift = FAN_SHIFT * l as u32;
                    g & ((1 << shift) - 1) == 0 && (last - g + 1) >> shift != 0
                })
                .unwrap_or(0);
            let top = &self.tops[(g >> (2 * FAN_SHIFT)) as usize];
            let entry = match level {
                2 => &top.entry,
                l => {
                    let gib = &make(&top.gibs, &writer)[(g >> FAN_SHIFT) as usize & (FAN - 1)];
                    if l == 1 {
                        &gib.entry
                    } else {
                        &make(&gib.granules, &writer)[g as usize & (FAN - 1)]
                    }
                }
            };
            // Writers are one at a time (`writers`): a load and a store, no read-modify-write.
            entry.store(change(entry.load(Relaxed)), Release);
            g += 1 << (FAN_SHIFT * level as u32);
        }
    }
}

impl Drop for Places {
    fn drop(&mut self) {
        for top in self.tops.iter_mut() {
            let gibs = *top.gibs.get_mut();
            if gibs.is_null() {
                continue;
            }
            // SAFETY: made by `Box::into_raw` in `make`, and freed only here.
            let mut gibs = unsafe { Box::from_raw(gibs) };
            for gib in gibs.iter_mut() {
                let granules = *gib.granules.get_mut();
                if !granules.is_null() {
                    // SAFETY: as above.
                    drop(unsafe { Box::from_raw(granules) });
                }
            }
        }
    }
}

/// The table `slot` names, if made.
#[inline]
fn made<T>(slot: &AtomicPtr<T>) -> Option<&T> {
    // SAFETY: a non-null pointer in a slot comes from `make`'s `Box::into_raw`, and the table
    // is freed only when the `Places` holding the slot is dropped.
    unsafe { slot.load(Acquire).as_ref() }
}

/// The table `slot` names, made (zeroed) if it has none yet. Only a writer makes tables, and
/// writers hold the lock (`_writer`), so a plain store installs one.
fn make<'a, T: Zeroed>(slot: &'a AtomicPtr<T>, _writer: &MutexGuard<()>) -> &'a T {
    if let Some(table) = made(slot) {
        return table;
    }
    let fresh = Box::into_raw(T::zeroed());
    slot.store(fresh, Release);
    // SAFETY: as in `made`.
    unsafe { &*fresh }
}

/// # Safety
///
/// All-zero bytes are a valid value of the type.
unsafe trait Zeroed: Sized {
    fn zeroed() -> Box<Self> {
        // SAFETY: the trait's contract.
        unsafe { Box::<Self>::new_zeroed().assume_init() }
    }
}

// SAFETY: zero is a valid `AtomicU32`, and a null `AtomicPtr`.
unsafe impl Zeroed for Granules {}
// SAFETY: as above.
unsafe impl Zeroed for Gibs {}

/// `len` 512 GiB blocks, none with an entry or a table.
fn zeroed_slice(len: usize) -> Box<[Top]> {
    // SAFETY: as for `Zeroed`.
    unsafe { Box::<[Top]>::new_zeroed_slice(len).assume_init() }
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
        let edge = 1u64 << (GRANULE_SHIFT + FAN_SHIFT);
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
    /// A reservation of 157 GiB, not aligned to any block, writes a few hundred entries, and
    /// every granule of it names its shard, even those whose own table was never made.
    #[test]
    fn a_large_reservation_is_cut_into_blocks() {
        let p = Places::default();
        let base = 0x7f12_3440_0000u64;
        let size = 157 << 30;
        p.add(base, size, 4);
        let mut written = 0;
        for top in p.tops.iter() {
            written += (top.entry.load(Acquire) != 0) as usize;
            for gib in made(&top.gibs).into_iter().flatten() {
                written += (gib.entry.load(Acquire) != 0) as usize;
                let granules = made(&gib.granules).into_iter().flatten();
                written += granules.filter(|e| e.load(Acquire) != 0).count();
            }
        }
        assert!(written < 1200, "{written} entries for 157 GiB");
        // A whole aligned 1 GiB block is one entry.
        let q = Places::default();
        q.add(1 << 40, 1 << 30, 2);
        let gibs = made(&q.tops[(1u64 << 40 >> (GRANULE_SHIFT + 2 * FAN_SHIFT)) as usize].gibs);
        assert!(gibs.is_some_and(|t| t.iter().all(|g| made(&g.granules).is_none())));
        assert_eq!(q.find((1 << 40) + (1 << 30) - 1), Place::Shard(2));
        assert_eq!(q.find((1 << 40) + (1 << 30)), Place::Search);
        for off in [0, 2 * MIB, 100 * MIB, 64 << 30, 100 << 30, size - 1] {
            assert_eq!(p.find(base + off), Place::Shard(4), "{off:#x}");
        }
        assert_eq!(p.find(base - 1), Place::Nowhere);
        assert_eq!(p.find(base + size), Place::Nowhere);
        // Another shard's segment inside it sends that granule, and only it, to a search.
        p.add(base + (70 << 30), MIB, 9);
        assert_eq!(p.find(base + (70 << 30)), Place::Search);
        assert_eq!(p.find(base + (70 << 30) + 2 * MIB), Place::Shard(4));
        p.remove(base, size);
        assert_eq!(p.find(base + (70 << 30) + 2 * MIB), Place::Nowhere);
        // A granule whose 1 GiB block was counted whole has no table of its own.
        assert_eq!(p.find(base + (71 << 30)), Place::Search);
        // The two were counted at different levels, so the one left names its shard again.
        assert_eq!(p.find(base + (70 << 30)), Place::Shard(9));
        p.remove(base + (70 << 30), MIB);
        assert_eq!(p.find(base + (70 << 30)), Place::Nowhere);
    }

    impl Places {
        fn has_granule_table(&self, g: u64) -> bool {
            made(&self.tops[(g >> (2 * FAN_SHIFT)) as usize].gibs).is_some_and(|gibs| {
                made(&gibs[(g >> FAN_SHIFT) as usize & (FAN - 1)].granules).is_some()
            })
        }
    }

    /// Random segments of random shards, against the segments themselves: an address in a
    /// segment of shard `s` is found in `s` or searched for, never placed elsewhere; while
    /// nothing has been removed, a granule all of whose segments are one shard's names it, and
    /// one none overlaps whose table exists says no shard holds it.
    #[test]
    fn agrees_with_the_segments_it_was_given() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for round in 0..40 {
            let p = Places::default();
            let window = 1u64 << 44;
            let mut segs = Vec::new();
            for _ in 0..(1 + next() % 12) {
                let base = (next() % window) & !(MIB - 1);
                let size = match next() % 4 {
                    0 => MIB * (1 + next() % 8),
                    1 => (2 * MIB) << (next() % 10),
                    2 => (1 + next() % (1 << 20)) * 2 * MIB,
                    _ => (1 + next() % 400) << 30,
                };
                let shard = (next() % 3) as usize;
                p.add(base, size, shard);
                segs.push((base, size, shard));
            }
            let removed = if round % 2 == 1 {
                let (b, s, _) = segs.swap_remove(next() as usize % segs.len());
                p.remove(b, s);
                true
            } else {
                false
            };
            let granule = |a: u64| a >> GRANULE_SHIFT;
            let mut probes: Vec<u64> = (0..200).map(|_| next() % window).collect();
            for &(b, s, _) in &segs {
                probes.extend([b, b + s - 1, b + s / 2, b.wrapping_sub(1), b + s]);
            }
            for a in probes {
                let owners: Vec<usize> = segs
                    .iter()
                    .filter(|&&(b, s, _)| {
                        granule(b) <= granule(a) && granule(a) <= granule(b + s - 1)
                    })
                    .map(|&(_, _, sh)| sh)
                    .collect();
                let found = p.find(a);
                match found {
                    Place::Shard(s) => assert!(
                        !owners.is_empty() && owners.iter().all(|&o| o == s),
                        "round {round}: {a:#x} placed in {s}, segments of {owners:?}"
                    ),
                    Place::Nowhere => assert!(owners.is_empty(), "round {round}: {a:#x}"),
                    Place::Search => {}
                }
                if removed {
                    continue;
                }
                if let Some(&s) = owners.first() {
                    if owners.iter().all(|&o| o == s) {
                        assert_eq!(found, Place::Shard(s), "round {round}: {a:#x}");
                    }
                } else if p.has_granule_table(granule(a)) {
                    assert_eq!(found, Place::Nowhere, "round {round}: {a:#x}");
                }
            }
        }
    }
}
