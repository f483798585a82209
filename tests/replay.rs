//! Replay of PyTorch memory snapshots: fidelity to what PyTorch recorded (its peak, its segment
//! calls and where in the trace they fall), the fragmentation goal, a synthetic snapshot with
//! exact expectations, bad input, and the command line.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

#[path = "common/sim.rs"]
mod common;

use common::{replay_in, trace};
use serde_pickle::{HashableValue, Value};
use vram_ledger::allocator::DEFAULT_REMAP_PIECE;
use vram_ledger::driver::DriverCall;
use vram_ledger::replay::{self, ReplayOptions, ReplayResult};
use vram_ledger::units::MIB;
use vram_ledger::SegmentMode;
use vram_ledger::Tag;

fn run(name: &str, mode: SegmentMode) -> ReplayResult {
    let r = replay_in(&trace(name), mode);
    assert_eq!(r.ooms, 0);
    assert_eq!(r.held_after, 0, "everything is returned after the replay");
    r
}

/// Every trace in `tests/data` (the shared recordings, copied).
const TRACES: [&str; 4] = [
    "gpt2-train",
    "gpt2-train-expandable",
    "llama1b-serve",
    "streams-train-0",
];

/// Traces recorded on the H200 with torch 2.11 by `scripts/record_workloads.py` (seed 0), with
/// Python frames, and the entries the recorder counted in Python.
const RECORDED: [(&str, usize); 4] = [
    ("ckpt-train-s0", 345_728),
    ("conv-train-s0", 27_673),
    ("moe-train-s0", 90_362),
    ("side-stream-s0", 4_520),
];

#[test]
fn replay_reads_snapshots_whose_python_frames_are_shared() {
    // An allocation's frames list is one Python object in its alloc, free_requested and
    // free_completed entries; serde-pickle alone refused every one of these files as a
    // "recursive structure".
    for (name, entries) in RECORDED {
        let t = trace(name);
        assert_eq!(t.events.len(), entries, "{name}");
        assert_eq!(t.expandable, Some(false), "{name}");
        let r = run(name, SegmentMode::Native);
        assert_eq!(r.unmatched_frees, 0, "{name}");
    }
}

#[test]
fn replay_the_recorded_mode_reproduces_pytorch_from_the_traces_own_records() {
    // The mode that matches each trace's recorded allocator settings must give what the
    // trace's own segment events say PyTorch reserved, and (native) as many segment
    // allocations and frees: the multi-stream trace frees 61 segments in its empty_cache
    // calls and holds blocks used on other streams until their free_completed; the side-stream
    // recording copies from pinned memory with record_stream. Native gets the recorded
    // segments' addresses and searches every free block of a size class, as PyTorch does:
    // without either, three of the recordings came out 2 to 90 MiB off.
    for name in TRACES.into_iter().chain(RECORDED.map(|(name, _)| name)) {
        let mode = match trace(name).expandable {
            Some(true) => SegmentMode::Expandable,
            Some(false) => SegmentMode::Native,
            None => panic!("{name} records no allocator settings"),
        };
        let r = run(name, mode);
        assert!(r.torch_peak_reserved > 0, "{name}");
        assert_eq!(r.peak_reserved, r.torch_peak_reserved, "{name} {mode}");
        if mode == SegmentMode::Native {
            for call in [DriverCall::AllocSegment, DriverCall::FreeSegment] {
                assert_eq!(
                    r.driver_calls[call], r.torch_driver_calls[call],
                    "{name}: {call}"
                );
            }
        }
    }
}

