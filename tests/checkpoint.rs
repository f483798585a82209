//! Checkpoints of a graph pool on the simulated device, in every segment mode: a restore puts
//! back exactly the blocks the checkpoint recorded (addresses, sizes, requests, tags), frees
//! what the pool held since, leaves the memory it did not free untouched, keeps the ledger equal
//! to a walk of the blocks, and is refused whole (nothing changed) while a capture runs, for a
//! checkpoint that does not fit the pool, or when the wait for another stream's work fails;
//! and random sequences of captures, frees, checkpoints and restores against a shadow of the
//! pool's live blocks.

#[path = "common/sim.rs"]
mod common;

use common::{check_graphs as check, sim, stamp, stamped};
use vram_ledger::driver::sim::SimDriver;
use vram_ledger::driver::{DriverCall, StreamId};
use vram_ledger::units::MIB;
use vram_ledger::{
    Allocation, Allocator, CheckpointBlock, Error, GraphPool, PoolOptions, SegmentMode, Tag,
};

const CAPTURE: StreamId = StreamId(0x100);
const EAGER: StreamId = StreamId(0x200);
const P: GraphPool = GraphPool(1, 0);
const Q: GraphPool = GraphPool(2, 0);

/// Run `body` as a capture into `pool` on CAPTURE.
fn captured<T>(a: &Allocator<SimDriver>, pool: GraphPool, body: impl FnOnce() -> T) -> T {
    let dev = a.driver().device().clone();
    dev.begin_capture(CAPTURE);
    a.begin_graph_pool(pool, CAPTURE).unwrap();
    let out = body();
    assert!(
        dev.end_capture(CAPTURE),
        "the allocator spoiled the capture"
    );
    a.end_graph_pool(pool, CAPTURE).unwrap();
    out
}

fn alloc(a: &Allocator<SimDriver>, n: u64, s: StreamId, tag: Tag) -> Allocation {
    a.allocate_tagged(n, s, tag).unwrap()
}

/// Each tag's allocated bytes, requested bytes and live allocations now.
fn current(s: &vram_ledger::Snapshot) -> Vec<(u64, u64, u64)> {
    Tag::ALL
        .iter()
        .map(|&t| {
            let x = &s.per_tag[t];
            (
                x.allocated_bytes.current,
                x.requested_bytes.current,
                x.allocations.current,
            )
        })
        .collect()
}

fn live(a: &Allocator<SimDriver>, pool: GraphPool) -> Vec<u64> {
    a.pool_live(pool).unwrap()
}

/// Eleven small buffers, a 3 MiB and a 40 MiB one captured into P; the 6th and 9th small ones
/// and both large ones stay live (PyTorch's checkpoint tests keep buffers in the middle of a
/// segment alive).
fn graph_with_live_middles(a: &Allocator<SimDriver>) -> Vec<Allocation> {
    captured(a, P, || {
        let small: Vec<_> = (0..11)
            .map(|i| alloc(a, 512 + 8 * i, CAPTURE, Tag::Activation))
            .collect();
        let big = alloc(a, 3 * MIB, CAPTURE, Tag::Activation);
        let huge = alloc(a, 40 * MIB, CAPTURE, Tag::KvCache);
        let mut kept = Vec::new();
        for (i, x) in small.into_iter().enumerate() {
            if i == 5 || i == 8 {
                kept.push(x);
            } else {
                a.free(x.ptr).unwrap();
            }
        }
        kept.extend([big, huge]);
        kept
    })
}

