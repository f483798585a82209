//! Behaviour of the caching allocator on the simulated device: PyTorch's rules, errors,
//! streams, limits, and the expandable mode.

#[path = "common/sim.rs"]
mod common;

use common::{check, free_all, sim, sim_on, sim_with};
use vram_ledger::driver::sim::{SimConfig, SimDriver};
use vram_ledger::driver::{DriverCall, StreamId};
use vram_ledger::units::{GIB, MIB};
use vram_ledger::{Allocation, Allocator, Config, Error, Limit, OomCause, SegmentMode, Tag};

const S0: StreamId = StreamId::DEFAULT;
const S1: StreamId = StreamId(0x1000);

#[test]
fn small_requests_share_a_2mib_segment() {
    let a = sim(SegmentMode::Native);
    let x = a.allocate(100, S0).unwrap();
    let y = a.allocate(700, S0).unwrap();
    assert_eq!((x.size, y.size), (512, 1024));
    assert_eq!(
        y.ptr,
        x.ptr + 512,
        "best fit carves the segment from its front"
    );
    let s = a.snapshot();
    assert_eq!(s.reserved_bytes.current, 2 * MIB);
    assert_eq!(s.driver_calls[DriverCall::AllocSegment], 1);
    assert_eq!(s.all.requested_bytes.current, 800);
    check(&a);
}

#[test]
fn large_requests_get_20mib_or_own_segments() {
    let a = sim(SegmentMode::Native);
    a.allocate(3 * MIB, S0).unwrap();
    assert_eq!(a.snapshot().reserved_bytes.current, 20 * MIB);
    a.allocate(11 * MIB, S0).unwrap();
    assert_eq!(
        a.snapshot().reserved_bytes.current,
        20 * MIB,
        "11 MiB fits in the 17 MiB tail"
    );
    a.allocate(7 * MIB, S0).unwrap();
    assert_eq!(
        a.snapshot().reserved_bytes.current,
        40 * MIB,
        "the 6 MiB tail is too small: a new 20 MiB segment"
    );
    a.allocate(23 * MIB + 1, S0).unwrap();
    assert_eq!(
        a.snapshot().reserved_bytes.current,
        64 * MIB,
        "23 MiB + 1 B gets a 24 MiB segment"
    );
    check(&a);
}

#[test]
fn large_pool_keeps_tails_up_to_1mib_attached() {
    let a = sim(SegmentMode::Native);
    // 20 MiB segment; 19.5 MiB leaves a 0.5 MiB tail: not split.
    let x = a.allocate(19 * MIB + MIB / 2, S0).unwrap();
    assert_eq!(x.size, 20 * MIB);
    assert_eq!(a.snapshot().all.allocated_bytes.current, 20 * MIB);
    a.free(x.ptr).unwrap();
    // 18 MiB leaves 2 MiB: split.
    let y = a.allocate(18 * MIB, S0).unwrap();
    assert_eq!(y.size, 18 * MIB);
    check(&a);
}

#[test]
fn best_fit_picks_the_smallest_block_that_fits() {
    let a = sim(SegmentMode::Native);
    // Requests of 10 MiB or more get segments of their own size.
    let segs: Vec<_> = [30u64, 40, 35]
        .iter()
        .map(|m| a.allocate(m * MIB, S0).unwrap())
        .collect();
    for s in &segs {
        a.free(s.ptr).unwrap();
    }
    let x = a.allocate(32 * MIB, S0).unwrap();
    assert_eq!(
        x.ptr, segs[2].ptr,
        "the 35 MiB block is the smallest that fits"
    );
    let y = a.allocate(30 * MIB, S0).unwrap();
    assert_eq!(y.ptr, segs[0].ptr, "an exact fit");
    check(&a);
}

#[test]
fn free_merges_neighbours_and_empty_cache_returns_everything() {
    let a = sim(SegmentMode::Native);
    let xs: Vec<_> = (0..4)
        .map(|_| a.allocate(256 * 1024, S0).unwrap())
        .collect();
    for x in [&xs[1], &xs[3], &xs[0], &xs[2]] {
        a.free(x.ptr).unwrap();
    }
    check(&a);
    // Merged back into one 2 MiB block: a 2 MiB-sized... 1 MiB request fits at the start.
    let y = a.allocate(MIB, S0).unwrap();
    assert_eq!(y.ptr, xs[0].ptr);
    a.free(y.ptr).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.snapshot().reserved_bytes.current, 0);
    assert_eq!(a.driver().held_bytes(), 0);
    assert_eq!(a.driver().live_objects(), 0);
    check(&a);
}

