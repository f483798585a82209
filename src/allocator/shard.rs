//! One shard of the caching allocator: the blocks, segments and free lists of the streams that
//! hash to it, behind one mutex. A cached allocation or free takes exactly this one lock.
//!
//! Invariants (checked by `invariants::check` on a dump, and by `Shard::self_check`):
//! - The free index holds exactly the `Free` blocks, keyed by (stream, size, address), so the
//!   first key at or after (stream, size) is the best fit: smallest, then lowest address.
//! - `live` maps the address of every `Allocated` block, and nothing else, to its id.
//! - `pending` holds one entry per outstanding event of each `Pending` block; the count in
//!   `Pending(n)` equals the block's entries.
//! - Reserved bytes in the ledger change only together with a successful driver call that
//!   took or gave back memory, so they always equal what the driver holds for us.
//! - Memory is freed or unmapped only after the streams that used it are synchronised
//!   (events waited for; the owning stream synchronised before an unmap).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use super::block::{Arena, Block, BlockId, BlockState, NIL};
use super::free_index::FreeIndex;
use super::rules::{self, PoolKind};
use super::{Allocation, Core};
use crate::driver::{DevicePtr, Driver, DriverError, EventId, PhysHandle, StreamId};
use crate::error::{Error, Result};
use crate::tag::Tag;

/// A multiplicative hash for device addresses: they are distinct, 512-byte aligned integers,
/// so SipHash's protection buys nothing and costs most of a lookup.
#[derive(Default)]
pub(crate) struct PtrHasher(u64);

impl Hasher for PtrHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    #[inline]
    fn write_u64(&mut self, x: u64) {
        let h = (x >> 9).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.0 = h ^ (h >> 29);
    }
}

/// The free lists of one stream.
#[derive(Debug)]
struct StreamPools {
    stream: StreamId,
    pools: [FreeIndex; 2],
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
}

/// Remap mode: a physical handle held but not mapped.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Spare {
    pub handle: PhysHandle,
    pub bytes: u64,
}

#[derive(Debug)]
pub(crate) enum SegmentKind {
    /// One `cuMemAlloc` of the whole segment.
    Plain,
    /// A virtual reservation with physical memory mapped on demand. Every mapping starts at
    /// `base + k * unit` and is a multiple of `unit` long.
    Expandable {
        unit: u64,
        /// One mapping per `unit` (PyTorch's expandable segments), or one per growth, sized to
        /// the request (the compact mode).
        per_unit: bool,
        mappings: BTreeMap<DevicePtr, Mapping>,
        /// Unmapped blocks by address, for growth.
        unmapped: BTreeSet<(DevicePtr, BlockId)>,
    },
}

#[derive(Debug)]
pub(crate) struct Segment {
    pub base: DevicePtr,
    pub size: u64,
    pub stream: StreamId,
    pub pool: PoolKind,
    pub first: BlockId,
    pub kind: SegmentKind,
}

impl Segment {
    fn is_expandable(&self) -> bool {
        matches!(self.kind, SegmentKind::Expandable { .. })
    }
}

/// Why growing failed: memory (worth releasing the cache and retrying) or anything else.
pub(crate) enum GrowError {
    Memory(String),
    Driver(DriverError),
}

impl From<DriverError> for GrowError {
    fn from(e: DriverError) -> Self {
        if e.is_out_of_memory() {
            GrowError::Memory(e.to_string())
        } else {
            GrowError::Driver(e)
        }
    }
}

#[derive(Default, Debug)]
pub(crate) struct Shard {
    /// This shard's index: its counters in the ledger.
    pub(crate) id: usize,
    pub(crate) blocks: Arena,
    pub(crate) segments: Vec<Option<Segment>>,
    vacant_segments: Vec<u32>,
    /// Free lists per stream; almost always one entry, so found by a linear search.
    index: Vec<StreamPools>,
    live: HashMap<DevicePtr, BlockId, BuildHasherDefault<PtrHasher>>,
    pub(crate) pending: Vec<(EventId, BlockId)>,
    /// The expandable segment of each (stream, pool) in this shard.
    expandable: Vec<(StreamId, PoolKind, u32)>,
    /// Remap mode: physical handles held but not mapped.
    pub(crate) spare: Vec<Spare>,
}

impl Shard {
    pub(crate) fn new(id: usize) -> Shard {
        Shard {
            id,
            ..Shard::default()
        }
    }

    #[inline]
    fn pools_of(&self, stream: StreamId) -> Option<&StreamPools> {
        self.index.iter().find(|p| p.stream == stream)
    }

