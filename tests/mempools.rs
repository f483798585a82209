//! Pools a thread allocates into (PyTorch's `torch.cuda.MemPool` and `use_mem_pool`) on the
//! simulated device, in every segment mode: a thread's route takes its allocations on every
//! stream and no other thread's; the innermost of nested pools serves; a held pool keeps its
//! memory through `empty_cache` and gives it back once released; a block freed in a pool waits
//! for the stream it was used on before another stream reuses it; a route ended that was never
//! begun is an error that changes nothing. A pool with an allocator of its own takes its
//! segments from it and gives them back to it, also after the pool is gone, its failures are
//! out of memory, and the cap counts it; a `use_on_oom` pool's free blocks serve what nothing
//! else can, and no other pool's do.

#[path = "common/sim.rs"]
mod common;

use common::{check_graphs as check, sim};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use common::sim_with;
use vram_ledger::driver::external::{SegmentSource, Source};
use vram_ledger::driver::sim::SimDriver;
use vram_ledger::driver::{
    DevicePtr, Driver, DriverCall, DriverError, DriverErrorKind, DriverResult, StreamId,
};
use vram_ledger::units::MIB;
use vram_ledger::{
    Allocation, Allocator, Config, Error, GraphPool, Limit, PoolOptions, SegmentMode, Tag,
};

const S0: StreamId = StreamId(0x100);
const S1: StreamId = StreamId(0x200);
const P: GraphPool = GraphPool(0, 1);
const Q: GraphPool = GraphPool(0, 2);

fn alloc(a: &Allocator<SimDriver>, n: u64, s: StreamId) -> Allocation {
    a.allocate_tagged(n, s, Tag::Activation).unwrap()
}

/// The pool a block's segment names in the allocator's dump (None: a stream's own memory).
fn pool_of(a: &Allocator<SimDriver>, x: &Allocation) -> Option<GraphPool> {
    a.dump()
        .segments
        .iter()
        .find(|s| s.blocks.iter().any(|b| b.addr == x.ptr))
        .expect("the block's segment is in the dump")
        .graph_pool
        .map(|(p, q)| GraphPool(p, q))
}

#[test]
fn a_thread_route_takes_that_threads_allocations_on_every_stream_and_no_other_threads() {
    for mode in SegmentMode::ALL {
        let a = sim(mode);
        a.hold_pool(P, PoolOptions::default()).unwrap();
        a.begin_thread_pool(P).unwrap();
        let here: Vec<_> = [S0, S1].map(|s| alloc(&a, 3 * MIB, s)).into();
        let elsewhere = std::thread::scope(|t| t.spawn(|| alloc(&a, 3 * MIB, S0)).join().unwrap());
        a.end_thread_pool(P).unwrap();
        let after = alloc(&a, 3 * MIB, S0);
        for x in &here {
            assert_eq!(pool_of(&a, x), Some(P), "{mode}: routed to the pool");
        }
        assert_eq!(
            pool_of(&a, &elsewhere),
            None,
            "{mode}: another thread is not routed"
        );
        assert_eq!(pool_of(&a, &after), None, "{mode}: the route ended");
        assert_eq!(a.graph_memory().allocated, 2 * 3 * MIB, "{mode}");
        check(&a);
    }
}

#[test]
fn nested_pools_serve_the_innermost_until_it_ends() {
    for mode in SegmentMode::ALL {
        let a = sim(mode);
        a.begin_thread_pool(P).unwrap();
        let outer = alloc(&a, MIB, S0);
        a.begin_thread_pool(Q).unwrap();
        let inner = alloc(&a, MIB, S0);
        a.end_thread_pool(Q).unwrap();
        let outer_again = alloc(&a, MIB, S0);
        a.end_thread_pool(P).unwrap();
        assert_eq!(pool_of(&a, &outer), Some(P), "{mode}");
        assert_eq!(pool_of(&a, &inner), Some(Q), "{mode}");
        assert_eq!(pool_of(&a, &outer_again), Some(P), "{mode}");
        check(&a);
    }
}