#[test]
fn streams_do_not_share_cached_blocks() {
    let a = sim(SegmentMode::Native);
    let x = a.allocate(4096, S0).unwrap();
    a.free(x.ptr).unwrap();
    let y = a.allocate(4096, S1).unwrap();
    assert_ne!(y.ptr, x.ptr);
    assert_eq!(a.snapshot().driver_calls[DriverCall::AllocSegment], 2);
    let z = a.allocate(4096, S0).unwrap();
    assert_eq!(z.ptr, x.ptr, "reused at once on its own stream");
    check(&a);
}

/// A 4 KiB block of S0 that work queued on S1 reads (`record_stream`, then the work submitted).
fn used_on_s1(a: &Allocator<SimDriver>) -> Allocation {
    let x = a.allocate(4096, S0).unwrap();
    a.record_stream(x.ptr, S1).unwrap();
    a.driver().device().submit(S1);
    x
}

#[test]
fn record_stream_defers_reuse_until_the_other_stream_completes() {
    let a = sim(SegmentMode::Native);
    let x = used_on_s1(&a);
    a.free_on(x.ptr, S0).unwrap();
    let s = a.snapshot();
    assert_eq!(s.all.allocated_bytes.current, 0);
    assert_eq!(
        s.active_bytes.current,
        512 * 8,
        "still active while S1 may read it"
    );
    check(&a);
    let y = a.allocate(4096, S0).unwrap();
    assert_ne!(y.ptr, x.ptr, "not reused before S1's work completes");
    a.driver().device().complete(S1);
    let z = a.allocate(4096, S0).unwrap();
    assert_eq!(z.ptr, x.ptr, "reused once the event completed");
    assert_eq!(a.snapshot().active_bytes.current, 2 * 4096);
    check(&a);
}

#[test]
fn empty_cache_waits_for_pending_blocks() {
    let a = sim(SegmentMode::Native);
    let x = used_on_s1(&a);
    a.free(x.ptr).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.snapshot().reserved_bytes.current, 0);
    assert!(a.driver().calls(DriverCall::WaitEvent) >= 1);
    check(&a);
}

#[test]
fn unknown_and_double_frees_are_errors_that_change_nothing() {
    let a = sim(SegmentMode::Native);
    let x = a.allocate(4096, S0).unwrap();
    let before = a.snapshot();
    assert!(matches!(a.free(x.ptr + 512), Err(Error::UnknownPointer(_))));
    assert_eq!(a.snapshot(), before);
    a.free(x.ptr).unwrap();
    let after = a.snapshot();
    let err = a.free(x.ptr).unwrap_err();
    assert!(err.to_string().contains("already freed"), "{err}");
    assert_eq!(a.snapshot(), after);
    assert!(matches!(
        a.record_stream(x.ptr, S1),
        Err(Error::UnknownPointer(_))
    ));
    check(&a);
}

#[test]
fn free_on_with_an_unknown_pointer_or_the_wrong_stream() {
    let a = sim(SegmentMode::Native);
    // Unknown everywhere: an error (and no deadlock: the stream's shard is unlocked before
    // every shard is searched).
    assert!(matches!(
        a.free_on(0xdead_b000, S0),
        Err(Error::UnknownPointer(_))
    ));
    // Allocated on S1, freed with S0 as the hint: found by the search.
    let x = a.allocate(4096, S1).unwrap();
    a.free_on(x.ptr, S0).unwrap();
    assert_eq!(a.snapshot().all.allocated_bytes.current, 0);
    check(&a);
}

#[test]
fn zero_and_absurd_sizes() {
    let a = sim(SegmentMode::Native);
    let z = a.allocate(0, S0).unwrap();
    assert_eq!((z.ptr, z.size), (0, 0));
    a.free(0).unwrap();
    assert_eq!(a.snapshot().all.total_allocations, 0);
    assert!(matches!(
        a.allocate(1 << 60, S0),
        Err(Error::SizeTooLarge(_))
    ));
    assert!(matches!(
        a.allocate(u64::MAX, S0),
        Err(Error::SizeTooLarge(_))
    ));
    check(&a);
}

