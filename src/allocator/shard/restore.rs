//! A graph pool's blocks put back as a checkpoint recorded them, the shard's half (PyTorch's
//! `setCheckpointPoolState`: inductor's CUDA-graph trees record one graph, checkpoint its pool,
//! and put the pool back to that state before recording the next graph on the same memory).
//! `checkpoint.rs` holds the entry points and every shard's lock across the three steps.
//!
//! Invariants:
//! - [`Shard::restore_sync`] and [`Shard::restore_check`] change no block of the pool (the
//!   first waits for other streams' work on the pool's live blocks and settles completed
//!   pending frees); once every shard passed both, [`Shard::restore_apply`] cannot fail.
//! - Restoring frees every allocated block of the pool and cuts each recorded block back out of
//!   the free memory at its address, with its size, tag and request; free neighbours merge as
//!   any free does. Segments, mappings and reserved bytes do not change: a held pool's memory
//!   is never released or unmapped, so what was mapped at the checkpoint still is.
//! - The ledger sees one free per block freed and one allocation per block made, so its
//!   figures stay those of a walk of the blocks.

use super::{held, Shard};
use crate::allocator::block::{BlockId, BlockState, NIL};
use crate::allocator::core::Core;
use crate::allocator::history::Action;
use crate::allocator::owner::PoolKey;
use crate::driver::{DevicePtr, Driver};
use crate::error::{Error, Result};
use crate::tag::Tag;

/// One allocated block of a pool, as a checkpoint records it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CheckpointBlock {
    pub addr: DevicePtr,
    /// Bytes the block holds (the request rounded, and any remainder too small to split off).
    pub size: u64,
    /// Bytes its caller asked for.
    pub requested: u64,
    pub tag: Tag,
}

fn stale(why: String) -> Error {
    Error::StaleCheckpoint(why)
}

impl Shard {
    /// Segments of pool `key` (and of its tags' regions) in this shard.
    fn pool_segments(&self, key: PoolKey) -> Vec<u32> {
        self.segments.ids_where(|s| s.owner.pool() == Some(key))
    }

    /// The blocks of segment `sid`, in address order.
    fn segment_blocks(&self, sid: u32) -> Vec<BlockId> {
        let mut ids = Vec::new();
        let mut id = self.segments.get(sid).first;
        while id != NIL {
            ids.push(id);
            id = self.blocks[id].next;
        }
        ids
    }

    /// Append the allocated blocks of pool `key` here to `out`.
    pub(crate) fn pool_allocations(&self, key: PoolKey, out: &mut Vec<CheckpointBlock>) {
        for sid in self.pool_segments(key) {
            for id in self.segment_blocks(sid) {
                let b = &self.blocks[id];
                if b.state == BlockState::Allocated {
                    out.push(CheckpointBlock {
                        addr: b.addr,
                        size: b.size,
                        requested: b.requested,
                        tag: b.tag,
                    });
                }
            }
        }
    }

    /// The segment of pool `key` here that holds all of `b`, if one does.
    pub(crate) fn pool_segment_of(&self, key: PoolKey, b: &CheckpointBlock) -> Option<u32> {
        self.pool_segments(key).into_iter().find(|&sid| {
            let s = self.segments.get(sid);
            s.base <= b.addr && b.addr.saturating_add(b.size) <= s.base + s.size
        })
    }

    /// Make the pool's blocks settle: wait for the work other streams queued on its live
    /// blocks (they are freed at once, not through events), and wait out pending frees. No
    /// block changes but pending ones completing, which any poll may do.
    pub(crate) fn restore_sync<D: Driver>(&mut self, core: &Core<D>, key: PoolKey) -> Result<()> {
        if self.graphs.capturing() {
            return Err(Error::Capturing("restore a graph pool's checkpoint"));
        }
        let segments = self.pool_segments(key);
        let pending = segments.iter().any(|&sid| {
            self.segment_blocks(sid)
                .iter()
                .any(|&id| matches!(self.blocks[id].state, BlockState::Pending(_)))
        });
        if pending {
            self.process_pending(core, true)?;
        }
        for sid in segments {
            for id in self.segment_blocks(sid) {
                let b = &self.blocks[id];
                if b.state != BlockState::Allocated || b.used_streams.is_empty() {
                    continue;
                }
                if self.capture_underway(core, &b.used_streams) {
                    return Err(Error::Capturing("restore a graph pool's checkpoint"));
                }
                for event in held::record_all(core, &b.used_streams)? {
                    let waited = core.driver.wait_event(event);
                    if let Err(e) = core.driver.destroy_event(event) {
                        tracing::warn!(error = %e, "could not destroy a completed event");
                    }
                    waited?;
                }
            }
        }
        Ok(())
    }