    #[inline]
    fn index_insert(&mut self, id: BlockId) {
        let (stream, pool) = (self.blocks[id].stream, self.blocks[id].pool);
        let i = match self.index.iter().position(|p| p.stream == stream) {
            Some(i) => i,
            None => self.add_stream(stream),
        };
        self.index[i].pools[pool as usize].insert(&mut self.blocks, id);
    }

    #[cold]
    fn add_stream(&mut self, stream: StreamId) -> usize {
        self.index.push(StreamPools {
            stream,
            pools: Default::default(),
        });
        self.index.len() - 1
    }

    #[inline]
    fn index_remove(&mut self, id: BlockId) {
        let (stream, pool) = (self.blocks[id].stream, self.blocks[id].pool);
        let p = self
            .index
            .iter_mut()
            .find(|p| p.stream == stream)
            .expect("free block's stream has free lists");
        p.pools[pool as usize].remove(&mut self.blocks, id);
    }

    /// The best cached block for a request, if one may serve it.
    #[inline]
    fn best_fit(
        &self,
        stream: StreamId,
        pool: PoolKind,
        rounded: u64,
        max_split: u64,
    ) -> Option<BlockId> {
        let id = self.pools_of(stream)?.pools[pool as usize].best_fit(&self.blocks, rounded)?;
        // Both max-split rules only get stricter as blocks grow, so if the best fit may not
        // serve, no larger block may.
        rules::may_serve(max_split, self.blocks[id].size, rounded).then_some(id)
    }

    /// Serve a request from the cache, if it can be.
    #[inline]
    pub(crate) fn try_alloc<D: Driver>(
        &mut self,
        core: &Core<D>,
        stream: StreamId,
        rounded: u64,
        requested: u64,
        tag: Tag,
    ) -> Option<Allocation> {
        let pool = rules::pool_for(rounded);
        let id = self.best_fit(stream, pool, rounded, core.max_split)?;
        self.index_remove(id);
        Some(self.take(core, id, rounded, requested, tag))
    }

    /// Hand out the front of free block `id` (out of the index: a best fit, or fresh memory from
    /// `grow`), splitting off the
    /// tail when the split rule says so.
    pub(crate) fn take<D: Driver>(
        &mut self,
        core: &Core<D>,
        id: BlockId,
        rounded: u64,
        requested: u64,
        tag: Tag,
    ) -> Allocation {
        let (size, pool, expandable) = {
            let b = &self.blocks[id];
            let seg = self.segments[b.segment as usize]
                .as_ref()
                .expect("block's segment exists");
            (b.size, b.pool, seg.is_expandable())
        };
        if rules::should_split(pool, expandable, core.max_split, size, rounded) {
            let b = &self.blocks[id];
            let tail = Block {
                prev: id,
                next: b.next,
                ..Self::block(
                    b.addr + rounded,
                    size - rounded,
                    b.segment,
                    BlockState::Free,
                    b.stream,
                    pool,
                )
            };
            let next = tail.next;
            let tid = self.blocks.insert(tail);
            if next != NIL {
                self.blocks[next].prev = tid;
            }
            let b = &mut self.blocks[id];
            b.next = tid;
            b.size = rounded;
            self.index_insert(tid);
        }
        let b = &mut self.blocks[id];
        b.state = BlockState::Allocated;
        b.requested = requested;
        b.tag = tag;
        let alloc = Allocation {
            ptr: b.addr,
            size: b.size,
            requested,
            stream: b.stream,
            tag,
        };
        self.live.insert(alloc.ptr, id);
        core.ledger
            .shard(self.id)
            .on_alloc(tag, alloc.size, requested);
        alloc
    }

    /// Make `id` free, merge it with free neighbours, and put the result in the index; returns
    /// the merged block.
    fn insert_free(&mut self, mut id: BlockId) -> BlockId {
        self.blocks[id].state = BlockState::Free;
        let prev = self.blocks[id].prev;
        if prev != NIL && self.blocks[prev].state == BlockState::Free {
            self.index_remove(prev);
            self.absorb_next(prev);
            id = prev;
        }
        let next = self.blocks[id].next;
        if next != NIL && self.blocks[next].state == BlockState::Free {
            self.index_remove(next);
            self.absorb_next(id);
        }
        self.index_insert(id);
        id
    }

    /// Merge the block after `id` into `id` (neither is in the index).
    fn absorb_next(&mut self, id: BlockId) {
        let next = self.blocks[id].next;
        let (size, after) = (self.blocks[next].size, self.blocks[next].next);
        self.blocks[id].size += size;
        self.blocks[id].next = after;
        if after != NIL {
            self.blocks[after].prev = id;
        }
        self.blocks.remove(next);
    }