#[test]
fn checkpoint_restore_puts_back_exactly_the_recorded_blocks() {
    for mode in SegmentMode::ALL {
        let a = sim(mode);
        let kept = graph_with_live_middles(&a);
        // The simulated device keeps contents of mapped memory only.
        let contents = mode != SegmentMode::Native;
        for (i, x) in kept.iter().enumerate().filter(|_| contents) {
            stamp(&a, x, 0x5000 + i as u64);
        }
        let cp = a.checkpoint_pool(P).unwrap();
        let mut addrs: Vec<u64> = kept.iter().map(|x| x.ptr).collect();
        addrs.sort_unstable();
        assert_eq!(
            cp.blocks.iter().map(|b| b.addr).collect::<Vec<_>>(),
            addrs,
            "{mode}"
        );
        let huge = cp.blocks.iter().find(|b| b.addr == kept[3].ptr).unwrap();
        assert_eq!(
            (huge.size, huge.requested, huge.tag),
            (kept[3].size, 40 * MIB, Tag::KvCache),
            "{mode}"
        );
        let before = a.snapshot();

        // The graph's outputs die and a second graph shares the pool.
        a.free(kept[0].ptr).unwrap();
        a.free(kept[3].ptr).unwrap();
        let second = captured(&a, P, || {
            [
                alloc(&a, 700, CAPTURE, Tag::Activation),
                alloc(&a, 20 * MIB, CAPTURE, Tag::Activation),
            ]
        });
        let reserved = a.snapshot().reserved_bytes.current;

        let done = a.restore_pool(&cp).unwrap();
        assert_eq!(done.made, cp.blocks, "{mode}");
        let mut freed = done.freed.clone();
        freed.sort_unstable();
        let mut expected: Vec<u64> = [kept[1].ptr, kept[2].ptr, second[0].ptr, second[1].ptr]
            .into_iter()
            .collect();
        expected.sort_unstable();
        assert_eq!(freed, expected, "{mode}: what was live at the restore");
        assert_eq!(a.checkpoint_pool(P).unwrap(), cp, "{mode}");
        assert_eq!(live(&a, P), addrs, "{mode}");
        // Blocks live throughout were freed and made again in place: their contents stay.
        if contents {
            assert!(stamped(&a, &kept[1], 0x5001), "{mode}");
            assert!(stamped(&a, &kept[2], 0x5002), "{mode}");
        }
        let after = a.snapshot();
        assert_eq!(current(&after), current(&before), "{mode}: the ledger");
        assert_eq!(
            after.reserved_bytes.current, reserved,
            "{mode}: memory moved"
        );
        check(&a);

        // The blocks made are allocations like any other.
        for p in addrs {
            a.free(p).unwrap();
        }
        assert!(live(&a, P).is_empty(), "{mode}");
        check(&a);
    }
}

#[test]
fn checkpoint_restore_is_refused_whole_when_it_cannot_be_done() {
    for mode in SegmentMode::ALL {
        let a = sim(mode);
        let kept = graph_with_live_middles(&a);
        let cp = a.checkpoint_pool(P).unwrap();
        a.free(kept[0].ptr).unwrap();
        let now = live(&a, P);
        let eager = alloc(&a, 4 * MIB, EAGER, Tag::Activation);
        let snap = current(&a.snapshot());
        let mut outside = cp.clone();
        outside.blocks.push(CheckpointBlock {
            addr: eager.ptr,
            size: eager.size,
            requested: eager.requested,
            tag: Tag::Activation,
        });
        let mut overlapping = cp.clone();
        let mut twin = overlapping.blocks[0];
        twin.addr += 8;
        overlapping.blocks.push(twin);
        let mut inflated = cp.clone();
        inflated.blocks[0].requested = inflated.blocks[0].size + 1;
        for bad in [outside, overlapping, inflated] {
            match a.restore_pool(&bad) {
                Err(Error::StaleCheckpoint(_)) => {}
                other => panic!("{mode}: {other:?}"),
            }
        }
        let mut unknown = cp.clone();
        unknown.pool = GraphPool(9, 9);
        assert!(matches!(
            a.restore_pool(&unknown),
            Err(Error::UnknownGraphPool(_))
        ));

        // While another graph is being captured.
        let dev = a.driver().device().clone();
        dev.begin_capture(CAPTURE);
        a.begin_graph_pool(Q, CAPTURE).unwrap();
        assert!(
            matches!(a.restore_pool(&cp), Err(Error::Capturing(_))),
            "{mode}"
        );
        assert!(
            dev.end_capture(CAPTURE),
            "{mode}: the restore spoiled the capture"
        );
        a.end_graph_pool(Q, CAPTURE).unwrap();

        assert_eq!(
            live(&a, P),
            now,
            "{mode}: a refused restore changed the pool"
        );
        assert_eq!(current(&a.snapshot()), snap, "{mode}");
        check(&a);
        a.restore_pool(&cp).unwrap();
        assert_eq!(a.checkpoint_pool(P).unwrap(), cp, "{mode}");
        check(&a);
    }
}

