//! Blocks and the arena that stores them.
//!
//! Invariants:
//! - Within a segment, blocks form a doubly linked list in address order that tiles the
//!   segment exactly: the first starts at the segment base, each next starts where its
//!   predecessor ends, the last ends at the segment end.
//! - Two neighbours are never both `Free` (they are merged), nor both `Unmapped`.
//! - A block's `list` is the slot of its owner's free lists in its shard: every block of a
//!   segment has the segment's owner, so neighbours share it.
//! - Block ids are arena indices; a freed id is recycled, so the arena stops growing once a
//!   workload reaches its high-water mark and the hot path allocates nothing.

use crate::allocator::rules::PoolKind;
use crate::driver::{DevicePtr, StreamId};
use crate::tag::Tag;

pub(crate) type BlockId = u32;
pub(crate) const NIL: BlockId = BlockId::MAX;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BlockState {
    /// Mapped, cached, in the free index.
    Free,
    /// Handed out to a caller.
    Allocated,
    /// Freed by its caller, waiting for this many events of other streams.
    Pending(u32),
    /// Address space of an expandable segment with no physical memory behind it.
    Unmapped,
}

#[derive(Debug)]
pub(crate) struct Block {
    pub addr: DevicePtr,
    pub size: u64,
    pub requested: u64,
    pub prev: BlockId,
    pub next: BlockId,
    /// Links of the free list of the block's bin, and the bin (meaningful only while `Free`).
    pub free_prev: BlockId,
    pub free_next: BlockId,
    pub bin: u16,
    pub segment: u32,
    /// The slot of its owner's free lists in the shard (the owner is found there).
    pub list: u32,
    pub state: BlockState,
    pub tag: Tag,
    pub pool: PoolKind,
    /// Streams other than its owner's that used the block (`record_stream`). Empty (and so not
    /// heap-allocated) for almost every block.
    pub used_streams: Vec<StreamId>,
}

/// What a new block is: everything but its tag, request and other streams, which start empty.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Fresh {
    pub addr: DevicePtr,
    pub size: u64,
    pub segment: u32,
    pub list: u32,
    pub state: BlockState,
    pub pool: PoolKind,
    pub prev: BlockId,
    pub next: BlockId,
}

impl Block {
    pub fn end(&self) -> DevicePtr {
        self.addr + self.size
    }
}

/// A free-list arena of blocks.
#[derive(Default, Debug)]
pub(crate) struct Arena {
    blocks: Vec<Block>,
    vacant: Vec<BlockId>,
}

impl Arena {
    /// A new block, in a recycled slot when there is one (written in place: the slot's empty
    /// list of other streams keeps its capacity).
    #[inline]
    pub fn insert(&mut self, f: Fresh) -> BlockId {
        let Some(id) = self.vacant.pop() else {
            self.blocks.push(Block {
                addr: f.addr,
                size: f.size,
                requested: 0,
                prev: f.prev,
                next: f.next,
                free_prev: NIL,
                free_next: NIL,
                bin: 0,
                segment: f.segment,
                list: f.list,
                state: f.state,
                tag: Tag::Untracked,
                pool: f.pool,
                used_streams: Vec::new(),
            });
            return (self.blocks.len() - 1) as BlockId;
        };
        let b = &mut self.blocks[id as usize];
        b.addr = f.addr;
        b.size = f.size;
        b.requested = 0;
        b.prev = f.prev;
        b.next = f.next;
        b.segment = f.segment;
        b.list = f.list;
        b.state = f.state;
        b.tag = Tag::Untracked;
        b.pool = f.pool;
        b.used_streams.clear();
        id
    }

    /// Forget a block; its id may be reused by the next insert.
    #[inline]
    pub fn remove(&mut self, id: BlockId) {
        self.vacant.push(id);
    }
}

impl std::ops::Index<BlockId> for Arena {
    type Output = Block;
    #[inline]
    fn index(&self, id: BlockId) -> &Block {
        &self.blocks[id as usize]
    }
}

impl std::ops::IndexMut<BlockId> for Arena {
    #[inline]
    fn index_mut(&mut self, id: BlockId) -> &mut Block {
        &mut self.blocks[id as usize]
    }
}