#[test]
fn replay_splits_driver_time_by_tenth_where_the_trace_had_its_segment_events() {
    // Native replay makes PyTorch's segment calls at PyTorch's events, so each tenth of its
    // estimated driver time must be what the trace's own segment events in that tenth cost,
    // counted here from the events: a segment free that is the first since the program's own
    // allocations and frees also drains their work (only the 0.2 µs stream synchronisations of
    // our cache releases are ours alone). Virtual modes split at the same events; every split
    // adds up.
    use vram_ledger::driver::cost::{drain_extra_ns, host_seconds, LOADED_SYNC_NS};
    use vram_ledger::replay::engine::TENTHS;
    use vram_ledger::replay::trace::Action;
    for (name, _) in RECORDED
        .into_iter()
        .chain([("streams-train-0", 0), ("gpt2-train", 0)])
    {
        let t = trace(name);
        let n = t.events.len();
        let mut theirs = [0.0; TENTHS];
        let mut queued = false;
        for (i, e) in t.events.iter().enumerate() {
            let call = match e.action {
                Action::SegmentAlloc => DriverCall::AllocSegment,
                Action::SegmentFree => DriverCall::FreeSegment,
                Action::Alloc | Action::FreeRequested => {
                    queued = true;
                    continue;
                }
                _ => continue,
            };
            theirs[i * TENTHS / n] += host_seconds(call, e.size);
            if call == DriverCall::FreeSegment && std::mem::take(&mut queued) {
                theirs[i * TENTHS / n] += drain_extra_ns(LOADED_SYNC_NS) as f64 * 1e-9;
            }
        }
        let r = run(name, SegmentMode::Native);
        for (k, &recorded) in theirs.iter().enumerate() {
            let ours = r.driver_seconds_by_tenth[k];
            assert!(
                (ours - recorded).abs() < 1e-6
                    && (r.torch_driver_seconds_by_tenth[k] - recorded).abs() < 1e-9,
                "{name}: tenth {k}: {ours} s replayed, {recorded} s in the trace's events"
            );
        }
        assert!(
            theirs.iter().filter(|&&x| x > 0.0).count() > 1,
            "{name}: one tenth only"
        );
        for mode in [SegmentMode::Native, SegmentMode::Remap] {
            let r = run(name, mode);
            let sum: f64 = r.driver_seconds_by_tenth.iter().sum();
            assert!((sum - r.driver_seconds).abs() < 1e-9, "{name} {mode}");
        }
    }
}

/// Remap on the trace `name` with the largest piece `piece` bytes.
fn run_remap(name: &str, piece: u64) -> ReplayResult {
    let t = trace(name);
    let opts = ReplayOptions {
        mode: SegmentMode::Remap,
        remap_piece: Some(piece),
        timeline_points: 0,
        ..Default::default()
    };
    let r = replay::replay(&t, &opts, |_| {}).unwrap();
    assert_eq!((r.ooms, r.held_after), (0, 0), "{name}");
    r
}

#[test]
fn replay_prices_each_wait_that_drains_the_programs_work() {
    // streams-train-0 moves memory between streams, which synchronises, and PyTorch emptied its
    // cache there, freeing segments.
    use vram_ledger::replay::trace::Action;
    let t = trace("streams-train-0");
    let at = |sync_ns| {
        let opts = ReplayOptions {
            mode: SegmentMode::Remap,
            timeline_points: 0,
            sync_ns,
            ..Default::default()
        };
        replay::replay(&t, &opts, |_| {}).unwrap()
    };
    let (idle, one, two) = (at(None), at(Some(1_000_000)), at(Some(2_000_000)));
    assert_eq!(
        (idle.driver_calls, one.driver_calls),
        (one.driver_calls, two.driver_calls),
        "the price changes no decision"
    );
    assert_eq!((idle.drains, idle.torch_drains, idle.sync_us), (0, 0, None));
    assert_eq!(
        (one.drains, one.torch_drains),
        (two.drains, two.torch_drains)
    );
    let waits = |r: &ReplayResult| {
        [
            DriverCall::SyncStream,
            DriverCall::SyncDevice,
            DriverCall::FreeSegment,
        ]
        .map(|c| r.driver_calls[c])
        .iter()
        .sum::<u64>()
    };
    // A wait right after another (in one operation, no work queued between) drains nothing.
    assert!(
        one.drains > 0 && one.drains < waits(&one),
        "{} drains of {} waits",
        one.drains,
        waits(&one)
    );
    let idle_price = vram_ledger::driver::cost::host_seconds(DriverCall::SyncStream, 0);
    let per_drain = (one.driver_seconds - idle.driver_seconds) / one.drains as f64;
    assert!(
        (per_drain - (1e-3 - idle_price)).abs() < 1e-9,
        "each drain adds 1 ms less the idle price, not {per_drain} s"
    );
    // PyTorch's drains, counted from the trace: the segment frees that come first after the
    // program's allocations and frees (its empty_cache calls here).
    let mut queued = false;
    let mut theirs = 0;
    for e in &t.events {
        match e.action {
            Action::Alloc | Action::FreeRequested => queued = true,
            Action::SegmentFree if std::mem::take(&mut queued) => theirs += 1,
            _ => {}
        }
    }
    assert_eq!(one.torch_drains, theirs);
    assert_eq!(theirs, one.cache_releases, "one drain per empty_cache");
    let torch_per_drain =
        (one.torch_driver_seconds - idle.torch_driver_seconds) / one.torch_drains as f64;
    assert!((torch_per_drain - (1e-3 - idle_price)).abs() < 1e-9);
    let tenths: f64 = one.driver_seconds_by_tenth.iter().sum();
    assert!((tenths - one.driver_seconds).abs() < 1e-9);
    // The default is the price measured under load.
    let default = replay::replay(
        &t,
        &ReplayOptions {
            mode: SegmentMode::Remap,
            timeline_points: 0,
            ..Default::default()
        },
        |_| {},
    )
    .unwrap();
    assert_eq!(default.sync_us, Some(437.9));
}

