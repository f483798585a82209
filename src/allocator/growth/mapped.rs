//! Virtual segments, what the expandable, compact and remap policies share: one address
//! reservation per (owner, pool), physical memory mapped into it on demand and unmapped where
//! it lies wholly inside free blocks.
//!
//! Invariants:
//! - Every mapping starts at `base + k * unit` and is a multiple of `unit` long; CUDA maps
//!   whole handles only, so each mapping is one handle (`map_one`) or one spare piece.
//! - A mapping is either fully mapped, accessible and recorded in `mappings`, or not mapped
//!   at all: a failure part-way through growth undoes the chunk it was on and keeps the
//!   chunks before it, mapped and accounted.
//! - `unmapped` holds exactly the `Unmapped` blocks of the segment, keyed by address.
//! - Before anything in a segment is unmapped, its stream is synchronised, or the whole device
//!   ([`SyncFirst`]: a graph pool's segment, another stream's growth, a caller that has
//!   synchronised it); a graph pool's memory is never moved to serve other growth.
//! - An asleep tag's segments are neither released nor moved here (`sleep.rs` owns their
//!   mappings until the tag wakes), and no allocation grows them.

use std::collections::{BTreeMap, BTreeSet};

use super::later::note_late_failure;
use crate::allocator::block::{BlockId, BlockState, NIL};
use crate::allocator::core::{Core, GrowError};
use crate::allocator::history::Action;
use crate::allocator::owner::Owner;
use crate::allocator::planted::{self, Bug};
use crate::allocator::rules::PoolKind;
use crate::allocator::segment::{Mapping, Segment, SegmentKind, Spare, VirtualMap};
use crate::allocator::shard::Shard;
use crate::driver::{DevicePtr, Driver, DriverError, EventId, PhysHandle, StreamId};
use crate::error::{OomCause, Result};

/// What to synchronise before unmapping memory freed on a segment's stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SyncFirst {
    /// The segment's own stream (the whole device for a graph pool's segment).
    Owner,
    /// The whole device: for another stream's growth, or at drop (a stream handle seen earlier
    /// may have been destroyed since; the device cannot be).
    Device,
    /// Nothing: the caller has synchronised the device.
    Done,
    /// Remap's move for growth on this stream ([`crate::Config::unmap_later`]): a segment of
    /// the stream's own whose free memory is all in pieces is not synchronised; its pieces'
    /// old mappings are unmapped once an event recorded now completes (`later.rs`). Any other
    /// segment is synchronised as with `Owner`.
    Later(StreamId),
}

/// Where growth goes in a reservation.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Site {
    /// A free block (in the index) that holds the request already.
    Free(BlockId),
    /// Map `bytes` at the front of unmapped block `range`.
    Map { range: BlockId, bytes: u64 },
}

impl Shard {
    /// The reservation of (`owner`, `pool`), made on first use, its mappings multiples of
    /// `unit` long.
    pub(crate) fn reservation<D: Driver>(
        &mut self,
        core: &Core<D>,
        owner: Owner,
        pool: PoolKind,
        unit: u64,
    ) -> std::result::Result<u32, GrowError> {
        if let Some(seg) = self.reservation_of(owner, pool) {
            return Ok(seg);
        }
        // Address space for 9/8 of the device, as PyTorch reserves: enough to map every byte
        // of the device even with holes left by earlier unmaps. (Remap growth may pass over a
        // hole for a range where its spare pieces fit; if holes ever took more than the
        // eighth, growth would fill them again, with new memory.)
        let size = (core.device_total + core.device_total / 8).div_ceil(unit) * unit;
        let base = core.driver.reserve_va(size).map_err(GrowError::Driver)?;
        let seg = Segment {
            base,
            size,
            owner,
            pool,
            first: NIL,
            kind: SegmentKind::Virtual(VirtualMap {
                unit,
                mappings: BTreeMap::new(),
                unmapped: BTreeSet::new(),
            }),
        };
        let (seg, first) = self.add_segment(core, seg, BlockState::Unmapped);
        self.segments
            .get_mut(seg)
            .virt_mut()
            .unmapped
            .insert((base, first));
        self.reservations.push((owner, pool, seg));
        Ok(seg)
    }

