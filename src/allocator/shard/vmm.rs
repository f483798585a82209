//! Virtual segments (the expandable, compact and remap modes): one address reservation per
//! (stream, pool), physical memory mapped into it on demand and unmapped where it lies wholly
//! inside free blocks.
//!
//! Invariants:
//! - Every mapping starts at `base + k * unit` and is a multiple of `unit` long; CUDA maps
//!   whole handles only, so each mapping is one handle (`map_one`) or one spare piece.
//! - A mapping is either fully mapped, accessible and recorded in `mappings`, or not mapped
//!   at all: a failure part-way through growth undoes the chunk it was on and keeps the
//!   chunks before it, mapped and accounted.
//! - `unmapped` holds exactly the `Unmapped` blocks of the segment, keyed by address.
//! - Remap: moving memory before growth keeps the free blocks beside the range that growth is
//!   to map, as chosen before the move (growth extends them in place; it chooses again after
//!   the move, with the pieces moved, and may take another range).
//! - Remap: the small pool's mappings are pages of one granule; its growth moves no memory and
//!   maps no larger spare piece (a large piece there would be pinned by small blocks).
//! - Before anything in a segment is unmapped, its stream is synchronised, or the whole device
//!   ([`SyncFirst`]: a graph pool's segment, another stream's growth, a caller that has
//!   synchronised it); a graph pool's memory is never moved to serve other growth.
//! - An asleep tag's segments are neither released nor moved here (`sleep.rs` owns their
//!   mappings until the tag wakes), and no allocation grows them.

use std::collections::{BTreeMap, BTreeSet};

use super::{GrowError, Segment, SegmentKind, Shard};
use crate::allocator::block::{BlockId, BlockState, NIL};
use crate::allocator::config::SegmentMode;
use crate::allocator::core::Core;
use crate::allocator::graphs::is_pool_key;
use crate::allocator::regions;
use crate::allocator::rules::{self, PoolKind};
use crate::driver::{DevicePtr, Driver, DriverError, PhysHandle, StreamId};
use crate::error::{OomCause, Result};
use crate::replay::trace::Action;

/// Remap growth weighs at most this many unmapped ranges for where to map spare pieces.
const WEIGHED: usize = 32;

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
}

/// Where growth goes ([`Shard::site`]).
#[derive(Clone, Copy, Debug)]
pub(super) enum Site {
    /// A free block (in the index) that holds the request already.
    Free(BlockId),
    /// Map `bytes` at the front of unmapped block `range`.
    Map { range: BlockId, bytes: u64 },
}

/// The physical side of a virtual segment.
#[derive(Debug)]
pub(crate) struct VirtualMap {
    /// Mappings start at multiples of this and are multiples of it long.
    pub unit: u64,
    /// One mapping per `unit` (PyTorch's expandable segments), or one per growth, sized to the
    /// request (the compact mode).
    pub per_unit: bool,
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
    /// Asleep (`sleep.rs`): where its contents wait, and whether its memory was given back.
    pub sleep: Option<super::sleep::Slept>,
}

impl Mapping {
    /// Asleep with its memory given back: nothing is mapped at its range.
    pub(crate) fn gone(&self) -> bool {
        self.sleep.is_some_and(|s| s.gone)
    }
}

impl Shard {
    /// The reservation of (`stream`, `pool`), made on first use.
    fn reservation<D: Driver>(
        &mut self,
        core: &Core<D>,
        stream: StreamId,
        pool: PoolKind,
    ) -> std::result::Result<u32, GrowError> {
        if let Some(seg) = self.reservation_of(stream, pool) {
            return Ok(seg);
        }
        let (unit, per_unit) = match core.mode {
            SegmentMode::Compact => (core.granularity, false),
            SegmentMode::Remap => (core.granularity, true),
            _ => (rules::expandable_page(pool, core.granularity), true),
        };
        // Address space for 9/8 of the device, as PyTorch reserves: enough to map every byte
        // of the device even with holes left by earlier unmaps. (Remap growth may pass over a
        // hole for a range where its spare pieces fit; if holes ever took more than the
        // eighth, growth would fill them again, with new memory.)
        let size = (core.device_total + core.device_total / 8).div_ceil(unit) * unit;
        let base = core.driver.reserve_va(size).map_err(GrowError::Driver)?;
        let seg = Segment {
            base,
            size,
            stream,
            pool,
            first: NIL,
            kind: SegmentKind::Virtual(VirtualMap {
                unit,
                per_unit,
                mappings: BTreeMap::new(),
                unmapped: BTreeSet::new(),
            }),
        };
        let (seg, first) = self.add_segment(seg, BlockState::Unmapped);
        self.segments
            .get_mut(seg)
            .virt_mut()
            .unmapped
            .insert((base, first));
        self.reservations.push((stream, pool, seg));
        Ok(seg)
    }

