//! CUDA graph pools on the simulated device, in every segment mode: memory that allocations
//! made during a capture got is never handed to anything outside the graph while the graph may
//! replay (eager code on the capture stream, a capture into another pool), survives
//! `empty_cache`, out-of-memory retries and moves, is shared by captures that share a pool,
//! and goes back to the driver once the last graph that uses it is released. The ledger's
//! graph figure is checked against a walk of the blocks, and the memory that appeared outside
//! the allocator during a capture against what the simulated process added there.

#[path = "common/sim.rs"]
mod common;

use common::{check_graphs as check, sim};
use vram_ledger::driver::sim::SimDriver;
use vram_ledger::driver::{DriverCall, StreamId};
use vram_ledger::units::MIB;
use vram_ledger::{Allocation, Allocator, Error, GraphPool, Limit, SegmentMode, Tag};

const CAPTURE: StreamId = StreamId(0x100);
const SIDE: StreamId = StreamId(0x180);
const EAGER: StreamId = StreamId(0x200);
const P: GraphPool = GraphPool(1, 0);
const Q: GraphPool = GraphPool(2, 0);

fn overlaps(x: &Allocation, y: &Allocation) -> bool {
    x.ptr < y.ptr + y.size && y.ptr < x.ptr + x.size
}

fn alloc(a: &Allocator<SimDriver>, n: u64, s: StreamId) -> Allocation {
    a.allocate_tagged(n, s, Tag::Activation).unwrap()
}

/// A capture into `pool` on CAPTURE: an intermediate buffer freed inside it and an output kept.
/// Returns (intermediate, output).
fn capture(a: &Allocator<SimDriver>, pool: GraphPool, n: u64) -> (Allocation, Allocation) {
    let dev = a.driver().device().clone();
    dev.begin_capture(CAPTURE);
    a.begin_graph_pool(pool, CAPTURE).unwrap();
    let tmp = alloc(a, n, CAPTURE);
    let out = alloc(a, n / 2, CAPTURE);
    a.free(tmp.ptr).unwrap();
    assert!(
        dev.end_capture(CAPTURE),
        "the allocator spoiled the capture"
    );
    a.end_graph_pool(pool, CAPTURE).unwrap();
    (tmp, out)
}

#[test]
fn graph_pool_memory_freed_in_a_capture_is_not_handed_to_eager_code() {
    for mode in SegmentMode::ALL {
        for n in [700, 3 * MIB, 40 * MIB] {
            let a = sim(mode);
            let (tmp, out) = capture(&a, P, n);
            // The same request again, eagerly, on the capture stream and on another one: a
            // cache that ignored the graph would hand back `tmp`'s block.
            for s in [CAPTURE, EAGER] {
                let e = alloc(&a, n, s);
                assert!(
                    !overlaps(&e, &tmp),
                    "{mode} {n}: eager got the graph's memory"
                );
                assert!(!overlaps(&e, &out), "{mode} {n}");
                a.free(e.ptr).unwrap();
            }
            assert_eq!(a.graph_memory().allocated, out.size, "{mode} {n}");
            check(&a);
        }
    }
}

#[test]
fn graph_pool_second_capture_into_another_pool_gets_other_memory() {
    for mode in SegmentMode::ALL {
        let a = sim(mode);
        let (tmp, out) = capture(&a, P, 10 * MIB);
        let (tmp2, out2) = capture(&a, Q, 10 * MIB);
        for x in [&tmp2, &out2] {
            assert!(!overlaps(x, &tmp) && !overlaps(x, &out), "{mode}");
        }
        check(&a);
    }
}

#[test]
fn graph_pool_shared_by_two_captures_reuses_its_memory() {
    for mode in SegmentMode::ALL {
        let a = sim(mode);
        let (tmp, _out) = capture(&a, P, 10 * MIB);
        let reserved = a.graph_memory().reserved;
        // Graphs that share a pool replay one at a time, in capture order: the second may use
        // what the first freed, as with PyTorch's allocator.
        let (tmp2, _) = capture(&a, P, 10 * MIB);
        assert_eq!(tmp2.ptr, tmp.ptr, "{mode}");
        assert!(
            a.graph_memory().reserved <= reserved + 5 * MIB + 2 * MIB,
            "{mode}"
        );
        check(&a);
    }
}