    /// The reservation of (`owner`, `pool`), if made.
    pub(crate) fn reservation_of(&self, owner: Owner, pool: PoolKind) -> Option<u32> {
        self.reservations
            .iter()
            .find(|&&(o, p, _)| o == owner && p == pool)
            .map(|&(_, _, seg)| seg)
    }

    /// Grow `seg` at `site` for a request of `rounded` bytes, `map` mapping at least the
    /// bytes asked from the range's start (it is given the shard, the start, the bytes and
    /// the range's size, and returns the bytes mapped, a prefix, and the error that stopped
    /// it). Returns a free block (listed) that holds at least `rounded` bytes and may serve it.
    pub(crate) fn grow_at<D: Driver>(
        &mut self,
        core: &Core<D>,
        seg: u32,
        site: Site,
        rounded: u64,
        map: impl FnOnce(&mut Shard, DevicePtr, u64, u64) -> (u64, Option<GrowError>),
    ) -> std::result::Result<BlockId, GrowError> {
        let (u, bytes) = match site {
            Site::Free(free) => return Ok(free),
            Site::Map { range, bytes } => (range, bytes),
        };
        let (start, room) = (self.blocks[u].addr, self.blocks[u].size);
        let (mapped, err) = map(self, start, bytes, room);
        if mapped == 0 {
            return Err(err.expect("nothing mapped means an error"));
        }
        core.graph_bytes(self.segments.get(seg).owner, mapped, false);
        // The mapped front of the unmapped block becomes a free block, merged with its
        // neighbours; by the choice of site the merged block holds the request.
        let id = self.split_front(u, mapped, seg);
        let id = self.insert_free(id);
        if let Some(e) = err {
            // What was mapped stays, cached and accounted.
            return Err(e);
        }
        if self.blocks[id].size < rounded {
            return Err(GrowError::Memory(OomCause::NotContiguous));
        }
        Ok(id)
    }

    /// The lowest place in `seg` for growth for a request of `rounded` bytes, mapping at
    /// least `floor` bytes (low addresses first keeps the mapped memory compact).
    pub(crate) fn lowest_site(&self, seg: u32, rounded: u64, floor: u64) -> Option<Site> {
        let v = self.segments.get(seg).virt();
        v.unmapped
            .iter()
            .find_map(|&(_, u)| self.site_at(seg, u, rounded, floor))
    }

    /// Map `bytes` of new memory from `start` in mappings of `chunk` bytes, committed against
    /// the limit first; returns the bytes mapped (a prefix: a chunk is either fully mapped,
    /// accessible and recorded, or not mapped at all) and the error that stopped it.
    pub(crate) fn map_new<D: Driver>(
        &mut self,
        core: &Core<D>,
        seg: u32,
        start: DevicePtr,
        bytes: u64,
        chunk: u64,
    ) -> (u64, Option<GrowError>) {
        if let Err(e) = core.commit(bytes) {
            return (0, Some(e));
        }
        let mut done = 0;
        let mut err = None;
        while done < bytes {
            let va = start + done;
            match map_one(core, va, chunk) {
                Ok(handle) => {
                    let m = Mapping::new(chunk, handle, false);
                    self.segments.get_mut(seg).virt_mut().mappings.insert(va, m);
                    self.record_map(core, seg, Action::SegmentMap, va, chunk);
                    done += chunk;
                }
                Err(e) => {
                    err = Some(GrowError::from(e));
                    break;
                }
            }
        }
        core.uncommit(bytes - done);
        if done > 0 {
            core.ledger.on_reserve(done, false);
        }
        (done, err)
    }

    /// Growth for a request of `rounded` bytes at unmapped block `u` of `seg`, mapping at
    /// least `floor` bytes, if `u` holds the request with the free blocks on either side.
    pub(crate) fn site_at(&self, seg: u32, u: BlockId, rounded: u64, floor: u64) -> Option<Site> {
        let v = self.segments.get(seg).virt();
        let b = &self.blocks[u];
        let free_size = |id: BlockId| {
            if id != NIL && self.blocks[id].state == BlockState::Free {
                self.blocks[id].size
            } else {
                0
            }
        };
        let before = free_size(b.prev);
        if before >= rounded {
            return Some(Site::Free(b.prev));
        }
        if before + b.size + free_size(b.next) < rounded {
            return None;
        }
        let bytes = ((rounded - before).max(floor).div_ceil(v.unit) * v.unit).min(b.size);
        Some(Site::Map { range: u, bytes })
    }