#[test]
fn oom_releases_the_cache_retries_then_reports() {
    let device = SimConfig {
        capacity: 4 * GIB,
        ..Default::default()
    };
    let a = sim_on(device, Config::default());
    // Cache 1 GiB on another stream, then ask for 3 GiB: only a release makes room.
    let c = a.allocate(GIB, S1).unwrap();
    a.free(c.ptr).unwrap();
    let w = a.allocate_tagged(3 * GIB, S0, Tag::Weights).unwrap();
    let s = a.snapshot();
    assert_eq!(s.alloc_retries, 1);
    assert_eq!(s.reserved_bytes.current, 3 * GIB);
    // Now a real OOM: the error carries the breakdown.
    let err = a.allocate(GIB, S0).unwrap_err();
    let Error::OutOfMemory(r) = &err else {
        panic!("{err}")
    };
    assert_eq!(r.requested, GIB);
    assert_eq!(r.device_total, 4 * GIB);
    assert_eq!(r.allocated, 3 * GIB);
    assert_eq!(r.per_tag[Tag::Weights], 3 * GIB);
    assert_eq!(r.process_usage, Some(3 * GIB + 512 * MIB));
    assert_eq!(r.non_allocator, Some(512 * MIB));
    let text = err.to_string();
    assert!(
        text.contains("Tried to allocate 1.00 GiB") && text.contains("weights 3.00 GiB"),
        "{text}"
    );
    assert_eq!(a.snapshot().ooms, 1);
    // And it goes on after a free.
    a.free(w.ptr).unwrap();
    a.allocate(GIB, S0).unwrap();
    check(&a);
}

#[test]
fn limit_in_bytes_and_fraction() {
    let a = sim_with(Config {
        limit: Some(Limit::Bytes(64 * MIB)),
        ..Default::default()
    });
    let x = a.allocate(40 * MIB, S0).unwrap();
    let err = a.allocate(40 * MIB, S0).unwrap_err();
    let Error::OutOfMemory(r) = &err else {
        panic!("{err}")
    };
    assert_eq!(r.limit, Some(64 * MIB));
    // The cause is the attempt made after the cache was released: 40 MiB held, 40 more wanted.
    assert_eq!(
        r.cause,
        OomCause::Limit {
            wanted: 40 * MIB,
            held: 40 * MIB,
            limit: 64 * MIB
        }
    );
    assert!(r.to_string().contains("limit of 64.00 MiB"), "{r}");
    a.free(x.ptr).unwrap();
    a.set_limit(Some(Limit::Fraction(0.5))).unwrap();
    assert_eq!(a.limit(), Some(40 * GIB));
    assert!(matches!(
        a.set_limit(Some(Limit::Fraction(1.5))),
        Err(Error::InvalidLimit(_))
    ));
    assert!(matches!(
        a.set_limit(Some(Limit::Fraction(f64::NAN))),
        Err(Error::InvalidLimit(_))
    ));
    check(&a);
}

#[test]
fn max_split_size_keeps_oversize_blocks_whole() {
    let cfg = Config {
        max_split_size: Some(64 * MIB),
        ..Default::default()
    };
    let a = sim_with(cfg);
    let big = a.allocate(100 * MIB, S0).unwrap();
    a.free(big.ptr).unwrap();
    // A small request does not take the oversize cached block.
    let s = a.allocate(4 * MIB, S0).unwrap();
    assert!(s.ptr < big.ptr || s.ptr >= big.ptr + big.size);
    // An oversize request within 20 MiB of it does.
    let b2 = a.allocate(90 * MIB, S0).unwrap();
    assert_eq!(b2.ptr, big.ptr);
    assert_eq!(b2.size, 100 * MIB, "never split");
    check(&a);
}