#[test]
fn a_held_pool_keeps_its_memory_through_empty_cache_and_gives_it_back_once_released() {
    for mode in SegmentMode::ALL {
        let a = sim(mode);
        // As torch.cuda.MemPool() and `with use_mem_pool(pool)`: a hold, then a route (its own
        // reference), ended and released.
        a.hold_pool(P, PoolOptions::default()).unwrap();
        a.begin_thread_pool(P).unwrap();
        let x = alloc(&a, 8 * MIB, S0);
        a.free_on(x.ptr, S0).unwrap();
        a.empty_cache().unwrap();
        let held = a.graph_memory().reserved;
        assert!(
            held >= 8 * MIB,
            "{mode}: empty_cache inside the pool kept it ({held})"
        );
        a.end_thread_pool(P).unwrap();
        a.release_graph_pool(P).unwrap();
        a.empty_cache().unwrap();
        assert_eq!(
            a.graph_memory().reserved,
            held,
            "{mode}: the pool object still holds it"
        );
        a.release_graph_pool(P).unwrap();
        a.empty_cache().unwrap();
        assert_eq!(
            a.graph_memory().reserved,
            0,
            "{mode}: released with the last reference"
        );
        assert_eq!(a.graph_memory().pools, 0, "{mode}");
        check(&a);
    }
}

/// A stream whose allocations share a shard (and so a pool's free blocks) with S0's: streams
/// are dealt to shards round-robin until every shard has one, then hashed, so one is found by
/// trying: a pool block S0 freed with no work queued is reusable at once by a stream in its
/// shard.
fn sharing_s0(a: &Allocator<SimDriver>) -> StreamId {
    for s in 1..16 {
        let x = alloc(a, 4096, StreamId(0x100 + s));
        a.free(x.ptr).unwrap();
    }
    (0x1000..0x2000)
        .map(StreamId)
        .find(|&t| {
            let x = alloc(a, 4096, S0);
            a.free_on(x.ptr, S0).unwrap();
            let y = alloc(a, 4096, t);
            a.free_on(y.ptr, t).unwrap();
            y.ptr == x.ptr
        })
        .expect("some stream shares S0's shard")
}

#[test]
fn a_block_freed_in_a_pool_waits_for_its_stream_before_another_stream_reuses_it() {
    for mode in SegmentMode::ALL {
        let a = sim(mode);
        alloc(&a, 4096, S0);
        a.begin_thread_pool(P).unwrap();
        let t = sharing_s0(&a);
        let x = alloc(&a, 4096, S0);
        // Work queued on S0 still uses the block when it is freed.
        a.driver().device().submit(S0);
        a.free_on(x.ptr, S0).unwrap();
        let y = alloc(&a, 4096, t);
        assert_ne!(
            y.ptr, x.ptr,
            "{mode}: another stream got the block while S0 may use it"
        );
        a.driver().device().complete(S0);
        let z = alloc(&a, 4096, t);
        assert_eq!(z.ptr, x.ptr, "{mode}: reused once S0 reached the free");
        a.end_thread_pool(P).unwrap();
        check(&a);
    }
}

#[test]
fn ending_a_route_this_thread_never_began_is_an_error_that_changes_nothing() {
    let a = sim(SegmentMode::Remap);
    assert!(matches!(
        a.end_thread_pool(P),
        Err(Error::UnknownGraphPool(_))
    ));
    a.begin_thread_pool(P).unwrap();
    let other = std::thread::scope(|t| t.spawn(|| a.end_thread_pool(P)).join().unwrap());
    assert!(
        matches!(other, Err(Error::UnknownGraphPool(_))),
        "{other:?}"
    );
    let x = alloc(&a, MIB, S0);
    assert_eq!(
        pool_of(&a, &x),
        Some(P),
        "this thread's route is still there"
    );
    a.end_thread_pool(P).unwrap();
    assert!(matches!(
        a.end_thread_pool(P),
        Err(Error::UnknownGraphPool(_))
    ));
    check(&a);
}

/// A pool's own allocator: another process on the same simulated device, counting its calls
/// and the bytes it holds, failing while `fail` is set.
struct Own {
    d: SimDriver,
    allocs: AtomicU64,
    frees: AtomicU64,
    held: AtomicU64,
    fail: AtomicBool,
}

impl std::fmt::Debug for Own {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the test's own allocator")
    }
}