    /// Unmap about `want` bytes of free memory from this shard's virtual segments (not graph
    /// pools'), none of it inside the free blocks `keep` (or [`NIL`]), after `sync`; returns
    /// the bytes unmapped.
    pub(crate) fn release_for_growth<D: Driver>(
        &mut self,
        core: &Core<D>,
        want: u64,
        sync: SyncFirst,
        keep: [BlockId; 2],
    ) -> Result<u64> {
        // Graph pools' memory is never moved: graphs replay at the addresses they captured.
        let segs: Vec<u32> = self
            .reservations
            .iter()
            .filter(|&&(owner, _, _)| !owner.is_pool())
            .map(|&(_, _, seg)| seg)
            .collect();
        let mut left = want;
        for seg in segs {
            if left == 0 {
                break;
            }
            left = left.saturating_sub(self.release_free_mappings(core, seg, left, sync, keep)?);
        }
        Ok(want - left)
    }

    /// Unmap mappings that lie wholly inside free blocks of `seg` other than `keep`, until at
    /// least `budget` bytes are unmapped (or all of them). What `sync` names is synchronised
    /// first: the device may still be reading memory freed on the segment's stream. Returns the
    /// bytes unmapped; on an error, what was unmapped before it is accounted and the rest stays
    /// mapped.
    fn release_free_mappings<D: Driver>(
        &mut self,
        core: &Core<D>,
        seg: u32,
        budget: u64,
        sync: SyncFirst,
        keep: [BlockId; 2],
    ) -> Result<u64> {
        // Asleep memory is neither given back nor moved: its free lists are detached.
        if self.sleeps(self.segments.get(seg).owner) {
            return Ok(0);
        }
        // Runs of contiguous mappings inside each free block.
        let mut runs: Vec<(BlockId, Vec<DevicePtr>)> = Vec::new();
        let s = self.segments.get(seg);
        let mappings = &s.virt().mappings;
        let mut id = s.first;
        while id != NIL {
            let b = &self.blocks[id];
            if b.state == BlockState::Free && !keep.contains(&id) {
                let inside: Vec<DevicePtr> = mappings
                    .range(b.addr..b.end())
                    .filter(|(&va, m)| va + m.bytes <= b.end())
                    .map(|(&va, _)| va)
                    .collect();
                if !inside.is_empty() {
                    runs.push((id, inside));
                }
            }
            id = b.next;
        }
        if runs.is_empty() {
            return Ok(0);
        }
        let owner = s.owner;
        let sync = if planted::active(Bug::UnmapUnsynced) {
            SyncFirst::Done
        } else {
            sync
        };
        let later = match sync {
            SyncFirst::Owner => {
                core.sync_owner(owner)?;
                None
            }
            SyncFirst::Device => {
                core.driver.sync_device()?;
                None
            }
            SyncFirst::Done => None,
            SyncFirst::Later(stream) => {
                let pieces = runs
                    .iter()
                    .flat_map(|(_, vas)| vas)
                    .all(|va| mappings[va].pooled);
                let event = (pieces && owner.stream() == Some(stream))
                    .then(|| core.driver.record_event(stream))
                    .and_then(|r| {
                        r.map_err(|e| {
                            note_late_failure(core, &e, "no event for a move without a wait; the stream is synchronised instead");
                        })
                        .ok()
                    });
                if event.is_none() {
                    core.sync_owner(owner)?;
                }
                event.map(|e| (e, stream))
            }
        };
        let mut released = 0;
        for (block, vas) in runs {
            // `cur` is the free block that still holds the mappings not yet unmapped.
            let mut cur = Some(block);
            let mut i = 0;
            while i < vas.len() && released < budget {
                let lo = vas[i];
                let mut hi = lo;
                let mut failed = None;
                let mut freed = 0;
                while i < vas.len() && vas[i] == hi && released + (hi - lo) < budget {
                    match self.unmap_mapping(core, seg, hi, later) {
                        Ok((bytes, gone)) => {
                            hi += bytes;
                            freed += gone;
                        }
                        Err(e) => {
                            failed = Some(e);
                            break;
                        }
                    }
                    i += 1;
                }
                if hi > lo {
                    let id = cur.expect("mappings left means a block holds them");
                    cur = self.carve_unmapped(id, lo, hi, seg);
                    core.ledger.on_unreserve(freed, false);
                    core.uncommit(freed);
                    core.graph_bytes(owner, hi - lo, true);
                    released += hi - lo;
                }
                if let Some(e) = failed {
                    return Err(e.into());
                }
            }
            if released >= budget {
                break;
            }
        }
        if let Some((event, _)) = later {
            // Recorded, but nothing retired under it (the budget was met first).
            self.drop_event_if_unused(core, event);
        }
        Ok(released)
    }