    /// The reservation of (`stream`, `pool`), if made.
    fn reservation_of(&self, stream: StreamId, pool: PoolKind) -> Option<u32> {
        self.reservations
            .iter()
            .find(|&&(s, p, _)| s == stream && p == pool)
            .map(|&(_, _, seg)| seg)
    }

    /// Get memory from the driver for a request that the cache cannot serve; returns a free
    /// block (out of the index) that holds at least `rounded` bytes and may serve it.
    pub(crate) fn grow_virtual<D: Driver>(
        &mut self,
        core: &Core<D>,
        stream: StreamId,
        rounded: u64,
    ) -> std::result::Result<BlockId, GrowError> {
        let pool = rules::pool_for(rounded);
        let seg = self.reservation(core, stream, pool)?;
        let (u, bytes) = match self.site(core, seg, rounded) {
            None => return Err(GrowError::Memory(OomCause::AddressSpace)),
            Some(Site::Free(free)) => {
                self.index_remove(free);
                return Ok(free);
            }
            Some(Site::Map { range, bytes }) => (range, bytes),
        };
        let unit = self.segments.get(seg).virt().unit;
        let per_unit = self.segments.get(seg).virt().per_unit;
        let (start, room) = (self.blocks[u].addr, self.blocks[u].size);
        let (mapped, err) = if core.mode == SegmentMode::Remap {
            self.map_spare(core, seg, start, bytes, room, largest_piece(core, pool))
        } else {
            core.commit(bytes)?;
            let chunk = if per_unit { unit } else { bytes };
            let (mapped, err) = self.map_chunks(core, seg, start, bytes, chunk);
            core.uncommit(bytes - mapped);
            if mapped > 0 {
                core.ledger.on_reserve(mapped, false);
            }
            (mapped, err.map(GrowError::from))
        };
        if mapped == 0 {
            return Err(err.expect("nothing mapped means an error"));
        }
        core.graph_bytes(stream, mapped, false);
        // The mapped front of the unmapped block becomes a free block, merged with its
        // neighbours; by the choice above the merged block holds the request.
        let id = self.split_front(u, mapped, seg);
        let id = self.insert_free(id);
        if let Some(e) = err {
            // What was mapped stays, cached and accounted.
            return Err(e);
        }
        if self.blocks[id].size < rounded {
            return Err(GrowError::Memory(OomCause::NotContiguous));
        }
        self.index_remove(id);
        Ok(id)
    }

    /// Where in `seg` growth for a request of `rounded` bytes goes: a free block that holds it
    /// already (the cache passed it over only because it is at least max_split_size; growth
    /// serves from it, as PyTorch's expandable segments do), or an unmapped range that, with the
    /// free blocks on either side, holds it, and the bytes to map at its front.
    ///
    /// The lowest such range, as low addresses first keeps the mapped memory compact; except
    /// that remap mode with spare pieces on hand weighs the lowest
    /// [`WEIGHED`] ranges and takes the one that needs the fewest new bytes, the lowest of those:
    /// a range too narrow for the pieces would leave them unused and create new memory. Only
    /// [`WEIGHED`] ranges: each costs a pass over the spare pieces per piece mapped, and a
    /// reservation riddled with holes must not make growth slow.
    pub(super) fn site<D: Driver>(&self, core: &Core<D>, seg: u32, rounded: u64) -> Option<Site> {
        let s = self.segments.get(seg);
        let v = s.virt();
        let piece = largest_piece(core, s.pool);
        // Only the pieces this pool may map weigh (`next_piece` passes over larger ones).
        let spare = (core.mode == SegmentMode::Remap)
            .then(|| self.spare_sizes(piece))
            .filter(|sizes| !sizes.is_empty());
        let (mut best, mut best_new, mut weighed) = (None, u64::MAX, 0);
        for &(_, u) in &v.unmapped {
            let bytes = match self.site_at(core, seg, u, rounded) {
                None => continue,
                Some(Site::Map { bytes, .. }) => bytes,
                free => return free,
            };
            let b = &self.blocks[u];
            let Some(sizes) = &spare else {
                return Some(Site::Map { range: u, bytes });
            };
            let new =
                super::spare::new_bytes_for(sizes.clone(), bytes, b.size, piece, core.granularity);
            if new < best_new {
                (best, best_new) = (Some(Site::Map { range: u, bytes }), new);
            }
            weighed += 1;
            if new == 0 || weighed == WEIGHED {
                break;
            }
        }
        best
    }

