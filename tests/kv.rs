//! The KV cache sized last, on the simulated device, in the order engines work: weights,
//! profile, reserve the KV cache (a prefix mapped), capture CUDA graphs (graph pools, and memory
//! outside the allocator for their instantiation), commit the KV cache to what the budget
//! contract leaves, serve.
//!
//! Every check of the contract reads this process's usage from the simulated device (what NVML
//! would report), not from the allocator's own figures.

use std::sync::Arc;

use vram_ledger::driver::sim::{SimDevice, SimDriver};
use vram_ledger::driver::DriverCall;
use vram_ledger::profile::{ProfileOptions, ProfileResult, Profiler};
use vram_ledger::units::{GIB, MIB};
use vram_ledger::{
    invariants, Allocator, Config, Error, GraphPool, KvCache, SegmentMode, StreamId, Tag,
};

const MAIN: StreamId = StreamId(0x10);
const CAPTURE: StreamId = StreamId(0x30);
/// An engine's KV block: not a divisor of the granularity, so rounding shows.
const BLOCK: u64 = 3 * MIB / 2;
const MODES: [SegmentMode; 4] = [
    SegmentMode::Native,
    SegmentMode::Expandable,
    SegmentMode::Compact,
    SegmentMode::Remap,
];

struct Engine {
    dev: Arc<SimDevice>,
    alloc: Allocator<SimDriver>,
    requested: u64,
    _weights: u64,
}

impl Engine {
    fn usage(&self) -> u64 {
        self.dev.used() - self.dev.other_usage()
    }

    /// One forward at the profiled shape (what serving needs besides the KV cache); returns
    /// this process's usage at the forward's peak.
    fn forward(&self) -> vram_ledger::Result<u64> {
        let x = self.alloc.allocate_tagged(GIB, MAIN, Tag::Activation)?;
        let y = self
            .alloc
            .allocate_tagged(300 * MIB, MAIN, Tag::Activation)?;
        let peak = self.usage();
        self.alloc.free(x.ptr)?;
        self.alloc.free(y.ptr)?;
        Ok(peak)
    }

    /// A CUDA graph captured into a pool of its own: 200 MiB in its pool, and `outside` bytes
    /// that instantiating it takes outside the allocator.
    fn capture(&self, pool: u64, outside: u64) -> u64 {
        self.dev.begin_capture(CAPTURE);
        let p = GraphPool(pool, 0);
        self.alloc.begin_graph_pool(p, CAPTURE).unwrap();
        let a = self
            .alloc
            .allocate_tagged(200 * MIB, CAPTURE, Tag::Activation)
            .unwrap();
        assert!(self.dev.end_capture(CAPTURE), "the capture stayed valid");
        self.alloc.driver().alloc_external(outside).unwrap();
        self.alloc.end_graph_pool(p, CAPTURE).unwrap();
        a.ptr
    }
}

/// Weights and a profiled pass (1.3 GiB of activations at its peak, 200 MiB behind the
/// allocator's back, and whatever `also` does inside the profile block), with the contract
/// armed; returns the engine and the profile.
fn profiled(
    dev: &Arc<SimDevice>,
    mode: SegmentMode,
    also: impl FnOnce(&Engine),
) -> (Engine, ProfileResult) {
    let alloc = Allocator::new(dev.spawn_process().unwrap(), Config::with_mode(mode)).unwrap();
    let mut e = Engine {
        dev: dev.clone(),
        requested: 0,
        _weights: 0,
        alloc,
    };
    let r = {
        let p = Profiler::new(&e.alloc).unwrap();
        e._weights = e
            .alloc
            .allocate_tagged(3 * GIB, MAIN, Tag::Weights)
            .unwrap()
            .ptr;
        p.profile(
            ProfileOptions {
                utilization: 0.2,
                ..Default::default()
            },
            || {
                e.forward().unwrap();
                e.alloc.driver().alloc_external(200 * MIB).unwrap();
                also(&e);
            },
        )
        .unwrap()
    };
    e.requested = r.requested;
    (e, r)
}

fn engine(dev: &Arc<SimDevice>, mode: SegmentMode) -> Engine {
    profiled(dev, mode, |_| {}).0
}

fn fresh(mode: SegmentMode) -> Engine {
    engine(&SimDevice::new(Default::default()), mode)
}

