//! One shard of the caching allocator: the blocks, segments and free lists of the streams the
//! stream table deals to it, behind one lock. A cached allocation or free takes exactly this
//! lock and touches nothing shared but this shard's ledger cells.
//!
//! This file holds the shard's tables and the cached path (best fit, split, free, merge,
//! `record_stream`, pending events). How memory is obtained and given back is the growth
//! policy's (`growth/`, where sleep also takes a tag's memory away and back); `check.rs` reads
//! the tables whole (self-check, dump, pool figures); `restore.rs` puts a graph pool's blocks
//! back as a checkpoint recorded them.
//!
//! Invariants (checked by `check.rs` and by `invariants::check` on a dump):
//! - Each owner (a stream, its tag's region of it, or a graph pool) has one slot in `lists`;
//!   every block names its owner's slot, and slots never move. A retired pool's slot holding
//!   nothing is marked vacant and taken by the next new owner; every other slot is kept for
//!   the shard's life. The free index of a slot
//!   and pool holds exactly the `Free` blocks of that owner and pool; its best fit is the
//!   smallest block that holds the request (within a bin, any). While a tag sleeps its
//!   regions' slots are marked asleep (nothing is served from them) and frees of its memory
//!   wait in `deferred`.
//! - `live` maps the address of every `Allocated` block, and nothing else, to its id.
//! - A segment of a held pool whose blocks are never split (`GraphRoutes::unsplit`) holds one
//!   block.
//! - `pending` holds one entry per outstanding event of each `Pending` block; the count in
//!   `Pending(n)` equals the block's entries. An entry without an event holds a block whose
//!   events wait for a capture's end before they are recorded (`held.rs`).
//! - Every block's `segment` names a live segment of this shard ([`Segments::get`]).
//! - Reserved bytes in the ledger change only together with a successful driver call that
//!   took or gave back memory, so they always equal what the driver holds for us.
//! - An allocation on a stream that is capturing a graph neither polls events nor moves
//!   memory (growth maps new memory instead), and its out-of-memory retry releases no cache:
//!   nothing it does synchronises, queries or unmaps. Only the calling stream is asked whether
//!   it captures: it is alive, where a segment's stream may have been destroyed since.

mod check;
mod held;
mod restore;

pub use self::restore::CheckpointBlock;

use std::num::NonZeroU64;

use crossbeam::utils::CachePadded;

use super::block::{Arena, BlockId, BlockState, Fresh, NIL};
use super::core::{Allocation, Core};
use super::free_index::FreeIndex;
use super::history::Action;
use super::live::LiveMap;
use super::owner::Owner;
use super::planted::{self, Bug};
use super::routes::GraphRoutes;
use super::rules::{self, PoolKind};
use super::segment::{Segment, Segments, Spare};
use super::spin::SpinLock;
use crate::driver::{DevicePtr, Driver, EventId, StreamId};
use crate::error::{Error, Result};
use crate::tag::Tag;

/// Every shard of an allocator, by index.
pub(crate) type Shards = [CachePadded<SpinLock<Shard>>];

/// What an allocation got: its address and the bytes reserved for it (small enough to come
/// back in registers).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Taken {
    pub(crate) ptr: NonZeroU64,
    pub(crate) size: u64,
}

impl Taken {
    /// The allocation as its caller on `stream` sees it.
    #[inline]
    pub(crate) fn allocation(self, requested: u64, stream: StreamId, tag: Tag) -> Allocation {
        Allocation {
            ptr: self.ptr.get(),
            size: self.size,
            requested,
            stream,
            tag,
        }
    }
}

/// The free lists of one owner.
#[derive(Debug)]
pub(crate) struct OwnerLists {
    pub(crate) owner: Owner,
    pub(crate) pools: [FreeIndex; 2],
    /// The owner is a region of an asleep tag: nothing is served from these lists.
    pub(crate) asleep: bool,
}