#[test]
fn graph_pool_side_stream_of_a_capture_is_routed_too() {
    for mode in SegmentMode::ALL {
        let a = sim(mode);
        let dev = a.driver().device().clone();
        dev.begin_capture(CAPTURE);
        a.begin_graph_pool(P, CAPTURE).unwrap();
        dev.join_capture(SIDE, CAPTURE);
        let side = alloc(&a, 4 * MIB, SIDE);
        a.free(side.ptr).unwrap();
        assert!(dev.end_capture(CAPTURE));
        a.end_graph_pool(P, CAPTURE).unwrap();
        let e = alloc(&a, 4 * MIB, SIDE);
        assert!(
            !overlaps(&e, &side),
            "{mode}: the side stream reused the graph's memory"
        );
        check(&a);
    }
}

#[test]
fn graph_pool_memory_survives_empty_cache_retries_and_moves() {
    for mode in SegmentMode::ALL {
        let a = sim(mode);
        let (tmp, out) = capture(&a, P, 40 * MIB);
        let held = a.graph_memory().reserved;
        assert!(held >= tmp.size + out.size, "{mode}");
        a.empty_cache().unwrap();
        assert_eq!(
            a.graph_memory().reserved,
            held,
            "{mode}: empty_cache released graph memory"
        );
        assert!(a.driver().is_accessible(tmp.ptr, tmp.size), "{mode}");
        // Eager growth under a limit: the retry releases the cache, compact and remap move
        // free memory; none of it may come from the graph.
        a.set_limit(Some(Limit::Bytes(held + 64 * MIB))).unwrap();
        let e = alloc(&a, 60 * MIB, EAGER);
        let err = a
            .allocate_tagged(200 * MIB, EAGER, Tag::Activation)
            .unwrap_err();
        assert!(matches!(err, Error::OutOfMemory(_)), "{mode}: {err}");
        assert_eq!(a.graph_memory().reserved, held, "{mode}");
        assert!(a.driver().is_accessible(tmp.ptr, tmp.size), "{mode}");
        a.free(e.ptr).unwrap();
        a.set_limit(None).unwrap();
        check(&a);
    }
}

#[test]
fn graph_pool_remap_small_capture_at_the_limit_trades_a_large_spare_piece() {
    // A released graph pool leaves its remap pieces spare. At the limit, a small allocation in
    // the next capture needs a page: the small pool may not map a large piece, and a capture
    // may not release the cache, so a spare piece is given back to make room for the page.
    let a = sim(SegmentMode::Remap);
    let (_, out) = capture(&a, P, 40 * MIB);
    a.free(out.ptr).unwrap();
    a.release_graph_pool(P).unwrap();
    let held = a.driver().held_bytes();
    assert!(
        held >= 40 * MIB && a.dump().spare >= 40 * MIB,
        "the pool's pieces are spare"
    );
    a.set_limit(Some(Limit::Bytes(held))).unwrap();
    let dev = a.driver().device().clone();
    dev.begin_capture(CAPTURE);
    a.begin_graph_pool(Q, CAPTURE).unwrap();
    let small = a.allocate_tagged(4096, CAPTURE, Tag::Activation).unwrap();
    assert!(
        dev.end_capture(CAPTURE),
        "the allocator spoiled the capture"
    );
    a.end_graph_pool(Q, CAPTURE).unwrap();
    assert!(a.driver().is_accessible(small.ptr, small.size));
    assert!(a.driver().held_bytes() <= held, "within the limit");
    check(&a);
    a.free(small.ptr).unwrap();
    a.release_graph_pool(Q).unwrap();
    a.set_limit(None).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.driver().held_bytes(), 0);
}

#[test]
fn graph_pool_release_gives_its_memory_back() {
    for mode in SegmentMode::ALL {
        let a = sim(mode);
        let (_tmp, out) = capture(&a, P, 40 * MIB);
        // A second graph shares the pool: one release is not the last.
        let (_, out2) = capture(&a, P, 8 * MIB);
        a.free(out2.ptr).unwrap();
        a.release_graph_pool(P).unwrap();
        assert!(a.graph_memory().reserved > 0, "{mode}");
        let syncs = a.driver().calls(DriverCall::SyncDevice);
        a.release_graph_pool(P).unwrap();
        assert!(
            a.driver().calls(DriverCall::SyncDevice) > syncs || mode == SegmentMode::Native,
            "{mode}: unmapped before the device finished replaying"
        );
        // What is still allocated stays, in the pool, until freed.
        assert!(a.driver().is_accessible(out.ptr, out.size), "{mode}");
        assert_eq!(a.graph_memory().allocated, out.size, "{mode}");
        check(&a);
        a.free(out.ptr).unwrap();
        a.empty_cache().unwrap();
        assert_eq!(a.driver().held_bytes(), 0, "{mode}");
        assert_eq!(a.snapshot().graph_reserved_bytes.current, 0, "{mode}");
        assert!(a.snapshot().graph_reserved_bytes.peak >= 40 * MIB, "{mode}");
        check(&a);
        assert!(matches!(
            a.release_graph_pool(P),
            Err(Error::UnknownGraphPool(_))
        ));
    }
}