#[test]
fn replay_remap_meets_the_goal_at_its_default_piece_and_25_percent_either_side() {
    // The replay goal: fragmentation at most 1.02 and at most twice PyTorch's estimated driver
    // time (waits priced under load, the default), at the default piece and at every size within 25% of it, on each shared trace
    // except streams-train-0, whose miss the README states (1.0752 at best).
    let d = DEFAULT_REMAP_PIECE;
    let g = 2 * MIB;
    let sizes: Vec<u64> = ((d * 3 / 4).div_ceil(g)..=(d * 5 / 4) / g)
        .map(|k| k * g)
        .collect();
    assert!(sizes.contains(&d) && sizes.len() >= 15, "{sizes:?}");
    for trace in ["gpt2-train", "gpt2-train-expandable", "llama1b-serve"] {
        for &piece in &sizes {
            let r = run_remap(trace, piece);
            let at = format!("{trace} at {} MiB", piece / MIB);
            assert!(
                r.fragmentation_ratio <= 1.02,
                "{at}: {}",
                r.fragmentation_ratio
            );
            assert!(
                r.driver_seconds <= 2.0 * r.torch_driver_seconds,
                "{at}: {} s against PyTorch's {} s",
                r.driver_seconds,
                r.torch_driver_seconds
            );
            assert!(r.fragmentation_ratio < r.torch_fragmentation_ratio, "{at}");
        }
    }
    // streams-train-0 misses the ratio goal (1.0752 in the README) and, with its waits priced
    // under load, the cost goal (2.51 times PyTorch's estimate); these bounds only catch a
    // regression from there.
    let r = run_remap("streams-train-0", d);
    assert!(r.fragmentation_ratio <= 1.08, "{}", r.fragmentation_ratio);
    assert!(
        r.driver_seconds <= 2.6 * r.torch_driver_seconds,
        "{} s against PyTorch's {} s",
        r.driver_seconds,
        r.torch_driver_seconds
    );
}

#[test]
fn replay_per_tag_peaks_come_from_metadata() {
    let r = run("gpt2-train", SegmentMode::Native);
    // Backward runs on autograd threads with empty metadata: untracked.
    assert!(r.per_tag[Tag::Untracked].peak_live > 0);
    assert!(r.per_tag[Tag::Weights].peak_live > 0);
    assert!(r.per_tag[Tag::Activation].peak_live > r.per_tag[Tag::Weights].peak_live);
    assert_eq!(r.per_tag[Tag::KvCache].peak_live, 0);
}

fn s(v: &str) -> Value {
    Value::String(v.into())
}

fn event(action: &str, addr: i64, size: i64, meta: &str) -> Value {
    on_stream(action, addr, size, meta, 0)
}

fn on_stream(action: &str, addr: i64, size: i64, meta: &str, stream: i64) -> Value {
    let mut d = BTreeMap::new();
    for (k, v) in [
        ("action", s(action)),
        ("addr", Value::I64(addr)),
        ("size", Value::I64(size)),
        ("stream", Value::I64(stream)),
        ("time_us", Value::I64(0)),
        ("user_metadata", s(meta)),
    ] {
        d.insert(HashableValue::String(k.into()), v);
    }
    Value::Dict(d)
}