    /// Unmap the mapping at `va` and release its physical memory (or, in remap mode, keep the
    /// piece as spare; with `later`, the mapping stays until that event completes: `later.rs`);
    /// returns its size and the bytes given back to the driver.
    fn unmap_mapping<D: Driver>(
        &mut self,
        core: &Core<D>,
        seg: u32,
        va: DevicePtr,
        later: Option<(EventId, StreamId)>,
    ) -> std::result::Result<(u64, u64), DriverError> {
        let mappings = &mut self.segments.get_mut(seg).virt_mut().mappings;
        let m = mappings
            .get_mut(&va)
            .expect("a free block's mapping exists");
        if m.pooled {
            let (bytes, handle) = (m.bytes, m.handle);
            match later {
                Some((event, stream)) => {
                    mappings.remove(&va);
                    self.retire(seg, stream, va, Spare { handle, bytes }, event);
                }
                None => {
                    core.driver.unmap(va, bytes)?;
                    mappings.remove(&va);
                    self.spare.push(Spare { handle, bytes });
                }
            }
            self.record_map(core, seg, Action::SegmentUnmap, va, bytes);
            return Ok((bytes, 0));
        }
        // Release first: if that fails nothing changed; a released handle stays alive until
        // its mapping goes, so a failed unmap afterwards still leaves a consistent mapping.
        if !m.released {
            core.driver.release_physical(m.handle)?;
            m.released = true;
        }
        core.driver.unmap(va, m.bytes)?;
        let bytes = m.bytes;
        mappings.remove(&va);
        self.record_map(core, seg, Action::SegmentUnmap, va, bytes);
        Ok((bytes, bytes))
    }

    /// Turn `[lo, hi)` of free block `id` (in the index) into an unmapped block, keeping any
    /// free head and tail, and merging with unmapped neighbours; returns the free tail, if any.
    fn carve_unmapped(
        &mut self,
        id: BlockId,
        lo: DevicePtr,
        hi: DevicePtr,
        seg: u32,
    ) -> Option<BlockId> {
        self.index_remove(id);
        let (addr, end) = (self.blocks[id].addr, self.blocks[id].end());
        // Head stays in `id`; the middle and tail become new blocks.
        let mut mid = id;
        if lo > addr {
            mid = self.insert_after(id, lo, hi - lo, BlockState::Unmapped);
            self.blocks[id].size = lo - addr;
            self.index_insert(id);
        } else {
            self.blocks[id].size = hi - lo;
            self.blocks[id].state = BlockState::Unmapped;
        }
        let tail = (hi < end).then(|| {
            let tail = self.insert_after(mid, hi, end - hi, BlockState::Free);
            self.index_insert(tail);
            tail
        });
        // Merge with unmapped neighbours.
        let mut m = mid;
        let prev = self.blocks[m].prev;
        if prev != NIL && self.blocks[prev].state == BlockState::Unmapped {
            let key = (self.blocks[prev].addr, prev);
            self.segments.get_mut(seg).virt_mut().unmapped.remove(&key);
            self.absorb_next(prev);
            m = prev;
        }
        let next = self.blocks[m].next;
        if next != NIL && self.blocks[next].state == BlockState::Unmapped {
            let key = (self.blocks[next].addr, next);
            self.segments.get_mut(seg).virt_mut().unmapped.remove(&key);
            self.absorb_next(m);
        }
        let key = (self.blocks[m].addr, m);
        self.segments.get_mut(seg).virt_mut().unmapped.insert(key);
        tail
    }