/// The engine's flow up to the commit: the KV cache's prefix, two
/// captures, and memory that stays allocated from then on without being part of any pass (a
/// library's workspace for a stream the captures used, as cuBLAS keeps one per stream).
fn reserved_and_captured(e: &Engine) -> KvCache {
    let kv = e.alloc.reserve_kv(BLOCK, None, 16).unwrap();
    assert_eq!(kv.usable_blocks, 16);
    e.capture(1, 150 * MIB);
    e.capture(2, 60 * MIB);
    e.alloc
        .allocate_tagged(96 * MIB, CAPTURE, Tag::Untracked)
        .unwrap();
    kv
}

/// Serving's `peak` usage is within what was requested less the margin (`below_margin`), and
/// short of it by less than one block and one page of rounding (an expandable page is 20 MiB).
fn fills_the_request(mode: SegmentMode, below_margin: u64, peak: u64) {
    assert!(
        peak <= below_margin,
        "{mode}: serving uses {peak} of {below_margin}"
    );
    assert!(
        below_margin - peak < BLOCK + 20 * MIB,
        "{mode}: {} bytes left unused below the margin",
        below_margin - peak
    );
}

#[test]
fn kv_commit_fills_what_the_contract_leaves_after_the_graphs_exactly() {
    for mode in MODES {
        let e = fresh(mode);
        let kv = reserved_and_captured(&e);
        let c = e.alloc.commit_kv().unwrap();
        assert_eq!(c.kv.base, kv.base, "{mode}: the address does not move");
        assert_eq!(c.kv.reserved_blocks, kv.reserved_blocks);
        assert_eq!(c.blocks_before, 16);
        assert!(c.kv.usable_blocks > 16);
        // Serving reaches the profiled peak again, beside what stayed allocated since: the
        // process then uses what it requested, less the margin and less than one block and one
        // page of rounding (an expandable page is 20 MiB).
        let peak = e.forward().unwrap();
        fills_the_request(mode, e.requested - c.room.margin, peak);
        // The ledger shows the KV cache; the invariants hold with it.
        let s = e.alloc.snapshot();
        assert_eq!(s.kv_cache.mapped.current, c.kv.mapped_bytes);
        assert_eq!(s.kv_cache.usable, c.kv.usable_blocks * BLOCK);
        assert_eq!(s.kv_cache.reserved, c.kv.reserved_bytes);
        assert!(s.kv_cache.mapped.current >= s.kv_cache.usable);
        assert_eq!(
            s.per_tag[Tag::KvCache].allocated_bytes.current,
            c.kv.mapped_bytes
        );
        invariants::check_sim(&e.alloc).unwrap();
        // Committing again changes nothing.
        let again = e.alloc.commit_kv().unwrap();
        assert_eq!(again.kv, c.kv, "{mode}");
        e.alloc.release_kv().unwrap();
        assert_eq!(e.alloc.snapshot().kv_cache.mapped.current, 0);
        invariants::check_sim(&e.alloc).unwrap();
    }
}

#[test]
fn kv_commit_never_passes_the_cap_whatever_appears_outside_the_allocator() {
    for mode in MODES {
        for extra in [0, 37 * MIB, 901 * MIB, 4 * GIB] {
            let e = fresh(mode);
            reserved_and_captured(&e);
            e.alloc.driver().alloc_external(extra).unwrap();
            let c = e.alloc.commit_kv().unwrap();
            let peak = e.forward().unwrap();
            assert!(
                peak <= e.requested,
                "{mode}, {extra} outside: {peak} past {}",
                e.requested
            );
            assert_eq!(
                c.room.outside,
                e.usage() - e.alloc.snapshot().reserved_bytes.current
            );
        }
    }
}

