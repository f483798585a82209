//! How a shard obtains device memory and gives it back: the segment mode chosen when the
//! allocator is built becomes a [`Growth`] policy here, once, and everything mode-specific
//! lives in the policy's own file:
//!
//! - `plain.rs`: native, one `cuMemAlloc` per segment (PyTorch's default rules);
//! - `expandable.rs`: one reservation per (owner, pool), pages mapped on demand;
//! - `compact.rs`: one mapping per growth, sized to the request, free memory moved first;
//! - `remap.rs` with `spare.rs`: physical pieces mapped whole and remapped where needed;
//! - `mapped.rs`: what the three virtual-memory policies share (reservations, mapping,
//!   unmapped ranges, giving free mappings back); `moves.rs`: taking free memory from other
//!   shards; `later.rs`: a moved piece's old mapping unmapped once its stream's work is done;
//!   `sleep.rs`: a tag's memory given back and made again at the same addresses.
//!
//! The cached path, the shard's tables and the ledger know nothing of modes; the cached path
//! asks the policy one thing, how a request is rounded ([`Growth::round`], an enum match).
//!
//! Invariant: giving memory back ([`Shard::release_cached`]) follows each segment's kind (a
//! plain segment, or mappings that remember whether their handle is a spare piece), so it is
//! right whatever policy made the memory.

mod compact;
mod expandable;
pub(crate) mod later;
pub(crate) mod mapped;
mod moves;
mod plain;
mod remap;
pub(crate) mod sleep;
mod spare;

pub(crate) use self::compact::Compact;
pub(crate) use self::mapped::SyncFirst;
pub(crate) use self::remap::Remap;
use super::block::BlockId;
use super::config::{Config, SegmentMode};
use super::core::{Core, GrowError};
use super::owner::{Owner, PoolKey};
use super::rules;
use super::shard::{Shard, Shards};
use crate::driver::{Driver, StreamId};
use crate::error::{Error, Result};

/// The segment mode, as the policy that grows and rounds.
#[derive(Debug)]
pub(crate) enum Growth {
    Plain,
    Expandable,
    Compact(Compact),
    Remap(Remap),
}

impl Growth {
    pub(crate) fn new(config: &Config, granularity: u64, max_split: u64) -> Growth {
        match config.mode {
            SegmentMode::Native => Growth::Plain,
            SegmentMode::Expandable => Growth::Expandable,
            SegmentMode::Compact => Growth::Compact(Compact {
                across_streams: config.move_across_streams,
            }),
            SegmentMode::Remap => Growth::Remap(Remap::new(config, granularity, max_split)),
        }
    }

    pub(crate) fn mode(&self) -> SegmentMode {
        match self {
            Growth::Plain => SegmentMode::Native,
            Growth::Expandable => SegmentMode::Expandable,
            Growth::Compact(_) => SegmentMode::Compact,
            Growth::Remap(_) => SegmentMode::Remap,
        }
    }

    /// Whether segments are virtual reservations with physical memory mapped on demand.
    pub(crate) fn is_virtual(&self) -> bool {
        !matches!(self, Growth::Plain)
    }

    /// The block size for a request of `size` bytes.
    #[inline]
    pub(crate) fn round(&self, size: u64) -> u64 {
        match self {
            Growth::Remap(r) => r.round(size),
            _ => rules::round_size(size),
        }
    }

    /// The new device memory a request of `rounded` bytes needs when nothing is cached (for the
    /// out-of-memory report).
    pub(crate) fn needed(&self, rounded: u64, granularity: u64) -> u64 {
        match self {
            Growth::Plain => rules::segment_size(rounded),
            _ => rounded.div_ceil(granularity) * granularity,
        }
    }

    /// Get memory for a request its owner's cache could not serve; returns a free block
    /// (listed) that holds it and may serve it. `shards` are every shard of the allocator (`sh`
    /// among them, held).
    pub(crate) fn grow<D: Driver>(&self, at: At<'_, D>, sh: &mut Shard, r: Request) -> Grown {
        match self {
            Growth::Plain => sh.grow_plain(at.core, r.owner, r.stream, r.rounded),
            Growth::Expandable => expandable::grow(at.core, sh, r.owner, r.rounded),
            Growth::Compact(c) => c.grow(at, sh, r),
            Growth::Remap(m) => m.grow(at, sh, r),
        }
    }
}

/// Where growth runs: what the shards share, and every shard.
#[derive(Clone, Copy)]
pub(crate) struct At<'a, D> {
    pub(crate) core: &'a Core<D>,
    pub(crate) shards: &'a Shards,
}

/// A request growth serves: `rounded` bytes for `owner`, made on `stream`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Request {
    pub(crate) owner: Owner,
    pub(crate) stream: StreamId,
    pub(crate) rounded: u64,
}

/// What growth gives: a listed free block that holds the request, or why not.
pub(crate) type Grown = std::result::Result<BlockId, GrowError>;

/// Whether growth for `owner` on `stream` may move memory before it adds any: not for a graph
/// pool (it grows only during a capture) nor while `stream` captures (a capture records the
/// addresses it uses, and the synchronisation a move needs would spoil it).
fn may_move<D: Driver>(core: &Core<D>, owner: Owner, stream: StreamId) -> bool {
    !owner.is_pool() && !core.driver.is_capturing(stream)
}

impl Shard {
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
        // Moved pieces' old mappings go first: a reservation with one cannot be released, nor
        // can its piece's memory be freed while it stands.
        if let Err(e) = self.finish_retiring(core, |_| true, true) {
            first_err.get_or_insert(e.into());
        }
        for seg in self.segments.ids() {
            // A graph that may still replay writes to its pool's memory, freed or not.
            if !self.graphs.releasable(self.segments.get(seg).owner) {
                continue;
            }
            if let Err(e) = self.release_segment(core, seg, sync) {
                first_err.get_or_insert(e);
            }
        }
        if let Err(e) = self.release_spare(core) {
            first_err.get_or_insert(e);
        }
        self.vacate_retired_lists();
        first_err.map_or(Ok(()), Err)
    }

    /// Give back what is free in segment `seg`: a whole free plain segment, or a virtual
    /// segment's free mappings (and its reservation once nothing in it is mapped).
    fn release_segment<D: Driver>(
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

    /// Release the free memory of pool `key` (no graph references it any more), in each of its
    /// regions; an asleep region's is released once it wakes, by the next `empty_cache`. Blocks
    /// freed while their streams still ran are waited for first, so that a pool whose tensors
    /// were all freed gives everything back now, as PyTorch's MemPool does when it goes.
    pub(crate) fn release_pool<D: Driver>(&mut self, core: &Core<D>, key: PoolKey) -> Result<()> {
        self.process_pending(core, true)?;
        for seg in self.segments.ids_where(|s| s.owner.pool() == Some(key)) {
            self.release_segment(core, seg, SyncFirst::Owner)?;
        }
        self.vacate_retired_lists();
        Ok(())
    }
}