#[test]
fn expandable_maps_pages_on_demand_and_unmaps_on_empty_cache() {
    let a = sim(SegmentMode::Expandable);
    let x = a.allocate(30 * MIB, S0).unwrap();
    let y = a.allocate(30 * MIB, S0).unwrap();
    assert_eq!(y.ptr, x.ptr + 30 * MIB, "one growing segment");
    let s = a.snapshot();
    assert_eq!(s.reserved_bytes.current, 60 * MIB);
    assert_eq!(s.driver_calls[DriverCall::Map], 3, "three 20 MiB pages");
    assert_eq!(a.driver().held_bytes(), 60 * MIB);
    check(&a);
    a.free(x.ptr).unwrap();
    a.empty_cache().unwrap();
    // Pages entirely inside the freed 30 MiB: [0, 20) only; [20, 40) is shared with y.
    assert_eq!(a.snapshot().reserved_bytes.current, 40 * MIB);
    check(&a);
    a.free(y.ptr).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.snapshot().reserved_bytes.current, 0);
    assert_eq!(a.driver().live_objects(), 0, "reservation released too");
    check(&a);
}

#[test]
fn expandable_refills_holes() {
    let a = sim(SegmentMode::Expandable);
    let xs: Vec<_> = (0..4).map(|_| a.allocate(20 * MIB, S0).unwrap()).collect();
    a.free(xs[1].ptr).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.snapshot().reserved_bytes.current, 60 * MIB);
    let y = a.allocate(20 * MIB, S0).unwrap();
    assert_eq!(y.ptr, xs[1].ptr, "the hole is mapped again");
    check(&a);
}

#[test]
fn expandable_failed_map_leaves_nothing_half_mapped() {
    let a = sim(SegmentMode::Expandable);
    // 60 MiB needs three pages; the second map fails.
    a.driver().fail_nth(DriverCall::Map, 2);
    let err = a.allocate(60 * MIB, S0).unwrap_err();
    assert!(matches!(err, Error::Driver(_)), "{err}");
    check(&a);
    assert_eq!(
        a.snapshot().reserved_bytes.current,
        20 * MIB,
        "the first page stays, cached and accounted"
    );
    // set_access failing is undone too.
    a.driver().fail_nth(DriverCall::SetAccess, 1);
    assert!(a.allocate(60 * MIB, S0).is_err());
    check(&a);
    // With faults gone, it works and all can be returned.
    let x = a.allocate(60 * MIB, S0).unwrap();
    free_all(&a, [x.ptr]);
    check(&a);
}

#[test]
fn driver_faults_on_segment_alloc_and_free() {
    let a = sim(SegmentMode::Native);
    a.driver().fail_nth(DriverCall::AllocSegment, 1);
    assert!(matches!(a.allocate(4096, S0), Err(Error::Driver(_))));
    check(&a);
    let x = a.allocate(4096, S0).unwrap();
    a.free(x.ptr).unwrap();
    a.driver().fail_nth(DriverCall::FreeSegment, 1);
    assert!(a.empty_cache().is_err());
    assert_eq!(
        a.snapshot().reserved_bytes.current,
        2 * MIB,
        "kept and accounted"
    );
    check(&a);
    a.empty_cache().unwrap();
    assert_eq!(a.driver().held_bytes(), 0);
}

#[test]
fn record_event_failure_leaves_the_allocation_live() {
    let a = sim(SegmentMode::Native);
    let x = a.allocate(4096, S0).unwrap();
    a.record_stream(x.ptr, S1).unwrap();
    a.driver().fail_nth(DriverCall::RecordEvent, 1);
    assert!(a.free(x.ptr).is_err());
    assert_eq!(a.snapshot().all.allocated_bytes.current, 4096);
    check(&a);
    a.free(x.ptr).unwrap();
    check(&a);
}

#[test]
fn many_threads_allocate_and_free_concurrently() {
    let a = std::sync::Arc::new(sim(SegmentMode::Native));
    let handles: Vec<_> = (0..8u64)
        .map(|t| {
            let a = a.clone();
            std::thread::spawn(move || {
                let stream = StreamId(t % 3 * 0x100);
                let mut live = Vec::new();
                for i in 0..2000u64 {
                    live.push(
                        a.allocate_tagged(
                            512 * (1 + (i * 7 + t) % 300),
                            stream,
                            Tag::ALL[(i % 4) as usize],
                        )
                        .unwrap(),
                    );
                    if i % 3 == 0 {
                        let x = live.swap_remove((i as usize * 13) % live.len());
                        a.free_on(x.ptr, x.stream).unwrap();
                    }
                }
                live
            })
        })
        .collect();
    let mut all: Vec<_> = handles
        .into_iter()
        .flat_map(|h| h.join().unwrap())
        .collect();
    all.sort_by_key(|x| x.ptr);
    for w in all.windows(2) {
        assert!(
            w[0].ptr + w[0].size <= w[1].ptr,
            "overlap between live allocations"
        );
    }
    check(&a);
    free_all(&a, all.iter().map(|x| x.ptr));
    check(&a);
}

