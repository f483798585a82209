//! One shard of the caching allocator: the blocks, segments and free lists of the streams the
//! stream table deals to it, behind one lock. A cached allocation or free takes exactly this
//! lock and touches nothing shared but this shard's ledger cells.
//!
//! This file holds the shard's tables and the cached path (best fit, split, free, merge,
//! `record_stream`, pending events). Growth and release live beside it by kind of memory:
//! `plain.rs` (one `cuMemAlloc` per segment), `vmm.rs` (virtual reservations with mappings),
//! `spare.rs` (remap mode's unmapped physical pieces); `check.rs` walks the tables for the
//! self-check, the state dump and pool statistics.
//!
//! Invariants (checked by `check.rs` and by `invariants::check` on a dump):
//! - The free index of each owner (a stream, its tag's region of it, or a graph pool) and pool
//!   holds exactly the `Free` blocks of that owner and pool; its best fit is the smallest block
//!   that holds the request (within a bin, any). While a tag sleeps its regions' free lists
//!   are in `detached` instead (`sleep.rs`), and its frees wait in `deferred`.
//! - `live` maps the address of every `Allocated` block, and nothing else, to its id.
//! - `pending` holds one entry per outstanding event of each `Pending` block; the count in
//!   `Pending(n)` equals the block's entries.
//! - Every block's `segment` names a live segment of this shard ([`Segments::get`]).
//! - Reserved bytes in the ledger change only together with a successful driver call that
//!   took or gave back memory, so they always equal what the driver holds for us.
//! - Memory is freed or unmapped only after the streams that used it are synchronised
//!   (events waited for; before an unmap, the owning stream synchronised, or the whole
//!   device: `vmm::SyncFirst`).
//! - An allocation on a stream that is capturing a graph neither polls events nor moves
//!   memory (growth maps new memory instead), and its out-of-memory retry releases no cache:
//!   nothing it does synchronises, queries or unmaps. Only the calling stream is asked whether
//!   it captures: it is alive, where a segment's stream may have been destroyed since.
//!   Not covered yet: growth in compact and remap mode, and an out-of-memory retry, on another
//!   stream synchronise the segments they move or release, whatever those segments' streams
//!   are doing (a capturing stream that shares this shard, or a destroyed one).

mod check;
mod plain;
pub(crate) mod sleep;
mod spare;
mod vmm;

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

pub use self::check::PoolStats;
pub(crate) use self::spare::Spare;
pub(crate) use self::vmm::{note_move_failure, SyncFirst, VirtualMap};
use super::block::{Arena, Block, BlockId, BlockState, NIL};
use super::core::{Allocation, Core};
use super::free_index::FreeIndex;
use super::graphs::GraphRoutes;
use super::planted::{self, Bug};
use super::rules::{self, PoolKind};
use crate::driver::{DevicePtr, Driver, DriverError, EventId, StreamId};
use crate::error::{Error, OomCause, Result};
use crate::replay::trace::Action;
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
pub(crate) struct StreamPools {
    stream: StreamId,
    pools: [FreeIndex; 2],
}

#[derive(Debug)]
pub(crate) enum SegmentKind {
    /// One `cuMemAlloc` of the whole segment.
    Plain,
    /// A virtual reservation with physical memory mapped on demand.
    Virtual(VirtualMap),
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
    pub(crate) fn is_virtual(&self) -> bool {
        matches!(self.kind, SegmentKind::Virtual(_))
    }

    /// The mappings of a virtual segment. Only virtual-memory code asks, and only for the
    /// segments it made (a plain segment here is a broken invariant, not an input).
    pub(crate) fn virt(&self) -> &VirtualMap {
        match &self.kind {
            SegmentKind::Virtual(v) => v,
            SegmentKind::Plain => panic!("segment at {:#x} is plain, not virtual", self.base),
        }
    }

    pub(crate) fn virt_mut(&mut self) -> &mut VirtualMap {
        match &mut self.kind {
            SegmentKind::Virtual(v) => v,
            SegmentKind::Plain => panic!("segment at {:#x} is plain, not virtual", self.base),
        }
    }
}

