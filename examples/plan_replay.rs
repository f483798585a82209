//! Policies tried on a trace before they are built into the allocator: a small replayer that
//! does what `vram-ledger replay` does for one mode, and can serve some blocks differently.
//!
//!     cargo run --release --example plan_replay -- TRACE [PLANS.json] [OPTIONS]
//!
//! - Without options it is a plain replay, and must print what `vram-ledger replay --mode M`
//!   prints for the same trace (ratio and estimated driver time): the check that this replayer
//!   follows the real one.
//! - `PLANS.json` (`scripts/episode_plans.py`; each block `[ordinal, offset, size]`, the size
//!   checked against the trace's): plans for the episodes that repeat an earlier one exactly.
//!   Each such episode's blocks are served from one arena at the offsets planned at the first
//!   sighting; the arena is one allocation of the allocator's, taken at the episode's first
//!   block and freed when its last block's free completed. `--shared`: one arena, the largest
//!   plan's size, taken once and kept, for every planned episode.
//! - `--segregate LIFE`: blocks that live longer than LIFE are allocated in a pool of their own
//!   (a stream identifier of their own), so that they do not pin the pieces of short-lived
//!   blocks. A lifetime is counted in trace events, or with `--turnover` in bytes allocated
//!   while the block lived, its own included, over the most bytes live so far (how many times
//!   the memory turned over: a unit without the trace's scale). It is the block's own (an
//!   oracle), or with `--predict` that of the last block of the same size whose free completed
//!   (known from the past only, as an allocator would know it). `--regions`: the pool is
//!   instead a region of the same stream (`Config::separate_tags`, the weights tag's region;
//!   every other block is tagged activation).
//!
//! The allocator and simulated device are set up as `replay::engine`'s private `fresh` sets
//! them up; `python/tests/test_plan_replay.py` holds the two to the same figures.
//! - `--mode M` (default remap), `--piece BYTES` (remap's piece).
//!
//! Prints one JSON line: peak live and peak reserved bytes, their ratio, the estimated driver
//! time, and how many blocks the plans and the long-lived pool served.

use std::collections::HashMap;
use std::path::Path;

use vram_ledger::driver::cost;
use vram_ledger::driver::sim::{SimConfig, SimDriver};
use vram_ledger::replay::engine::H200_CAPACITY;
use vram_ledger::replay::trace::{read_file, Action, Event};
use vram_ledger::{Allocator, Config, DevicePtr, Error, SegmentMode, StreamId, Tag};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Streams of their own for blocks whose free completes later than it was asked for, as the
/// replay engine makes them.
const HOLD_STREAMS: u64 = 1 << 56;
/// The long-lived pool of stream `s` is stream `LONG_LIVED + s` (below the simulated driver's
/// own streams and the allocator's keys).
const LONG_LIVED: u64 = 1 << 40;

#[derive(Default)]
struct Options {
    trace: String,
    plans: Option<String>,
    mode: Option<SegmentMode>,
    piece: Option<u64>,
    shared: bool,
    segregate: Option<f64>,
    predict: bool,
    turnover: bool,
    regions: bool,
}

fn options() -> Res<Options> {
    let mut o = Options::default();
    let mut files = vec![];
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        match a.as_str() {
            "--mode" => o.mode = Some(value("--mode")?.parse()?),
            "--piece" => o.piece = Some(value("--piece")?.parse()?),
            "--segregate" => o.segregate = Some(value("--segregate")?.parse()?),
            "--shared" => o.shared = true,
            "--predict" => o.predict = true,
            "--turnover" => o.turnover = true,
            "--regions" => o.regions = true,
            _ if a.starts_with("--") => return Err(format!("unknown option {a}").into()),
            _ => files.push(a),
        }
    }
    let mut files = files.into_iter();
    o.trace = files
        .next()
        .ok_or("usage: plan_replay TRACE [PLANS.json] [OPTIONS]")?;
    o.plans = files.next();
    Ok(o)
}

