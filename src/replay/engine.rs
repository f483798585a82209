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
//!
//! The estimated driver time, ours and PyTorch's, is read at the end of each tenth of the
//! events: both sides are split at the same events. Both price their waits by one rule
//! ([`cost::Drains`]): the program's kernels are taken to run on a stream between its
//! allocations and frees there, and the first wait for that stream afterwards drains them.

use std::collections::HashMap;
use std::time::Instant;

use serde::Serialize;

use super::addr_hash::AddrHash;
use super::before::Before;
use super::peak::{self, PeakBreakdown};
use super::trace::{Action, Event, Trace};
use crate::driver::counting::DriverCalls;
use crate::driver::sim::{SimConfig, SimDriver};
use crate::driver::{cost, DriverCall, StreamId};
use crate::ledger::{PerTag, Snapshot};
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
    /// What a wait for the device costs when it drains the program's queued work, ours and
    /// PyTorch's alike, in nanoseconds ([`SimConfig::sync_ns`]). Default: the price measured
    /// under load ([`cost::LOADED_SYNC_NS`]); `None` prices every wait as on an idle stream.
    pub sync_ns: Option<u64>,
    /// [`Config::unmap_later`] (default `false`, as the allocator's).
    pub unmap_later: bool,
}

/// An H200's memory as `cuMemGetInfo` reports it: 139.80 GiB, the total capacity PyTorch's
/// out-of-memory message gives on the H200 machines.
pub const H200_CAPACITY: u64 = 150_110_519_296;

