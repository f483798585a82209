//! What the model's shadow expects of the allocator's policy, written out from PyTorch's
//! documented behaviour and remap's own rules (never taken from the allocator): the bytes a
//! request is handed, when a request was served by a fresh segment, which cached block it must
//! take, and when an out-of-memory answer is owed.

use proptest::prelude::*;
use vram_ledger::allocator::dump::{DumpState, SegmentDump, StateDump};
use vram_ledger::driver::sim::{SimDevice, SimDriver};
use vram_ledger::driver::{DriverCall, StreamId};
use vram_ledger::units::MIB;
use vram_ledger::Allocator;

use super::common::fresh_segment;

/// The sizing rules the shadow expects, written out here from PyTorch's documented behaviour
/// (not taken from the allocator): a request is rounded up to a multiple of 512 B (at least
/// 512 B); the small pool serves rounded sizes up to 1 MiB; a block larger than the request is
/// split, leaving its tail free, when the tail is at least 512 B in the small pool and in the
/// virtual-memory modes, and when it is more than 1 MiB in the large pool of plain segments;
/// with `max_split_size`, a block serving an oversize request (at least that size) is never
/// split, and is less than 20 MiB larger than the request. Remap mode (vram-ledger's own)
/// hands a large request a whole number of 2 MiB granules when that adds at most a 64th and
/// does not take a request under `max_split_size` to it or over.
#[derive(Clone, Copy, Debug)]
pub struct Rules {
    /// Expandable, compact and remap modes.
    pub virtual_memory: bool,
    pub remap: bool,
    pub max_split: u64,
}

impl Rules {
    pub fn round(size: u64) -> u64 {
        if size == 0 {
            0
        } else {
            size.max(512).div_ceil(512) * 512
        }
    }

    /// The least and most bytes handed out for a request rounded to `rounded`; `fresh` when it
    /// is known to be served by a fresh plain segment (then the figure is exact).
    pub fn handed_out(&self, rounded: u64, fresh: bool) -> (u64, u64) {
        // Every block size is a multiple of 512 B, so a tail that is split whenever it is at
        // least 512 B leaves exactly the rounded size.
        if self.remap && rounded > MIB {
            let granules = rounded.div_ceil(2 * MIB) * 2 * MIB;
            let crosses = rounded < self.max_split && granules >= self.max_split;
            let size = if (granules - rounded) * 64 <= rounded && !crosses {
                granules
            } else {
                rounded
            };
            return (size, size);
        }
        if rounded == 0 || self.virtual_memory || rounded <= MIB {
            return (rounded, rounded);
        }
        let oversize = rounded >= self.max_split;
        if fresh {
            let seg = fresh_segment(rounded);
            let split = !oversize && seg - rounded > MIB;
            let size = if split { rounded } else { seg };
            (size, size)
        } else if oversize {
            (rounded, rounded + 20 * MIB - 512)
        } else {
            (rounded, rounded + MIB)
        }
    }
}

/// What the simulated driver says about plain segments, to tell when a request was served by a
/// fresh segment of its own.
#[derive(Clone, Copy)]
pub struct SegmentCalls {
    allocs: u64,
    frees: u64,
    held: u64,
}

impl SegmentCalls {
    pub fn now(a: &Allocator<SimDriver>) -> Self {
        let d = a.driver();
        SegmentCalls {
            allocs: d.calls(DriverCall::AllocSegment),
            frees: d.calls(DriverCall::FreeSegment),
            held: d.held_bytes(),
        }
    }

    /// The bytes of the one segment obtained since `before`, when exactly one was obtained and
    /// none freed (a failed call obtains nothing, and a request that grows takes the front of
    /// the new segment).
    pub fn fresh_segment(before: Self, after: Self) -> Option<u64> {
        (after.allocs == before.allocs + 1
            && after.frees == before.frees
            && after.held > before.held)
            .then(|| after.held - before.held)
    }
}

/// A request served from the cache takes the best fit among the blocks free before it in its
/// stream's list and pool: PyTorch's rule, the smallest block that fits, within the 1/32 the
/// free index may loosen it by in a crowded bin; with `max_split_size`, a block of that size
/// or more serves only requests of that size or more, and only those less than 20 MiB
/// smaller than it. `least` is the size the request needs (rounded as the rules say).
pub fn check_best_fit(
    before: &StateDump,
    ptr: u64,
    least: u64,
    rules: &Rules,
) -> Result<(), TestCaseError> {
    let all = || {
        before.segments.iter().flat_map(|s| {
            let blocks = s.blocks.iter().filter(|b| b.state == DumpState::Free);
            blocks.map(move |b| (s, b))
        })
    };
    let Some((seg, chosen)) = all().find(|(_, b)| b.addr == ptr) else {
        // Not free before: a block whose free completed during the call.
        return Ok(());
    };
    let may_serve = |size: u64| {
        size >= least
            && if least < rules.max_split {
                size < rules.max_split
            } else {
                size < least + 20 * MIB
            }
    };
    let same_list =
        |s: &SegmentDump| (s.stream, s.region, s.pool) == (seg.stream, seg.region, seg.pool);
    let best = all()
        .filter(|(s, b)| same_list(s) && may_serve(b.size))
        .map(|(_, b)| b.size)
        .min();
    if let Some(best) = best {
        prop_assert!(
            chosen.size <= best + best / 32,
            "a request of {} bytes took a free block of {} where one of {} fitted",
            least,
            chosen.size,
            best
        );
    }
    Ok(())
}

/// Whether an out-of-memory answer to a request of `rounded` bytes is owed to the device or
/// the limit: after the failure (the cache was given back before the retry), what the
/// allocator still holds plus the most a growth for the request maps does not fit under the
/// limit or in what the device has free.
pub fn out_of_memory_is_owed(
    a: &Allocator<SimDriver>,
    dev: &SimDevice,
    capacity: u64,
    rounded: u64,
    virtual_memory: bool,
) -> bool {
    let growth = if virtual_memory {
        // An expandable page is 20 MiB; remap maps whole pieces of up to 68 MiB.
        rounded + 70 * MIB
    } else {
        fresh_segment(rounded)
    };
    let held = a.snapshot().reserved_bytes.current;
    let over_limit = a.limit().is_some_and(|l| held + growth > l);
    over_limit || dev.used() + growth > capacity
}

/// A block just handed out on `stream` is used there: no other stream's unfinished work may
/// still use any of it (work queued earlier on `stream` itself runs first, in stream order).
pub fn use_new_block(
    dev: &SimDevice,
    ptr: u64,
    size: u64,
    stream: StreamId,
) -> Result<(), TestCaseError> {
    let users = dev.unfinished_users(ptr, size, stream);
    prop_assert!(
        users.is_empty(),
        "{:#x}+{} handed to {:?} while {:?} still used it",
        ptr,
        size,
        stream,
        users
    );
    dev.submit_touching(stream, ptr, size);
    Ok(())
}

/// Nothing was unmapped while work that used it had not finished.
pub fn no_unsafe_unmap(dev: &SimDevice) -> Result<(), TestCaseError> {
    let bad = dev.unsafe_unmaps();
    prop_assert!(bad.is_empty(), "{}", bad.join("; "));
    Ok(())
}