#[derive(Default, Debug)]
pub(crate) struct Shard {
    /// This shard's index: its counters in the ledger.
    pub(crate) id: usize,
    pub(crate) blocks: Arena,
    pub(crate) segments: Segments,
    /// Free lists by owner; almost always one or two, so found by a linear search.
    pub(crate) lists: Vec<OwnerLists>,
    live: LiveMap,
    /// Events other streams must reach before a freed block is reused (none yet: the block
    /// was freed during a capture, `held.rs`).
    pub(crate) pending: Vec<(Option<EventId>, BlockId)>,
    /// The virtual segment of each (owner, pool) in this shard.
    pub(crate) reservations: Vec<(Owner, PoolKind, u32)>,
    /// Remap mode: physical pieces held but not mapped.
    pub(crate) spare: Vec<Spare>,
    /// Remap mode with `unmap_later`: old mappings of moved pieces, waiting for the work that
    /// may still use them (`growth/later.rs`).
    pub(crate) retiring: Vec<super::growth::later::Retiring>,
    /// Captures routed to graph pools, and the pools graphs still reference.
    pub(crate) graphs: GraphRoutes,
    /// The allocation history is being recorded (`history.rs`).
    pub(crate) recording: bool,
    /// Tags asleep in this shard, one bit per tag index (`sleep.rs`).
    pub(crate) asleep: u8,
    /// Frees of asleep memory, applied when it wakes.
    pub(crate) deferred: Vec<DevicePtr>,
}

/// A tag's bit in [`Shard::asleep`].
#[inline]
pub(crate) fn tag_bit(tag: Tag) -> u8 {
    1 << tag.index()
}

impl Shard {
    pub(crate) fn new(id: usize) -> Shard {
        Shard {
            id,
            ..Shard::default()
        }
    }

    /// The slot of `owner`'s free lists, if it has one that may serve. Most shards serve one
    /// owner: the first slot is tried before the search.
    #[inline]
    fn list_of(&self, owner: Owner) -> Option<usize> {
        let serves = |l: &OwnerLists| l.owner == owner && !l.asleep;
        if serves(self.lists.first()?) {
            return Some(0);
        }
        self.lists.iter().position(serves)
    }

    /// The slot of `owner`'s free lists, made on first use (in a slot a retired pool gave
    /// up, when there is one: slots are never moved, blocks name theirs).
    pub(crate) fn list_for(&mut self, owner: Owner) -> u32 {
        if let Some(i) = self.lists.iter().position(|l| l.owner == owner) {
            return i as u32;
        }
        let lists = OwnerLists {
            owner,
            pools: Default::default(),
            asleep: self.sleeps(owner),
        };
        match self.lists.iter().position(|l| l.owner.is_vacant()) {
            Some(i) => {
                self.lists[i] = lists;
                i as u32
            }
            None => {
                self.lists.push(lists);
                (self.lists.len() - 1) as u32
            }
        }
    }

    /// Give up the free-list slots of retired pools (no shard holds them: no new block will be
    /// filed under them) that hold nothing here any more. A program that makes pool after pool
    /// (graphs captured again and again) would otherwise grow the slots, and every search of
    /// them, without end.
    pub(crate) fn vacate_retired_lists(&mut self) {
        for i in 0..self.lists.len() {
            let owner = self.lists[i].owner;
            if owner.pool().is_none_or(|k| self.graphs.held.contains(&k)) {
                continue;
            }
            let used = self.segments.iter().any(|(_, s)| s.owner == owner)
                || self.reservations.iter().any(|r| r.0 == owner);
            if !used {
                debug_assert!(self.lists[i].pools.iter().all(|p| p.len() == 0));
                self.lists[i] = OwnerLists {
                    owner: Owner::vacant(),
                    pools: Default::default(),
                    asleep: false,
                };
            }
        }
    }

    /// The owner of block `id`.
    #[inline]
    pub(crate) fn owner_of(&self, id: BlockId) -> Owner {
        self.lists[self.blocks[id].list as usize].owner
    }

    #[inline]
    pub(crate) fn index_insert(&mut self, id: BlockId) {
        let b = &self.blocks[id];
        let (list, pool) = (b.list as usize, b.pool as usize);
        self.lists[list].pools[pool].insert(&mut self.blocks, id);
    }

    #[inline]
    pub(crate) fn index_remove(&mut self, id: BlockId) {
        let b = &self.blocks[id];
        let (list, pool) = (b.list as usize, b.pool as usize);
        self.lists[list].pools[pool].remove(&mut self.blocks, id);
    }

    /// Listed block `id` changed size.
    #[inline(always)]
    fn index_resized(&mut self, id: BlockId) {
        let b = &self.blocks[id];
        let (list, pool) = (b.list as usize, b.pool as usize);
        self.lists[list].pools[pool].resized(&mut self.blocks, id);
    }