impl Default for ReplayOptions {
    fn default() -> Self {
        ReplayOptions {
            mode: SegmentMode::Native,
            capacity: H200_CAPACITY,
            timeline_points: 1000,
            remap_piece: None,
            release_at_end: true,
            move_across_streams: true,
            sync_ns: Some(cost::LOADED_SYNC_NS),
            unmap_later: false,
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
    /// Memory the recording found live, replayed as allocated first ([`Trace::before`]).
    pub before: Before,
    /// Frees of addresses the trace never allocated, after what was live before it was put
    /// back (0 on a consistent trace).
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
    /// a `cuMemUnmap` and a `cuMemRelease` per unmapped page and a stream synchronisation per
    /// unmapped range (PyTorch's `ExpandableSegment`). Its event queries and the
    /// synchronisations of its `empty_cache` are not in the trace, so not here.
    pub torch_driver_calls: DriverCalls,
    /// Estimated host time of our driver calls on an H200, in seconds
    /// ([`crate::driver::cost`]).
    pub driver_seconds: f64,
    /// The same estimate for the calls in `torch_driver_calls`, with a range-wide
    /// `cuMemSetAccess` priced per page (one call over a range costs what one per page does).
    pub torch_driver_seconds: f64,
    /// What a wait that drained the program's queued work was priced at, in microseconds
    /// ([`ReplayOptions::sync_ns`]); `None`: every wait priced idle.
    pub sync_us: Option<f64>,
    /// Our waits for the device that drained queued work: the first synchronisation of a stream
    /// (or of the device, or segment free) after the program's work there, each priced at
    /// `sync_us`.
    pub drains: u64,
    /// PyTorch's, from its segment frees and the synchronisations before its unmaps.
    pub torch_drains: u64,
    /// `driver_seconds` split by tenths of the trace's events, in order: a training or serving
    /// loop's later tenths are its warm steps, where driver calls cost step time.
    pub driver_seconds_by_tenth: [f64; TENTHS],
    /// `torch_driver_seconds` split the same way, by where the trace's segment events fall.
    pub torch_driver_seconds_by_tenth: [f64; TENTHS],
    /// Allocations that did not fit in `capacity`: the figures leave them out.
    pub ooms: u64,
    /// The simulated device's memory ([`ReplayOptions::capacity`]).
    pub capacity: u64,
    pub per_tag: PerTag<TagPeak>,
    pub unknown_tags: std::collections::BTreeMap<String, u64>,
    pub seconds: f64,
    pub events_per_second: f64,
    /// Bytes the simulated driver still held for the allocator after everything was freed and
    /// the cache emptied (0 unless something leaked; the warm cache with `release_at_end` off).
    pub held_after: u64,
    #[serde(skip)]
    pub timeline: Vec<Point>,
    /// The event after which reserved bytes first reached their peak, and the stream of its
    /// allocation (none when nothing was reserved).
    #[serde(skip)]
    pub peak_event: Option<(usize, u64)>,
    /// Where the reserved bytes stood at that moment ([`at_peak`]; not filled by [`replay`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub at_peak: Option<PeakBreakdown>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct TagPeak {
    /// Peak live bytes of this tag in the trace.
    pub peak_live: u64,
    /// Peak allocated bytes of this tag in our allocator (rounded sizes).
    pub peak_allocated: u64,
}

/// Streams of the replay's own, one per free that waits for its `free_completed`: above the
/// trace's streams, which the reader numbers from 0 ([`Trace::streams`]).
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
    replay_on(&fresh(trace, opts)?, trace, opts, progress)
}

/// An allocator as `opts` says, on a fresh simulated device. Native replay takes PyTorch's
/// decisions: its best fit is exact ([`Config::exact_best_fit`]), and on a trace recorded with
/// plain segments it gets the recorded segments' addresses from the simulated driver, for as
/// long as it makes the same segments (PyTorch's best fit prefers the lowest address among free
/// blocks of one size, so the address order is part of what it decided on).
fn fresh(trace: &Trace, opts: &ReplayOptions) -> Result<Allocator<SimDriver>, Error> {
    let drv = SimDriver::with_config(SimConfig {
        capacity: opts.capacity,
        context_overhead: 0,
        sync_ns: opts.sync_ns,
        ..Default::default()
    });
    if opts.mode == SegmentMode::Native && trace.expandable != Some(true) {
        let segments = trace
            .events
            .iter()
            .filter(|e| e.action == Action::SegmentAlloc);
        drv.device()
            .plan_segment_addresses(segments.map(|e| (e.size, e.addr)));
    }
    let config = Config {
        remap_piece: opts.remap_piece,
        move_across_streams: opts.move_across_streams,
        unmap_later: opts.unmap_later,
        exact_best_fit: opts.mode == SegmentMode::Native,
        ..Config::with_mode(opts.mode)
    };
    Allocator::new(drv, config)
}

/// Where the reserved bytes stood when `r` (a replay of `trace` with `opts`) reached its peak:
/// the trace replayed again on a fresh simulated device up to that event, and the allocator's
/// blocks and mappings read there. `None` when nothing was reserved.
pub fn at_peak(
    trace: &Trace,
    opts: &ReplayOptions,
    r: &ReplayResult,
) -> Result<Option<PeakBreakdown>, Error> {
    let Some((event, stream)) = r.peak_event else {
        return Ok(None);
    };
    let alloc = fresh(trace, opts)?;
    let mut again = Replayer::new(&alloc, trace, 0);
    for (i, e) in trace.events.iter().enumerate().take(event + 1) {
        again.event(i, e)?;
    }
    Ok(Some(peak::of_dump(&alloc.dump(), event, stream)))
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
    let host_before = alloc.driver().estimated_host_seconds();
    let drains_before = alloc.driver().drains();
    let ours = || alloc.driver().estimated_host_seconds() - host_before;
    let mut r = Replayer::new(alloc, trace, opts.timeline_points);
    // PyTorch's waits priced as the device prices ours (`opts.sync_ns` only builds a fresh
    // device); the device idle at the start, as PyTorch's side is.
    r.torch.drains = cost::Drains::new(alloc.driver().device().config().sync_ns);
    alloc.driver().forget_queued_work();
    let n = trace.events.len();
    // Cumulative estimated driver time, ours and PyTorch's, at the end of each tenth.
    let (mut at, mut torch_at) = ([0.0; TENTHS], [0.0; TENTHS]);
    let mut tenth = 0;
    let mut end_of_tenth = n.div_ceil(TENTHS);
    for (i, e) in trace.events.iter().enumerate() {
        r.event(i, e)?;
        r.sample(i);
        // A trace of fewer events than tenths ends several at one event.
        while tenth < TENTHS && i + 1 >= end_of_tenth {
            (at[tenth], torch_at[tenth]) = (ours(), r.torch.seconds);
            tenth += 1;
            end_of_tenth = (n * (tenth + 1)).div_ceil(TENTHS);
        }
        if i % 65536 == 0 {
            progress(i);
        }
    }
    r.sample_end();
    let seconds = start.elapsed().as_secs_f64();
    let driver_seconds = ours();
    let drains = alloc.driver().drains() - drains_before;
    let snap = alloc.snapshot();
    r.leave_nothing_live(opts.release_at_end)?;
    let held_after = alloc.driver().held_bytes();
    let mut result = r.result(opts, snap, seconds, (driver_seconds, drains), held_after);
    result.driver_seconds_by_tenth = by_tenth(&at);
    result.torch_driver_seconds_by_tenth = by_tenth(&torch_at);
    Ok(result)
}

/// Parts the trace's estimated driver time is split into ([`ReplayResult::driver_seconds_by_tenth`]).
pub const TENTHS: usize = 10;

/// What each tenth added to a running total read at the end of each.
fn by_tenth(cumulative: &[f64; TENTHS]) -> [f64; TENTHS] {
    std::array::from_fn(|k| cumulative[k] - if k == 0 { 0.0 } else { cumulative[k - 1] })
}

/// The trace's own live bytes, as PyTorch recorded them: until `free_requested` (per tag and in
/// all) and until `free_completed` (the floor), with their peaks.
#[derive(Default)]
struct Live {
    now: PerTag<u64>,
    total: u64,
    peak: u64,
    tag_peak: PerTag<u64>,
    floor: u64,
    floor_peak: u64,
}

impl Live {
    fn allocated(&mut self, tag: Tag, size: u64) {
        self.now[tag] += size;
        self.total += size;
        self.peak = self.peak.max(self.total);
        self.floor += size;
        self.floor_peak = self.floor_peak.max(self.floor);
        self.tag_peak[tag] = self.tag_peak[tag].max(self.now[tag]);
    }