/// Events written as `action addr size [tag] [@stream]`, separated by `;`: the address in
/// hex, the size in MiB. Several events share a line, so a trace reads as its steps.
fn events(spec: &str) -> Vec<Value> {
    let one = |e: &str| {
        let f: Vec<&str> = e.split_whitespace().collect();
        let addr = i64::from_str_radix(f[1].trim_start_matches("0x"), 16).unwrap();
        let size = f[2].parse::<i64>().unwrap() * MIB as i64;
        let (mut meta, mut stream) = ("", 0);
        for extra in &f[3..] {
            match extra.strip_prefix('@') {
                Some(s) => stream = s.parse().unwrap(),
                None => meta = extra,
            }
        }
        on_stream(f[0], addr, size, meta, stream)
    };
    spec.split(';')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(one)
        .collect()
}

fn snapshot(events: Vec<Value>) -> Vec<u8> {
    let mut top = BTreeMap::new();
    top.insert(
        HashableValue::String("segments".into()),
        Value::List(vec![]),
    );
    top.insert(
        HashableValue::String("device_traces".into()),
        Value::List(vec![Value::List(events)]),
    );
    serde_pickle::value_to_vec(&Value::Dict(top), Default::default()).unwrap()
}

#[test]
fn replay_synthetic_snapshot_exactly() {
    const MB: i64 = 1 << 20;
    let bytes = snapshot(events(
        "segment_alloc 0x10000000 40 weights; alloc 0x10000000 30 weights; alloc 0x20000000 4 kv; \
         alloc 0x30000000 2 optimizer; free_requested 0x30000000 2 optimizer; free_completed 0x30000000 2 optimizer; \
         free_requested 0x40000000 1; segment_free 0x10000000 40; snapshot 0 0;",
    ));
    let t = replay::trace::read_bytes(&bytes, None).unwrap();
    // The block at 0x40000000 is freed but never allocated: live before the recording, and
    // put back as allocated first.
    assert_eq!(t.events.len(), 9);
    assert_eq!((t.before.blocks, t.before.block_bytes), (1, MB as u64));
    assert_eq!(t.skipped.get("snapshot"), Some(&1));
    assert_eq!(
        t.unknown_tags.get("optimizer"),
        Some(&3),
        "unknown names are kept and counted"
    );
    let r = replay::replay(&t, &ReplayOptions::default(), |_| {}).unwrap();
    // Its free is never completed: it stays live to the end, beside the other three.
    assert_eq!(r.peak_live, (37 * MB) as u64);
    assert_eq!(r.torch_peak_reserved, (40 * MB) as u64);
    assert_eq!(r.allocations, 4);
    assert_eq!(r.frees, 2);
    assert_eq!(r.unmatched_frees, 0);
    assert_eq!(r.per_tag[Tag::Weights].peak_live, (30 * MB) as u64);
    assert_eq!(r.per_tag[Tag::KvCache].peak_live, (4 * MB) as u64);
    assert_eq!(
        r.per_tag[Tag::Untracked].peak_live,
        (3 * MB) as u64,
        "the unknown tag replays as untracked (2 MiB, beside the untagged 1 MiB put back)"
    );
    // Native: a 2 MiB small-pool segment for the 1 MiB block, a 30 MiB segment, a 20 MiB
    // segment (4 MiB fits, then 2 MiB in its tail).
    assert_eq!(r.peak_reserved, (52 * MB) as u64);
}

#[test]
fn the_default_device_holds_what_an_h200_holds() {
    // PyTorch gives the H200's total as 139.80 GiB: a 139 GiB block fits the device a replay
    // simulates by default, a 140 GiB one does not.
    for (gib, fits) in [(139, true), (140, false)] {
        let mib = gib * 1024;
        let bytes = snapshot(events(&format!(
            "alloc 0x10000000 {mib}; free_requested 0x10000000 {mib}; free_completed 0x10000000 {mib};"
        )));
        let t = replay::trace::read_bytes(&bytes, None).unwrap();
        let opts = ReplayOptions {
            timeline_points: 0,
            ..Default::default()
        };
        let r = replay::replay(&t, &opts, |_| {}).unwrap();
        assert_eq!(r.ooms == 0, fits, "{gib} GiB: {} out of memory", r.ooms);
    }
}

