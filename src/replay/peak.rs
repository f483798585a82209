//! Where a replay's memory stood at its peak: of the bytes reserved when the reserved peak was
//! reached, which were live, which were rounding, and which were free but could not serve the
//! allocation that grew (free beside live blocks, free on other streams' segments, or free on
//! the growing stream's own but of no use to it).
//!
//! Invariant: the parts partition what the allocator held at that moment, computed from its
//! blocks and mappings alone: requested + rounding + pending + free pinned + free on other
//! streams + free on the growing stream + spare = reserved (the ledger's figure, kept apart:
//! `tests/replay.rs` checks the two agree).

use serde::Serialize;

use crate::allocator::dump::{DumpState, SegmentDump, StateDump};

/// The parts of the reserved bytes at the replay's peak.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PeakBreakdown {
    /// The event after which reserved bytes first reached their peak, and the stream of its
    /// allocation (the one that grew).
    pub event: usize,
    pub stream: u64,
    /// What the ledger says was reserved then.
    pub reserved: u64,
    /// Bytes live blocks asked for, and what their blocks hold beyond that (size rounding,
    /// unsplit tails).
    pub requested: u64,
    pub rounding: u64,
    /// Freed blocks still waiting for other streams' work.
    pub pending: u64,
    /// Free, in memory that also holds a live or pending block (a plain segment, or a mapped
    /// page or piece): it cannot be given back while that block lives.
    pub free_pinned: u64,
    /// Free, in wholly free memory of other streams' segments (or graph pools'): giving it back
    /// or moving it would have served the growth.
    pub free_other_streams: u64,
    /// Free, in wholly free memory of the growing stream's own segments: of the wrong pool or
    /// too small for the request.
    pub free_same_stream: u64,
    /// Physical memory held but not mapped (remap's spare pieces).
    pub spare: u64,
}

impl PeakBreakdown {
    /// The parts' sum, which equals `reserved` when the allocator's records agree with its
    /// ledger.
    pub fn total(&self) -> u64 {
        self.requested
            + self.rounding
            + self.pending
            + self.free_pinned
            + self.free_other_streams
            + self.free_same_stream
            + self.spare
    }
}

/// The breakdown of dump `d`, taken right after event `event` (an allocation on `stream`).
pub fn of_dump(d: &StateDump, event: usize, stream: u64) -> PeakBreakdown {
    let mut b = PeakBreakdown {
        event,
        stream,
        reserved: d.ledger.reserved_bytes.current,
        spare: d.spare,
        ..Default::default()
    };
    for seg in &d.segments {
        add_segment(&mut b, seg, seg.stream == Some(stream));
    }
    b
}

/// Add `seg`'s blocks: live and pending ones by their state, free ones by the mapping they lie
/// in (a mapping holding any live or pending byte pins the free bytes beside it).
fn add_segment(b: &mut PeakBreakdown, seg: &SegmentDump, own: bool) {
    for blk in &seg.blocks {
        match blk.state {
            DumpState::Allocated => {
                b.requested += blk.requested;
                b.rounding += blk.size - blk.requested.min(blk.size);
            }
            DumpState::Pending => b.pending += blk.size,
            DumpState::Free | DumpState::Unmapped => {}
        }
    }
    // Blocks and mappings are both in address order: one pass over each.
    let mut first = 0;
    for &(start, len) in &seg.mapped {
        let end = start + len;
        while first < seg.blocks.len() && seg.blocks[first].addr + seg.blocks[first].size <= start {
            first += 1;
        }
        let mut free = 0;
        let mut pinned = false;
        for blk in seg.blocks[first..].iter().take_while(|b| b.addr < end) {
            let overlap = (blk.addr + blk.size).min(end) - blk.addr.max(start);
            match blk.state {
                DumpState::Free => free += overlap,
                DumpState::Allocated | DumpState::Pending => pinned = true,
                DumpState::Unmapped => {}
            }
        }
        if pinned {
            b.free_pinned += free;
        } else if own {
            b.free_same_stream += free;
        } else {
            b.free_other_streams += free;
        }
    }
}