#[test]
fn a_panic_inside_a_shard_poisons_only_that_shard() {
    let a = sim(SegmentMode::Native);
    let (s1, s2) = (StreamId(0x10), StreamId(0x20));
    assert_ne!(a.shard_of(s1), a.shard_of(s2));
    let kept = a.allocate(4096, s1).unwrap();
    // The panic strikes while s1's shard is growing, with its lock held.
    a.driver().panic_nth(DriverCall::AllocSegment, 1);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| a.allocate(30 * MIB, s1)));
    assert!(r.is_err(), "the injected panic propagates to the caller");
    let shard = a.shard_of(s1);
    for err in [
        a.allocate(4096, s1).unwrap_err(),
        a.free_on(kept.ptr, s1).unwrap_err(),
        a.record_stream(kept.ptr, s2).unwrap_err(),
    ] {
        assert!(
            matches!(err, Error::Poisoned { shard: s } if s == shard),
            "{err}"
        );
        assert!(err.to_string().contains("panic"), "{err}");
    }
    // Other streams' shards are untouched.
    let other = a.allocate(4096, s2).unwrap();
    a.free(other.ptr).unwrap();
    assert!(
        a.empty_cache().is_err(),
        "the poisoned shard cannot be emptied"
    );
    assert!(a.dump().problems.iter().any(|p| p.contains("panic")));
}

#[test]
fn dropping_the_allocator_gives_its_cache_back_and_keeps_live_memory() {
    // The same operations on two devices; one allocator then empties its cache, the other is
    // dropped with its cache full: the drop must leave exactly what the emptied one holds.
    let ops = |a: &Allocator<SimDriver>| {
        let keep = a.allocate(3 * MIB, S0).unwrap();
        for size in [4096, 30 * MIB, 200 * MIB] {
            let x = a.allocate(size, S0).unwrap();
            let y = a.allocate(size, S1).unwrap();
            a.free(x.ptr).unwrap();
            a.free(y.ptr).unwrap();
        }
        keep
    };
    for mode in SegmentMode::ALL {
        let emptied = sim(mode);
        ops(&emptied);
        emptied.empty_cache().unwrap();
        let live_only = emptied.driver().held_bytes();
        assert!(live_only > 0, "{mode:?}");

        // Dropping the allocator drops its driver: the simulated process exits, and the device
        // counts what only the exit gave back.
        let a = sim(mode);
        let device = a.driver().device().clone();
        ops(&a);
        assert!(
            a.driver().held_bytes() > live_only,
            "{mode:?}: a cache to give back"
        );
        drop(a);
        assert_eq!(
            device.reclaimed_at_exit(),
            live_only,
            "{mode:?}: after drop"
        );

        // With nothing live, nothing is left.
        let a = sim(mode);
        let device = a.driver().device().clone();
        let keep = ops(&a);
        a.free(keep.ptr).unwrap();
        drop(a);
        assert_eq!(device.reclaimed_at_exit(), 0, "{mode:?}: all of it back");
    }
}

#[test]
fn dropping_the_allocator_after_its_streams_are_gone_synchronises_only_the_device() {
    // A stream the allocator cached memory for is destroyed before the allocator is dropped:
    // the drop must not name it to the driver (the simulated device panics on a destroyed
    // stream, as a real one may crash), and still gives everything back.
    use vram_ledger::Driver;
    for mode in SegmentMode::ALL {
        let a = sim(mode);
        let device = a.driver().device().clone();
        let s = a.driver().create_stream().unwrap();
        for size in [4096, 30 * MIB] {
            let x = a.allocate(size, s).unwrap();
            a.free(x.ptr).unwrap();
        }
        a.driver().destroy_stream(s).unwrap();
        drop(a);
        assert_eq!(device.reclaimed_at_exit(), 0, "{mode:?}");
    }
}

