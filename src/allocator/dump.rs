//! Copies of the allocator's state, for readers outside the allocation path: the dump the
//! invariant checker reads (`crate::invariants`) and the snapshot writer writes, and the
//! per-pool figures `memory_stats` reports. Plain values: nothing here refers back to the
//! allocator's tables.

use serde::Serialize;

use super::owner::PoolKey;
use super::rules::PoolKind;
use crate::ledger::Snapshot;
use crate::tag::Tag;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DumpState {
    Free,
    Allocated,
    Pending,
    Unmapped,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct BlockDump {
    pub addr: u64,
    pub size: u64,
    pub requested: u64,
    pub state: DumpState,
    pub tag: Tag,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SegmentDump {
    pub base: u64,
    pub pool: PoolKind,
    /// The stream whose free lists hold its free blocks (none for a graph pool's segment), and
    /// the tag whose region of that stream it is, when tags are kept apart.
    pub stream: Option<u64>,
    pub region: Option<Tag>,
    pub size: u64,
    pub expandable: bool,
    /// Whether the segment came from its pool's own allocator (not from the driver).
    pub external: bool,
    /// Mapped ranges, `(addr, len)`; the whole segment for a plain one.
    pub mapped: Vec<(u64, u64)>,
    /// Ranges of an asleep tag whose memory was given back (`(addr, len)`): its allocations
    /// stay there, with nothing mapped behind them until it wakes.
    pub asleep: Vec<(u64, u64)>,
    pub blocks: Vec<BlockDump>,
    /// The CUDA graph pool whose segment this is, as the host named it
    /// (`Allocator::begin_graph_pool`), also once no graph references it while its allocated
    /// blocks keep the segment.
    pub graph_pool: Option<(u64, u64)>,
    #[serde(skip)]
    pub(crate) pool_key: Option<PoolKey>,
}

/// A copy of an allocator's state.
#[derive(Clone, Debug, Default, Serialize)]
pub struct StateDump {
    pub segments: Vec<SegmentDump>,
    pub ledger: Snapshot,
    /// Bytes committed against the limit.
    pub committed: u64,
    /// Physical memory held but not mapped (remap mode's spare memory).
    pub spare: u64,
    /// What the driver says the allocator holds, when the caller knows it (the simulated
    /// driver does).
    pub driver_held: Option<u64>,
    /// Internal inconsistencies found while dumping.
    pub problems: Vec<String>,
    /// Free-list slots in use over every shard (one per owner that holds memory in a shard).
    pub free_list_slots: usize,
}

/// The figures `memory_stats` reports per pool, as they are now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PoolStats {
    pub allocations: u64,
    pub allocated_bytes: u64,
    pub requested_bytes: u64,
    /// Allocated blocks plus freed blocks still waiting for another stream.
    pub active: u64,
    pub active_bytes: u64,
    /// Free blocks in segments that are split (not wholly free).
    pub inactive_split: u64,
    pub inactive_split_bytes: u64,
    pub segments: u64,
    /// Bytes mapped (virtual segments) or allocated (plain segments).
    pub reserved_bytes: u64,
}

impl PoolStats {
    pub(crate) fn add(&mut self, o: &PoolStats) {
        self.allocations += o.allocations;
        self.allocated_bytes += o.allocated_bytes;
        self.requested_bytes += o.requested_bytes;
        self.active += o.active;
        self.active_bytes += o.active_bytes;
        self.inactive_split += o.inactive_split;
        self.inactive_split_bytes += o.inactive_split_bytes;
        self.segments += o.segments;
        self.reserved_bytes += o.reserved_bytes;
    }
}