    /// Growth for a request of `rounded` bytes at unmapped block `u` of `seg`
    /// ([`Shard::site`]), if `u` holds the request with the free blocks on either side.
    fn site_at<D: Driver>(
        &self,
        core: &Core<D>,
        seg: u32,
        u: BlockId,
        rounded: u64,
    ) -> Option<Site> {
        let s = self.segments.get(seg);
        let v = s.virt();
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
        // Remap mode grows the large pool by at least a large segment's worth, as PyTorch's
        // segments do: small requests then do not each cost a map.
        let floor = if core.mode == SegmentMode::Remap && s.pool == PoolKind::Large {
            rules::LARGE_BUFFER
        } else {
            0
        };
        let bytes = ((rounded - before).max(floor).div_ceil(v.unit) * v.unit).min(b.size);
        Some(Site::Map { range: u, bytes })
    }

    /// Map `bytes` from `start` in mappings of `chunk` bytes; returns the bytes mapped (a
    /// prefix: a chunk is either fully mapped, accessible and recorded, or not mapped at all)
    /// and the error that stopped it.
    fn map_chunks<D: Driver>(
        &mut self,
        core: &Core<D>,
        seg: u32,
        start: DevicePtr,
        bytes: u64,
        chunk: u64,
    ) -> (u64, Option<DriverError>) {
        let mut done = 0;
        while done < bytes {
            let va = start + done;
            match map_one(&core.driver, va, chunk) {
                Ok(handle) => {
                    let m = Mapping {
                        bytes: chunk,
                        handle,
                        released: false,
                        pooled: false,
                        sleep: None,
                    };
                    self.segments.get_mut(seg).virt_mut().mappings.insert(va, m);
                    self.record_map(core, seg, Action::SegmentMap, va, chunk);
                    done += chunk;
                }
                Err(e) => return (done, Some(e)),
            }
        }
        (done, None)
    }

    /// Compact and remap modes, before growing for `stream`: move memory rather than add it
    /// (remap: for the large pool only; a small-pool page is new memory, see `room_wanted`).
    /// Free mappings of this shard are unmapped first, so that reserved bytes follow live bytes
    /// (compact: their memory goes back to the driver; remap: their pieces become spare, to be
    /// mapped here), except (remap) the free blocks beside the range that growth will map:
    /// growth uses them where they are, and moving them would only map their pieces back (one
    /// unmap, map and set-access each, for nothing). Returns the bytes still wanted. A failure
    /// only means that less is moved.
    pub(crate) fn make_room<D: Driver>(
        &mut self,
        core: &Core<D>,
        stream: StreamId,
        rounded: u64,
    ) -> u64 {
        let (want, site) = self.room_wanted(core, stream, rounded);
        if want == 0 {
            return 0;
        }
        let keep = site.map_or([NIL; 2], |u| [self.blocks[u].prev, self.blocks[u].next]);
        match self.release_for_growth(core, want, SyncFirst::Owner, keep) {
            Ok(got) => want.saturating_sub(got),
            Err(e) => {
                note_move_failure(core, &e);
                want
            }
        }
    }