#[test]
fn kv_commit_resizes_in_place_when_the_cap_moves() {
    for mode in MODES {
        let e = fresh(mode);
        reserved_and_captured(&e);
        let c = e.alloc.commit_kv().unwrap();
        let n = c.kv.usable_blocks;
        // A co-tenant left and the user grants 4 GiB more: the KV cache grows where it is.
        e.alloc.set_cap(Some(e.requested + 4 * GIB));
        let grown = e.alloc.commit_kv().unwrap();
        assert_eq!(grown.kv.base, c.kv.base);
        assert!(grown.kv.usable_blocks >= n + (4 * GIB - 2 * MIB) / BLOCK - 1);
        assert!(e.forward().unwrap() <= e.requested + 4 * GIB);
        // The cap comes back down: the engine frees its newest blocks and shrinks.
        e.alloc.set_cap(Some(e.requested));
        let shrunk = e.alloc.resize_kv(n, n).unwrap();
        assert_eq!(shrunk.usable_blocks, n);
        let peak = e.forward().unwrap();
        assert!(
            peak <= e.requested,
            "{mode}: {peak} past {} after shrinking",
            e.requested
        );
        // Growing past what the contract leaves is refused, and changes nothing.
        let e2 = e.alloc.resize_kv(n + 4096, n).unwrap_err();
        assert!(matches!(e2, Error::KvShort(_)), "{e2}");
        assert_eq!(e.alloc.kv_cache().unwrap().usable_blocks, n);
        invariants::check_sim(&e.alloc).unwrap();
    }
}

#[test]
fn kv_commit_shrink_refuses_blocks_in_use_and_bad_sizes() {
    let e = fresh(SegmentMode::Remap);
    reserved_and_captured(&e);
    let c = e.alloc.commit_kv().unwrap();
    let n = c.kv.usable_blocks;
    let err = e.alloc.resize_kv(10, 20).unwrap_err();
    assert!(
        err.to_string().contains("blocks below 20 are in use"),
        "{err}"
    );
    assert_eq!(e.alloc.kv_cache().unwrap().usable_blocks, n);
    let err = e.alloc.resize_kv(c.kv.reserved_blocks + 1, 0).unwrap_err();
    assert!(err.to_string().contains("do not fit"), "{err}");
    assert!(e.alloc.resize_kv(20, 20).is_ok());
    let err = e.alloc.reserve_kv(BLOCK, None, 1).unwrap_err();
    assert!(err.to_string().contains("reserved already"), "{err}");
    e.alloc.release_kv().unwrap();
    assert!(matches!(e.alloc.commit_kv(), Err(Error::NoKvCache)));
    for (block, max, initial) in [
        (0, None, 1),
        (BLOCK, Some(MIB), 1),
        (BLOCK, Some(GIB), 10_000),
    ] {
        assert!(
            matches!(
                e.alloc.reserve_kv(block, max, initial),
                Err(Error::InvalidArgument(_))
            ),
            "block {block}, max {max:?}, initial {initial}"
        );
    }
    invariants::check_sim(&e.alloc).unwrap();
}

#[test]
fn kv_commit_is_refused_while_a_capture_runs() {
    let e = fresh(SegmentMode::Expandable);
    e.alloc.reserve_kv(BLOCK, None, 4).unwrap();
    e.dev.begin_capture(CAPTURE);
    e.alloc.begin_graph_pool(GraphPool(9, 0), CAPTURE).unwrap();
    assert!(matches!(e.alloc.commit_kv(), Err(Error::Capturing(_))));
    assert!(matches!(e.alloc.resize_kv(8, 4), Err(Error::Capturing(_))));
    assert!(e.dev.end_capture(CAPTURE));
    e.alloc.end_graph_pool(GraphPool(9, 0), CAPTURE).unwrap();
    assert!(e.alloc.commit_kv().is_ok());
}

/// Whether the KV cache is as it was (`before`) or as asked (`after`), in its own figures, in
/// the ledger and on the device.
fn whole(e: &Engine, before: u64, after: u64) -> u64 {
    let kv = e.alloc.kv_cache().unwrap();
    assert!(
        kv.usable_blocks == before || kv.usable_blocks == after,
        "the KV cache has {} blocks, neither {before} nor {after}",
        kv.usable_blocks
    );
    assert!(kv.mapped_bytes >= kv.usable_blocks * BLOCK);
    assert!(
        e.alloc
            .driver()
            .is_accessible(kv.base, kv.usable_blocks * BLOCK),
        "every usable block is mapped"
    );
    invariants::check_sim(&e.alloc).unwrap();
    kv.usable_blocks
}