    /// Number of live allocations in this shard.
    pub(crate) fn live_count(&self) -> usize {
        self.live.len()
    }

    /// Return an allocation to the cache (or to the pending list when other streams used it).
    /// Unknown pointers are an error and change nothing.
    pub(crate) fn free<D: Driver>(&mut self, core: &Core<D>, ptr: DevicePtr) -> Result<()> {
        let Some(&id) = self.live.get(&ptr) else {
            return Err(Error::UnknownPointer(ptr));
        };
        if self.blocks[id].used_streams.is_empty() {
            self.live.remove(&ptr);
            let b = &self.blocks[id];
            core.ledger
                .shard(self.id)
                .on_free(b.tag, b.size, b.requested, false);
            self.insert_free(id);
            return Ok(());
        }
        // Other streams may still be using the block: it is reusable once each of them has
        // reached the point where it was freed.
        let streams = std::mem::take(&mut self.blocks[id].used_streams);
        let mut events = Vec::with_capacity(streams.len());
        for &s in &streams {
            match core.driver.record_event(s) {
                Ok(e) => events.push(e),
                Err(e) => {
                    for ev in events {
                        let _ = core.driver.destroy_event(ev);
                    }
                    self.blocks[id].used_streams = streams;
                    return Err(e.into());
                }
            }
        }
        self.live.remove(&ptr);
        let b = &mut self.blocks[id];
        b.state = BlockState::Pending(events.len() as u32);
        core.ledger
            .shard(self.id)
            .on_free(b.tag, b.size, b.requested, true);
        self.pending.extend(events.into_iter().map(|e| (e, id)));
        Ok(())
    }

    /// Note that `stream` uses the allocation at `ptr`.
    pub(crate) fn record_stream(&mut self, ptr: DevicePtr, stream: StreamId) -> Result<()> {
        let &id = self.live.get(&ptr).ok_or(Error::UnknownPointer(ptr))?;
        let b = &mut self.blocks[id];
        if stream != b.stream && !b.used_streams.contains(&stream) {
            b.used_streams.push(stream);
        }
        Ok(())
    }

    /// Return pending blocks whose events completed to the cache. With `wait`, block until all
    /// of them complete.
    pub(crate) fn process_pending<D: Driver>(&mut self, core: &Core<D>, wait: bool) -> Result<()> {
        let mut i = 0;
        while i < self.pending.len() {
            let (event, id) = self.pending[i];
            let done = if wait {
                core.driver.wait_event(event)?;
                true
            } else {
                // A failed query is treated as "not yet": the next poll or a wait settles it.
                core.driver.query_event(event).unwrap_or(false)
            };
            if !done {
                i += 1;
                continue;
            }
            if let Err(e) = core.driver.destroy_event(event) {
                tracing::warn!(error = %e, "could not destroy a completed event");
            }
            self.pending.swap_remove(i);
            let BlockState::Pending(n) = self.blocks[id].state else {
                unreachable!("pending block")
            };
            if n > 1 {
                self.blocks[id].state = BlockState::Pending(n - 1);
            } else {
                core.ledger.shard(self.id).on_released(self.blocks[id].size);
                self.insert_free(id);
            }
        }
        Ok(())
    }

    fn new_segment(&mut self, seg: Segment) -> u32 {
        match self.vacant_segments.pop() {
            Some(i) => {
                self.segments[i as usize] = Some(seg);
                i
            }
            None => {
                self.segments.push(Some(seg));
                (self.segments.len() - 1) as u32
            }
        }
    }

    fn block(
        addr: DevicePtr,
        size: u64,
        segment: u32,
        state: BlockState,
        stream: StreamId,
        pool: PoolKind,
    ) -> Block {
        Block {
            addr,
            size,
            requested: 0,
            prev: NIL,
            next: NIL,
            free_prev: NIL,
            free_next: NIL,
            segment,
            state,
            tag: Tag::Untracked,
            stream,
            pool,
            used_streams: Vec::new(),
        }
    }

    /// Get memory from the driver for a request that the cache cannot serve; returns a free
    /// block (out of the index) that holds at least `rounded` bytes and may serve it.
    pub(crate) fn grow<D: Driver>(
        &mut self,
        core: &Core<D>,
        stream: StreamId,
        rounded: u64,
    ) -> std::result::Result<BlockId, GrowError> {
        if core.expandable {
            self.grow_expandable(core, stream, rounded)
        } else {
            self.grow_plain(core, stream, rounded)
        }
    }