impl SegmentSource for Own {
    fn alloc(&self, bytes: u64, stream: StreamId) -> DriverResult<DevicePtr> {
        if self.fail.load(Relaxed) {
            return Err(DriverError::new(
                DriverCall::AllocSegment,
                DriverErrorKind::OutOfMemory,
                "refused",
            ));
        }
        let p = self.d.alloc_segment(bytes, stream)?;
        self.allocs.fetch_add(1, Relaxed);
        self.held.fetch_add(bytes, Relaxed);
        Ok(p)
    }

    fn free(&self, ptr: DevicePtr, bytes: u64, _stream: StreamId) -> DriverResult<()> {
        self.d.free_segment(ptr, bytes)?;
        self.frees.fetch_add(1, Relaxed);
        self.held.fetch_sub(bytes, Relaxed);
        Ok(())
    }
}

fn own(a: &Allocator<SimDriver>) -> Arc<Own> {
    Arc::new(Own {
        d: a.driver().device().spawn_process().unwrap(),
        allocs: AtomicU64::new(0),
        frees: AtomicU64::new(0),
        held: AtomicU64::new(0),
        fail: AtomicBool::new(false),
    })
}

fn with_source(o: &Arc<Own>) -> PoolOptions {
    PoolOptions {
        source: Some(o.clone() as Source),
        ..PoolOptions::default()
    }
}

#[test]
fn a_pool_with_its_own_allocator_takes_its_segments_from_it_and_gives_them_back() {
    for mode in SegmentMode::ALL {
        let a = sim(mode);
        let o = own(&a);
        let segments_before = a.snapshot().driver_calls[DriverCall::AllocSegment];
        a.hold_pool(P, with_source(&o)).unwrap();
        a.begin_thread_pool(P).unwrap();
        let big = alloc(&a, 3 * MIB, S0);
        let small = alloc(&a, 700, S0);
        let plain_before = alloc(&a, MIB, S1);
        a.end_thread_pool(P).unwrap();
        // The route's reference and the pool object's.
        a.release_graph_pool(P).unwrap();
        a.release_graph_pool(P).unwrap();
        // A small and a large segment in S0's shard, one in S1's.
        assert_eq!(o.allocs.load(Relaxed), 3, "{mode}");
        assert_eq!(pool_of(&a, &big), Some(P), "{mode}");
        assert_eq!(pool_of(&a, &small), Some(P), "{mode}");
        assert_eq!(
            pool_of(&a, &plain_before),
            Some(P),
            "{mode}: on every stream"
        );
        let held = o.held.load(Relaxed);
        assert_eq!(
            a.snapshot().reserved_bytes.current,
            held,
            "{mode}: counted as reserved"
        );
        if mode == SegmentMode::Native {
            assert_eq!(
                a.snapshot().driver_calls[DriverCall::AllocSegment],
                segments_before,
                "{mode}: no segment from the driver"
            );
        }
        check(&a);
        // The pool object is gone; the memory goes back to its allocator once freed.
        for x in [&big, &small, &plain_before] {
            a.free(x.ptr).unwrap();
        }
        a.empty_cache().unwrap();
        assert_eq!(o.frees.load(Relaxed), 3, "{mode}");
        assert_eq!(o.held.load(Relaxed), 0, "{mode}");
        assert_eq!(a.snapshot().reserved_bytes.current, 0, "{mode}");
        check(&a);
    }
}

#[test]
fn a_pools_own_allocator_refusing_is_out_of_memory_and_the_cap_counts_its_memory() {
    let a = sim_with(Config {
        limit: Some(Limit::Bytes(64 * MIB)),
        ..Config::with_mode(SegmentMode::Remap)
    });
    let o = own(&a);
    a.hold_pool(P, with_source(&o)).unwrap();
    a.begin_thread_pool(P).unwrap();
    o.fail.store(true, Relaxed);
    let refused = a.allocate_tagged(8 * MIB, S0, Tag::Activation);
    assert!(matches!(refused, Err(Error::OutOfMemory(_))), "{refused:?}");
    o.fail.store(false, Relaxed);
    let x = alloc(&a, 40 * MIB, S0);
    let over = a.allocate_tagged(30 * MIB, S0, Tag::Activation);
    assert!(
        matches!(over, Err(Error::OutOfMemory(_))),
        "the cap counts the pool: {over:?}"
    );
    assert_eq!(o.allocs.load(Relaxed), 1);
    a.free(x.ptr).unwrap();
    a.end_thread_pool(P).unwrap();
    check(&a);
}