    fn free_requested(&mut self, tag: Tag, size: u64) {
        self.now[tag] -= size;
        self.total -= size;
    }

    fn free_completed(&mut self, size: u64) {
        self.floor -= size;
    }
}

/// PyTorch's side of the replay, from the trace's segment events: the bytes it reserved and the
/// driver calls they imply, with their estimated host time.
#[derive(Default)]
struct Torch {
    reserved: u64,
    peak: u64,
    calls: DriverCalls,
    seconds: f64,
    /// PyTorch's waits, drained by the rule and at the price of our side's
    /// ([`SimConfig::sync_ns`]).
    drains: cost::Drains,
}

impl Torch {
    /// `calls` made, priced as `priced` calls on `bytes` each.
    fn call(&mut self, call: DriverCall, calls: u64, priced: u64, bytes: u64) {
        self.calls.add(call, calls);
        self.seconds += priced as f64 * cost::host_seconds(call, bytes);
    }

    /// A wait for `stream`'s work (`None`: the device's), charged what it drained.
    fn waited(&mut self, stream: Option<u64>) {
        self.seconds += self.drains.waited(stream) as f64 * 1e-9;
    }

    /// Each of `calls` once per page of an expandable range of `bytes`; returns the page size and
    /// the page count.
    fn per_page(&mut self, calls: [DriverCall; 2], bytes: u64) -> (u64, u64) {
        let (page, pages) = expandable_pages(bytes);
        for call in calls {
            self.call(call, pages, pages, page);
        }
        (page, pages)
    }

    /// A `segment_alloc` or `segment_map` event.
    fn segment_mapped(&mut self, e: &Event) {
        // A hostile trace's segments may add up past 2^64; the sum is only reported.
        self.reserved = self.reserved.saturating_add(e.size);
        self.peak = self.peak.max(self.reserved);
        if e.action == Action::SegmentAlloc {
            self.call(DriverCall::AllocSegment, 1, 1, e.size);
        } else {
            // PyTorch's expandable segments: a handle and a map per page, then the range made
            // accessible in one call. One call over a range of pages costs what one call per
            // page costs (`scripts/vmm_range_bench.py` on the H200), so it is priced per page
            // and counted once.
            let (page, pages) =
                self.per_page([DriverCall::CreatePhysical, DriverCall::Map], e.size);
            self.call(DriverCall::SetAccess, 1, pages, page);
        }
    }

    /// A `segment_free` or `segment_unmap` event.
    fn segment_released(&mut self, e: &Event) {
        self.reserved = self.reserved.saturating_sub(e.size);
        if e.action == Action::SegmentFree {
            // cuMemFree synchronises the device.
            self.call(DriverCall::FreeSegment, 1, 1, e.size);
            self.waited(None);
        } else {
            // Unmapping does not wait for the device, so PyTorch synchronises the segment's
            // stream before it unmaps (ExpandableSegment::unmapHandles).
            self.call(DriverCall::SyncStream, 1, 1, 0);
            self.waited(Some(e.stream));
            self.per_page([DriverCall::Unmap, DriverCall::ReleasePhysical], e.size);
        }
    }
}

/// A replay under way: the trace's blocks as our allocator holds them, and what is measured.
struct Replayer<'a> {
    allocator: &'a Allocator<SimDriver>,
    trace: &'a Trace,
    delayed: Vec<bool>,
    /// Trace address -> (our pointer, trace size, tag).
    ours: HashMap<u64, (u64, u64, Tag), AddrHash>,
    /// Frees requested and not yet completed: trace address -> (size, the stream of its own
    /// that holds the block back, if its completion comes later).
    completing: HashMap<u64, (u64, Option<StreamId>), AddrHash>,
    next_hold: u64,
    live: Live,
    torch: Torch,
    allocations: u64,
    frees: u64,
    unmatched: u64,
    ooms: u64,
    cache_releases: u64,
    /// Events per timeline point.
    every: usize,
    timeline: Vec<Point>,
    /// The moment of most live memory in the current point's window: (event, live bytes,
    /// live bytes per tag).
    window: (usize, u64, PerTag<u64>),
    /// The most reserved after an allocation, and that allocation's event and stream.
    peak: (u64, Option<(usize, u64)>),
}