#[test]
fn checkpoint_restore_waits_for_other_streams_and_a_failed_wait_changes_nothing() {
    for mode in SegmentMode::ALL {
        let a = sim(mode);
        a.hold_pool(P, PoolOptions::default()).unwrap();
        // A thread's pool outside any capture: its blocks are used by the allocating stream.
        a.begin_thread_pool(P).unwrap();
        let x = alloc(&a, 2 * MIB, EAGER, Tag::Activation);
        let y = alloc(&a, 1000, EAGER, Tag::Weights);
        let cp = a.checkpoint_pool(P).unwrap();
        a.free(y.ptr).unwrap();
        let z = alloc(&a, 3000, EAGER, Tag::Activation);
        a.end_thread_pool(P).unwrap();
        let now = live(&a, P);
        let snap = current(&a.snapshot());

        let waits = a.driver().calls(DriverCall::WaitEvent);
        a.driver().fail_nth(DriverCall::WaitEvent, 1);
        assert!(
            a.restore_pool(&cp).is_err(),
            "{mode}: the failed wait was dropped"
        );
        assert_eq!(live(&a, P), now, "{mode}");
        assert_eq!(current(&a.snapshot()), snap, "{mode}");
        check(&a);

        let done = a.restore_pool(&cp).unwrap();
        assert!(
            a.driver().calls(DriverCall::WaitEvent) > waits + 1,
            "{mode}: no wait"
        );
        let mut freed = done.freed;
        freed.sort_unstable();
        let mut expected = vec![x.ptr, z.ptr];
        expected.sort_unstable();
        assert_eq!(freed, expected, "{mode}");
        assert_eq!(a.checkpoint_pool(P).unwrap(), cp, "{mode}");
        check(&a);
    }
}

#[test]
fn checkpoint_restore_remakes_blocks_that_all_died_since() {
    for mode in SegmentMode::ALL {
        let a = sim(mode);
        let outs = captured(&a, P, || {
            [
                alloc(&a, 512, CAPTURE, Tag::Activation),
                alloc(&a, 512, CAPTURE, Tag::Activation),
            ]
        });
        let cp = a.checkpoint_pool(P).unwrap();
        for x in &outs {
            a.free(x.ptr).unwrap();
        }
        assert!(live(&a, P).is_empty(), "{mode}");
        let done = a.restore_pool(&cp).unwrap();
        assert!(done.freed.is_empty(), "{mode}");
        assert_eq!(live(&a, P).len(), 2, "{mode}");
        check(&a);
    }
}

/// One step of the shadow-model property below.
#[derive(Clone, Debug)]
enum Op {
    /// A capture into P allocating blocks of these (size index, tag index), keeping those whose
    /// bit is set in the mask (the rest die inside the capture).
    Capture(Vec<(u8, u8)>, u16),
    /// A live block of the pool dies.
    Free(u16),
    /// Eager work on another stream beside the pool.
    Eager(u8),
    Checkpoint,
    Restore,
    EmptyCache,
}

const SIZES: [u64; 7] = [512, 3000, MIB + 1, 2 * MIB, 5 * MIB, 20 * MIB, 40 * MIB];

fn op() -> impl proptest::strategy::Strategy<Value = Op> {
    use proptest::prelude::*;
    prop_oneof![
        3 => (proptest::collection::vec((0u8..7, 0u8..4), 1..6), any::<u16>())
            .prop_map(|(v, keep)| Op::Capture(v, keep)),
        3 => any::<u16>().prop_map(Op::Free),
        1 => (0u8..7).prop_map(Op::Eager),
        2 => Just(Op::Checkpoint),
        2 => Just(Op::Restore),
        1 => Just(Op::EmptyCache),
    ]
}

/// What the pool holds allocated, as the shadow keeps it: address → (size, request, tag, stamp).
type Shadow = std::collections::BTreeMap<u64, (u64, u64, Tag, u64)>;

