//! Sleep and wake of CUDA graph pools on the simulated device, in every virtual-memory mode:
//! with tags kept apart, a pool's memory of a tag is that tag's region, so it sleeps with the
//! tag (offloaded or discarded) and wakes at the same addresses, where a captured graph replays
//! as before. The ledger's graph gauge is checked against a walk of the segments throughout,
//! and faults injected into every driver call of sleep and wake leave the tag wholly asleep or
//! wholly awake with the pool's contents intact.

#[path = "common/sim.rs"]
mod common;

use common::{check_graphs as check, stamp, stamped, VIRTUAL};
use vram_ledger::driver::sim::SimDriver;
use vram_ledger::driver::{DriverCall, StreamId};
use vram_ledger::units::{GIB, MIB};
use vram_ledger::{Allocation, Allocator, Error, GraphPool, SegmentMode, Tag};

const CAPTURE: StreamId = StreamId(0x100);
const EAGER: StreamId = StreamId(0x200);
const P: GraphPool = GraphPool(1, 0);

fn allocator(mode: SegmentMode) -> Allocator<SimDriver> {
    common::tags_apart(mode, 80 * GIB)
}

/// A graph's memory: a capture into P allocating an intermediate (freed inside the capture)
/// and an output (kept, as a graph's output is), both activation; the output stamped.
fn capture(a: &Allocator<SimDriver>) -> Allocation {
    let dev = a.driver().device().clone();
    dev.begin_capture(CAPTURE);
    a.begin_graph_pool(P, CAPTURE).unwrap();
    let tmp = a
        .allocate_tagged(24 * MIB, CAPTURE, Tag::Activation)
        .unwrap();
    let out = a
        .allocate_tagged(6 * MIB, CAPTURE, Tag::Activation)
        .unwrap();
    a.free(tmp.ptr).unwrap();
    assert!(
        dev.end_capture(CAPTURE),
        "the allocator spoiled the capture"
    );
    a.end_graph_pool(P, CAPTURE).unwrap();
    stamp(a, &out, 0xfeed);
    out
}

#[test]
fn sleep_offloads_a_graph_pool_with_its_tag_and_wakes_it_at_the_same_addresses() {
    for mode in VIRTUAL {
        let a = allocator(mode);
        let w = a.allocate_tagged(64 * MIB, EAGER, Tag::Weights).unwrap();
        let out = capture(&a);
        let pool = a.graph_memory().reserved;
        assert!(pool >= 30 * MIB, "{mode}: {pool}");
        check(&a);
        let r = a.sleep(&[Tag::Activation], &[]).unwrap();
        assert!(r.given_back_bytes >= pool, "{mode}: {r:?}");
        assert_eq!(
            a.graph_memory().reserved,
            0,
            "{mode}: the pool's memory went back"
        );
        assert!(
            a.driver().read_word(out.ptr).is_err(),
            "{mode}: nothing behind it"
        );
        assert!(
            a.driver().is_accessible(w.ptr, w.size),
            "{mode}: other tags stay"
        );
        check(&a);
        a.wake(&[]).unwrap();
        assert_eq!(a.graph_memory().reserved, pool, "{mode}");
        assert!(
            stamped(&a, &out, 0xfeed),
            "{mode}: the graph's output, where it was"
        );
        check(&a);
        a.release_graph_pool(P).unwrap();
        a.free(out.ptr).unwrap();
        a.free(w.ptr).unwrap();
        a.empty_cache().unwrap();
        assert_eq!(a.driver().held_bytes(), 0, "{mode}");
        check(&a);
    }
}

#[test]
fn sleep_discards_a_graph_pool_and_wake_gives_zeros_at_the_same_addresses() {
    for mode in VIRTUAL {
        let a = allocator(mode);
        let out = capture(&a);
        a.sleep(&[], &[Tag::Activation]).unwrap();
        assert_eq!(a.graph_memory().reserved, 0, "{mode}");
        a.wake(&[Tag::Activation]).unwrap();
        assert_eq!(a.driver().read_word(out.ptr).unwrap(), 0, "{mode}");
        assert_eq!(
            a.driver().read_word(out.ptr + out.size - 8).unwrap(),
            0,
            "{mode}"
        );
        check(&a);
    }
}