    /// Serve a request from the cache, if it can be.
    #[inline]
    pub(crate) fn try_alloc<D: Driver>(
        &mut self,
        core: &Core<D>,
        owner: Owner,
        rounded: u64,
        requested: u64,
        tag: Tag,
    ) -> Option<Taken> {
        let pool = rules::pool_for(rounded);
        let list = self.list_of(owner)?;
        let id = self.lists[list].pools[pool as usize].best_fit(
            &self.blocks,
            rounded,
            core.exact_fit,
        )?;
        // Both max-split rules only get stricter as blocks grow, so if the best fit may not
        // serve, no larger block may.
        if !rules::may_serve(core.max_split, self.blocks[id].size, rounded) {
            return None;
        }
        Some(self.take(core, id, rounded, requested, tag))
    }

    /// Hand out the front of listed free block `id` (a best fit, or fresh memory from growth),
    /// splitting off the tail when the split rule says so. The tail keeps the block (and its
    /// place in the index, while its size stays in its bin); the front becomes a block of its
    /// own.
    pub(crate) fn take<D: Driver>(
        &mut self,
        core: &Core<D>,
        id: BlockId,
        rounded: u64,
        requested: u64,
        tag: Tag,
    ) -> Taken {
        let b = &self.blocks[id];
        let (addr, size, pool) = (b.addr, b.size, b.pool);
        // Only the large pool's rule depends on the segment's kind.
        let virt = pool == PoolKind::Large && self.segments.get(b.segment).is_virtual();
        // A shard that holds no unsplit pool, almost every one, skips the look at the owner.
        let front = if rules::should_split(pool, virt, core.max_split, size, rounded)
            && (self.graphs.unsplit.is_empty() || !self.graphs.unsplit(self.owner_of(id)))
        {
            let cut = if planted::active(Bug::SplitOffBy512) {
                rounded - rules::MIN_BLOCK
            } else {
                rounded
            };
            let front = self.insert_before(id, addr, rounded, BlockState::Allocated);
            let tail = &mut self.blocks[id];
            tail.addr = addr + cut;
            tail.size = size - cut;
            self.index_resized(id);
            front
        } else {
            self.index_remove(id);
            id
        };
        let b = &mut self.blocks[front];
        b.state = BlockState::Allocated;
        b.requested = requested;
        b.tag = tag;
        let (ptr, size) = (b.addr, b.size);
        self.live.insert(ptr, front);
        core.ledger.shard(self.id).on_alloc(tag, size, requested);
        Taken {
            ptr: NonZeroU64::new(ptr).expect("device address 0 is never allocated"),
            size,
        }
    }

    /// Make `id` free, merged with free neighbours, and listed; returns the merged block (a
    /// neighbour that absorbs it keeps its own block and place in the index).
    #[inline(always)]
    pub(crate) fn insert_free(&mut self, id: BlockId) -> BlockId {
        let (prev, next) = (self.blocks[id].prev, self.blocks[id].next);
        let prev_free = prev != NIL && self.blocks[prev].state == BlockState::Free;
        let next_free = next != NIL
            && self.blocks[next].state == BlockState::Free
            && !planted::active(Bug::MissedMerge);
        match (prev_free, next_free) {
            (false, false) => {
                self.blocks[id].state = BlockState::Free;
                self.index_insert(id);
                id
            }
            (true, false) => {
                self.absorb_next(prev);
                self.index_resized(prev);
                prev
            }
            (false, true) => {
                self.absorb_prev(next);
                self.index_resized(next);
                next
            }
            (true, true) => {
                self.index_remove(next);
                self.absorb_next(prev);
                self.absorb_next(prev);
                self.index_resized(prev);
                prev
            }
        }
    }

    /// Merge the block after `id` into `id` (the one absorbed is not listed).
    pub(crate) fn absorb_next(&mut self, id: BlockId) {
        let next = self.blocks[id].next;
        let (size, after) = (self.blocks[next].size, self.blocks[next].next);
        self.blocks[id].size += size;
        self.blocks[id].next = after;
        if after != NIL {
            self.blocks[after].prev = id;
        }
        self.blocks.remove(next);
    }