    fn grow_plain<D: Driver>(
        &mut self,
        core: &Core<D>,
        stream: StreamId,
        rounded: u64,
    ) -> std::result::Result<BlockId, GrowError> {
        let pool = rules::pool_for(rounded);
        let size = rules::segment_size(rounded);
        core.commit(size).map_err(GrowError::Memory)?;
        let base = match core.driver.alloc_segment(size, stream) {
            Ok(p) => p,
            Err(e) => {
                core.uncommit(size);
                return Err(e.into());
            }
        };
        core.ledger
            .driver
            .segment_allocs
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        core.ledger.on_reserve(size, true);
        let seg = self.new_segment(Segment {
            base,
            size,
            stream,
            pool,
            first: NIL,
            kind: SegmentKind::Plain,
        });
        let id = self
            .blocks
            .insert(Self::block(base, size, seg, BlockState::Free, stream, pool));
        self.segments[seg as usize]
            .as_mut()
            .expect("just made")
            .first = id;
        Ok(id)
    }

    fn expandable_segment<D: Driver>(
        &mut self,
        core: &Core<D>,
        stream: StreamId,
        pool: PoolKind,
    ) -> std::result::Result<u32, GrowError> {
        if let Some(&(_, _, seg)) = self
            .expandable
            .iter()
            .find(|(s, p, _)| *s == stream && *p == pool)
        {
            return Ok(seg);
        }
        let (unit, per_unit) = if core.compact {
            (core.granularity, false)
        } else if core.remap {
            (core.granularity, true)
        } else {
            (rules::expandable_page(pool, core.granularity), true)
        };
        // Address space for 9/8 of the device, as PyTorch reserves: enough to map every byte
        // of the device even with holes left by earlier unmaps.
        let size = (core.device_total + core.device_total / 8).div_ceil(unit) * unit;
        let base = core.driver.reserve_va(size).map_err(GrowError::Driver)?;
        let seg = self.new_segment(Segment {
            base,
            size,
            stream,
            pool,
            first: NIL,
            kind: SegmentKind::Expandable {
                unit,
                per_unit,
                mappings: BTreeMap::new(),
                unmapped: BTreeSet::new(),
            },
        });
        let id = self.blocks.insert(Self::block(
            base,
            size,
            seg,
            BlockState::Unmapped,
            stream,
            pool,
        ));
        let s = self.segments[seg as usize].as_mut().expect("just made");
        s.first = id;
        if let SegmentKind::Expandable { unmapped, .. } = &mut s.kind {
            unmapped.insert((base, id));
        }
        self.expandable.push((stream, pool, seg));
        Ok(seg)
    }