#[test]
fn graph_pool_release_fault_loses_nothing() {
    for mode in SegmentMode::ALL {
        for call in [
            DriverCall::SyncDevice,
            DriverCall::Unmap,
            DriverCall::ReleasePhysical,
            DriverCall::FreeSegment,
            DriverCall::ReleaseVa,
        ] {
            let a = sim(mode);
            let (_tmp, out) = capture(&a, P, 40 * MIB);
            a.free(out.ptr).unwrap();
            a.driver().fail_nth(call, 1);
            let r = a.release_graph_pool(P);
            a.driver().clear_faults();
            check(&a);
            // Whether or not the fault hit, what was not released is accounted (the check
            // above) and goes with the cache.
            a.empty_cache().unwrap();
            assert_eq!(
                a.driver().held_bytes(),
                0,
                "{mode} {call} {r:?} {:?}",
                a.dump()
            );
            check(&a);
        }
    }
}

#[test]
fn graph_pool_outside_memory_of_a_capture_is_measured() {
    let a = sim(SegmentMode::Native);
    let dev = a.driver().device().clone();
    a.driver().alloc_external(30 * MIB).unwrap(); // before: not the graph's
    dev.begin_capture(CAPTURE);
    a.begin_graph_pool(P, CAPTURE).unwrap();
    let x = alloc(&a, 5 * MIB, CAPTURE);
    assert!(dev.end_capture(CAPTURE));
    a.driver().alloc_external(82 * MIB).unwrap(); // instantiation
    a.end_graph_pool(P, CAPTURE).unwrap();
    a.driver().alloc_external(7 * MIB).unwrap(); // after: not the graph's either
    let s = a.snapshot();
    assert_eq!(s.graph_outside_bytes, 82 * MIB);
    assert_eq!(s.graph_reserved_bytes.current, a.graph_memory().reserved);
    assert!(a.graph_memory().reserved >= x.size);
}

#[test]
fn graph_pool_calls_out_of_order_are_errors() {
    let a = sim(SegmentMode::Native);
    assert!(matches!(
        a.begin_graph_pool(P, CAPTURE),
        Err(Error::NotCapturing(_))
    ));
    assert!(matches!(
        a.end_graph_pool(P, CAPTURE),
        Err(Error::UnknownGraphPool(_))
    ));
    assert!(matches!(
        a.release_graph_pool(Q),
        Err(Error::UnknownGraphPool(_))
    ));
    // Without routing, nothing changes for allocations.
    let x = alloc(&a, MIB, CAPTURE);
    a.free(x.ptr).unwrap();
    check(&a);
}

#[test]
fn graph_pool_figures_in_the_profile_report() {
    use vram_ledger::profile::{ProfileOptions, Profiler};
    let a = sim(SegmentMode::Expandable);
    let p = Profiler::new(&a).unwrap();
    let scope = p
        .begin(ProfileOptions {
            utilization: 0.5,
            ..ProfileOptions::default()
        })
        .unwrap();
    let x = alloc(&a, 300 * MIB, EAGER);
    a.free(x.ptr).unwrap();
    let (_tmp, _out) = capture(&a, P, 24 * MIB);
    // What the simulated process adds outside the allocator while a graph is captured and
    // instantiated, then outside any capture.
    let dev = a.driver().device().clone();
    dev.begin_capture(CAPTURE);
    a.begin_graph_pool(P, CAPTURE).unwrap();
    assert!(dev.end_capture(CAPTURE));
    a.driver().alloc_external(64 * MIB).unwrap();
    a.end_graph_pool(P, CAPTURE).unwrap();
    a.driver().alloc_external(10 * MIB).unwrap();
    let r = scope.end().unwrap();
    assert_eq!(r.graph_pools, a.graph_memory().reserved);
    assert!(r.graph_pools >= 36 * MIB, "{}", r.graph_pools);
    assert_eq!(r.graph_outside, 64 * MIB);
    assert!(r.non_allocator >= 74 * MIB);
    assert!(r
        .report_lines()
        .iter()
        .any(|l| l.starts_with("CUDA graphs: ")));
}

