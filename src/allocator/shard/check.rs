//! Reading a shard whole: the self-check of its tables, the copy of its state that the
//! invariant checker reads, and per-pool statistics.
//!
//! Nothing here changes the shard, and nothing here is on the allocation path: these walk
//! every block, under the shard's lock, when a test, a dump or `memory_stats` asks.

use super::Shard;
use crate::allocator::block::{BlockState, NIL};
use crate::allocator::dump::{BlockDump, DumpState, PoolStats, SegmentDump, StateDump};
use crate::allocator::rules::PoolKind;
use crate::allocator::segment::SegmentKind;

impl Shard {
    /// Add this shard's per-pool figures (small, large) to `pools`.
    pub(crate) fn pool_stats(&self, pools: &mut [PoolStats; 2]) {
        for (_, s) in self.segments.iter() {
            let p = &mut pools[s.pool as usize];
            p.segments += 1;
            p.reserved_bytes += s.backed_bytes();
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
        out.free_list_slots += self.lists.iter().filter(|l| !l.owner.is_vacant()).count();
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
                SegmentKind::Plain | SegmentKind::External(_) => {
                    (vec![(s.base, s.size)], Vec::new())
                }
                SegmentKind::Virtual(v) => v
                    .mappings
                    .iter()
                    .map(|(&va, m)| (va, m.bytes))
                    .partition(|(va, _)| !v.mappings[va].gone()),
            };
            out.segments.push(SegmentDump {
                base: s.base,
                pool: s.pool,
                stream: s.owner.stream().map(|st| st.0),
                region: s.owner.region(),
                size: s.size,
                expandable: s.is_virtual(),
                external: matches!(s.kind, SegmentKind::External(_)),
                mapped,
                asleep,
                blocks,
                // Named by the allocator, which knows the pools (`Allocator::dump`).
                graph_pool: None,
                pool_key: s.owner.pool(),
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
            if let (SegmentKind::Virtual(v), PoolKind::Small) = (&s.kind, s.pool) {
                for (va, m) in &v.mappings {
                    if m.pooled && m.bytes != v.unit {
                        problems.push(format!(
                            "segment {i}: the small pool maps a piece of {} bytes at {va:#x}",
                            m.bytes
                        ));
                    }
                }
            }
            // A pool whose blocks are never split has one block in each segment.
            if self.graphs.unsplit(s.owner) && self.blocks[s.first].next != NIL {
                problems.push(format!(
                    "segment {i} of an unsplit pool holds more than one block"
                ));
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
                if self.lists.get(b.list as usize).map(|l| l.owner) != Some(s.owner) {
                    problems.push(format!(
                        "block at {:#x} names free lists of another owner than its segment's",
                        b.addr
                    ));
                }
                match b.state {
                    BlockState::Free => {
                        free_seen += 1;
                        let listed = self
                            .lists
                            .get(b.list as usize)
                            .is_some_and(|l| l.pools[b.pool as usize].contains(&self.blocks, id));
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
                        if self.live.get(b.addr) != Some(id) {
                            problems.push(format!(
                                "allocated block at {:#x} is not in the live map",
                                b.addr
                            ));
                        }
                    }
                    BlockState::Pending(n) => {
                        pending_events += n as usize;
                        let held = self
                            .pending
                            .iter()
                            .filter(|(e, p)| *p == id && e.is_none())
                            .count();
                        if held > 1 || (held == 1 && (n != 1 || b.used_streams.is_empty())) {
                            problems.push(format!(
                                "pending block at {:#x} is held {held} times for a capture's end, waiting for {n} entries",
                                b.addr
                            ));
                        }
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
                        SegmentKind::Plain | SegmentKind::External(_) => {
                            problems.push("a plain segment has an unmapped block".into())
                        }
                    },
                }
                prev = id;
                id = b.next;
            }
        }
        let mut indexed = 0;
        for (slot, l) in self.lists.iter().enumerate() {
            if l.asleep != self.sleeps(l.owner) {
                problems.push(format!(
                    "the free lists of {:?} are marked {} but the tag is not",
                    l.owner,
                    if l.asleep { "asleep" } else { "awake" }
                ));
            }
            for (k, idx) in l.pools.iter().enumerate() {
                indexed += idx.len();
                if !idx.bitmap_agrees() {
                    problems.push(format!(
                        "the free index of {:?} has a bitmap that does not match its bins",
                        l.owner
                    ));
                }
                let listed = idx.listed(&self.blocks);
                if listed.len() != idx.len() {
                    problems.push(format!(
                        "the free index of {:?} lists {} blocks but counts {}",
                        l.owner,
                        listed.len(),
                        idx.len()
                    ));
                }
                for id in listed {
                    let b = &self.blocks[id];
                    if b.state != BlockState::Free
                        || b.list as usize != slot
                        || b.pool as usize != k
                    {
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

    /// Bytes held for graph pools in this shard, and bytes of them handed out.
    pub(crate) fn graph_bytes(&self) -> (u64, u64) {
        let (mut reserved, mut allocated) = (0, 0);
        for (_, s) in self.segments.iter().filter(|(_, s)| s.owner.is_pool()) {
            reserved += s.backed_bytes();
            let mut id = s.first;
            while id != NIL {
                let b = &self.blocks[id];
                if b.state == BlockState::Allocated {
                    allocated += b.size;
                }
                id = b.next;
            }
        }
        (reserved, allocated)
    }
}