#[test]
fn replay_drains_pytorchs_streams_one_by_one() {
    // PyTorch's expandable segments synchronise a segment's stream before unmapping it (one
    // call per unmap), which drains that stream's work only; a segment free synchronises the
    // device. Stream 1's unmap drains stream 1; stream 2's unmap right after still finds
    // stream 2's allocation queued; a second unmap on stream 1 finds nothing; after more work
    // on stream 1, a segment free drains it, and the next free finds nothing.
    let bytes = snapshot(events(
        "segment_map 0x10000000 20 @1; alloc 0x10000000 20 @1; segment_map 0x40000000 20 @2; \
         alloc 0x40000000 20 @2; free_requested 0x10000000 20 @1; free_completed 0x10000000 20 @1; \
         free_requested 0x40000000 20 @2; free_completed 0x40000000 20 @2; \
         segment_unmap 0x10000000 20 @1; segment_unmap 0x40000000 20 @2; segment_unmap 0x10000000 20 @1; \
         alloc 0x20000000 2 @1; free_requested 0x20000000 2 @1; free_completed 0x20000000 2 @1; \
         segment_free 0x30000000 2; segment_free 0x30000000 2;",
    ));
    let t = replay::trace::read_bytes(&bytes, None).unwrap();
    let at = |sync_ns| {
        let opts = ReplayOptions {
            timeline_points: 0,
            sync_ns,
            ..Default::default()
        };
        replay::replay(&t, &opts, |_| {}).unwrap()
    };
    let (idle, loaded) = (at(None), at(Some(1_000_000)));
    assert_eq!(loaded.torch_driver_calls[DriverCall::SyncStream], 3);
    assert_eq!(
        loaded.torch_drains, 3,
        "stream 1, stream 2, then the device"
    );
    let idle_price = vram_ledger::driver::cost::host_seconds(DriverCall::SyncStream, 0);
    let extra = loaded.torch_driver_seconds - idle.torch_driver_seconds;
    assert!(
        (extra - 3.0 * (1e-3 - idle_price)).abs() < 1e-9,
        "{extra} s"
    );
}

#[test]
fn replay_a_block_waits_for_its_free_completed() {
    const MB: i64 = 1 << 20;
    // A is freed, but its free completes (its other stream's work) only after B is allocated:
    // B may not reuse A's memory, and the floor counts A until then. C, after, may.
    let bytes = snapshot(events(
        "alloc 0x1000 30; free_requested 0x1000 30; alloc 0x2000 30; \
         free_completed 0x1000 30; free_requested 0x2000 30; free_completed 0x2000 30; \
         alloc 0x3000 30;",
    ));
    let t = replay::trace::read_bytes(&bytes, None).unwrap();
    for mode in SegmentMode::ALL {
        let r = replay_in(&t, mode);
        assert_eq!(
            r.peak_live,
            (60 * MB) as u64,
            "{mode}: live until completed"
        );
        assert_eq!(r.peak_live_requested, (30 * MB) as u64, "{mode}");
        assert!(
            r.peak_reserved >= (60 * MB) as u64,
            "{mode}: B reused A early"
        );
        assert!(
            r.peak_reserved < (90 * MB) as u64,
            "{mode}: C did not reuse"
        );
    }
}

#[test]
fn replay_releases_the_cache_where_pytorch_did() {
    // Two segments freed in a row (one empty_cache), then a new one: a replay that kept its
    // cache would serve the last allocation from it and allocate no third segment.
    let bytes = snapshot(events(
        "segment_alloc 0x10000000 40; alloc 0x10000000 40; segment_alloc 0x20000000 40; \
         alloc 0x20000000 40; free_requested 0x10000000 40; free_completed 0x10000000 40; \
         free_requested 0x20000000 40; free_completed 0x20000000 40; segment_free 0x10000000 40; \
         segment_free 0x20000000 40; segment_alloc 0x30000000 40; alloc 0x30000000 40;",
    ));
    let t = replay::trace::read_bytes(&bytes, None).unwrap();
    let r = replay::replay(&t, &ReplayOptions::default(), |_| {}).unwrap();
    assert_eq!(r.cache_releases, 1);
    assert_eq!(r.driver_calls[DriverCall::AllocSegment], 3);
    assert_eq!(r.driver_calls[DriverCall::FreeSegment], 2);
    assert!(r.torch_driver_seconds > 0.0 && r.driver_seconds > 0.0);
}