#[test]
fn contract_kv_faults_in_every_driver_call_leave_it_wholly_old_or_new() {
    for mode in MODES {
        for call in DriverCall::ALL {
            for n in 1..=3 {
                let e = fresh(mode);
                reserved_and_captured(&e);
                // Commit (a growth of thousands of blocks).
                e.alloc
                    .driver()
                    .fail_nth(call, e.alloc.driver().calls(call) + n);
                let target = match e.alloc.commit_kv() {
                    Ok(c) => c.kv.usable_blocks,
                    Err(_) => u64::MAX,
                };
                e.alloc.driver().clear_faults();
                let now = whole(&e, 16, target);
                if now == 16 {
                    let c = e.alloc.commit_kv().unwrap();
                    assert!(c.kv.usable_blocks > 16, "{mode}, {call:?}: a retry commits");
                }
                let n_blocks = e.alloc.kv_cache().unwrap().usable_blocks;
                // Shrink (the device synchronised, handles released, pieces unmapped).
                let half = n_blocks / 2;
                e.alloc
                    .driver()
                    .fail_nth(call, e.alloc.driver().calls(call) + n);
                let _ = e.alloc.resize_kv(half, half);
                e.alloc.driver().clear_faults();
                let now = whole(&e, n_blocks, half);
                // Grow back.
                e.alloc
                    .driver()
                    .fail_nth(call, e.alloc.driver().calls(call) + n);
                let _ = e.alloc.resize_kv(n_blocks, now);
                e.alloc.driver().clear_faults();
                whole(&e, now, n_blocks);
                let peak = e.forward().unwrap();
                assert!(
                    peak <= e.requested,
                    "{mode}, {call:?} #{n}: inside the request"
                );
            }
        }
    }
}

/// A serving mix in native mode: a new 1 GiB segment, and 100 MiB cut from what is free in the
/// segment the profiled pass's workspace pins. Returns this process's usage at its peak.
fn native_serving(e: &Engine) -> u64 {
    let a = e.alloc.allocate_tagged(GIB, MAIN, Tag::Activation).unwrap();
    let b = e
        .alloc
        .allocate_tagged(100 * MIB, MAIN, Tag::Activation)
        .unwrap();
    let peak = e.usage();
    e.alloc.free(a.ptr).unwrap();
    e.alloc.free(b.ptr).unwrap();
    peak
}

#[test]
fn contract_native_kv_commit_after_serving_takes_what_the_profile_kept_for_cuts_serving_did_not_make(
) {
    // The profiled pass leaves a 200 MiB workspace allocated, cut from its 300 MiB segment: a
    // plain segment is freed only whole, so the first commit keeps the pass's whole rise above
    // the bytes still allocated (which way another shape cuts segments is unknown before it
    // runs). Serving's mix uses the pinned segment's free part.
    let (e, r) = profiled(
        &SimDevice::new(Default::default()),
        SegmentMode::Native,
        |e| {
            e.alloc
                .allocate_tagged(200 * MIB, MAIN, Tag::Activation)
                .unwrap();
        },
    );
    let below_margin = e.requested - r.margin;
    let kv = reserved_and_captured(&e);
    let first = e.alloc.commit_kv().unwrap();
    assert_eq!(first.room.served_rise, None);
    // Committed again before serving: nothing measured says the profile kept too much.
    let early = e.alloc.commit_kv().unwrap();
    assert_eq!(early.room.served_rise, Some(0));
    assert_eq!(early.kv, first.kv);
    let peak = native_serving(&e);
    assert!(peak <= below_margin, "{peak} past {below_margin}");
    let unused = below_margin - peak;
    assert!(
        unused >= 100 * MIB - 2 * MIB,
        "the first commit keeps the workspace segment's free part for serving: {unused} unused"
    );
    // A resize that grows sees serving too, and so does the commit after it.
    let grown = e
        .alloc
        .resize_kv(first.kv.usable_blocks + 50, first.kv.usable_blocks)
        .unwrap();
    assert_eq!(grown.base, kv.base, "the address does not move");
    let again = e.alloc.commit_kv().unwrap();
    assert_eq!(again.room.served_rise, Some(GIB));
    assert!(
        again.kv.usable_blocks > grown.usable_blocks,
        "{} blocks, as before",
        again.kv.usable_blocks
    );
    // Serving the same mix again fills what was requested, less the margin and the rounding.
    let peak = native_serving(&e);
    fills_the_request(SegmentMode::Native, below_margin, peak);
    // Serving the same mix again, a third commit measures the same and changes nothing.
    assert_eq!(e.alloc.commit_kv().unwrap().kv, again.kv);
    invariants::check_sim(&e.alloc).unwrap();
}

