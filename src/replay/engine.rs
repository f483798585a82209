//! The replay engine: feeds a trace's allocations and frees through an [`Allocator`] on a
//! [`SimDriver`] and measures what it reserves against what is live.
//!
//! Invariant: "live" is measured on the trace itself (sum of the sizes of blocks allocated and
//! not yet free, as PyTorch recorded them), so every mode is compared against the same
//! denominator; PyTorch's own reserved bytes come from the trace's segment events.
//!
//! What the trace records is what the replay does:
//! - each allocation on the stream it was recorded on;
//! - a free whose `free_completed` comes later than its `free_requested` (the block was used
//!   on other streams, `record_stream`) waits for that: the block is recorded on a stream of
//!   its own, whose work completes at `free_completed`, so no mode may reuse it earlier; the
//!   floor of the fragmentation ratio counts it as live until then (nobody can reuse it);
//! - where PyTorch released its cache (a run of `segment_free` or `segment_unmap` events:
//!   `empty_cache`, or an out-of-memory retry), the replay releases the allocator's.

use std::collections::HashMap;
use std::time::Instant;

use serde::Serialize;

use super::trace::{Action, Trace};
use crate::driver::counting::DriverCalls;
use crate::driver::sim::{SimConfig, SimDriver};
use crate::driver::{cost, DriverCall, StreamId};
use crate::ledger::PerTag;
use crate::tag::Tag;
use crate::units::MIB;
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
    /// [`Config::move_across_streams`] (default `true`: replay measures what the allocator
    /// can do with it).
    pub move_across_streams: bool,
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
            move_across_streams: true,
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
    /// Peak of the bytes live until their `free_completed`: the floor no allocator can go
    /// below (memory awaiting another stream's work cannot be reused by anyone).
    pub peak_live: u64,
    /// Peak of the bytes live until their `free_requested` (equal to `peak_live` on a
    /// single-stream trace).
    pub peak_live_requested: u64,
    /// Times the trace released PyTorch's cache, and so the replay released ours.
    pub cache_releases: u64,
    pub peak_reserved: u64,
    pub fragmentation_ratio: f64,
    pub torch_peak_reserved: u64,
    pub torch_fragmentation_ratio: f64,
    /// Every driver call our allocator made, by name.
    pub driver_calls: DriverCalls,
    /// The driver calls PyTorch's recorded segment events imply: a `cuMemAlloc` or `cuMemFree`
    /// per segment event; for an expandable trace, per mapped range a `cuMemCreate` and a
    /// `cuMemMap` per page (20 MiB, or 2 MiB for the small pool's) and one `cuMemSetAccess`, and
    /// a `cuMemUnmap` and a `cuMemRelease` per unmapped page (PyTorch's `ExpandableSegment`).
    /// Its event queries and synchronisations are not in the trace, so not here.
    pub torch_driver_calls: DriverCalls,
    /// Estimated host time of our driver calls on an H200, in seconds
    /// ([`crate::driver::cost`]).
    pub driver_seconds: f64,
    /// The same estimate for the calls in `torch_driver_calls`, with a range-wide
    /// `cuMemSetAccess` priced per page (one call over a range costs what one per page does).
    pub torch_driver_seconds: f64,
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

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct TagPeak {
    /// Peak live bytes of this tag in the trace.
    pub peak_live: u64,
    /// Peak allocated bytes of this tag in our allocator (rounded sizes).
    pub peak_allocated: u64,
}

/// Streams of the replay's own, one per free that waits for its `free_completed`: above any
/// real stream handle (user-space pointers) and below graph pool keys.
const HOLD_STREAMS: u64 = 1 << 56;

/// The page size and page count of a range PyTorch's expandable segments mapped: 20 MiB pages
/// in the large pool, 2 MiB in the small one.
fn expandable_pages(bytes: u64) -> (u64, u64) {
    let page = if bytes.is_multiple_of(20 * MIB) {
        20 * MIB
    } else {
        2 * MIB
    };
    (page, bytes.div_ceil(page))
}