/// Planned episodes: each block by its place among the trace's allocations.
#[derive(Default)]
struct Plans {
    /// Allocation ordinal -> (episode, offset, size), the size checked against the trace's.
    block: HashMap<u64, (usize, u64, u64)>,
    /// Each episode's arena bytes and number of blocks.
    episodes: Vec<(u64, usize)>,
}

fn read_plans(path: &str) -> Res<Plans> {
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(path)?)?;
    let mut p = Plans::default();
    for (k, ep) in v["episodes"]
        .as_array()
        .ok_or("plans: no episodes")?
        .iter()
        .enumerate()
    {
        let blocks = ep["blocks"]
            .as_array()
            .ok_or("plans: an episode without blocks")?;
        let arena = ep["arena"].as_u64().ok_or("plans: no arena")?;
        for b in blocks {
            let field = |j: usize| {
                b[j].as_u64()
                    .ok_or("plans: a block is [ordinal, offset, size]")
            };
            let (ordinal, offset, size) = (field(0)?, field(1)?, field(2)?);
            if offset + size > arena {
                return Err(format!("plans: block {ordinal} ends past its arena").into());
            }
            p.block.insert(ordinal, (k, offset, size));
        }
        p.episodes.push((arena, blocks.len()));
    }
    Ok(p)
}

/// Lifetimes as `--segregate` counts them, kept as the trace goes (the oracle reads them all
/// first, `--predict` as frees complete).
#[derive(Default)]
struct Clock {
    turnover: bool,
    /// Bytes allocated so far, bytes live (to free completion) and the most live so far.
    allocated: u64,
    live: u64,
    peak: u64,
    /// Trace address -> (event, bytes allocated before it) of its allocation.
    born: HashMap<u64, (usize, u64)>,
}

impl Clock {
    /// Event `i`; the lifetime of the block whose free completed there, if any.
    fn tick(&mut self, i: usize, e: &Event) -> Option<f64> {
        match e.action {
            Action::Alloc => {
                self.born.insert(e.addr, (i, self.allocated));
                self.allocated += e.size;
                self.live += e.size;
                self.peak = self.peak.max(self.live);
                None
            }
            Action::FreeCompleted => {
                let (at, before) = self.born.remove(&e.addr)?;
                self.live -= e.size;
                Some(if self.turnover {
                    (self.allocated - before) as f64 / self.peak as f64
                } else {
                    (i - at) as f64
                })
            }
            _ => None,
        }
    }
}

/// Each allocation's lifetime (infinite: never freed), by its event.
fn lifetimes(ev: &[Event], turnover: bool) -> Vec<f64> {
    let mut out = vec![f64::INFINITY; ev.len()];
    let mut clock = Clock {
        turnover,
        ..Clock::default()
    };
    for (i, e) in ev.iter().enumerate() {
        let born = clock.born.get(&e.addr).map(|b| b.0);
        if let (Some(life), Some(a)) = (clock.tick(i, e), born) {
            out[a] = life;
        }
    }
    out
}

enum Held {
    /// The allocator's block, and the stream (pool) it was allocated on.
    Own(DevicePtr, StreamId),
    /// A block in episode `.0`'s arena.
    Planned(usize),
}

struct Arena {
    ptr: DevicePtr,
    stream: StreamId,
    /// Planned blocks whose free has not completed yet.
    open: usize,
}

/// One of episode `k`'s blocks is gone: the arena goes back to the allocator after the last
/// (a kept arena stays).
fn close(
    alloc: &Allocator<SimDriver>,
    arenas: &mut [Option<Arena>],
    k: usize,
    keep: bool,
) -> Res<()> {
    let a = arenas[k]
        .as_mut()
        .ok_or("a planned block without its arena")?;
    a.open -= 1;
    if a.open == 0 && !keep {
        alloc.free_on(a.ptr, a.stream)?;
    }
    Ok(())
}