#[test]
fn a_pool_keeps_how_it_was_made() {
    let a = sim(SegmentMode::Native);
    let (o, other) = (own(&a), own(&a));
    a.hold_pool(P, with_source(&o)).unwrap();
    a.hold_pool(P, with_source(&o)).unwrap();
    a.hold_pool(P, PoolOptions::default()).unwrap();
    let refused = a.hold_pool(P, with_source(&other));
    assert!(
        matches!(refused, Err(Error::InvalidArgument(_))),
        "{refused:?}"
    );
    a.begin_thread_pool(P).unwrap();
    alloc(&a, MIB, S0);
    assert_eq!((o.allocs.load(Relaxed), other.allocs.load(Relaxed)), (1, 0));
    a.end_thread_pool(P).unwrap();
}

#[test]
fn a_use_on_oom_pools_free_blocks_serve_what_nothing_else_can() {
    for mode in SegmentMode::ALL {
        let a = sim_with(Config {
            limit: Some(Limit::Bytes(100 * MIB)),
            ..Config::with_mode(mode)
        });
        let on_oom = PoolOptions {
            use_on_oom: true,
            ..PoolOptions::default()
        };
        a.hold_pool(P, PoolOptions::default()).unwrap();
        a.hold_pool(Q, on_oom).unwrap();
        let mut kept = Vec::new();
        for pool in [P, Q] {
            a.begin_thread_pool(pool).unwrap();
            kept.push(alloc(&a, 40 * MIB, S0));
            a.end_thread_pool(pool).unwrap();
        }
        for x in &kept {
            a.free(x.ptr).unwrap();
        }
        // The cap leaves no room for 30 MiB more: Q's free block serves it, P's never does.
        let c = alloc(&a, 30 * MIB, S0);
        assert_eq!(pool_of(&a, &c), Some(Q), "{mode}");
        assert_eq!(c.ptr, kept[1].ptr, "{mode}: Q's block, reused");
        let d = a.allocate_tagged(30 * MIB, S0, Tag::Activation);
        assert!(
            matches!(d, Err(Error::OutOfMemory(_))),
            "{mode}: P is not for this: {d:?}"
        );
        a.free(c.ptr).unwrap();
        a.begin_thread_pool(Q).unwrap();
        let e = alloc(&a, 20 * MIB, S0);
        assert_eq!(e.ptr, c.ptr, "{mode}: the block went back to Q");
        a.end_thread_pool(Q).unwrap();
        check(&a);
    }
}

#[test]
fn a_pool_whose_blocks_were_all_freed_gives_its_memory_back_as_it_goes() {
    for mode in SegmentMode::ALL {
        let a = sim(mode);
        let o = own(&a);
        a.hold_pool(P, with_source(&o)).unwrap();
        a.begin_thread_pool(P).unwrap();
        let x = alloc(&a, 3 * MIB, S0);
        // Freed while work queued on its stream may still use it: pending, not yet free.
        a.driver().device().submit(S0);
        a.free_on(x.ptr, S0).unwrap();
        a.end_thread_pool(P).unwrap();
        a.release_graph_pool(P).unwrap();
        a.release_graph_pool(P).unwrap();
        assert_eq!(
            a.graph_memory().reserved,
            0,
            "{mode}: without another empty_cache"
        );
        assert_eq!(
            o.held.load(Relaxed),
            0,
            "{mode}: back to the pool's allocator"
        );
        check(&a);
    }
}