impl<'a> Replayer<'a> {
    fn new(allocator: &'a Allocator<SimDriver>, trace: &'a Trace, timeline_points: usize) -> Self {
        let every = if timeline_points == 0 {
            usize::MAX
        } else {
            trace.events.len().div_ceil(timeline_points).max(1)
        };
        Replayer {
            allocator,
            trace,
            delayed: delayed_frees(trace),
            ours: HashMap::with_capacity_and_hasher(4096, AddrHash::default()),
            completing: HashMap::with_capacity_and_hasher(64, AddrHash::default()),
            next_hold: 0,
            live: Live::default(),
            torch: Torch::default(),
            allocations: 0,
            frees: 0,
            unmatched: 0,
            ooms: 0,
            cache_releases: 0,
            every,
            timeline: Vec::with_capacity(timeline_points + 1),
            window: (0, 0, PerTag::default()),
            peak: (0, None),
        }
    }

    fn event(&mut self, i: usize, e: &Event) -> Result<(), Error> {
        if matches!(e.action, Action::Alloc | Action::FreeRequested) {
            // The program ran kernels on this stream between its allocations and frees: the
            // next wait for the stream or the device, ours or PyTorch's, drains them. They
            // finish only when waited for (`SimDriver::work_queued`), so an allocator that
            // puts work off until an event on the stream is charged as late as it can be.
            self.allocator.driver().work_queued(StreamId(e.stream));
            self.torch.drains.work_queued(e.stream);
        }
        match e.action {
            Action::Alloc => self.alloc(i, e)?,
            Action::FreeRequested => self.free_requested(i, e)?,
            Action::FreeCompleted => self.free_completed(e),
            Action::SegmentAlloc | Action::SegmentMap => self.torch.segment_mapped(e),
            Action::SegmentFree | Action::SegmentUnmap => self.segment_released(i, e)?,
            Action::Oom => {}
        }
        Ok(())
    }

    /// Event `i`, an allocation.
    fn alloc(&mut self, i: usize, e: &Event) -> Result<(), Error> {
        let stream = StreamId(e.stream);
        match self.allocator.allocate_tagged(e.size, stream, e.tag) {
            Ok(a) => {
                self.allocations += 1;
                let reserved = self.allocator.ledger().reserved();
                if reserved > self.peak.0 {
                    self.peak = (reserved, Some((i, e.stream)));
                }
                if let Some((old, ..)) = self.ours.insert(e.addr, (a.ptr, e.size, e.tag)) {
                    // The trace reused an address we think is live: keep ours consistent.
                    self.allocator.free(old)?;
                }
                self.live.allocated(e.tag, e.size);
            }
            Err(Error::OutOfMemory(_)) => self.ooms += 1,
            Err(err) => return Err(err),
        }
        Ok(())
    }

    /// Event `i`, a `free_requested`.
    fn free_requested(&mut self, i: usize, e: &Event) -> Result<(), Error> {
        let Some((ptr, size, tag)) = self.ours.remove(&e.addr) else {
            self.unmatched += 1;
            return Ok(());
        };
        let hold = self.delayed[i].then(|| {
            self.next_hold += 1;
            StreamId(HOLD_STREAMS + self.next_hold)
        });
        if let Some(h) = hold {
            // Work queued on a stream of its own, completed at free_completed.
            self.allocator.record_stream(ptr, h)?;
            self.allocator.driver().device().submit_external(h);
        }
        self.allocator.free_on(ptr, StreamId(e.stream))?;
        self.completing.insert(e.addr, (size, hold));
        self.frees += 1;
        self.live.free_requested(tag, size);
        Ok(())
    }