fn run(mode: SegmentMode, ops: &[Op]) -> Result<(), proptest::test_runner::TestCaseError> {
    use proptest::prop_assert_eq;
    let a = sim(mode);
    // As a graph holds its pool: known, and its memory kept, whatever dies.
    a.hold_pool(P, PoolOptions::default()).unwrap();
    let contents = mode != SegmentMode::Native;
    let mut shadow = Shadow::new();
    let mut saved: Option<(vram_ledger::PoolCheckpoint, Shadow)> = None;
    let mut seed = 0x9000u64;
    for op in ops {
        match op {
            Op::Capture(blocks, keep) => {
                let made: Vec<(Allocation, bool)> = captured(&a, P, || {
                    let mut out = Vec::new();
                    for (i, &(s, t)) in blocks.iter().enumerate() {
                        let x = alloc(&a, SIZES[s as usize], CAPTURE, Tag::ALL[t as usize]);
                        out.push((x, keep & (1 << i) != 0));
                    }
                    for (x, kept) in &out {
                        if !kept {
                            a.free(x.ptr).unwrap();
                        }
                    }
                    out
                });
                for (x, _) in made.into_iter().filter(|m| m.1) {
                    seed += 1;
                    if contents {
                        stamp(&a, &x, seed);
                    }
                    shadow.insert(x.ptr, (x.size, x.requested, x.tag, seed));
                }
            }
            Op::Free(pick) if !shadow.is_empty() => {
                let addr = *shadow.keys().nth(*pick as usize % shadow.len()).unwrap();
                a.free(addr).unwrap();
                shadow.remove(&addr);
            }
            Op::Free(_) => {}
            Op::Eager(s) => {
                let x = alloc(&a, SIZES[*s as usize], EAGER, Tag::Activation);
                a.free(x.ptr).unwrap();
            }
            Op::Checkpoint => {
                let cp = a.checkpoint_pool(P).unwrap();
                let recorded: Vec<CheckpointBlock> = shadow
                    .iter()
                    .map(|(&addr, &(size, requested, tag, _))| CheckpointBlock {
                        addr,
                        size,
                        requested,
                        tag,
                    })
                    .collect();
                prop_assert_eq!(&cp.blocks, &recorded, "{}: the checkpoint", mode);
                saved = Some((cp, shadow.clone()));
            }
            Op::Restore => {
                let Some((cp, then)) = &saved else { continue };
                let done = a.restore_pool(cp).unwrap();
                let mut freed = done.freed.clone();
                freed.sort_unstable();
                prop_assert_eq!(
                    freed,
                    shadow.keys().copied().collect::<Vec<_>>(),
                    "{}: a restore frees what the pool held",
                    mode
                );
                prop_assert_eq!(&done.made, &cp.blocks, "{}", mode);
                // A block live at the checkpoint and still live now kept its bytes; one remade
                // from a block that died since holds whatever it holds, and is stamped anew.
                let mut now = Shadow::new();
                for (&addr, &(size, requested, tag, s)) in then {
                    let x = Allocation {
                        ptr: addr,
                        size,
                        requested,
                        stream: CAPTURE,
                        tag,
                    };
                    let survived = shadow.get(&addr).is_some_and(|n| n.3 == s);
                    let s = if survived {
                        if contents {
                            proptest::prop_assert!(
                                stamped(&a, &x, s),
                                "{}: contents at {:#x}",
                                mode,
                                addr
                            );
                        }
                        s
                    } else {
                        seed += 1;
                        if contents {
                            stamp(&a, &x, seed);
                        }
                        seed
                    };
                    now.insert(addr, (size, requested, tag, s));
                }
                shadow = now;
            }
            Op::EmptyCache => a.empty_cache().unwrap(),
        }
        check(&a);
        prop_assert_eq!(
            live(&a, P),
            shadow.keys().copied().collect::<Vec<_>>(),
            "{}: the pool's live blocks after {:?}",
            mode,
            op
        );
    }
    Ok(())
}

/// Random captures, frees, checkpoints and restores of one pool against a shadow of its live
/// blocks, in every mode: each checkpoint records exactly the shadow's blocks, each restore
/// succeeds, frees exactly what the pool held and makes exactly the checkpoint's blocks, blocks
/// live throughout keep their contents, and the invariants hold after every step.
/// Cases: `VRAM_LEDGER_CASES` / 8 per mode (default 125).
#[test]
fn checkpoint_restore_against_a_shadow_of_the_pool() {
    let cases = std::env::var("VRAM_LEDGER_CASES")
        .ok()
        .and_then(|v| v.parse::<u32>().ok())
        .unwrap_or(1000)
        / 8;
    for mode in SegmentMode::ALL {
        let mut runner = proptest::test_runner::TestRunner::new(proptest::test_runner::Config {
            cases: cases.max(1),
            failure_persistence: None,
            ..Default::default()
        });
        let ops = proptest::collection::vec(op(), 1..40);
        if let Err(e) = runner.run(&ops, |ops| run(mode, &ops)) {
            panic!("{mode}: {e}");
        }
    }
}