#[test]
fn a_capture_never_takes_a_use_on_oom_pools_block() {
    let a = sim(SegmentMode::Remap);
    let on_oom = PoolOptions {
        use_on_oom: true,
        ..PoolOptions::default()
    };
    let first = alloc(&a, 4096, S0);
    a.begin_thread_pool(P).unwrap();
    let t = sharing_s0(&a);
    a.end_thread_pool(P).unwrap();
    a.release_graph_pool(P).unwrap();
    a.free(first.ptr).unwrap();
    a.empty_cache().unwrap();
    a.set_limit(Some(Limit::Bytes(64 * MIB))).unwrap();
    a.hold_pool(Q, on_oom).unwrap();
    a.begin_thread_pool(Q).unwrap();
    let q = alloc(&a, 40 * MIB, S0);
    a.end_thread_pool(Q).unwrap();
    a.free(q.ptr).unwrap();
    // Settles the freed block (it waited for S0) and keeps it: Q is held.
    a.empty_cache().unwrap();
    // A graph made from this capture would keep writing into Q's block after Q reused it.
    // The capture runs on a stream of Q's block's shard, where the fallback looks.
    let dev = a.driver().device().clone();
    dev.begin_capture(t);
    a.begin_graph_pool(GraphPool(7, 0), t).unwrap();
    let captured = a.allocate_tagged(30 * MIB, t, Tag::Activation);
    assert!(dev.end_capture(t));
    a.end_graph_pool(GraphPool(7, 0), t).unwrap();
    assert!(
        matches!(captured, Err(Error::OutOfMemory(_))),
        "{captured:?}"
    );
    // Eager code may take it.
    let eager = alloc(&a, 30 * MIB, S0);
    assert_eq!(eager.ptr, q.ptr);
    check(&a);
}

#[test]
fn a_pool_released_while_a_thread_is_routed_to_it_goes_when_the_route_ends() {
    for mode in SegmentMode::ALL {
        let a = sim(mode);
        a.hold_pool(P, PoolOptions::default()).unwrap();
        a.begin_thread_pool(P).unwrap();
        let x = alloc(&a, 3 * MIB, S0);
        a.free(x.ptr).unwrap();
        // Over the C ABI the references may go before the route ends.
        a.release_graph_pool(P).unwrap();
        a.release_graph_pool(P).unwrap();
        assert_eq!(a.graph_memory().pools, 1, "{mode}: still routed");
        a.end_thread_pool(P).unwrap();
        assert_eq!(a.graph_memory().pools, 0, "{mode}");
        assert_eq!(a.graph_memory().reserved, 0, "{mode}: its memory went back");
        check(&a);
    }
}

#[test]
fn pool_after_pool_leaves_no_free_lists_behind() {
    for mode in SegmentMode::ALL {
        let a = sim(mode);
        let o = own(&a);
        let mut slots = Vec::new();
        for n in 0..200u64 {
            let pool = GraphPool(0, 100 + n);
            let options = if n % 2 == 0 {
                with_source(&o)
            } else {
                PoolOptions::default()
            };
            a.hold_pool(pool, options).unwrap();
            a.begin_thread_pool(pool).unwrap();
            let x = alloc(&a, MIB + n * 4096, S0);
            a.end_thread_pool(pool).unwrap();
            a.release_graph_pool(pool).unwrap();
            a.release_graph_pool(pool).unwrap();
            // Freed after its pool went: given back with the next empty_cache.
            a.free(x.ptr).unwrap();
            a.empty_cache().unwrap();
            slots.push(a.dump().free_list_slots);
        }
        assert!(
            slots.iter().all(|&s| s <= 2),
            "{mode}: free-list slots {slots:?}"
        );
        assert_eq!(a.graph_memory().reserved, 0, "{mode}");
        assert_eq!(o.held.load(Relaxed), 0, "{mode}");
        check(&a);
    }
}

/// The segments of `pool` in the allocator's dump: (size, each block's (size, allocated)).
fn pool_segments(a: &Allocator<SimDriver>, pool: GraphPool) -> Vec<(u64, Vec<(u64, bool)>)> {
    a.dump()
        .segments
        .iter()
        .filter(|s| s.graph_pool == Some((pool.0, pool.1)))
        .map(|s| {
            let blocks = s
                .blocks
                .iter()
                .map(|b| {
                    (
                        b.size,
                        b.state == vram_ledger::allocator::dump::DumpState::Allocated,
                    )
                })
                .collect();
            (s.size, blocks)
        })
        .collect()
}