    fn grow_expandable<D: Driver>(
        &mut self,
        core: &Core<D>,
        stream: StreamId,
        rounded: u64,
    ) -> std::result::Result<BlockId, GrowError> {
        let pool = rules::pool_for(rounded);
        let seg = self.expandable_segment(core, stream, pool)?;
        // Move memory rather than add it: free mappings of this shard are unmapped first, so
        // that reserved bytes follow live bytes (compact: their memory goes back to the
        // driver; remap: their pages become spare, to be mapped here). A failure here only
        // means that less is moved.
        let want = if core.remap {
            let g = core.granularity;
            (rounded.div_ceil(g) * g).saturating_sub(self.spare_bytes())
        } else if core.compact {
            rounded
        } else {
            0
        };
        if want > 0 {
            if let Err(e) = self.release_for_growth(core, want) {
                core.ledger
                    .move_failures
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                tracing::debug!(error = %e, "could not release free mappings before growing");
            }
        }
        let (unit, per_unit, candidates): (u64, bool, Vec<(DevicePtr, BlockId)>) =
            match &self.segments[seg as usize].as_ref().expect("exists").kind {
                SegmentKind::Expandable {
                    unit,
                    per_unit,
                    unmapped,
                    ..
                } => (*unit, *per_unit, unmapped.iter().copied().collect()),
                SegmentKind::Plain => unreachable!("expandable segment"),
            };
        // The lowest unmapped range that, with the free blocks on either side, holds the
        // request: low addresses first keeps the mapped memory compact.
        let free_size = |sh: &Shard, id: BlockId| {
            if id != NIL && sh.blocks[id].state == BlockState::Free {
                sh.blocks[id].size
            } else {
                0
            }
        };
        let mut choice = None;
        for (_, u) in candidates {
            let b = &self.blocks[u];
            let before = free_size(self, b.prev);
            let after = free_size(self, b.next);
            if before + b.size + after >= rounded {
                // Remap mode grows the large pool by at least a large segment's worth, as
                // PyTorch's segments do: small requests then do not each cost a map.
                let floor = if core.remap && pool == PoolKind::Large {
                    rules::LARGE_BUFFER
                } else {
                    0
                };
                let need = rounded.saturating_sub(before).max(floor).div_ceil(unit) * unit;
                choice = Some((u, need.min(b.size)));
                break;
            }
        }
        let Some((u, bytes)) = choice else {
            return Err(GrowError::Memory(
                "the expandable segment's address space is exhausted".into(),
            ));
        };
        let start = self.blocks[u].addr;
        let (mapped, err) = if core.remap {
            let piece = match pool {
                PoolKind::Small => core.granularity,
                PoolKind::Large => core.remap_piece,
            };
            let room = self.blocks[u].size;
            self.map_spare(core, seg, start, bytes, room, piece)
        } else {
            core.commit(bytes).map_err(GrowError::Memory)?;
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
        // The mapped front of the unmapped block becomes a free block, merged with its
        // neighbours; by the choice above the merged block holds the request.
        let id = self.split_front(u, mapped, seg);
        let id = self.insert_free(id);
        if let Some(e) = err {
            // What was mapped stays, cached and accounted.
            return Err(e);
        }
        if self.blocks[id].size < rounded {
            return Err(GrowError::Memory(
                "the mapped memory is not contiguous with enough free memory".into(),
            ));
        }
        self.index_remove(id);
        Ok(id)
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
                    let counters = &core.ledger.driver;
                    counters
                        .maps
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    counters
                        .creates
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let s = self.segments[seg as usize].as_mut().expect("exists");
                    if let SegmentKind::Expandable { mappings, .. } = &mut s.kind {
                        let m = Mapping {
                            bytes: chunk,
                            handle,
                            released: false,
                            pooled: false,
                        };
                        mappings.insert(va, m);
                    }
                    done += chunk;
                }
                Err(e) => return (done, Some(e)),
            }
        }
        (done, None)
    }

    /// Remap mode: physical memory held but not mapped.
    pub(crate) fn spare_bytes(&self) -> u64 {
        self.spare.iter().map(|p| p.bytes).sum()
    }

    /// Remap mode: map at least `bytes` (at most `room`) from `start`, one whole handle per map
    /// call: spare handles first (the smallest that covers what is left, else the largest that
    /// fits), then new handles of at most `piece` bytes. Returns the bytes mapped (a prefix)
    /// and the error that stopped it; a handle that could not be mapped stays spare.
    fn map_spare<D: Driver>(
        &mut self,
        core: &Core<D>,
        seg: u32,
        start: DevicePtr,
        bytes: u64,
        room: u64,
        piece: u64,
    ) -> (u64, Option<GrowError>) {
        let g = core.granularity;
        let mut done = 0;
        while done < bytes {
            let (left, fits) = (bytes - done, room - done);
            let covering = self
                .spare
                .iter()
                .enumerate()
                .filter(|(_, p)| p.bytes >= left && p.bytes <= fits)
                .min_by_key(|(_, p)| p.bytes);
            let largest = || {
                self.spare
                    .iter()
                    .enumerate()
                    .filter(|(_, p)| p.bytes <= fits)
                    .max_by_key(|(_, p)| p.bytes)
            };
            let p = match covering.or_else(largest).map(|(i, _)| i) {
                Some(i) => self.spare.swap_remove(i),
                None => {
                    let size = piece.min(left.div_ceil(g) * g);
                    if let Err(m) = core.commit(size) {
                        return (done, Some(GrowError::Memory(m)));
                    }
                    match core.driver.create_physical(size) {
                        Ok(handle) => {
                            core.ledger
                                .driver
                                .creates
                                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            core.ledger.on_reserve(size, false);
                            Spare {
                                handle,
                                bytes: size,
                            }
                        }
                        Err(e) => {
                            core.uncommit(size);
                            return (done, Some(e.into()));
                        }
                    }
                }
            };
            let va = start + done;
            if let Err(e) = map_piece(&core.driver, va, p.bytes, p.handle) {
                self.spare.push(p);
                return (done, Some(e.into()));
            }
            core.ledger
                .driver
                .maps
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let s = self.segments[seg as usize].as_mut().expect("exists");
            if let SegmentKind::Expandable { mappings, .. } = &mut s.kind {
                let m = Mapping {
                    bytes: p.bytes,
                    handle: p.handle,
                    released: false,
                    pooled: true,
                };
                mappings.insert(va, m);
            }
            done += p.bytes;
        }
        (done, None)
    }

    /// Remap mode: give the spare handles back to the driver.
    fn release_spare<D: Driver>(&mut self, core: &Core<D>) -> Result<()> {
        while let Some(p) = self.spare.pop() {
            if let Err(e) = core.driver.release_physical(p.handle) {
                self.spare.push(p);
                return Err(e.into());
            }
            core.ledger
                .driver
                .releases
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            core.ledger.on_unreserve(p.bytes, false);
            core.uncommit(p.bytes);
        }
        Ok(())
    }

    /// Split `bytes` off the front of unmapped block `u` as a new block (returned), marking
    /// `u`'s remainder; `bytes` may be all of `u`, in which case `u` itself is returned.
    fn split_front(&mut self, u: BlockId, bytes: u64, seg: u32) -> BlockId {
        let s = self.segments[seg as usize].as_mut().expect("exists");
        let SegmentKind::Expandable { unmapped, .. } = &mut s.kind else {
            unreachable!()
        };
        let b = &self.blocks[u];
        unmapped.remove(&(b.addr, u));
        if bytes == b.size {
            return u;
        }
        let front = Block {
            size: bytes,
            next: u,
            used_streams: Vec::new(),
            ..Self::block(b.addr, bytes, seg, BlockState::Free, b.stream, b.pool)
        };
        let prev = b.prev;
        let fid = self.blocks.insert(Block { prev, ..front });
        if prev != NIL {
            self.blocks[prev].next = fid;
        } else {
            self.segments[seg as usize].as_mut().expect("exists").first = fid;
        }
        let b = &mut self.blocks[u];
        b.prev = fid;
        b.addr += bytes;
        b.size -= bytes;
        let key = (b.addr, u);
        if let SegmentKind::Expandable { unmapped, .. } =
            &mut self.segments[seg as usize].as_mut().expect("exists").kind
        {
            unmapped.insert(key);
        }
        fid
    }

    /// Give every unused byte of this shard back to the driver: wait for pending events, free
    /// whole free plain segments, unmap whole free pages of expandable segments (and release
    /// an expandable reservation once nothing in it is mapped). Returns the first error; what
    /// could not be released stays cached and accounted.
    pub(crate) fn release_cached<D: Driver>(&mut self, core: &Core<D>) -> Result<()> {
        let mut first_err: Option<Error> = None;
        if let Err(e) = self.process_pending(core, true) {
            first_err.get_or_insert(e);
        }
        for seg in 0..self.segments.len() as u32 {
            let Some(s) = self.segments[seg as usize].as_ref() else {
                continue;
            };
            let r = if s.is_expandable() {
                self.shrink_expandable(core, seg)
            } else {
                self.free_plain(core, seg)
            };
            if let Err(e) = r {
                first_err.get_or_insert(e);
            }
        }
        if let Err(e) = self.release_spare(core) {
            first_err.get_or_insert(e);
        }
        first_err.map_or(Ok(()), Err)
    }

    fn free_plain<D: Driver>(&mut self, core: &Core<D>, seg: u32) -> Result<()> {
        let s = self.segments[seg as usize].as_ref().expect("exists");
        let b = &self.blocks[s.first];
        if b.state != BlockState::Free || b.next != NIL {
            return Ok(());
        }
        let (base, size, first) = (s.base, s.size, s.first);
        core.driver.free_segment(base, size)?;
        core.ledger
            .driver
            .segment_frees
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.index_remove(first);
        self.blocks.remove(first);
        self.segments[seg as usize] = None;
        self.vacant_segments.push(seg);
        core.ledger.on_unreserve(size, true);
        core.uncommit(size);
        Ok(())
    }

    fn shrink_expandable<D: Driver>(&mut self, core: &Core<D>, seg: u32) -> Result<()> {
        self.release_free_mappings(core, seg, u64::MAX)?;
        self.release_reservation_if_empty(core, seg)
    }

    /// Compact mode: before growing by about `want` bytes, unmap that much free memory from
    /// this shard's expandable segments.
    fn release_for_growth<D: Driver>(&mut self, core: &Core<D>, want: u64) -> Result<()> {
        let segs: Vec<u32> = self.expandable.iter().map(|&(_, _, seg)| seg).collect();
        let mut left = want;
        for seg in segs {
            if left == 0 {
                break;
            }
            left = left.saturating_sub(self.release_free_mappings(core, seg, left)?);
        }
        Ok(())
    }

    /// Unmap mappings that lie wholly inside free blocks of `seg`, until at least `budget`
    /// bytes are unmapped (or all of them). The segment's stream is synchronised first: the
    /// device may still be reading memory freed on it. Returns the bytes unmapped; on an error,
    /// what was unmapped before it is accounted and the rest stays mapped.
    fn release_free_mappings<D: Driver>(
        &mut self,
        core: &Core<D>,
        seg: u32,
        budget: u64,
    ) -> Result<u64> {
        // Runs of contiguous mappings inside each free block.
        let mut runs: Vec<(BlockId, Vec<DevicePtr>)> = Vec::new();
        {
            let s = self.segments[seg as usize].as_ref().expect("exists");
            let SegmentKind::Expandable { mappings, .. } = &s.kind else {
                unreachable!()
            };
            let mut id = s.first;
            while id != NIL {
                let b = &self.blocks[id];
                if b.state == BlockState::Free {
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
        }
        if runs.is_empty() {
            return Ok(0);
        }
        let stream = self.segments[seg as usize].as_ref().expect("exists").stream;
        core.driver.sync_stream(stream)?;
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
    /// page as spare); returns its size and the bytes given back to the driver.
    fn unmap_mapping<D: Driver>(
        &mut self,
        core: &Core<D>,
        seg: u32,
        va: DevicePtr,
    ) -> std::result::Result<(u64, u64), DriverError> {
        let s = self.segments[seg as usize].as_mut().expect("exists");
        let SegmentKind::Expandable { mappings, .. } = &mut s.kind else {
            unreachable!()
        };
        let m = mappings
            .get_mut(&va)
            .expect("a free block's mapping exists");
        if m.pooled {
            let (bytes, handle) = (m.bytes, m.handle);
            core.driver.unmap(va, bytes)?;
            mappings.remove(&va);
            self.spare.push(Spare { handle, bytes });
            core.ledger
                .driver
                .unmaps
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
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
        let counters = &core.ledger.driver;
        counters
            .unmaps
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        counters
            .releases
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok((bytes, bytes))
    }

    /// Turn `[lo, hi)` of free block `id` (out of or in the index) into an unmapped block,
    /// keeping any free head and tail, and merging with unmapped neighbours; returns the free
    /// tail, if any.
    fn carve_unmapped(
        &mut self,
        id: BlockId,
        lo: DevicePtr,
        hi: DevicePtr,
        seg: u32,
    ) -> Option<BlockId> {
        self.index_remove(id);
        let (addr, end, stream, pool) = {
            let b = &self.blocks[id];
            (b.addr, b.end(), b.stream, b.pool)
        };
        // Head stays in `id`; the middle and tail become new blocks.
        let mut mid = id;
        if lo > addr {
            mid = self.insert_after(id, lo, hi - lo, seg, BlockState::Unmapped, stream, pool);
            self.blocks[id].size = lo - addr;
            self.index_insert(id);
        } else {
            self.blocks[id].size = hi - lo;
            self.blocks[id].state = BlockState::Unmapped;
        }
        let tail = (hi < end).then(|| {
            let tail = self.insert_after(mid, hi, end - hi, seg, BlockState::Free, stream, pool);
            self.index_insert(tail);
            tail
        });
        // Merge with unmapped neighbours.
        let mut m = mid;
        let prev = self.blocks[m].prev;
        if prev != NIL && self.blocks[prev].state == BlockState::Unmapped {
            let key = (self.blocks[prev].addr, prev);
            self.unmapped_set(seg).remove(&key);
            self.absorb_next(prev);
            m = prev;
        }
        let next = self.blocks[m].next;
        if next != NIL && self.blocks[next].state == BlockState::Unmapped {
            let key = (self.blocks[next].addr, next);
            self.unmapped_set(seg).remove(&key);
            self.absorb_next(m);
        }
        let key = (self.blocks[m].addr, m);
        self.unmapped_set(seg).insert(key);
        tail
    }

    #[allow(clippy::too_many_arguments)]
    fn insert_after(
        &mut self,
        id: BlockId,
        addr: DevicePtr,
        size: u64,
        seg: u32,
        state: BlockState,
        stream: StreamId,
        pool: PoolKind,
    ) -> BlockId {
        let next = self.blocks[id].next;
        let nid = self.blocks.insert(Block {
            prev: id,
            next,
            ..Self::block(addr, size, seg, state, stream, pool)
        });
        if next != NIL {
            self.blocks[next].prev = nid;
        }
        self.blocks[id].next = nid;
        nid
    }

    fn unmapped_set(&mut self, seg: u32) -> &mut BTreeSet<(DevicePtr, BlockId)> {
        match &mut self.segments[seg as usize].as_mut().expect("exists").kind {
            SegmentKind::Expandable { unmapped, .. } => unmapped,
            SegmentKind::Plain => unreachable!(),
        }
    }

    fn release_reservation_if_empty<D: Driver>(&mut self, core: &Core<D>, seg: u32) -> Result<()> {
        let s = self.segments[seg as usize].as_ref().expect("exists");
        let b = &self.blocks[s.first];
        if b.state != BlockState::Unmapped || b.next != NIL {
            return Ok(());
        }
        let (base, size, first, stream, pool) = (s.base, s.size, s.first, s.stream, s.pool);
        core.driver.release_va(base, size)?;
        self.blocks.remove(first);
        self.segments[seg as usize] = None;
        self.vacant_segments.push(seg);
        self.expandable
            .retain(|&(st, p, _)| !(st == stream && p == pool));
        Ok(())
    }

    /// Walk this shard's structures and report any internal inconsistency.
    pub(crate) fn self_check(&self, problems: &mut Vec<String>) {
        let mut free_seen = 0usize;
        let mut live_seen = 0usize;
        let mut pending_events = 0usize;
        for (i, s) in self.segments.iter().enumerate() {
            let Some(s) = s else { continue };
            let mut id = s.first;
            let mut prev = NIL;
            while id != NIL {
                let b = &self.blocks[id];
                if b.prev != prev {
                    problems.push(format!("segment {i}: block {id} has a wrong back link"));
                }
                if b.segment as usize != i {
                    problems.push(format!(
                        "block {id} claims segment {} but is in {i}",
                        b.segment
                    ));
                }
                match b.state {
                    BlockState::Free => {
                        free_seen += 1;
                        let listed = self
                            .pools_of(b.stream)
                            .is_some_and(|p| p.pools[b.pool as usize].contains(&self.blocks, id));
                        if !listed {
                            problems.push(format!(
                                "free block at {:#x} is not in the free index",
                                b.addr
                            ));
                        }
                        if prev != NIL && self.blocks[prev].state == BlockState::Free {
                            problems.push(format!(
                                "free block at {:#x} was not merged with its predecessor",
                                b.addr
                            ));
                        }
                    }
                    BlockState::Allocated => {
                        live_seen += 1;
                        if self.live.get(&b.addr) != Some(&id) {
                            problems.push(format!(
                                "allocated block at {:#x} is not in the live map",
                                b.addr
                            ));
                        }
                    }
                    BlockState::Pending(n) => {
                        pending_events += n as usize;
                        let listed = self.pending.iter().filter(|(_, p)| *p == id).count();
                        if listed != n as usize {
                            problems.push(format!("pending block at {:#x} waits for {n} events but {listed} are listed", b.addr));
                        }
                    }
                    BlockState::Unmapped => {
                        if let SegmentKind::Expandable { unmapped, .. } = &s.kind {
                            if !unmapped.contains(&(b.addr, id)) {
                                problems.push(format!(
                                    "unmapped block at {:#x} is not in the unmapped set",
                                    b.addr
                                ));
                            }
                        } else {
                            problems.push("a plain segment has an unmapped block".into());
                        }
                    }
                }
                prev = id;
                id = b.next;
            }
        }
        let mut indexed = 0;
        for p in &self.index {
            for (k, idx) in p.pools.iter().enumerate() {
                indexed += idx.len();
                for id in idx.listed(&self.blocks) {
                    let b = &self.blocks[id];
                    if b.state != BlockState::Free || b.stream != p.stream || b.pool as usize != k {
                        problems.push(format!(
                            "the free index lists a block at {:#x} that is not free there",
                            b.addr
                        ));
                    }
                }
            }
        }
        if indexed != free_seen {
            problems.push(format!(
                "free index has {indexed} entries for {free_seen} free blocks"
            ));
        }
        if self.live.len() != live_seen {
            problems.push(format!(
                "live map has {} entries for {live_seen} allocated blocks",
                self.live.len()
            ));
        }
        if self.pending.len() != pending_events {
            problems.push(format!(
                "{} pending events for {pending_events} expected",
                self.pending.len()
            ));
        }
    }
}

/// Create physical memory of `bytes` and map it at `va`; on failure undo what this did.
fn map_one<D: Driver>(
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

/// Map an existing handle of `bytes` at `va` and enable it; on failure undo the mapping (the
/// handle stays, spare).
fn map_piece<D: Driver>(
    driver: &D,
    va: DevicePtr,
    bytes: u64,
    handle: PhysHandle,
) -> std::result::Result<(), DriverError> {
    driver.map(va, bytes, handle)?;
    if let Err(e) = driver.set_access(va, bytes) {
        if let Err(e2) = driver.unmap(va, bytes) {
            tracing::error!(error = %e2, "could not undo a mapping whose access could not be set");
        }
        return Err(e);
    }
    Ok(())
}
