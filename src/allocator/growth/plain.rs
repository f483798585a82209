//! The native policy: one `cuMemAlloc` per segment, sized by PyTorch's rules, freed whole by
//! `empty_cache` once its only block is free. A pool with its own allocator
//! (`driver/external.rs`) grows the same way in every mode, from that allocator.
//!
//! Invariant: a plain segment is counted in the ledger's segment gauge and its bytes in
//! reserved bytes exactly while the driver (or its pool's allocator) holds it.

use crate::allocator::block::{BlockId, BlockState, NIL};
use crate::allocator::core::{Core, GrowError};
use crate::allocator::history::Action;
use crate::allocator::owner::Owner;
use crate::allocator::planted::{self, Bug};
use crate::allocator::rules;
use crate::allocator::segment::{Segment, SegmentKind};
use crate::allocator::shard::Shard;
use crate::driver::external::Source;
use crate::driver::{Driver, StreamId};
use crate::error::Result;

impl Shard {
    /// Get a segment from the driver for `owner`, for a request (made on `stream`) that the
    /// cache cannot serve; returns a free block (listed) that holds at least `rounded` bytes
    /// and may serve it.
    pub(crate) fn grow_plain<D: Driver>(
        &mut self,
        core: &Core<D>,
        owner: Owner,
        stream: StreamId,
        rounded: u64,
    ) -> std::result::Result<BlockId, GrowError> {
        let size = rules::segment_size(rounded);
        let base = core.obtain(size, true, || core.driver.alloc_segment(size, stream))?;
        Ok(self.add_plain(core, owner, base, size, rounded, SegmentKind::Plain))
    }

    /// As [`Shard::grow_plain`], from the allocator of `owner`'s pool.
    pub(crate) fn grow_external<D: Driver>(
        &mut self,
        core: &Core<D>,
        owner: Owner,
        stream: StreamId,
        rounded: u64,
        source: &Source,
    ) -> std::result::Result<BlockId, GrowError> {
        let size = rules::segment_size(rounded);
        let base = core.obtain(size, true, || source.alloc(size, stream))?;
        let kind = SegmentKind::External(source.clone());
        Ok(self.add_plain(core, owner, base, size, rounded, kind))
    }

    fn add_plain<D: Driver>(
        &mut self,
        core: &Core<D>,
        owner: Owner,
        base: u64,
        size: u64,
        rounded: u64,
        kind: SegmentKind,
    ) -> BlockId {
        core.graph_bytes(owner, size, false);
        core.record_segment(Action::SegmentAlloc, base, size, owner);
        let seg = Segment {
            base,
            size,
            owner,
            pool: rules::pool_for(rounded),
            first: NIL,
            kind,
        };
        let (_, first) = self.add_segment(core, seg, BlockState::Free);
        self.index_insert(first);
        first
    }

    /// Free segment `seg` if its only block is free.
    pub(crate) fn free_plain<D: Driver>(&mut self, core: &Core<D>, seg: u32) -> Result<()> {
        if !self.wholly(seg, BlockState::Free) {
            return Ok(());
        }
        let s = self.segments.get(seg);
        let (base, size, first, owner) = (s.base, s.size, s.first, s.owner);
        match &s.kind {
            SegmentKind::External(source) => {
                // The pool's allocator may not wait for work still using the memory, as
                // cuMemFree does; graphs that used the pool replay on streams not seen here.
                core.driver.sync_device()?;
                source.free(base, size, StreamId(0))?;
            }
            _ => core.driver.free_segment(base, size)?,
        }
        core.graph_bytes(owner, size, true);
        core.record_segment(Action::SegmentFree, base, size, owner);
        self.index_remove(first);
        self.remove_segment(core, seg);
        core.ledger
            .on_unreserve(size, !planted::active(Bug::SegmentCount));
        core.uncommit(size);
        Ok(())
    }
}