#[test]
fn a_no_split_pools_allocations_take_whole_blocks_each_its_own_segment() {
    let unsplit = PoolOptions {
        no_split: true,
        ..PoolOptions::default()
    };
    for separate_tags in [false, true] {
        for mode in SegmentMode::ALL {
            let a = sim_with(Config {
                mode,
                separate_tags,
                ..Config::default()
            });
            let mode = format!("{mode}, separate_tags {separate_tags}");
            a.hold_pool(P, unsplit.clone()).unwrap();
            a.hold_pool(Q, PoolOptions::default()).unwrap();
            // As PyTorch's test: 4 MiB twice in each pool.
            let mut split = Vec::new();
            let mut whole = Vec::new();
            for _ in 0..2 {
                a.begin_thread_pool(Q).unwrap();
                split.push(alloc(&a, 4 * MIB, S0));
                a.end_thread_pool(Q).unwrap();
                a.begin_thread_pool(P).unwrap();
                whole.push(alloc(&a, 4 * MIB, S0));
                a.end_thread_pool(P).unwrap();
            }
            // The self-check knows that an unsplit pool's segment holds one block.
            check(&a);
            for x in &split {
                assert_eq!(x.size, 4 * MIB, "{mode}: the other pool splits");
            }
            // PyTorch's segment for 4 MiB is 20 MiB; here it is one block, wholly the
            // allocation's.
            for x in &whole {
                assert_eq!(x.size, 20 * MIB, "{mode}: the whole block");
            }
            let segs = pool_segments(&a, P);
            assert_eq!(
                segs,
                vec![(20 * MIB, vec![(20 * MIB, true)]); 2],
                "{mode}: a segment per allocation"
            );
            assert!(
                pool_segments(&a, Q).iter().all(|(_, b)| b.len() > 1),
                "{mode}: the other pool's segment holds more than one block"
            );
            assert_eq!(
                a.graph_memory().allocated,
                2 * 4 * MIB + 2 * 20 * MIB,
                "{mode}: the ledger counts whole blocks"
            );
            // A freed block serves a smaller request whole, and nothing new is made; a small
            // request has a small segment of its own.
            a.free_on(whole[0].ptr, S0).unwrap();
            a.begin_thread_pool(P).unwrap();
            let again = alloc(&a, 3 * MIB, S0);
            let small = alloc(&a, 4096, S0);
            a.end_thread_pool(P).unwrap();
            assert_eq!((again.ptr, again.size), (whole[0].ptr, 20 * MIB), "{mode}");
            assert_eq!(small.size, 2 * MIB, "{mode}: a small segment, whole");
            let segs = pool_segments(&a, P);
            assert_eq!(segs.len(), 3, "{mode}");
            assert!(
                segs.iter().all(|(size, b)| *b == vec![(*size, true)]),
                "{mode}: {segs:?}"
            );
            check(&a);
            for x in split.iter().chain([&whole[1], &again]) {
                a.free_on(x.ptr, S0).unwrap();
            }
            // Found by its address alone, as any segment is.
            a.free(small.ptr).unwrap();
            // Each pool's hold and each of its routes counted a reference.
            for (pool, refs) in [(P, 4), (Q, 3)] {
                for _ in 0..refs {
                    a.release_graph_pool(pool).unwrap();
                }
            }
            a.empty_cache().unwrap();
            assert_eq!(a.graph_memory().reserved, 0, "{mode}: all given back");
            assert_eq!(a.graph_memory().pools, 0, "{mode}");
            check(&a);
        }
    }
}

#[test]
fn a_pool_made_unsplit_stays_so() {
    let a = sim(SegmentMode::Native);
    let unsplit = PoolOptions {
        no_split: true,
        ..PoolOptions::default()
    };
    a.hold_pool(P, unsplit.clone()).unwrap();
    assert!(matches!(
        a.hold_pool(P, PoolOptions::default()),
        Err(Error::InvalidArgument(_))
    ));
    a.hold_pool(P, unsplit).unwrap();
    a.begin_thread_pool(P).unwrap();
    assert_eq!(alloc(&a, 4 * MIB, S0).size, 20 * MIB, "still whole");
    a.end_thread_pool(P).unwrap();
}