    /// Merge the block before `id` into `id`, which grows down over it (the one absorbed is
    /// not listed).
    #[inline(always)]
    fn absorb_prev(&mut self, id: BlockId) {
        let gone = self.blocks[id].prev;
        let (addr, size, before) = (
            self.blocks[gone].addr,
            self.blocks[gone].size,
            self.blocks[gone].prev,
        );
        let b = &mut self.blocks[id];
        b.addr = addr;
        b.size += size;
        b.prev = before;
        if before != NIL {
            self.blocks[before].next = id;
        } else {
            let seg = self.blocks[id].segment;
            self.segments.get_mut(seg).first = id;
        }
        self.blocks.remove(gone);
    }

    /// A new block of `id`'s segment linked in right after `id`, with its owner and pool.
    #[inline]
    pub(crate) fn insert_after(
        &mut self,
        id: BlockId,
        addr: DevicePtr,
        size: u64,
        state: BlockState,
    ) -> BlockId {
        let next = self.blocks[id].next;
        self.link_new(id, next, id, addr, size, state)
    }

    /// A new block of `id`'s segment linked in right before `id` (the segment's first block,
    /// when `id` was), with its owner and pool.
    #[inline]
    pub(crate) fn insert_before(
        &mut self,
        id: BlockId,
        addr: DevicePtr,
        size: u64,
        state: BlockState,
    ) -> BlockId {
        let prev = self.blocks[id].prev;
        self.link_new(prev, id, id, addr, size, state)
    }

    /// A new block between neighbours `prev` and `next` (either may be [`NIL`]), in the segment,
    /// free lists and pool of block `like`.
    #[inline(always)]
    fn link_new(
        &mut self,
        prev: BlockId,
        next: BlockId,
        like: BlockId,
        addr: DevicePtr,
        size: u64,
        state: BlockState,
    ) -> BlockId {
        let b = &self.blocks[like];
        let seg = b.segment;
        let nid = self.blocks.insert(Fresh {
            addr,
            size,
            segment: seg,
            list: b.list,
            state,
            pool: b.pool,
            prev,
            next,
        });
        if prev != NIL {
            self.blocks[prev].next = nid;
        } else {
            self.segments.get_mut(seg).first = nid;
        }
        if next != NIL {
            self.blocks[next].prev = nid;
        }
        nid
    }

    /// A segment's first block, spanning all of it.
    pub(crate) fn add_segment<D: Driver>(
        &mut self,
        core: &Core<D>,
        seg: Segment,
        state: BlockState,
    ) -> (u32, BlockId) {
        let (base, size, owner, pool) = (seg.base, seg.size, seg.owner, seg.pool);
        core.places.add(base, size, self.id);
        let list = self.list_for(owner);
        let sid = self.segments.insert(seg);
        let first = self.blocks.insert(Fresh {
            addr: base,
            size,
            segment: sid,
            list,
            state,
            pool,
            prev: NIL,
            next: NIL,
        });
        self.segments.get_mut(sid).first = first;
        (sid, first)
    }

    /// Whether segment `sid` is one block, in `state`.
    pub(crate) fn wholly(&self, sid: u32, state: BlockState) -> bool {
        let b = &self.blocks[self.segments.get(sid).first];
        b.state == state && b.next == NIL
    }

    /// Forget segment `sid` and its only block (the caller gave its memory back).
    pub(crate) fn remove_segment<D: Driver>(&mut self, core: &Core<D>, sid: u32) {
        let s = self.segments.get(sid);
        let first = s.first;
        core.places.remove(s.base, s.size);
        self.blocks.remove(first);
        self.segments.remove(sid);
    }

    /// Physical memory held but not mapped (remap's spare pieces).
    pub(crate) fn spare_bytes(&self) -> u64 {
        self.spare.iter().map(|p| p.bytes).sum()
    }

    /// Number of live allocations in this shard.
    pub(crate) fn live_count(&self) -> usize {
        self.live.len()
    }

    /// The block allocated at `ptr`, if any.
    pub(crate) fn live_block(&self, ptr: DevicePtr) -> Option<BlockId> {
        self.live.get(ptr)
    }

    /// Return an allocation to the cache (or to the pending list when other streams used it).
    /// Unknown pointers are an error and change nothing.
    #[inline(always)]
    pub(crate) fn free<D: Driver>(&mut self, core: &Core<D>, ptr: DevicePtr) -> Result<()> {
        let Some(id) = self.live.remove(ptr) else {
            return Err(Error::UnknownPointer(ptr));
        };
        // Three flags tested on the cached path; the rest out of line.
        if self.asleep != 0 || self.recording || !self.blocks[id].used_streams.is_empty() {
            return self.free_slow(core, ptr, id);
        }
        let b = &self.blocks[id];
        core.ledger
            .shard(self.id)
            .on_free(b.tag, b.size, b.requested, false);
        self.insert_free(id);
        Ok(())
    }