#[test]
fn a_fraction_made_as_bytes_over_the_total_is_those_bytes() {
    // A total like the H200's (139.8 GiB), where bytes / total * total is not always exact.
    let device = SimConfig {
        capacity: 150_110_519_296,
        ..SimConfig::default()
    };
    let a = sim_on(device, Config::with_mode(SegmentMode::Native));
    let total = a.device_total();
    // PyTorch's tests ask for "this much more than is reserved" this way.
    let lost = (1..2000u64)
        .map(|k| k * MIB + 18 * MIB)
        .filter(|&want| {
            a.set_limit(Some(Limit::Fraction(want as f64 / total as f64)))
                .unwrap();
            a.limit() != Some(want)
        })
        .count();
    assert_eq!(
        lost, 0,
        "limits that came back other than asked (total {total})"
    );
}

/// A request that fails leaves the process holding what it held before: the memory growth
/// mapped on the way to failing goes back to the driver, so a process beside it can use it.
#[test]
fn a_failed_allocation_gives_back_what_it_mapped() {
    use vram_ledger::driver::sim::SimDevice;
    for mode in [
        SegmentMode::Native,
        SegmentMode::Expandable,
        SegmentMode::Compact,
        SegmentMode::Remap,
    ] {
        let dev = SimDevice::new(SimConfig::default());
        let a = Allocator::new(dev.spawn_process().unwrap(), Config::with_mode(mode)).unwrap();
        let b = Allocator::new(dev.spawn_process().unwrap(), Config::with_mode(mode)).unwrap();
        let kept = a.allocate(GIB, S0).unwrap();
        let held = a.snapshot().reserved_bytes.current;
        let err = a.allocate(79 * GIB, S0).unwrap_err();
        let Error::OutOfMemory(r) = &err else {
            panic!("{mode}: {err}")
        };
        assert_eq!(
            a.snapshot().reserved_bytes.current,
            held,
            "{mode}: the failed request left memory mapped"
        );
        assert_eq!(r.reserved, held, "{mode}: the report reads what is left");
        let other = b
            .allocate(GIB, S0)
            .expect("the process beside it gets its memory");
        b.free(other.ptr).unwrap();
        a.free(kept.ptr).unwrap();
        check(&a);
        check(&b);
    }
}

/// Pointer 0, a zero-byte allocation's, has no memory: recording a stream's use of it does
/// nothing, as freeing it does (PyTorch's `recordStream` of an empty tensor likewise).
#[test]
fn record_stream_of_pointer_0_is_a_no_op() {
    let a = sim(SegmentMode::Native);
    let z = a.allocate(0, S0).unwrap();
    assert_eq!(z.ptr, 0);
    a.record_stream(z.ptr, S1).unwrap();
    a.free(z.ptr).unwrap();
    assert!(matches!(
        a.record_stream(0x1234, S1),
        Err(Error::UnknownPointer(0x1234))
    ));
    check(&a);
}

/// What an out-of-memory message advises for cached memory it could not use depends on the
/// mode: a virtual-memory mode for native segments, not the one the allocator is already in.
/// (Compact serves this request: it unmaps the free pages between the live blocks.)
#[test]
fn oom_advice_about_cached_memory_fits_the_mode() {
    for mode in [
        SegmentMode::Native,
        SegmentMode::Expandable,
        SegmentMode::Remap,
    ] {
        let device = SimConfig {
            capacity: 4 * GIB,
            ..Default::default()
        };
        let a = sim_on(device, Config::with_mode(mode));
        // Live blocks pin free memory beside them: one 4 MiB block in five kept, 2.2 GiB free.
        let blocks: Vec<_> = (0..700).map(|_| a.allocate(4 * MIB, S0).unwrap()).collect();
        for (i, b) in blocks.iter().enumerate() {
            if i % 5 != 0 {
                a.free(b.ptr).unwrap();
            }
        }
        let err = a.allocate(1200 * MIB, S0).unwrap_err();
        let Error::OutOfMemory(r) = &err else {
            panic!("{mode}: {err}")
        };
        assert_eq!(r.mode, mode.name());
        assert!(r.cached > r.needed, "{mode}: {r:?}");
        let text = err.to_string();
        let advice = "a virtual-memory mode (expandable, compact or remap) may help";
        assert_eq!(
            text.contains(advice),
            mode == SegmentMode::Native,
            "{mode}: {text}"
        );
        assert!(
            mode == SegmentMode::Native || text.contains("pinned beside live blocks"),
            "{mode}: {text}"
        );
        free_all(&a, blocks.iter().step_by(5).map(|b| b.ptr));
        check(&a);
    }
}