#[test]
fn graph_pool_release_during_another_capture_waits_for_it() {
    for mode in SegmentMode::ALL {
        let a = sim(mode);
        let dev = a.driver().device().clone();
        let (tmp, out) = capture(&a, P, 40 * MIB);
        a.free(out.ptr).unwrap();
        // A second graph is being captured when the first is destroyed: a device
        // synchronisation now would spoil it.
        dev.begin_capture(SIDE);
        a.begin_graph_pool(Q, SIDE).unwrap();
        let held = a.graph_memory().reserved;
        a.release_graph_pool(P).unwrap();
        let x = alloc(&a, 3 * MIB, SIDE);
        assert!(
            a.driver().is_accessible(tmp.ptr, tmp.size),
            "{mode}: released during a capture"
        );
        assert!(
            dev.end_capture(SIDE),
            "{mode}: the release spoiled another capture"
        );
        a.end_graph_pool(Q, SIDE).unwrap();
        // Now P goes; Q's memory stays.
        let after = a.graph_memory();
        assert_eq!(after.pools, 1, "{mode}");
        assert!(after.allocated >= x.size, "{mode}");
        assert!(
            a.snapshot().graph_reserved_bytes.current < held + x.size,
            "{mode}: the released pool was not given back"
        );
        assert!(!a.driver().is_accessible(tmp.ptr, tmp.size), "{mode}");
        check(&a);
    }
}

#[test]
fn graph_pool_captures_ending_out_of_order_keep_their_routes() {
    let a = sim(SegmentMode::Native);
    let dev = a.driver().device().clone();
    dev.begin_capture(CAPTURE);
    a.begin_graph_pool(P, CAPTURE).unwrap();
    dev.begin_capture(SIDE);
    a.begin_graph_pool(P, SIDE).unwrap();
    // The first capture ends first: the second's allocations still go to the pool.
    assert!(dev.end_capture(CAPTURE));
    a.end_graph_pool(P, CAPTURE).unwrap();
    let before = a.graph_memory().allocated;
    let x = alloc(&a, 5 * MIB, SIDE);
    assert_eq!(a.graph_memory().allocated, before + x.size);
    assert!(dev.end_capture(SIDE));
    a.end_graph_pool(P, SIDE).unwrap();
    check(&a);
}

/// A pool's segments name it in the dump (and as `segment_pool_id` in the snapshot, as
/// PyTorch's do); other segments name none; a pool no graph references any more is still told
/// apart from eager memory while its allocated blocks keep it.
#[test]
fn graph_pool_segments_name_their_pool() {
    for mode in SegmentMode::ALL {
        let a = sim(mode);
        let eager = alloc(&a, 4 * MIB, EAGER);
        let (_, out) = capture(&a, P, 40 * MIB);
        let pools = |a: &Allocator<SimDriver>| -> Vec<Option<(u64, u64)>> {
            let mut v: Vec<_> = a.dump().segments.iter().map(|s| s.graph_pool).collect();
            v.sort();
            v.dedup();
            v
        };
        assert_eq!(pools(&a), vec![None, Some((P.0, P.1))], "{mode}");
        assert_eq!(
            snapshot_pool_ids(&a),
            vec![(0, 0), (P.0 as i64, P.1 as i64)],
            "{mode}"
        );
        a.release_graph_pool(P).unwrap();
        let released = pools(&a);
        assert_eq!(released.len(), 2, "{mode}: {released:?}");
        assert_eq!(
            released[1],
            Some((P.0, P.1)),
            "{mode}: still named by its allocated blocks"
        );
        let bytes = vram_ledger::replay::snapshot::write(&a, 0);
        vram_ledger::replay::trace::read_bytes(&bytes, Some(0)).expect("read back");
        a.free(out.ptr).unwrap();
        a.free(eager.ptr).unwrap();
        check(&a);
    }
}

/// The distinct `segment_pool_id`s of `a`'s snapshot pickle, sorted.
fn snapshot_pool_ids(a: &Allocator<SimDriver>) -> Vec<(i64, i64)> {
    use serde_pickle::{HashableValue as H, Value as V};
    let bytes = vram_ledger::replay::snapshot::write(a, 0);
    let V::Dict(top) = serde_pickle::value_from_slice(&bytes, Default::default()).unwrap() else {
        panic!("a snapshot is a dict")
    };
    let Some(V::List(segments)) = top.get(&H::String("segments".into())) else {
        panic!("segments")
    };
    let mut ids: Vec<(i64, i64)> = segments
        .iter()
        .map(|s| match s {
            V::Dict(d) => match d.get(&H::String("segment_pool_id".into())) {
                Some(V::Tuple(t)) => match t.as_slice() {
                    [V::I64(x), V::I64(y)] => (*x, *y),
                    other => panic!("{other:?}"),
                },
                other => panic!("{other:?}"),
            },
            other => panic!("{other:?}"),
        })
        .collect();
    ids.sort();
    ids.dedup();
    ids
}