/// After a commit that followed serving: the batch runs again, inside the request.
fn runs_again_inside_the_request(e: &Engine, mode: SegmentMode, batch: u64) {
    let again = e
        .alloc
        .allocate_tagged(batch, MAIN, Tag::Activation)
        .unwrap_or_else(|err| panic!("{mode}: {err}"));
    assert!(e.usage() <= e.requested, "{mode}");
    e.alloc.free(again.ptr).unwrap();
    invariants::check_sim(&e.alloc).unwrap();
}

/// Committed, then shrunk by `bytes` to make room for serving (a commit never unmaps); returns
/// the blocks the commit gave.
fn committed_then_shrunk(e: &Engine, bytes: u64) -> u64 {
    let n = e.alloc.commit_kv().unwrap().kv.usable_blocks;
    let fewer = n - bytes.div_ceil(BLOCK);
    e.alloc.resize_kv(fewer, fewer).unwrap();
    n
}

#[test]
fn contract_kv_commit_after_serving_keeps_room_for_a_mix_larger_than_the_profile() {
    // Serving needs 512 MiB more than the profiled pass took (the engine had shrunk its KV
    // cache to make room for it): a commit after serving keeps it, so the same mix still runs
    // inside the request.
    for mode in MODES {
        let e = fresh(mode);
        reserved_and_captured(&e);
        let n = committed_then_shrunk(&e, 600 * MIB);
        let big = e
            .alloc
            .allocate_tagged(GIB + 300 * MIB + 512 * MIB, MAIN, Tag::Activation)
            .unwrap();
        e.alloc.free(big.ptr).unwrap();
        // Neither the cache given back nor peaks the user resets hide serving's peak from the
        // next commit.
        e.alloc.empty_cache().unwrap();
        e.alloc.ledger().reset_peaks();
        let c = e.alloc.commit_kv().unwrap();
        assert!(
            c.room.transient >= GIB + 812 * MIB,
            "{mode}: {} kept for serving",
            c.room.transient
        );
        assert!(
            c.kv.usable_blocks < n,
            "{mode}: the KV cache did not grow back"
        );
        runs_again_inside_the_request(&e, mode, GIB + 812 * MIB);
    }
}

#[test]
fn contract_kv_commit_after_serving_keeps_the_rise_on_top_of_what_stayed_allocated_since() {
    // Serving rose 1.8 GiB; then 512 MiB stayed allocated (a workspace, an adapter; in native
    // mode it pins the batch's cached segment). The next commit keeps the rise on top of it,
    // so the same batch still runs beside it. (The engine shrank its KV cache first to make
    // room: a commit never unmaps.)
    for mode in MODES {
        let e = fresh(mode);
        reserved_and_captured(&e);
        committed_then_shrunk(&e, 2500 * MIB);
        let batch = GIB + 812 * MIB;
        let big = e
            .alloc
            .allocate_tagged(batch, MAIN, Tag::Activation)
            .unwrap();
        e.alloc.free(big.ptr).unwrap();
        e.alloc
            .allocate_tagged(512 * MIB, MAIN, Tag::Untracked)
            .unwrap();
        let c = e.alloc.commit_kv().unwrap();
        assert!(c.room.transient >= batch, "{mode}: {:?}", c.room);
        runs_again_inside_the_request(&e, mode, batch);
    }
}