    /// [`Shard::free`] of block `id` (out of `live`) when a tag sleeps here, the history is
    /// recorded, or other streams used the block.
    #[cold]
    fn free_slow<D: Driver>(&mut self, core: &Core<D>, ptr: DevicePtr, id: BlockId) -> Result<()> {
        if self.asleep != 0 && self.lists[self.blocks[id].list as usize].asleep {
            return self.defer_free(ptr, id);
        }
        if !self.blocks[id].used_streams.is_empty() {
            return self.free_used_elsewhere(core, ptr, id);
        }
        self.free_now(core, id);
        Ok(())
    }

    /// Return allocated block `id` (out of `live`, used by no other stream) to the cache at
    /// once: counted as freed, recorded in the history when it is, merged with free neighbours.
    pub(super) fn free_now<D: Driver>(&mut self, core: &Core<D>, id: BlockId) {
        let b = &self.blocks[id];
        core.ledger
            .shard(self.id)
            .on_free(b.tag, b.size, b.requested, false);
        if self.recording {
            self.record_free(core, id, true);
        }
        self.insert_free(id);
    }

    /// Free block `id` (out of `live`) that other streams may still be using: it is reusable
    /// once each of them has reached the point where it was freed. On a failure nothing
    /// changed: the block is live again.
    fn free_used_elsewhere<D: Driver>(
        &mut self,
        core: &Core<D>,
        ptr: DevicePtr,
        id: BlockId,
    ) -> Result<()> {
        if self.capture_underway(core, &self.blocks[id].used_streams) {
            self.hold(core, id);
            return Ok(());
        }
        let streams = std::mem::take(&mut self.blocks[id].used_streams);
        let events = match held::record_all(core, &streams) {
            Ok(events) => events,
            Err(e) => {
                self.blocks[id].used_streams = streams;
                self.live.insert(ptr, id);
                return Err(e.into());
            }
        };
        let b = &mut self.blocks[id];
        b.state = BlockState::Pending(events.len() as u32);
        core.ledger
            .shard(self.id)
            .on_free(b.tag, b.size, b.requested, true);
        self.pending
            .extend(events.into_iter().map(|e| (Some(e), id)));
        if self.recording {
            self.record_free(core, id, false);
        }
        Ok(())
    }

    /// Note that `stream` uses the allocation at `ptr`.
    pub(crate) fn record_stream(&mut self, ptr: DevicePtr, stream: StreamId) -> Result<()> {
        let id = self.live.get(ptr).ok_or(Error::UnknownPointer(ptr))?;
        let own = self.owner_of(id).stream();
        let b = &mut self.blocks[id];
        if own != Some(stream) && !b.used_streams.contains(&stream) {
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
            let Some(event) = event else {
                // Its events, once recorded, are entries of their own, polled after this one.
                if !self.record_held(core, i) {
                    i += 1;
                }
                continue;
            };
            let done = if wait {
                core.driver.wait_event(event)?;
                true
            } else {
                // A failed query keeps the block pending, which is safe: the next poll or a wait
                // settles it.
                core.driver.query_event(event).unwrap_or_else(|e| {
                    tracing::warn!(error = %e, "could not query an event; its block stays pending");
                    false
                })
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

    /// Whether `owner`'s memory is asleep.
    #[inline]
    pub(crate) fn sleeps(&self, owner: Owner) -> bool {
        self.asleep != 0 && owner.region().is_some_and(|t| self.tag_asleep(t))
    }

    pub(crate) fn tag_asleep(&self, tag: Tag) -> bool {
        self.asleep & tag_bit(tag) != 0
    }

    /// Keep the free of asleep block `id` (out of `live`) for when its tag wakes; it stays
    /// live until then. A second free of the same pointer is refused as any double free is.
    fn defer_free(&mut self, ptr: DevicePtr, id: BlockId) -> Result<()> {
        self.live.insert(ptr, id);
        if self.deferred.contains(&ptr) {
            return Err(Error::UnknownPointer(ptr));
        }
        self.deferred.push(ptr);
        Ok(())
    }

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
        let stream = self.owner_of(id).stream().unwrap_or_default();
        core.history
            .record(action, b.addr, b.requested, stream, b.tag);
    }
}