    fn free_completed(&mut self, e: &Event) {
        if let Some((size, hold)) = self.completing.remove(&e.addr) {
            if let Some(h) = hold {
                self.allocator.driver().device().complete(h);
            }
            self.live.free_completed(size);
        }
    }

    /// Event `i`, a `segment_free` or `segment_unmap`.
    fn segment_released(&mut self, i: usize, e: &Event) -> Result<(), Error> {
        if e.sleep {
            // A tag put to sleep: the recording gave its memory back, its allocations live on.
            // The modes replayed here do not sleep; what the recording held falls.
            self.torch.segment_released(e);
            return Ok(());
        }
        // The first of a run: PyTorch released its cache here. (In vram-ledger's own
        // recordings, the compact and remap modes also unmap to move memory: there only
        // segment frees mark a release.)
        let run = i > 0
            && matches!(
                self.trace.events[i - 1].action,
                Action::SegmentFree | Action::SegmentUnmap
            );
        let moved = e.action == Action::SegmentUnmap
            && self
                .trace
                .vram_ledger_mode
                .as_deref()
                .is_some_and(|m| m != "expandable");
        if !run && !moved {
            self.allocator.empty_cache()?;
            self.cache_releases += 1;
        }
        self.torch.segment_released(e);
        Ok(())
    }

    /// After event `i`. Each timeline point is the moment of most live memory in its window, so
    /// that short spikes (and the peak) show in the picture.
    fn sample(&mut self, i: usize) {
        if self.live.total >= self.window.1 {
            self.window = (i, self.live.total, self.live.now);
        }
        if (i + 1).is_multiple_of(self.every) {
            let (event, _, live) = self.window;
            self.timeline.push(Point {
                event,
                live,
                reserved: self.allocator.ledger().reserved(),
                torch_reserved: self.torch.reserved,
            });
            self.window = (i + 1, 0, self.live.now);
        }
    }

    /// The timeline's last point, after the last event.
    fn sample_end(&mut self) {
        self.timeline.push(Point {
            event: self.trace.events.len(),
            live: self.live.now,
            reserved: self.allocator.ledger().reserved(),
            torch_reserved: self.torch.reserved,
        });
    }

    /// Free what the trace left live, and give the cache back unless the caller keeps it warm
    /// for another replay.
    fn leave_nothing_live(&mut self, release: bool) -> Result<(), Error> {
        for (ptr, ..) in std::mem::take(&mut self.ours).into_values() {
            self.allocator.free(ptr)?;
        }
        if release {
            self.allocator.empty_cache()?;
        }
        Ok(())
    }

    fn result(
        self,
        opts: &ReplayOptions,
        snap: Snapshot,
        seconds: f64,
        (driver_seconds, drains): (f64, u64),
        held_after: u64,
    ) -> ReplayResult {
        let floor_peak = self.live.floor_peak;
        let ratio = |r: u64| {
            if floor_peak == 0 {
                0.0
            } else {
                r as f64 / floor_peak as f64
            }
        };
        let events = self.trace.events.len();
        ReplayResult {
            mode: opts.mode,
            before: self.trace.before,
            capacity: opts.capacity,
            events,
            allocations: self.allocations,
            frees: self.frees,
            unmatched_frees: self.unmatched,
            peak_live: floor_peak,
            peak_live_requested: self.live.peak,
            cache_releases: self.cache_releases,
            peak_reserved: snap.reserved_bytes.peak,
            fragmentation_ratio: ratio(snap.reserved_bytes.peak),
            torch_peak_reserved: self.torch.peak,
            torch_fragmentation_ratio: ratio(self.torch.peak),
            driver_calls: snap.driver_calls,
            torch_driver_calls: self.torch.calls,
            driver_seconds,
            torch_driver_seconds: self.torch.seconds,
            sync_us: self.torch.drains.price_ns().map(|ns| ns as f64 / 1e3),
            drains,
            torch_drains: self.torch.drains.count(),
            driver_seconds_by_tenth: [0.0; TENTHS],
            torch_driver_seconds_by_tenth: [0.0; TENTHS],
            ooms: self.ooms,
            per_tag: PerTag(std::array::from_fn(|i| TagPeak {
                peak_live: self.live.tag_peak.0[i],
                peak_allocated: snap.per_tag.0[i].allocated_bytes.peak,
            })),
            unknown_tags: self.trace.unknown_tags.clone(),
            seconds,
            held_after,
            events_per_second: events as f64 / seconds.max(1e-9),
            timeline: self.timeline,
            peak_event: self.peak.1,
            at_peak: None,
        }
    }
}