/// Weights loaded as engines often load them (built in a wider type, then converted): each
/// converted weight lands in the free memory its wider original left, so half of that memory
/// stays free but held with it. Then the profiled pass, the flow up to the commit, serving, a
/// commit after serving, and serving again. Returns the engine, its margin and serving's peak.
fn converted_weights_then_served(mode: SegmentMode) -> (Engine, u64, u64) {
    let dev = SimDevice::new(Default::default());
    let alloc = Allocator::new(dev.spawn_process().unwrap(), Config::with_mode(mode)).unwrap();
    let mut e = Engine {
        dev: dev.clone(),
        requested: 0,
        _weights: 0,
        alloc,
    };
    let p = Profiler::new(&e.alloc).unwrap();
    let wide = e
        .alloc
        .allocate_tagged(2 * GIB, MAIN, Tag::Weights)
        .unwrap();
    e.alloc.free(wide.ptr).unwrap();
    e._weights = e
        .alloc
        .allocate_tagged(GIB, MAIN, Tag::Weights)
        .unwrap()
        .ptr;
    let r = p
        .profile(
            ProfileOptions {
                utilization: 0.2,
                ..Default::default()
            },
            || {
                e.forward().unwrap();
            },
        )
        .unwrap();
    e.requested = r.requested;
    reserved_and_captured(&e);
    let first = e.alloc.commit_kv().unwrap().kv;
    e.forward().unwrap();
    // Native mode learns from serving that the free half beside the weights serves nothing;
    // the other modes counted it once already and change nothing.
    let again = e.alloc.commit_kv().unwrap().kv;
    if mode != SegmentMode::Native {
        assert_eq!(again, first, "{mode}");
    }
    let peak = e.forward().unwrap();
    invariants::check_sim(&e.alloc).unwrap();
    (e, r.margin, peak)
}

#[test]
fn kv_commit_counts_memory_the_profiled_pass_held_once() {
    // What eager work holds free in memory it cannot give back (here: beside the converted
    // weights) was part of the profiled pass's peak too. Counting it again as held leaves it
    // unused: the committed KV cache must let serving reach the request, less the margin and
    // the rounding.
    for mode in MODES {
        let (e, margin, peak) = converted_weights_then_served(mode);
        fills_the_request(mode, e.requested - margin, peak);
    }
}

#[test]
fn contract_kv_commit_after_serving_sees_the_rise_made_in_a_released_graph_pools_memory() {
    // A graph's pool is released while serving, a batch uses its memory, and another graph is
    // captured before the next commit: graph pools hold as much at the commit as when the
    // window opened, but less at serving's peak, where eager work had the pool's 200 MiB.
    for mode in MODES {
        let e = fresh(mode);
        e.alloc.reserve_kv(BLOCK, None, 16).unwrap();
        let p1 = e.capture(1, 0);
        e.capture(2, 0);
        committed_then_shrunk(&e, 1000 * MIB);
        e.alloc.free(p1).unwrap();
        e.alloc.release_graph_pool(GraphPool(1, 0)).unwrap();
        let batch = GIB + 500 * MIB + 300 * MIB;
        let big = e
            .alloc
            .allocate_tagged(batch, MAIN, Tag::Activation)
            .unwrap();
        e.alloc.free(big.ptr).unwrap();
        e.capture(3, 0);
        let c = e.alloc.commit_kv().unwrap();
        assert!(c.room.transient >= batch, "{mode}: {:?}", c.room);
        runs_again_inside_the_request(&e, mode, batch);
    }
}

#[test]
fn contract_kv_a_refused_reservation_whose_undo_fails_loses_nothing() {
    // More initial blocks than the device holds: the growth fails part-way and is undone, with
    // the undo itself failing at one release or unmap. The ledger stays consistent with what
    // the driver holds, and once the faults are gone everything can be given back.
    for mode in MODES {
        for call in [
            DriverCall::ReleasePhysical,
            DriverCall::Unmap,
            DriverCall::ReleaseVa,
        ] {
            for n in 1..=4 {
                let e = fresh(mode);
                // No cap: the growth fails at the driver, part-way, not against the cap first.
                e.alloc.set_cap(None);
                e.alloc
                    .driver()
                    .fail_nth(call, e.alloc.driver().calls(call) + n);
                let err = e
                    .alloc
                    .reserve_kv(32 * MIB, None, 2500)
                    .expect_err("more than the device holds");
                assert!(
                    matches!(err, Error::KvShort(_) | Error::Driver(_)),
                    "{mode}, {call:?} #{n}: {err}"
                );
                invariants::check_sim(&e.alloc).unwrap();
                e.alloc.driver().clear_faults();
                e.alloc.empty_cache().unwrap();
                if e.alloc.kv_cache().is_some() {
                    e.alloc.release_kv().unwrap();
                }
                invariants::check_sim(&e.alloc).unwrap();
                assert_eq!(e.alloc.snapshot().lost_bytes, 0, "{mode}, {call:?} #{n}");
                e.alloc.reserve_kv(BLOCK, None, 16).unwrap();
            }
        }
    }
}