    /// How much memory growth for `stream` should move before it adds any, and (remap mode)
    /// the unmapped range it will map ([`Shard::site`], with the spare pieces on hand now).
    pub(crate) fn room_wanted<D: Driver>(
        &self,
        core: &Core<D>,
        stream: StreamId,
        rounded: u64,
    ) -> (u64, Option<BlockId>) {
        match core.mode {
            // A capture records the addresses it uses: grow, move nothing, while it runs (a
            // graph pool grows only during a capture).
            _ if is_pool_key(stream) || core.driver.is_capturing(regions::stream_of(stream)) => {
                (0, None)
            }
            // A small-pool page is one granule: moving memory for it would map a whole free
            // piece of the large pool (CUDA maps whole handles), where small blocks that live
            // long would pin all of it. New pages cost a map each, as the small pool's always do.
            SegmentMode::Remap if rules::pool_for(rounded) == PoolKind::Small => (0, None),
            SegmentMode::Remap => {
                let g = core.granularity;
                let seg = self.reservation_of(stream, rules::pool_for(rounded));
                let (bytes, site) = match seg.and_then(|seg| self.site(core, seg, rounded)) {
                    Some(Site::Free(_)) => return (0, None),
                    Some(Site::Map { range, bytes }) => (bytes, Some(range)),
                    None => (rounded.div_ceil(g) * g, None),
                };
                (bytes.saturating_sub(self.spare_bytes()), site)
            }
            SegmentMode::Compact => (rounded, None),
            _ => (0, None),
        }
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
            .filter(|&&(owner, _, _)| !is_pool_key(owner))
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
        if self.sleeps(self.segments.get(seg).stream) {
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
        let owner = s.stream;
        match sync {
            SyncFirst::Owner => core.sync_owner(owner)?,
            SyncFirst::Device => core.driver.sync_device()?,
            SyncFirst::Done => {}
        }
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
                    match self.unmap_mapping(core, seg, hi) {
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
        Ok(released)
    }

    /// Unmap the mapping at `va` and release its physical memory (or, in remap mode, keep the
    /// piece as spare); returns its size and the bytes given back to the driver.
    fn unmap_mapping<D: Driver>(
        &mut self,
        core: &Core<D>,
        seg: u32,
        va: DevicePtr,
    ) -> std::result::Result<(u64, u64), DriverError> {
        let mappings = &mut self.segments.get_mut(seg).virt_mut().mappings;
        let m = mappings
            .get_mut(&va)
            .expect("a free block's mapping exists");
        if m.pooled {
            let (bytes, handle) = (m.bytes, m.handle);
            core.driver.unmap(va, bytes)?;
            mappings.remove(&va);
            self.spare.push(super::Spare { handle, bytes });
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
            mid = self.insert_after(id, lo, hi - lo, seg, BlockState::Unmapped);
            self.blocks[id].size = lo - addr;
            self.index_insert(id);
        } else {
            self.blocks[id].size = hi - lo;
            self.blocks[id].state = BlockState::Unmapped;
        }
        let tail = (hi < end).then(|| {
            let tail = self.insert_after(mid, hi, end - hi, seg, BlockState::Free);
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
        let (addr, size, prev) = (
            self.blocks[u].addr,
            self.blocks[u].size,
            self.blocks[u].prev,
        );
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
        let fid = if prev == NIL {
            let (stream, pool) = (b.stream, b.pool);
            let fid = self.blocks.insert(crate::allocator::block::Block {
                next: u,
                ..crate::allocator::block::Block::new(
                    addr,
                    bytes,
                    seg,
                    BlockState::Free,
                    stream,
                    pool,
                )
            });
            self.segments.get_mut(seg).first = fid;
            fid
        } else {
            self.insert_after(prev, addr, bytes, seg, BlockState::Free)
        };
        self.blocks[u].prev = fid;
        fid
    }

    /// Unmap every free mapping of `seg`, and give its reservation back once nothing in it is
    /// mapped.
    pub(super) fn shrink_virtual<D: Driver>(
        &mut self,
        core: &Core<D>,
        seg: u32,
        sync: SyncFirst,
    ) -> Result<()> {
        self.release_free_mappings(core, seg, u64::MAX, sync, [NIL; 2])?;
        let s = self.segments.get(seg);
        let b = &self.blocks[s.first];
        if b.state != BlockState::Unmapped || b.next != NIL {
            return Ok(());
        }
        let (base, size, first, stream, pool) = (s.base, s.size, s.first, s.stream, s.pool);
        core.driver.release_va(base, size)?;
        self.blocks.remove(first);
        self.segments.remove(seg);
        self.reservations
            .retain(|&(st, p, _)| !(st == stream && p == pool));
        Ok(())
    }
}

impl Shard {
    /// Record a mapping made or removed in segment `seg` (when the history is recorded).
    pub(super) fn record_map<D: Driver>(
        &self,
        core: &Core<D>,
        seg: u32,
        action: Action,
        va: DevicePtr,
        bytes: u64,
    ) {
        if core.history.on() {
            let stream = self.segments.get(seg).stream;
            core.history
                .record(action, va, bytes, stream, crate::tag::Tag::Untracked);
        }
    }
}

/// Remap mode: the largest new piece growth in `pool` creates (the small pool's pages are
/// one granule each).
fn largest_piece<D: Driver>(core: &Core<D>, pool: PoolKind) -> u64 {
    match pool {
        PoolKind::Small => core.granularity,
        PoolKind::Large => core.remap_piece,
    }
}

/// Create physical memory of `bytes` and map it at `va`; on failure undo what this did.
pub(super) fn map_one<D: Driver>(
    driver: &D,
    va: DevicePtr,
    bytes: u64,
) -> std::result::Result<PhysHandle, DriverError> {
    let h = driver.create_physical(bytes)?;
    if let Err(e) = driver.map(va, bytes, h) {
        if let Err(e2) = driver.release_physical(h) {
            tracing::error!(error = %e2, "could not release a physical handle after a failed map");
        }
        return Err(e);
    }
    if let Err(e) = driver.set_access(va, bytes) {
        // Release then unmap: the memory goes when the mapping does.
        let undo = driver
            .release_physical(h)
            .and_then(|()| driver.unmap(va, bytes));
        if let Err(e2) = undo {
            tracing::error!(error = %e2, "could not undo a mapping whose access could not be set");
        }
        return Err(e);
    }
    Ok(h)
}

/// A move that failed: counted, and the allocation takes new memory instead.
pub(crate) fn note_move_failure<D: Driver>(core: &Core<D>, e: &crate::error::Error) {
    core.ledger
        .move_failures
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    tracing::debug!(error = %e, "could not release free mappings before growing");
}