/// A shard's segments by id; an id is reused once its segment is gone.
#[derive(Default, Debug)]
pub(crate) struct Segments {
    slots: Vec<Option<Segment>>,
    vacant: Vec<u32>,
}

impl Segments {
    fn insert(&mut self, seg: Segment) -> u32 {
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

    fn remove(&mut self, id: u32) {
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
    fn ids(&self) -> Vec<u32> {
        (0..self.slots.len() as u32)
            .filter(|&i| self.slots[i as usize].is_some())
            .collect()
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (u32, &Segment)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| Some((i as u32, s.as_ref()?)))
    }
}

/// Why growing failed: memory (worth releasing the cache and retrying) or anything else.
#[derive(Debug)]
pub(crate) enum GrowError {
    Memory(OomCause),
    Driver(DriverError),
}

impl From<DriverError> for GrowError {
    fn from(e: DriverError) -> Self {
        if e.is_out_of_memory() {
            GrowError::Memory(OomCause::Device(e))
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
    pub(crate) segments: Segments,
    /// Free lists per stream; almost always one entry, so found by a linear search.
    index: Vec<StreamPools>,
    live: HashMap<DevicePtr, BlockId, BuildHasherDefault<PtrHasher>>,
    /// Events other streams must reach before a freed block is reused.
    pub(crate) pending: Vec<(EventId, BlockId)>,
    /// The virtual segment of each (stream, pool) in this shard.
    reservations: Vec<(StreamId, PoolKind, u32)>,
    /// Remap mode: physical pieces held but not mapped.
    pub(crate) spare: Vec<Spare>,
    /// Captures routed to graph pools, and the pools graphs still reference.
    pub(crate) graphs: GraphRoutes,
    /// The allocation history is being recorded (`history.rs`).
    pub(crate) recording: bool,
    /// Tags asleep in this shard, one bit per tag index (`sleep.rs`).
    pub(crate) asleep: u8,
    /// The free lists of asleep regions, out of the index while their memory sleeps.
    pub(crate) detached: Vec<StreamPools>,
    /// Frees of asleep memory, applied when it wakes.
    pub(crate) deferred: Vec<DevicePtr>,
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
            .expect("a free block's stream has free lists");
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

    /// Hand out the front of free block `id` (out of the index: a best fit, or fresh memory
    /// from growth), splitting off the tail when the split rule says so.
    pub(crate) fn take<D: Driver>(
        &mut self,
        core: &Core<D>,
        id: BlockId,
        rounded: u64,
        requested: u64,
        tag: Tag,
    ) -> Allocation {
        let b = &self.blocks[id];
        let (size, pool) = (b.size, b.pool);
        let virt = self.segments.get(b.segment).is_virtual();
        if rules::should_split(pool, virt, core.max_split, size, rounded) {
            let cut = if planted::active(Bug::SplitOffBy512) {
                rounded - rules::MIN_BLOCK
            } else {
                rounded
            };
            let tid = self.insert_after(id, b.addr + cut, size - cut, b.segment, BlockState::Free);
            self.blocks[id].size = rounded;
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
        if next != NIL
            && self.blocks[next].state == BlockState::Free
            && !planted::active(Bug::MissedMerge)
        {
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

    /// A new block of segment `seg` linked in right after `id`, in the same stream and pool.
    #[inline]
    fn insert_after(
        &mut self,
        id: BlockId,
        addr: DevicePtr,
        size: u64,
        seg: u32,
        state: BlockState,
    ) -> BlockId {
        let (stream, pool, next) = {
            let b = &self.blocks[id];
            (b.stream, b.pool, b.next)
        };
        let nid = self.blocks.insert(Block {
            prev: id,
            next,
            ..Block::new(addr, size, seg, state, stream, pool)
        });
        if next != NIL {
            self.blocks[next].prev = nid;
        }
        self.blocks[id].next = nid;
        nid
    }

    /// A segment's first block, spanning all of it.
    fn add_segment(&mut self, seg: Segment, state: BlockState) -> (u32, BlockId) {
        let (base, size, stream, pool) = (seg.base, seg.size, seg.stream, seg.pool);
        let sid = self.segments.insert(seg);
        let first = self
            .blocks
            .insert(Block::new(base, size, sid, state, stream, pool));
        self.segments.get_mut(sid).first = first;
        (sid, first)
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
        // One byte tested on the cached path; the rest out of line.
        if self.asleep != 0 && self.sleeps(self.blocks[id].stream) {
            return self.defer_free(ptr);
        }
        if self.blocks[id].used_streams.is_empty() {
            self.live.remove(&ptr);
            let b = &self.blocks[id];
            core.ledger
                .shard(self.id)
                .on_free(b.tag, b.size, b.requested, false);
            if self.recording {
                self.record_free(core, id, true);
            }
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
        if self.recording {
            self.record_free(core, id, false);
        }
        Ok(())
    }

    /// Note that `stream` uses the allocation at `ptr`.
    pub(crate) fn record_stream(&mut self, ptr: DevicePtr, stream: StreamId) -> Result<()> {
        let &id = self.live.get(&ptr).ok_or(Error::UnknownPointer(ptr))?;
        let b = &mut self.blocks[id];
        if stream != super::regions::stream_of(b.stream) && !b.used_streams.contains(&stream) {
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
            let b = &mut self.blocks[id];
            match b.state {
                BlockState::Pending(n) if n > 1 => b.state = BlockState::Pending(n - 1),
                BlockState::Pending(_) => {
                    core.ledger.shard(self.id).on_released(b.size);
                    if self.recording {
                        self.record_block(core, id, Action::FreeCompleted);
                    }
                    self.insert_free(id);
                }
                other => panic!("a pending event names a block that is {other:?}"),
            }
        }
        Ok(())
    }

    /// Give every unused byte of this shard back to the driver: wait for pending events, free
    /// whole free plain segments, unmap free mappings of virtual segments (and release a
    /// reservation once nothing in it is mapped, after `sync`), release spare pieces. Returns
    /// the first error; what could not be released stays cached and accounted.
    pub(crate) fn release_cached<D: Driver>(
        &mut self,
        core: &Core<D>,
        sync: SyncFirst,
    ) -> Result<()> {
        let mut first_err: Option<Error> = None;
        if let Err(e) = self.process_pending(core, true) {
            first_err.get_or_insert(e);
        }
        for seg in self.segments.ids() {
            // A graph that may still replay writes to its pool's memory, freed or not.
            if !self.graphs.releasable(self.segments.get(seg).stream) {
                continue;
            }
            if let Err(e) = self.release_segment(core, seg, sync) {
                first_err.get_or_insert(e);
            }
        }
        if let Err(e) = self.release_spare(core) {
            first_err.get_or_insert(e);
        }
        first_err.map_or(Ok(()), Err)
    }
}

impl Shard {
    /// Record the free of block `id` (and, when nothing else uses it, its completion).
    #[cold]
    fn record_free<D: Driver>(&self, core: &Core<D>, id: BlockId, completed: bool) {
        self.record_block(core, id, Action::FreeRequested);
        if completed {
            self.record_block(core, id, Action::FreeCompleted);
        }
    }

    #[cold]
    fn record_block<D: Driver>(&self, core: &Core<D>, id: BlockId, action: Action) {
        let b = &self.blocks[id];
        core.history
            .record(action, b.addr, b.requested, b.stream, b.tag);
    }

    /// Give back what is free in segment `seg`: a whole free plain segment, or a virtual
    /// segment's free mappings (and its reservation once nothing in it is mapped).
    pub(crate) fn release_segment<D: Driver>(
        &mut self,
        core: &Core<D>,
        seg: u32,
        sync: SyncFirst,
    ) -> Result<()> {
        if self.segments.get(seg).is_virtual() {
            self.shrink_virtual(core, seg, sync)
        } else {
            self.free_plain(core, seg)
        }
    }
}

impl Block {
    /// A block with no neighbours, no tag and no other streams.
    fn new(
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
}