/// While its tag sleeps, a pool takes no new memory (a capture's allocation of that tag is
/// refused), and a release of the pool (its last graph destroyed) waits: the asleep memory is
/// given back by the first `empty_cache` after the wake.
#[test]
fn sleep_graph_pool_refuses_captures_and_defers_its_release_while_asleep() {
    for mode in VIRTUAL {
        let a = allocator(mode);
        let out = capture(&a);
        a.sleep(&[Tag::Activation], &[]).unwrap();
        let dev = a.driver().device().clone();
        dev.begin_capture(CAPTURE);
        a.begin_graph_pool(P, CAPTURE).unwrap();
        assert!(
            matches!(
                a.allocate_tagged(MIB, CAPTURE, Tag::Activation),
                Err(Error::Asleep(Tag::Activation))
            ),
            "{mode}"
        );
        assert!(dev.end_capture(CAPTURE));
        a.end_graph_pool(P, CAPTURE).unwrap();
        a.release_graph_pool(P).unwrap();
        a.release_graph_pool(P).unwrap();
        a.free(out.ptr).unwrap();
        check(&a);
        a.wake(&[]).unwrap();
        check(&a);
        a.empty_cache().unwrap();
        assert_eq!(a.driver().held_bytes(), 0, "{mode}");
        assert_eq!(a.graph_memory().reserved, 0, "{mode}");
        check(&a);
    }
}

/// Every tag asleep, graph pools with them: the allocator holds nothing (the goal: 8 MiB).
#[test]
fn sleep_of_every_tag_leaves_the_allocator_holding_at_most_8_mib() {
    for mode in VIRTUAL {
        let a = allocator(mode);
        let mut live = vec![
            a.allocate_tagged(512 * MIB, EAGER, Tag::Weights).unwrap(),
            a.allocate_tagged(700 << 10, EAGER, Tag::Weights).unwrap(),
            a.allocate_tagged(GIB, EAGER, Tag::KvCache).unwrap(),
            a.allocate_tagged(3 * MIB, EAGER, Tag::Activation).unwrap(),
            a.allocate_tagged(4096, EAGER, Tag::Untracked).unwrap(),
        ];
        live.push(capture(&a));
        a.sleep(
            &[Tag::Weights],
            &[Tag::KvCache, Tag::Activation, Tag::Untracked],
        )
        .unwrap();
        let held = a.snapshot().reserved_bytes.current;
        // The goal is at most 8 MiB; on the simulated device nothing at all is held.
        assert_eq!(held, 0, "{mode}: {held} bytes held asleep");
        assert_eq!(a.driver().held_bytes(), held, "{mode}: the driver agrees");
        a.wake(&[]).unwrap();
        check(&a);
        a.release_graph_pool(P).unwrap();
        for x in live {
            a.free(x.ptr).unwrap();
        }
        a.empty_cache().unwrap();
        assert_eq!(a.driver().held_bytes(), 0, "{mode}");
    }
}

#[test]
fn sleep_and_wake_faults_leave_a_graph_pool_wholly_asleep_or_awake() {
    let calls = [
        DriverCall::SyncDevice,
        DriverCall::HostAlloc,
        DriverCall::CopyToHost,
        DriverCall::CopyToDevice,
        DriverCall::SyncStream,
        DriverCall::ReleasePhysical,
        DriverCall::Unmap,
        DriverCall::CreatePhysical,
        DriverCall::Map,
        DriverCall::SetAccess,
    ];
    let mut struck = std::collections::BTreeSet::new();
    for mode in VIRTUAL {
        for call in calls {
            for nth in [1, 2] {
                for during_wake in [false, true] {
                    let a = allocator(mode);
                    let out = capture(&a);
                    let pool = a.graph_memory().reserved;
                    if during_wake {
                        a.sleep(&[Tag::Activation], &[]).unwrap();
                    }
                    let before = a.driver().calls(call);
                    a.driver().fail_nth(call, nth);
                    let r = if during_wake {
                        a.wake(&[]).map(|_| ())
                    } else {
                        a.sleep(&[Tag::Activation], &[]).map(|_| ())
                    };
                    if a.driver().calls(call) >= before + nth {
                        struck.insert(call);
                    }
                    a.driver().clear_faults();
                    let what = format!("{mode} {call} #{nth} wake={during_wake} ({r:?})");
                    if !a.asleep_tags().contains(&Tag::Activation) {
                        assert!(stamped(&a, &out, 0xfeed), "{what}: awake, all there");
                    }
                    check(&a);
                    a.wake(&[]).unwrap();
                    assert!(stamped(&a, &out, 0xfeed), "{what}");
                    assert_eq!(a.graph_memory().reserved, pool, "{what}");
                    check(&a);
                    a.release_graph_pool(P).unwrap();
                    a.free(out.ptr).unwrap();
                    a.empty_cache().unwrap();
                    assert_eq!(a.driver().held_bytes(), 0, "{what}");
                    assert_eq!(a.driver().host_bytes(), 0, "{what}");
                }
            }
        }
    }
    assert_eq!(struck.len(), calls.len(), "struck: {struck:?}");
}