#[test]
fn replay_moves_memory_between_streams() {
    const MB: i64 = 1 << 20;
    // 100 MiB used and freed on one stream, then on another: with moves, the second stream
    // takes the first one's memory instead of adding its own.
    let bytes = snapshot(events(
        "alloc 0x1000 100 @7; free_requested 0x1000 100 @7; free_completed 0x1000 100 @7; \
         alloc 0x2000 100 @9;",
    ));
    let t = replay::trace::read_bytes(&bytes, None).unwrap();
    for mode in [SegmentMode::Compact, SegmentMode::Remap] {
        let peak = |moves: bool| {
            let opts = ReplayOptions {
                mode,
                move_across_streams: moves,
                ..Default::default()
            };
            replay::replay(&t, &opts, |_| {}).unwrap().peak_reserved
        };
        let (with, without) = (peak(true), peak(false));
        assert!(with < (150 * MB) as u64, "{mode}: {with}");
        assert!(without >= (200 * MB) as u64, "{mode}: {without}");
    }
}

#[test]
fn replay_rejects_files_that_are_not_snapshots() {
    let dir = std::env::temp_dir().join(format!("vram-ledger-replay-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("snapshot.json");
    std::fs::write(&json, br#"{"device_traces": []}"#).unwrap();
    let e = replay::read_file(&json, None).unwrap_err().to_string();
    assert!(e.contains("not a pickle"), "{e}");
    let e = replay::read_file(&dir.join("missing.pickle"), None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("cannot read"), "{e}");
    let t = snapshot(vec![]);
    let e = replay::trace::read_bytes(&t, Some(3))
        .unwrap_err()
        .to_string();
    assert!(e.contains("device 3") && e.contains("1 device"), "{e}");
    let bad = snapshot(vec![Value::I64(7)]);
    let e = replay::trace::read_bytes(&bad, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("entry 0 is not a dict"), "{e}");
    let noaddr = {
        let Value::Dict(mut d) = event("alloc", 1, 512, "") else {
            unreachable!()
        };
        d.remove(&HashableValue::String("addr".into()));
        snapshot(vec![Value::Dict(d)])
    };
    let e = replay::trace::read_bytes(&noaddr, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("'addr'"), "{e}");
}

#[test]
fn replay_refuses_a_pickle_that_expands_without_bound() {
    // Found by fuzzing: 381 bytes that double a value with every DUP + TUPLE2, which the pickle
    // decoder would build in full (gigabytes).
    let e = replay::read_file(Path::new("tests/data/pickle-bomb.pickle"), None)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("would expand to at least") && e.contains("from 381 bytes"),
        "{e}"
    );
}

#[test]
fn replay_cli_json_svg_and_errors() {
    // Where the binary was built, unless a bundle moved it elsewhere.
    let exe = std::env::var("VRAM_LEDGER_BIN")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_vram-ledger").to_string());
    let exe = exe.as_str();
    let svg = std::env::temp_dir().join(format!("vram-ledger-{}.svg", std::process::id()));
    let out = Command::new(exe)
        .args([
            "replay",
            "tests/data/gpt2-train.pickle.gz",
            "--mode",
            "remap",
            "--json",
            "--svg",
        ])
        .arg(&svg)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for key in [
        "fragmentation_ratio",
        "peak_reserved",
        "peak_live",
        "torch_peak_reserved",
        "driver_calls",
        "per_tag",
    ] {
        assert!(v.get(key).is_some(), "missing {key}");
    }
    assert_eq!(v["mode"], "remap");
    // The waits priced under load by default, and gpt2-train's remap moves drain five times.
    assert_eq!(v["sync_us"], 437.9);
    assert_eq!(
        (v["drains"].as_u64(), v["torch_drains"].as_u64()),
        (Some(5), Some(0))
    );
    let picture = std::fs::read_to_string(&svg).unwrap();
    assert!(picture.starts_with("<svg") && picture.contains("PyTorch reserved"));
    let _ = std::fs::remove_file(&svg);

    let listed = Command::new(exe)
        .args(["replay", "--list-modes"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&listed.stdout);
    for m in SegmentMode::ALL {
        assert!(text.contains(m.name()));
    }
    let text_file = std::env::temp_dir().join(format!("vram-ledger-{}.txt", std::process::id()));
    std::fs::write(&text_file, "not a snapshot").unwrap();
    let bad = Command::new(exe)
        .arg("replay")
        .arg(&text_file)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&text_file);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("not a pickle"));
    let bad = Command::new(exe)
        .args([
            "replay",
            "tests/data/gpt2-train.pickle.gz",
            "--mode",
            "magic",
        ])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown segment mode"));
    for price in ["nan", "inf", "2e9", "0.1", "-1"] {
        let bad = Command::new(exe)
            .args(["replay", "tests/data/gpt2-train.pickle.gz"])
            .arg(format!("--sync-us={price}"))
            .output()
            .unwrap();
        assert_eq!(bad.status.code(), Some(2), "--sync-us {price}");
        assert!(String::from_utf8_lossy(&bad.stderr).contains("--sync-us"));
    }
}

#[test]
fn replay_at_peak_partitions_what_was_reserved_on_every_trace_and_mode() {
    // The parts come from the allocator's blocks and mappings, the reserved figure from its
    // ledger: they must agree, and the moment must be the peak the replay reported.
    for name in TRACES {
        let t = trace(name);
        for mode in SegmentMode::ALL {
            let opts = ReplayOptions {
                mode,
                ..Default::default()
            };
            let r = replay::replay(&t, &opts, |_| {}).unwrap();
            let p = replay::at_peak(&t, &opts, &r).unwrap().unwrap();
            assert_eq!(
                p.reserved, r.peak_reserved,
                "{name} {mode}: the peak's moment"
            );
            assert_eq!(p.total(), p.reserved, "{name} {mode}: {p:?}");
            assert!(p.requested <= r.peak_live_requested, "{name} {mode}");
        }
    }
}

#[test]
fn replay_at_peak_names_pinned_and_other_streams_memory() {
    const MB: u64 = 1 << 20;
    let at_peak = |spec: &str| {
        let t = replay::trace::read_bytes(&snapshot(events(spec)), None).unwrap();
        let opts = ReplayOptions::default();
        let r = replay::replay(&t, &opts, |_| {}).unwrap();
        replay::at_peak(&t, &opts, &r).unwrap().unwrap()
    };
    // Native: 8 MiB requests take 20 MiB segments, one per stream. The first segment keeps B
    // live beside A's freed 8 MiB and its own 4 MiB tail; stream 1's growth for C gets a new
    // segment, whose 12 MiB tail lies beside C.
    let p = at_peak(
        "alloc 0x1000 8; alloc 0x2000 8; free_requested 0x1000 8; free_completed 0x1000 8; \
         alloc 0x3000 8 @1",
    );
    assert_eq!((p.event, p.stream), (4, 1));
    assert_eq!(p.reserved, 40 * MB);
    assert_eq!(p.requested, 16 * MB);
    assert_eq!(p.free_pinned, 24 * MB);
    assert_eq!(
        p.free_other_streams + p.free_same_stream + p.pending + p.rounding,
        0
    );
    // Stream 0's segment wholly free when stream 1 grows: free on another stream.
    let p = at_peak(
        "alloc 0x1000 8; free_requested 0x1000 8; free_completed 0x1000 8; alloc 0x3000 8 @1",
    );
    assert_eq!(p.reserved, 40 * MB);
    assert_eq!(p.free_other_streams, 20 * MB);
    assert_eq!(p.free_pinned, 12 * MB);
    // A freed block still used by another stream waits: pending, not free.
    let p = at_peak(
        "alloc 0x1000 8; free_requested 0x1000 8; alloc 0x3000 8 @1; free_completed 0x1000 8",
    );
    assert_eq!(p.pending, 8 * MB);
}
