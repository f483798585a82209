//! The live map of one shard: the address of every allocated block to its id.
//!
//! An open-addressing table with linear probing and backward-shift deletion, keyed by device
//! address. Addresses are distinct non-zero multiples of 512, so a multiplicative hash of the
//! address over 512 spreads them, 0 can mark an empty slot, and no tombstones are needed: a
//! removal moves later entries of the same run back, so every lookup stops at the first empty
//! slot. One probe sequence per operation, no hashing of bytes, no control words: a free does
//! one `remove`, an allocation one `insert`.
//!
//! Invariants:
//! - `len` entries are non-empty; the table is at most 7/8 full (it doubles before passing).
//! - Every key sits in the run that starts at its home slot: no empty slot lies between its
//!   home slot and its own (so lookups may stop at the first empty one).

use crate::driver::DevicePtr;

use super::block::BlockId;

const EMPTY: DevicePtr = 0;

#[derive(Debug)]
pub(crate) struct LiveMap {
    /// (address, block) per slot; address 0 marks an empty slot.
    slots: Box<[(DevicePtr, BlockId)]>,
    mask: usize,
    len: usize,
    /// The most entries before the table doubles (7/8 of its slots).
    most: usize,
}

impl Default for LiveMap {
    fn default() -> Self {
        LiveMap::with_slots(64)
    }
}

impl LiveMap {
    fn with_slots(slots: usize) -> LiveMap {
        debug_assert!(slots.is_power_of_two());
        LiveMap {
            slots: vec![(EMPTY, 0); slots].into_boxed_slice(),
            mask: slots - 1,
            len: 0,
            most: slots / 8 * 7,
        }
    }

    #[inline]
    fn home(&self, ptr: DevicePtr) -> usize {
        let h = (ptr >> 9).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        (h >> 32) as usize & self.mask
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    #[inline]
    pub(crate) fn get(&self, ptr: DevicePtr) -> Option<BlockId> {
        if ptr == EMPTY {
            return None;
        }
        let mut i = self.home(ptr);
        loop {
            match self.slots[i] {
                (k, id) if k == ptr => return Some(id),
                (EMPTY, _) => return None,
                _ => i = (i + 1) & self.mask,
            }
        }
    }

    /// Map `ptr` (not zero, not present) to `id`.
    #[inline]
    pub(crate) fn insert(&mut self, ptr: DevicePtr, id: BlockId) {
        debug_assert_ne!(ptr, EMPTY, "device address 0 is never allocated");
        if self.len == self.most {
            self.grow();
        }
        let mut i = self.home(ptr);
        while self.slots[i].0 != EMPTY {
            debug_assert_ne!(self.slots[i].0, ptr, "{ptr:#x} is live already");
            i = (i + 1) & self.mask;
        }
        self.slots[i] = (ptr, id);
        self.len += 1;
    }

    /// Remove `ptr`, returning its id, if present.
    #[inline]
    pub(crate) fn remove(&mut self, ptr: DevicePtr) -> Option<BlockId> {
        if ptr == EMPTY {
            return None;
        }
        let mut i = self.home(ptr);
        let id = loop {
            match self.slots[i] {
                (k, id) if k == ptr => break id,
                (EMPTY, _) => return None,
                _ => i = (i + 1) & self.mask,
            }
        };
        self.len -= 1;
        let next = (i + 1) & self.mask;
        if self.slots[next].0 == EMPTY {
            self.slots[i].0 = EMPTY;
        } else {
            self.shift_back(i);
        }
        Some(id)
    }

    /// Backward shift after removing the entry at `hole`: move each later entry of the run
    /// whose home slot is not between the hole and itself into the hole, until the run ends.
    #[cold]
    fn shift_back(&mut self, mut hole: usize) {
        let mut j = (hole + 1) & self.mask;
        while self.slots[j].0 != EMPTY {
            let home = self.home(self.slots[j].0);
            if (j.wrapping_sub(home) & self.mask) >= (j.wrapping_sub(hole) & self.mask) {
                self.slots[hole] = self.slots[j];
                hole = j;
            }
            j = (j + 1) & self.mask;
        }
        self.slots[hole].0 = EMPTY;
    }

    #[cold]
    fn grow(&mut self) {
        let old = std::mem::replace(self, LiveMap::with_slots(self.slots.len() * 2));
        for &(k, id) in old.slots.iter() {
            if k != EMPTY {
                self.insert(k, id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// Against a std map, with addresses that collide in the home slot often (a small table,
    /// clustered addresses) and removals from the middle of runs.
    #[test]
    fn agrees_with_a_hash_map_through_growth_and_backward_shifts() {
        let mut m = LiveMap::default();
        let mut shadow = HashMap::new();
        let mut x: u64 = 0x1234_5678;
        for step in 0..200_000u32 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let ptr = ((x % 5000) + 1) * 512 + (1 << 40);
            match shadow.entry(ptr) {
                std::collections::hash_map::Entry::Occupied(e) if !x.is_multiple_of(3) => {
                    assert_eq!(m.remove(ptr), Some(e.remove()), "step {step}");
                }
                std::collections::hash_map::Entry::Occupied(_) => {}
                std::collections::hash_map::Entry::Vacant(e) => {
                    m.insert(ptr, step);
                    e.insert(step);
                }
            }
            assert_eq!(m.len(), shadow.len());
            let probe = ((x >> 20) % 5000 + 1) * 512 + (1 << 40);
            assert_eq!(m.get(probe), shadow.get(&probe).copied(), "step {step}");
        }
        for (&k, &v) in &shadow {
            assert_eq!(m.get(k), Some(v));
        }
        assert_eq!(m.remove(0), None);
        assert_eq!(m.get(0), None);
    }
}
