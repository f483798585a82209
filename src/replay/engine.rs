//! The replay engine: feeds a trace's allocations and frees through an [`Allocator`] on a
//! [`SimDriver`] and measures what it reserves against what is live.
//!
//! Invariant: "live" is measured on the trace itself (sum of the sizes of blocks allocated and
//! not yet freed, as PyTorch recorded them), so every mode is compared against the same
//! denominator; PyTorch's own reserved bytes come from the trace's segment events.

use std::collections::HashMap;
use std::time::Instant;

use serde::Serialize;

use super::trace::{Action, Trace};
use crate::driver::counting::DriverCalls;
use crate::driver::sim::{SimConfig, SimDriver};
use crate::driver::{DriverCall, StreamId};
use crate::ledger::PerTag;
use crate::tag::Tag;
use crate::{Allocator, Config, Error, SegmentMode};

#[derive(Clone, Debug)]
pub struct ReplayOptions {
    pub mode: SegmentMode,
    /// Simulated device memory (default: an H200's 139.8 GiB).
    pub capacity: u64,
    /// Timeline points to keep (for the picture); 0 for none.
    pub timeline_points: usize,
    /// Remap mode's largest mapped piece (default [`crate::allocator::DEFAULT_REMAP_PIECE`]).
    pub remap_piece: Option<u64>,
    /// Give the cache back to the driver at the end (default `true`). What the trace left live
    /// is freed either way; with `false` the freed blocks stay cached, so that the next replay
    /// on the same allocator starts warm (a soak: passes back to back, nothing reset between
    /// them) and `held_after` is what the warm cache holds.
    pub release_at_end: bool,
}

/// An H200's memory as `cuMemGetInfo` reports it.
pub const H200_CAPACITY: u64 = 143_771_287_552;

impl Default for ReplayOptions {
    fn default() -> Self {
        ReplayOptions {
            mode: SegmentMode::Native,
            capacity: H200_CAPACITY,
            timeline_points: 1000,
            remap_piece: None,
            release_at_end: true,
        }
    }
}

/// One sample of the timeline.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Point {
    pub event: usize,
    pub live: PerTag<u64>,
    pub reserved: u64,
    pub torch_reserved: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct ReplayResult {
    pub mode: SegmentMode,
    pub events: usize,
    pub allocations: u64,
    pub frees: u64,
    /// Frees of addresses the trace never allocated (it started mid-run).
    pub unmatched_frees: u64,
    pub peak_live: u64,
    pub peak_reserved: u64,
    pub fragmentation_ratio: f64,
    pub torch_peak_reserved: u64,
    pub torch_fragmentation_ratio: f64,
    /// Every driver call our allocator made, by name.
    pub driver_calls: DriverCalls,
    /// The driver calls PyTorch's recorded segment events imply: a `cuMemAlloc` or `cuMemFree`
    /// per segment event; for an expandable trace a `cuMemCreate`, `cuMemMap` and
    /// `cuMemSetAccess` per mapped page and a `cuMemUnmap` and `cuMemRelease` per unmapped one.
    pub torch_driver_calls: DriverCalls,
    pub ooms: u64,
    pub per_tag: PerTag<TagPeak>,
    pub unknown_tags: std::collections::BTreeMap<String, u64>,
    pub seconds: f64,
    pub events_per_second: f64,
    /// Bytes the simulated driver still held for the allocator after everything was freed and
    /// the cache emptied (0 unless something leaked; the warm cache with `release_at_end` off).
    pub held_after: u64,
    #[serde(skip)]
    pub timeline: Vec<Point>,
}

#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct TagPeak {
    /// Peak live bytes of this tag in the trace.
    pub peak_live: u64,
    /// Peak allocated bytes of this tag in our allocator (rounded sizes).
    pub peak_allocated: u64,
}

/// Replay `trace` on a fresh simulated device, calling `progress` with the number of events
/// done now and then.
pub fn replay(
    trace: &Trace,
    opts: &ReplayOptions,
    progress: impl FnMut(usize),
) -> Result<ReplayResult, Error> {
    let drv = SimDriver::with_config(SimConfig {
        capacity: opts.capacity,
        context_overhead: 0,
        ..Default::default()
    });
    let config = Config {
        remap_piece: opts.remap_piece,
        ..Config::with_mode(opts.mode)
    };
    let alloc = Allocator::new(drv, config)?;
    replay_on(&alloc, trace, opts, progress)
}

