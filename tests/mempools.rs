//! Pools a thread allocates into (PyTorch's `torch.cuda.MemPool` and `use_mem_pool`) on the
//! simulated device, in every segment mode: a thread's route takes its allocations on every
//! stream and no other thread's; the innermost of nested pools serves; a held pool keeps its
//! memory through `empty_cache` and gives it back once released; a block freed in a pool waits
//! for the stream it was used on before another stream reuses it; and a route ended that was
//! never begun is an error that changes nothing.

#[path = "common/sim.rs"]
mod common;

use common::{check_graphs as check, sim};
use vram_ledger::driver::sim::SimDriver;
use vram_ledger::driver::StreamId;
use vram_ledger::units::MIB;
use vram_ledger::{Allocation, Allocator, Error, GraphPool, SegmentMode, Tag};

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
        a.hold_pool(P).unwrap();
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
        a.hold_pool(P).unwrap();
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
