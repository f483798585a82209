//! Segments as the shards hold them: a plain `cuMemAlloc` segment, one from a pool's own
//! allocator, or a virtual reservation with the physical memory mapped into it; and remap
//! mode's spare physical pieces. Plain
//! data: the policies that make and release segments live in `growth/`.
//!
//! Invariants (kept by `growth/`, checked by `shard/check.rs`):
//! - A segment's blocks tile it exactly (`block.rs`); every block names its segment by id.
//! - A virtual segment's mappings start at `base + k * unit`, are multiples of `unit` long, and
//!   are each one whole physical handle (CUDA maps whole handles only); `unmapped` holds
//!   exactly the segment's `Unmapped` blocks, keyed by address.
//! - A spare piece is one handle, mapped nowhere, counted in reserved bytes until released.

use std::collections::{BTreeMap, BTreeSet};

use super::block::BlockId;
use super::owner::Owner;
use super::rules::PoolKind;
use crate::driver::external::Source;
use crate::driver::{DevicePtr, PhysHandle};

#[derive(Debug)]
pub(crate) enum SegmentKind {
    /// One `cuMemAlloc` of the whole segment.
    Plain,
    /// One allocation of the whole segment from its pool's own allocator, given back to it.
    External(Source),
    /// A virtual reservation with physical memory mapped on demand.
    Virtual(VirtualMap),
}

#[derive(Debug)]
pub(crate) struct Segment {
    pub base: DevicePtr,
    pub size: u64,
    pub owner: Owner,
    pub pool: PoolKind,
    pub first: BlockId,
    pub kind: SegmentKind,
}

impl Segment {
    pub(crate) fn is_virtual(&self) -> bool {
        matches!(self.kind, SegmentKind::Virtual(_))
    }

    /// The mappings of a virtual segment. Only virtual-memory code asks, and only for the
    /// segments it made (a plain segment here is a broken invariant, not an input).
    pub(crate) fn virt(&self) -> &VirtualMap {
        match &self.kind {
            SegmentKind::Virtual(v) => v,
            _ => panic!("segment at {:#x} is plain, not virtual", self.base),
        }
    }

    pub(crate) fn virt_mut(&mut self) -> &mut VirtualMap {
        match &mut self.kind {
            SegmentKind::Virtual(v) => v,
            _ => panic!("segment at {:#x} is plain, not virtual", self.base),
        }
    }

    /// Bytes of device memory behind the segment now (an asleep mapping's given-back memory
    /// is not).
    pub(crate) fn backed_bytes(&self) -> u64 {
        match &self.kind {
            SegmentKind::Plain | SegmentKind::External(_) => self.size,
            SegmentKind::Virtual(v) => v
                .mappings
                .values()
                .filter(|m| !m.gone())
                .map(|m| m.bytes)
                .sum(),
        }
    }
}

/// The physical side of a virtual segment.
#[derive(Debug)]
pub(crate) struct VirtualMap {
    /// Mappings start at multiples of this and are multiples of it long.
    pub unit: u64,
    pub mappings: BTreeMap<DevicePtr, Mapping>,
    /// Unmapped blocks by address, for growth.
    pub unmapped: BTreeSet<(DevicePtr, BlockId)>,
}

/// One `cuMemMap`.
#[derive(Debug)]
pub(crate) struct Mapping {
    pub bytes: u64,
    pub handle: PhysHandle,
    /// The handle was released but the unmap failed: the mapping still holds the memory.
    pub released: bool,
    /// Remap mode: unmapping keeps the handle as a spare piece (to be mapped again where it
    /// is needed) instead of releasing it.
    pub pooled: bool,
    /// Asleep: where its contents wait, and whether its memory was given back.
    pub sleep: Option<Slept>,
}

impl Mapping {
    /// A mapping of a fresh handle.
    pub(crate) fn new(bytes: u64, handle: PhysHandle, pooled: bool) -> Mapping {
        Mapping {
            bytes,
            handle,
            released: false,
            pooled,
            sleep: None,
        }
    }

    /// Asleep with its memory given back: nothing is mapped at its range.
    pub(crate) fn gone(&self) -> bool {
        self.sleep.is_some_and(|s| s.gone)
    }
}

/// An asleep mapping's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Slept {
    /// Where its contents wait in the tag's host memory (an offset), or [`DISCARDED`].
    pub host: u64,
    /// Its memory was given back (released and unmapped).
    pub gone: bool,
}

/// [`Slept::host`] of a mapping whose contents are not kept.
pub(crate) const DISCARDED: u64 = u64::MAX;

/// A physical handle held but not mapped (remap mode).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Spare {
    pub handle: PhysHandle,
    pub bytes: u64,
}

/// A shard's segments by id; an id is reused once its segment is gone.
#[derive(Default, Debug)]
pub(crate) struct Segments {
    slots: Vec<Option<Segment>>,
    vacant: Vec<u32>,
}

impl Segments {
    pub(crate) fn insert(&mut self, seg: Segment) -> u32 {
        match self.vacant.pop() {
            Some(i) => {
                self.slots[i as usize] = Some(seg);
                i
            }
            None => {
                self.slots.push(Some(seg));
                (self.slots.len() - 1) as u32
            }
        }
    }

    pub(crate) fn remove(&mut self, id: u32) {
        self.slots[id as usize] = None;
        self.vacant.push(id);
    }

    /// The live segment `id` (every block names one: a shard invariant).
    #[inline]
    pub(crate) fn get(&self, id: u32) -> &Segment {
        self.slots[id as usize]
            .as_ref()
            .unwrap_or_else(|| panic!("segment {id} is gone but still named"))
    }

    #[inline]
    pub(crate) fn get_mut(&mut self, id: u32) -> &mut Segment {
        self.slots[id as usize]
            .as_mut()
            .unwrap_or_else(|| panic!("segment {id} is gone but still named"))
    }

    /// Ids of the live segments, in id order (a copy: callers change the table as they go).
    pub(crate) fn ids(&self) -> Vec<u32> {
        (0..self.slots.len() as u32)
            .filter(|&i| self.slots[i as usize].is_some())
            .collect()
    }

    /// Ids of the live segments `keep` selects (a copy, as [`Segments::ids`]).
    pub(crate) fn ids_where(&self, keep: impl Fn(&Segment) -> bool) -> Vec<u32> {
        self.iter()
            .filter(|(_, s)| keep(s))
            .map(|(id, _)| id)
            .collect()
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (u32, &Segment)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| Some((i as u32, s.as_ref()?)))
    }
}