fn main() -> Res<()> {
    let o = options()?;
    let trace = read_file(Path::new(&o.trace), None)?;
    let plans = o
        .plans
        .as_deref()
        .map(read_plans)
        .transpose()?
        .unwrap_or_default();
    let mode = o.mode.unwrap_or(SegmentMode::Remap);
    let drv = SimDriver::with_config(SimConfig {
        capacity: H200_CAPACITY,
        context_overhead: 0,
        sync_ns: Some(cost::LOADED_SYNC_NS),
        ..Default::default()
    });
    if mode == SegmentMode::Native && trace.expandable != Some(true) {
        // As the replay engine: native takes the recorded segments' addresses, which PyTorch's
        // best fit orders blocks of one size by.
        let segments = trace
            .events
            .iter()
            .filter(|e| e.action == Action::SegmentAlloc);
        drv.device()
            .plan_segment_addresses(segments.map(|e| (e.size, e.addr)));
    }
    let config = Config {
        remap_piece: o.piece,
        move_across_streams: true,
        exact_best_fit: mode == SegmentMode::Native,
        separate_tags: o.regions,
        ..Config::with_mode(mode)
    };
    let alloc = Allocator::new(drv, config)?;
    // As the replay engine: the driver time from here on, the device idle at the start.
    let before = alloc.driver().estimated_host_seconds();
    alloc.driver().forget_queued_work();
    let ev = &trace.events;
    // The oracle's lifetimes, read ahead; --predict learns them as frees complete instead.
    let lifetime = match o.segregate {
        Some(_) if !o.predict => lifetimes(ev, o.turnover),
        _ => vec![],
    };
    let mut clock = Clock {
        turnover: o.turnover,
        ..Clock::default()
    };
    let largest = plans.episodes.iter().map(|e| e.0).max().unwrap_or(0);
    let mut kept: Option<DevicePtr> = None;
    // Size -> the lifetime of the last block of that size whose free completed (--predict).
    let mut last_life: HashMap<u64, f64> = HashMap::new();
    let mut ours: HashMap<u64, Held> = HashMap::new();
    // Trace address -> (size, hold stream, planned episode), between free_requested and
    // free_completed.
    let mut completing: HashMap<u64, (u64, Option<StreamId>, Option<usize>)> = HashMap::new();
    let mut arenas: Vec<Option<Arena>> = (0..plans.episodes.len()).map(|_| None).collect();
    let (mut ordinal, mut next_hold, mut planned, mut long_lived) = (0u64, 0u64, 0u64, 0u64);
    let (mut live, mut peak_live, mut ooms) = (0u64, 0u64, 0u64);
    for (i, e) in ev.iter().enumerate() {
        let stream = StreamId(e.stream);
        // Whether an allocation here goes to the long-lived pool: decided before this event's
        // own free (if any) teaches --predict anything.
        let long = match (o.segregate, e.action) {
            (Some(l), Action::Alloc) if o.predict => last_life.get(&e.size).is_some_and(|&t| t > l),
            (Some(l), Action::Alloc) => lifetime[i] > l,
            _ => false,
        };
        if let Some(life) = clock.tick(i, e) {
            last_life.insert(e.size, life);
        }
        if matches!(e.action, Action::Alloc | Action::FreeRequested) {
            alloc.driver().work_queued(stream);
        }
        match e.action {
            Action::Alloc => {
                let held = if let Some(&(k, _, size)) = plans.block.get(&ordinal) {
                    if size != e.size {
                        let msg = format!(
                            "plans: block {ordinal} is {size} bytes, the trace's {}",
                            e.size
                        );
                        return Err(msg.into());
                    }
                    if arenas[k].is_none() {
                        if o.shared && arenas.iter().flatten().any(|a| a.open > 0) {
                            return Err(
                                "--shared: an episode began before another's blocks were freed"
                                    .into(),
                            );
                        }
                        let ptr = match kept {
                            Some(p) if o.shared => p,
                            _ => {
                                let bytes = if o.shared {
                                    largest
                                } else {
                                    plans.episodes[k].0
                                };
                                alloc.allocate_tagged(bytes, stream, Tag::Activation)?.ptr
                            }
                        };
                        if o.shared {
                            kept = Some(ptr);
                        }
                        arenas[k] = Some(Arena {
                            ptr,
                            stream,
                            open: plans.episodes[k].1,
                        });
                    }
                    planned += 1;
                    Held::Planned(k)
                } else {
                    // The long-lived pool: a stream of its own, or with --regions a region of the
                    // same stream (`Config::separate_tags`, the weights tag's).
                    let (pool, tag) = match (long, o.regions) {
                        (false, false) => (stream, e.tag),
                        (false, true) => (stream, Tag::Activation),
                        (true, false) => (StreamId(LONG_LIVED + e.stream), e.tag),
                        (true, true) => (stream, Tag::Weights),
                    };
                    long_lived += u64::from(long);
                    match alloc.allocate_tagged(e.size, pool, tag) {
                        Ok(a) => Held::Own(a.ptr, pool),
                        Err(Error::OutOfMemory(_)) => {
                            ooms += 1;
                            ordinal += 1;
                            continue;
                        }
                        Err(err) => return Err(err.into()),
                    }
                };
                ordinal += 1;
                // The trace reused an address still live here: as the replay engine, let the
                // old block go.
                match ours.insert(e.addr, held) {
                    Some(Held::Own(ptr, _)) => alloc.free(ptr)?,
                    Some(Held::Planned(k)) => close(&alloc, &mut arenas, k, o.shared)?,
                    None => {}
                }
                live += e.size;
                peak_live = peak_live.max(live);
            }
            Action::FreeRequested => {
                let Some(held) = ours.remove(&e.addr) else {
                    continue;
                };
                match held {
                    Held::Own(ptr, pool) => {
                        let delayed = !ev
                            .get(i + 1)
                            .is_some_and(|n| n.action == Action::FreeCompleted && n.addr == e.addr);
                        let hold = delayed.then(|| {
                            next_hold += 1;
                            StreamId(HOLD_STREAMS + next_hold)
                        });
                        if let Some(h) = hold {
                            alloc.record_stream(ptr, h)?;
                            alloc.driver().device().submit_external(h);
                        }
                        alloc.free_on(ptr, pool)?;
                        completing.insert(e.addr, (e.size, hold, None));
                    }
                    Held::Planned(k) => {
                        completing.insert(e.addr, (e.size, None, Some(k)));
                    }
                }
            }
            Action::FreeCompleted => {
                let Some((size, hold, episode)) = completing.remove(&e.addr) else {
                    continue;
                };
                if let Some(h) = hold {
                    alloc.driver().device().complete(h);
                }
                live -= size;
                if let Some(k) = episode {
                    close(&alloc, &mut arenas, k, o.shared)?;
                }
            }
            Action::SegmentFree | Action::SegmentUnmap if !e.sleep => {
                // PyTorch released its cache here (the first of a run of releases); in
                // vram-ledger's own compact and remap recordings an unmap is a move instead.
                let run =
                    i > 0 && matches!(ev[i - 1].action, Action::SegmentFree | Action::SegmentUnmap);
                let moved = e.action == Action::SegmentUnmap
                    && trace
                        .vram_ledger_mode
                        .as_deref()
                        .is_some_and(|m| m != "expandable");
                if !run && !moved {
                    alloc.empty_cache()?;
                }
            }
            _ => {}
        }
    }
    // The ledger's own peak, as the replay engine reports it: it also sees a peak inside one
    // call (a release and retry after an out-of-memory).
    let peak_reserved = alloc.snapshot().reserved_bytes.peak;
    let ratio = if peak_live == 0 {
        0.0
    } else {
        peak_reserved as f64 / peak_live as f64
    };
    println!(
        "{}",
        serde_json::json!({
            "mode": mode.to_string(), "piece": o.piece, "planned_episodes": plans.episodes.len(),
            "planned_blocks": planned, "long_lived_blocks": long_lived, "peak_live": peak_live,
            "peak_reserved": peak_reserved, "ratio": ratio, "ooms": ooms,
            "driver_seconds": alloc.driver().estimated_host_seconds() - before,
        })
    );
    Ok(())
}
