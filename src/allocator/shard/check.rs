//! Reading a shard whole: the self-check of its tables, the copy of its state that the
//! invariant checker reads, and per-pool statistics.
//!
//! Nothing here changes the shard, and nothing here is on the allocation path: these walk
//! every block, under the shard's lock, when a test, a dump or `memory_stats` asks.

use super::{SegmentKind, Shard};
use crate::allocator::block::{BlockState, NIL};
use crate::invariants::{BlockDump, DumpState, SegmentDump, StateDump};

/// The figures `memory_stats` reports per pool, as they are now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
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

impl Shard {
    /// Add this shard's per-pool figures (small, large) to `pools`.
    pub(crate) fn pool_stats(&self, pools: &mut [PoolStats; 2]) {
        for (_, s) in self.segments.iter() {
            let p = &mut pools[s.pool as usize];
            p.segments += 1;
            p.reserved_bytes += match &s.kind {
                SegmentKind::Plain => s.size,
                SegmentKind::Virtual(v) => v
                    .mappings
                    .values()
                    .filter(|m| !m.gone())
                    .map(|m| m.bytes)
                    .sum(),
            };
            let split = self.blocks[s.first].next != NIL;
            let mut id = s.first;
            while id != NIL {
                let b = &self.blocks[id];
                match b.state {
                    BlockState::Allocated => {
                        p.allocations += 1;
                        p.allocated_bytes += b.size;
                        p.requested_bytes += b.requested;
                        p.active += 1;
                        p.active_bytes += b.size;
                    }
                    BlockState::Pending(_) => {
                        p.active += 1;
                        p.active_bytes += b.size;
                    }
                    BlockState::Free if split => {
                        p.inactive_split += 1;
                        p.inactive_split_bytes += b.size;
                    }
                    BlockState::Free | BlockState::Unmapped => {}
                }
                id = b.next;
            }
        }
    }

    /// Append a copy of this shard's segments and blocks to `out`.
    pub(crate) fn dump_into(&self, out: &mut StateDump) {
        out.spare += self.spare_bytes();
        for (_, s) in self.segments.iter() {
            let mut blocks = Vec::new();
            let mut id = s.first;
            while id != NIL {
                let b = &self.blocks[id];
                let state = match b.state {
                    BlockState::Free => DumpState::Free,
                    BlockState::Allocated => DumpState::Allocated,
                    BlockState::Pending(_) => DumpState::Pending,
                    BlockState::Unmapped => DumpState::Unmapped,
                };
                blocks.push(BlockDump {
                    addr: b.addr,
                    size: b.size,
                    requested: b.requested,
                    state,
                    tag: b.tag,
                });
                id = b.next;
            }
            let (mapped, asleep) = match &s.kind {
                SegmentKind::Plain => (vec![(s.base, s.size)], Vec::new()),
                SegmentKind::Virtual(v) => v
                    .mappings
                    .iter()
                    .map(|(&va, m)| (va, m.bytes))
                    .partition(|(va, _)| !v.mappings[va].gone()),
            };
            out.segments.push(SegmentDump {
                base: s.base,
                pool: s.pool,
                size: s.size,
                expandable: s.is_virtual(),
                mapped,
                asleep,
                blocks,
            });
        }
    }

    /// Walk this shard's structures and report any internal inconsistency.
    pub(crate) fn self_check(&self, problems: &mut Vec<String>) {
        let mut free_seen = 0usize;
        let mut live_seen = 0usize;
        let mut pending_events = 0usize;
        for (i, s) in self.segments.iter() {
            // Remap's small pool maps pages of one granule, never a large pool's piece.
            if let (SegmentKind::Virtual(v), crate::allocator::rules::PoolKind::Small) =
                (&s.kind, s.pool)
            {
                for (va, m) in &v.mappings {
                    if m.pooled && m.bytes != v.unit {
                        problems.push(format!(
                            "segment {i}: the small pool maps a piece of {} bytes at {va:#x}",
                            m.bytes
                        ));
                    }
                }
            }
            let mut id = s.first;
            let mut prev = NIL;
            while id != NIL {
                let b = &self.blocks[id];
                if b.prev != prev {
                    problems.push(format!("segment {i}: block {id} has a wrong back link"));
                }
                if b.segment != i {
                    problems.push(format!(
                        "block {id} claims segment {} but is in {i}",
                        b.segment
                    ));
                }
                match b.state {
                    BlockState::Free => {
                        free_seen += 1;
                        let listed = self
                            .index
                            .iter()
                            .chain(&self.detached)
                            .find(|p| p.stream == b.stream)
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
                            problems.push(format!(
                                "pending block at {:#x} waits for {n} events but {listed} are listed",
                                b.addr
                            ));
                        }
                    }
                    BlockState::Unmapped => match &s.kind {
                        SegmentKind::Virtual(v) if v.unmapped.contains(&(b.addr, id)) => {}
                        SegmentKind::Virtual(_) => problems.push(format!(
                            "unmapped block at {:#x} is not in the unmapped set",
                            b.addr
                        )),
                        SegmentKind::Plain => {
                            problems.push("a plain segment has an unmapped block".into())
                        }
                    },
                }
                prev = id;
                id = b.next;
            }
        }
        let mut indexed = 0;
        for p in self.index.iter().chain(&self.detached) {
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