    /// Split `bytes` off the front of unmapped block `u` as a new free block (returned, not in
    /// the index); `bytes` may be all of `u`, in which case `u` itself is returned.
    fn split_front(&mut self, u: BlockId, bytes: u64, seg: u32) -> BlockId {
        let (addr, size) = (self.blocks[u].addr, self.blocks[u].size);
        let unmapped = &mut self.segments.get_mut(seg).virt_mut().unmapped;
        unmapped.remove(&(addr, u));
        if bytes == size {
            return u;
        }
        unmapped.insert((addr + bytes, u));
        let b = &mut self.blocks[u];
        b.addr += bytes;
        b.size -= bytes;
        // The new front takes `u`'s place in the list: `u` moves up by `bytes`.
        self.insert_before(u, addr, bytes, BlockState::Free)
    }

    /// Unmap every free mapping of `seg`, and give its reservation back once nothing in it is
    /// mapped.
    pub(crate) fn shrink_virtual<D: Driver>(
        &mut self,
        core: &Core<D>,
        seg: u32,
        sync: SyncFirst,
    ) -> Result<()> {
        self.release_free_mappings(core, seg, u64::MAX, sync, [NIL; 2])?;
        // A retiring mapping (`later.rs`) shows as unmapped here, but the driver still holds
        // it: the reservation stays until it is gone.
        if !self.wholly(seg, BlockState::Unmapped) || self.retiring_in(seg) {
            return Ok(());
        }
        let s = self.segments.get(seg);
        let (base, size, owner, pool) = (s.base, s.size, s.owner, s.pool);
        core.driver.release_va(base, size)?;
        self.remove_segment(core, seg);
        self.reservations
            .retain(|&(o, p, _)| !(o == owner && p == pool));
        Ok(())
    }
}

impl Shard {
    /// Record a mapping made or removed in segment `seg` (when the history is recorded).
    pub(crate) fn record_map<D: Driver>(
        &self,
        core: &Core<D>,
        seg: u32,
        action: Action,
        va: DevicePtr,
        bytes: u64,
    ) {
        core.record_segment(action, va, bytes, self.segments.get(seg).owner);
    }
}

/// Create physical memory of `bytes` and map it at `va`; on failure undo what this did, and
/// what cannot be undone is counted as lost and tried again later (`stranded.rs`).
pub(crate) fn map_one<D: Driver>(
    core: &Core<D>,
    va: DevicePtr,
    bytes: u64,
) -> std::result::Result<PhysHandle, DriverError> {
    let driver = &core.driver;
    core.stranded.undo_first(driver, &core.ledger);
    let h = driver.create_physical(bytes)?;
    if let Err(e) = driver.map(va, bytes, h) {
        if driver.release_physical(h).is_err() {
            core.stranded
                .strand(&core.ledger, va, bytes, false, Some(h));
        }
        return Err(e);
    }
    if let Err(e) = driver.set_access(va, bytes) {
        // Release then unmap: the memory goes when the mapping does. Each step is tried even
        // when the other fails, so that what is left to undo is as small as it can be.
        let released = driver.release_physical(h).is_ok();
        let unmapped = driver.unmap(va, bytes).is_ok();
        if !(released && unmapped) {
            core.stranded
                .strand(&core.ledger, va, bytes, !unmapped, (!released).then_some(h));
        }
        return Err(e);
    }
    Ok(h)
}

/// A move that failed: counted and logged, and the allocation takes new memory instead (what
/// was unmapped before the failure is accounted; the rest stays mapped where it was).
pub(crate) fn note_move_failure<D: Driver>(core: &Core<D>, e: &crate::error::Error) {
    core.ledger
        .move_failures
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    tracing::warn!(error = %e, "could not move free memory before growing; growing with new memory instead");
}