/// For each event, whether it is a `free_requested` whose `free_completed` comes later: not
/// the next event of the trace with the same address.
fn delayed_frees(trace: &Trace) -> Vec<bool> {
    let ev = &trace.events;
    (0..ev.len())
        .map(|i| {
            ev[i].action == Action::FreeRequested
                && !ev
                    .get(i + 1)
                    .is_some_and(|n| n.action == Action::FreeCompleted && n.addr == ev[i].addr)
        })
        .collect()
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
        move_across_streams: opts.move_across_streams,
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
    let dev = alloc.driver().device().clone();
    let host_before = alloc.driver().estimated_host_seconds();
    let mut torch_seconds = 0.0;
    // `calls` made, priced as `priced` calls on `bytes` each.
    let mut torch_call =
        |torch: &mut DriverCalls, call: DriverCall, calls: u64, priced: u64, bytes: u64| {
            torch.add(call, calls);
            torch_seconds += priced as f64 * cost::host_seconds(call, bytes);
        };
    let delayed = delayed_frees(trace);
    // Trace address -> (our pointer, trace size, tag).
    let mut live: HashMap<u64, (u64, u64, Tag)> = HashMap::with_capacity(4096);
    // Frees requested and not yet completed: trace address -> (size, the stream of its own
    // that holds the block back, if its completion comes later).
    let mut completing: HashMap<u64, (u64, Option<StreamId>)> = HashMap::with_capacity(64);
    let (mut floor_now, mut floor_peak, mut next_hold) = (0u64, 0u64, 0u64);
    let mut cache_releases = 0u64;
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
                    floor_now += e.size;
                    floor_peak = floor_peak.max(floor_now);
                    tag_peak[e.tag] = tag_peak[e.tag].max(live_now[e.tag]);
                }
                Err(Error::OutOfMemory(_)) => ooms += 1,
                Err(err) => return Err(err),
            },
            Action::FreeRequested => match live.remove(&e.addr) {
                Some((ptr, size, tag)) => {
                    let hold = delayed[i].then(|| {
                        next_hold += 1;
                        StreamId(HOLD_STREAMS + next_hold)
                    });
                    if let Some(h) = hold {
                        // Work queued on a stream of its own, completed at free_completed.
                        alloc.record_stream(ptr, h)?;
                        dev.submit_external(h);
                    }
                    alloc.free_on(ptr, StreamId(e.stream))?;
                    completing.insert(e.addr, (size, hold));
                    frees += 1;
                    live_now[tag] -= size;
                    live_total -= size;
                }
                None => unmatched += 1,
            },
            Action::FreeCompleted => {
                if let Some((size, hold)) = completing.remove(&e.addr) {
                    if let Some(h) = hold {
                        dev.complete(h);
                    }
                    floor_now -= size;
                }
            }
            Action::SegmentAlloc | Action::SegmentMap => {
                torch_reserved += e.size;
                torch_peak = torch_peak.max(torch_reserved);
                if e.action == Action::SegmentAlloc {
                    torch_call(&mut torch, DriverCall::AllocSegment, 1, 1, e.size);
                } else {
                    // PyTorch's expandable segments: a handle and a map per page, then the
                    // range made accessible in one call. One call over a range of pages costs
                    // what one call per page costs (`scripts/vmm_range_bench.py` on the H200),
                    // so it is priced per page and counted once.
                    let (page, pages) = expandable_pages(e.size);
                    torch_call(&mut torch, DriverCall::CreatePhysical, pages, pages, page);
                    torch_call(&mut torch, DriverCall::Map, pages, pages, page);
                    torch_call(&mut torch, DriverCall::SetAccess, 1, pages, page);
                }
            }
            Action::SegmentFree | Action::SegmentUnmap => {
                // The first of a run: PyTorch released its cache here. (In vram-ledger's own
                // recordings, the compact and remap modes also unmap to move memory: there
                // only segment frees mark a release.)
                let run = i > 0
                    && matches!(
                        trace.events[i - 1].action,
                        Action::SegmentFree | Action::SegmentUnmap
                    );
                let moved = e.action == Action::SegmentUnmap
                    && trace
                        .vram_ledger_mode
                        .as_deref()
                        .is_some_and(|m| m != "expandable");
                if !run && !moved {
                    alloc.empty_cache()?;
                    cache_releases += 1;
                }
                torch_reserved = torch_reserved.saturating_sub(e.size);
                if e.action == Action::SegmentFree {
                    torch_call(&mut torch, DriverCall::FreeSegment, 1, 1, e.size);
                } else {
                    let (page, pages) = expandable_pages(e.size);
                    torch_call(&mut torch, DriverCall::Unmap, pages, pages, page);
                    torch_call(&mut torch, DriverCall::ReleasePhysical, pages, pages, page);
                }
            }
            Action::Oom => {}
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
    let driver_seconds = alloc.driver().estimated_host_seconds() - host_before;
    let snap = alloc.snapshot();
    let ratio = |r: u64| {
        if floor_peak == 0 {
            0.0
        } else {
            r as f64 / floor_peak as f64
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
        peak_live: floor_peak,
        peak_live_requested: live_peak,
        cache_releases,
        peak_reserved: snap.reserved_bytes.peak,
        fragmentation_ratio: ratio(snap.reserved_bytes.peak),
        torch_peak_reserved: torch_peak,
        torch_fragmentation_ratio: ratio(torch_peak),
        driver_calls: snap.driver_calls,
        torch_driver_calls: torch,
        driver_seconds,
        torch_driver_seconds: torch_seconds,
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