/// Replay `trace` through an existing allocator (whose mode is the caller's business; `opts`
/// only names it in the result). At the end everything the trace left live is freed and, unless
/// `opts.release_at_end` is false, the cache emptied; `held_after` says what the driver still
/// holds.
pub fn replay_on(
    alloc: &Allocator<SimDriver>,
    trace: &Trace,
    opts: &ReplayOptions,
    mut progress: impl FnMut(usize),
) -> Result<ReplayResult, Error> {
    let start = Instant::now();
    // Trace address -> (our pointer, trace size, tag).
    let mut live: HashMap<u64, (u64, u64, Tag)> = HashMap::with_capacity(4096);
    let (mut live_now, mut live_peak) = (PerTag::<u64>::default(), 0u64);
    let mut tag_peak = PerTag::<u64>::default();
    let mut live_total = 0u64;
    let (mut torch_reserved, mut torch_peak) = (0u64, 0u64);
    let mut torch = DriverCalls::default();
    let (mut allocations, mut frees, mut unmatched, mut ooms) = (0u64, 0u64, 0u64, 0u64);
    let every = if opts.timeline_points == 0 {
        usize::MAX
    } else {
        trace.events.len().div_ceil(opts.timeline_points).max(1)
    };
    let mut timeline = Vec::with_capacity(opts.timeline_points + 1);
    let mut window = (0usize, 0u64, PerTag::<u64>::default());
    for (i, e) in trace.events.iter().enumerate() {
        match e.action {
            Action::Alloc => match alloc.allocate_tagged(e.size, StreamId(e.stream), e.tag) {
                Ok(a) => {
                    allocations += 1;
                    if let Some((old, ..)) = live.insert(e.addr, (a.ptr, e.size, e.tag)) {
                        // The trace reused an address we think is live: keep ours consistent.
                        alloc.free(old)?;
                    }
                    live_now[e.tag] += e.size;
                    live_total += e.size;
                    live_peak = live_peak.max(live_total);
                    tag_peak[e.tag] = tag_peak[e.tag].max(live_now[e.tag]);
                }
                Err(Error::OutOfMemory(_)) => ooms += 1,
                Err(err) => return Err(err),
            },
            Action::FreeRequested => match live.remove(&e.addr) {
                Some((ptr, size, tag)) => {
                    alloc.free_on(ptr, StreamId(e.stream))?;
                    frees += 1;
                    live_now[tag] -= size;
                    live_total -= size;
                }
                None => unmatched += 1,
            },
            Action::SegmentAlloc | Action::SegmentMap => {
                torch_reserved += e.size;
                torch_peak = torch_peak.max(torch_reserved);
                if e.action == Action::SegmentAlloc {
                    torch.add(DriverCall::AllocSegment, 1);
                } else {
                    // PyTorch's expandable segments create one handle per mapped page.
                    for call in [
                        DriverCall::CreatePhysical,
                        DriverCall::Map,
                        DriverCall::SetAccess,
                    ] {
                        torch.add(call, 1);
                    }
                }
            }
            Action::SegmentFree | Action::SegmentUnmap => {
                torch_reserved = torch_reserved.saturating_sub(e.size);
                if e.action == Action::SegmentFree {
                    torch.add(DriverCall::FreeSegment, 1);
                } else {
                    torch.add(DriverCall::Unmap, 1);
                    torch.add(DriverCall::ReleasePhysical, 1);
                }
            }
            Action::FreeCompleted | Action::Oom => {}
        }
        // Each timeline point is the moment of most live memory in its window, so that
        // short spikes (and the peak) show in the picture.
        if live_total >= window.1 {
            window = (i, live_total, live_now);
        }
        if (i + 1) % every == 0 {
            let (event, _, live) = window;
            timeline.push(Point {
                event,
                live,
                reserved: alloc.ledger().reserved(),
                torch_reserved,
            });
            window = (i + 1, 0, live_now);
        }
        if i % 65536 == 0 {
            progress(i);
        }
    }
    timeline.push(Point {
        event: trace.events.len(),
        live: live_now,
        reserved: alloc.ledger().reserved(),
        torch_reserved,
    });
    let seconds = start.elapsed().as_secs_f64();
    let snap = alloc.snapshot();
    let ratio = |r: u64| {
        if live_peak == 0 {
            0.0
        } else {
            r as f64 / live_peak as f64
        }
    };
    // Leave nothing live: free what the trace left live, and give the cache back unless the
    // caller keeps it warm for another replay.
    for (ptr, ..) in live.into_values() {
        alloc.free(ptr)?;
    }
    if opts.release_at_end {
        alloc.empty_cache()?;
    }
    let held_after = alloc.driver().held_bytes();
    Ok(ReplayResult {
        mode: opts.mode,
        events: trace.events.len(),
        allocations,
        frees,
        unmatched_frees: unmatched,
        peak_live: live_peak,
        peak_reserved: snap.reserved_bytes.peak,
        fragmentation_ratio: ratio(snap.reserved_bytes.peak),
        torch_peak_reserved: torch_peak,
        torch_fragmentation_ratio: ratio(torch_peak),
        driver_calls: snap.driver_calls,
        torch_driver_calls: torch,
        ooms,
        per_tag: PerTag(std::array::from_fn(|i| TagPeak {
            peak_live: tag_peak.0[i],
            peak_allocated: snap.per_tag.0[i].allocated_bytes.peak,
        })),
        unknown_tags: trace.unknown_tags.clone(),
        seconds,
        held_after,
        events_per_second: trace.events.len() as f64 / seconds.max(1e-9),
        timeline,
    })
}