    /// Whether the recorded blocks `plan` (those this shard holds, in address order, not
    /// overlapping) can be cut out of pool `key`'s memory here once its live blocks are freed.
    pub(crate) fn restore_check(&self, key: PoolKey, plan: &[CheckpointBlock]) -> Result<()> {
        for sid in self.pool_segments(key) {
            let owner = self.segments.get(sid).owner;
            if self.sleeps(owner) {
                return Err(stale(format!("{owner:?} is asleep")));
            }
            if self
                .segment_blocks(sid)
                .iter()
                .any(|&id| matches!(self.blocks[id].state, BlockState::Pending(_)))
            {
                return Err(stale("a block of the pool is still pending".to_owned()));
            }
        }
        for b in plan {
            let sid = self.pool_segment_of(key, b).ok_or_else(|| {
                stale(format!(
                    "no segment of the pool holds the block at {:#x} any more",
                    b.addr
                ))
            })?;
            let end = b.addr + b.size;
            for id in self.segment_blocks(sid) {
                let x = &self.blocks[id];
                let overlaps = x.addr < end && b.addr < x.addr + x.size;
                if overlaps && !matches!(x.state, BlockState::Free | BlockState::Allocated) {
                    return Err(stale(format!(
                        "the block at {:#x} is not mapped memory of the pool",
                        b.addr
                    )));
                }
            }
        }
        Ok(())
    }

    /// Free every allocated block of pool `key` here (appending their addresses to `freed`)
    /// and allocate the recorded blocks `plan` in their place. Only after
    /// [`Shard::restore_sync`] and [`Shard::restore_check`] passed, under the same lock.
    pub(crate) fn restore_apply<D: Driver>(
        &mut self,
        core: &Core<D>,
        key: PoolKey,
        plan: &[CheckpointBlock],
        freed: &mut Vec<DevicePtr>,
    ) {
        for sid in self.pool_segments(key) {
            for id in self.segment_blocks(sid) {
                if self.blocks[id].state != BlockState::Allocated {
                    continue;
                }
                let ptr = self.blocks[id].addr;
                self.live.remove(ptr);
                // Other streams' work on it was waited for (`restore_sync`).
                self.blocks[id].used_streams.clear();
                self.free_now(core, id);
                freed.push(ptr);
            }
        }
        for b in plan {
            let sid = self
                .pool_segment_of(key, b)
                .expect("restore_check found the block's segment");
            self.cut_out(core, sid, b);
        }
    }

    /// Allocate exactly `b` out of the free block of segment `sid` that holds it.
    fn cut_out<D: Driver>(&mut self, core: &Core<D>, sid: u32, b: &CheckpointBlock) {
        let id = self
            .segment_blocks(sid)
            .into_iter()
            .find(|&id| {
                let x = &self.blocks[id];
                x.addr <= b.addr && b.addr + b.size <= x.addr + x.size
            })
            .expect("restore_check found the block's range");
        debug_assert_eq!(self.blocks[id].state, BlockState::Free);
        self.index_remove(id);
        let (addr, size) = (self.blocks[id].addr, self.blocks[id].size);
        if addr < b.addr {
            let front = self.insert_before(id, addr, b.addr - addr, BlockState::Free);
            self.index_insert(front);
        }
        let end = b.addr + b.size;
        if end < addr + size {
            let tail = self.insert_after(id, end, addr + size - end, BlockState::Free);
            self.index_insert(tail);
        }
        let x = &mut self.blocks[id];
        x.addr = b.addr;
        x.size = b.size;
        x.state = BlockState::Allocated;
        x.requested = b.requested;
        x.tag = b.tag;
        self.live.insert(b.addr, id);
        core.ledger
            .shard(self.id)
            .on_alloc(b.tag, b.size, b.requested);
        if self.recording {
            self.record_block(core, id, Action::Alloc);
        }
    }
}
