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
    /// Links of the free list of the block's bin (meaningful only while `Free`).
    pub free_prev: BlockId,
    pub free_next: BlockId,
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

impl Block {
    /// A block with no neighbours, no tag and no other streams.
    pub fn new(
        addr: DevicePtr,
        size: u64,
        segment: u32,
        list: u32,
        state: BlockState,
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
            list,
            state,
            tag: Tag::Untracked,
            pool,
            used_streams: Vec::new(),
        }
    }

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
    pub fn insert(&mut self, block: Block) -> BlockId {
        match self.vacant.pop() {
            Some(id) => {
                self.blocks[id as usize] = block;
                id
            }
            None => {
                self.blocks.push(block);
                (self.blocks.len() - 1) as BlockId
            }
        }
    }

    /// Forget a block; its id may be reused by the next insert.
    pub fn remove(&mut self, id: BlockId) {
        self.blocks[id as usize].used_streams = Vec::new();
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
