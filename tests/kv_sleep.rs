//! The KV cache of `reserve_kv` sleeps with the KV tag, and the budget contract holds across
//! sleep and wake: the cache's memory is given back and mapped again at the same addresses,
//! sizing the cache while a tag sleeps leaves that tag room to wake, and a wake in progress is
//! not counted twice against the cap. On the simulated device, which keeps what is written and
//! faults on memory that is not mapped, in every virtual-memory mode.

#[path = "common/sim.rs"]
mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{check, tags_apart, VIRTUAL};
use vram_ledger::driver::sim::SimDriver;
use vram_ledger::driver::{DriverCall, StreamId};
use vram_ledger::profile::{ProfileOptions, Profiler};
use vram_ledger::units::{GIB, MIB};
use vram_ledger::{Allocator, Error, SegmentMode, Tag};

const S: StreamId = StreamId(0x10);
const BLOCK: u64 = 3 * MIB / 2;

fn readable(a: &Allocator<SimDriver>, va: u64) -> bool {
    a.driver().read_word(va).is_ok()
}

/// A wake with the `n`th call of `call` from now failing fails on the KV tag, which stays asleep.
fn wake_fails_leaving_kv_asleep(a: &Allocator<SimDriver>, call: DriverCall, n: u64, what: &str) {
    let d = a.driver();
    d.fail_nth(call, n);
    let e = a.wake(&[]).unwrap_err();
    d.clear_faults();
    assert!(
        matches!(
            e,
            Error::Wake {
                tag: Tag::KvCache,
                ..
            }
        ),
        "{what}: {e}"
    );
    assert_eq!(a.asleep_tags(), vec![Tag::KvCache], "{what}");
}

#[test]
fn the_kv_cache_is_discarded_with_its_tag_and_mapped_again_at_its_addresses() {
    for mode in VIRTUAL {
        let a = tags_apart(mode, 80 * GIB);
        let w = a.allocate_tagged(GIB, S, Tag::Weights).unwrap();
        let kv = a.reserve_kv(BLOCK, Some(16 * GIB), 4096).unwrap();
        let last = kv.base + kv.usable_blocks * BLOCK - 8;
        a.driver().write_word(kv.base, 0xfeed).unwrap();
        a.driver().write_word(last, 0xbeef).unwrap();
        let held = a.driver().held_bytes();
        let reserved = a.snapshot().reserved_bytes.current;

        let r = a.sleep(&[Tag::Weights], &[Tag::KvCache]).unwrap();
        assert_eq!(a.asleep_tags(), vec![Tag::Weights, Tag::KvCache], "{mode}");
        assert!(r.discarded_bytes >= kv.mapped_bytes, "{mode}: {r:?}");
        assert!(
            !readable(&a, kv.base) && !readable(&a, last),
            "{mode}: the KV cache is still mapped asleep"
        );
        assert!(
            a.driver().held_bytes() + kv.mapped_bytes + GIB <= held,
            "{mode}: held {} asleep against {held} awake",
            a.driver().held_bytes()
        );
        let asleep = a.snapshot();
        assert_eq!(
            asleep.sleeping_bytes[Tag::KvCache],
            kv.mapped_bytes,
            "{mode}"
        );
        assert_eq!(asleep.kv_cache.mapped.current, 0, "{mode}");
        // Still one allocation of the KV tag, as asleep allocations stay allocated.
        assert_eq!(
            asleep.per_tag[Tag::KvCache].allocated_bytes.current,
            kv.mapped_bytes
        );
        check(&a);
        let info = a.kv_cache().unwrap();
        assert_eq!(
            (info.usable_blocks, info.mapped_bytes),
            (0, 0),
            "{mode}: nothing usable asleep"
        );
        // Nothing maps KV memory while its tag sleeps.
        assert!(
            matches!(a.commit_kv(), Err(Error::Asleep(Tag::KvCache))),
            "{mode}"
        );
        assert!(
            matches!(a.resize_kv(10, 10), Err(Error::Asleep(Tag::KvCache))),
            "{mode}"
        );

        let woke = a.wake(&[]).unwrap();
        assert_eq!(woke.tags, vec![Tag::Weights, Tag::KvCache], "{mode}");
        assert!(woke.zeroed_bytes >= kv.mapped_bytes, "{mode}: {woke:?}");
        let back = a.kv_cache().unwrap();
        assert_eq!(
            (back.base, back.usable_blocks, back.mapped_bytes),
            (kv.base, kv.usable_blocks, kv.mapped_bytes),
            "{mode}"
        );
        assert_eq!(
            a.driver().read_word(kv.base).unwrap(),
            0,
            "{mode}: discarded reads zeros"
        );
        assert_eq!(a.driver().read_word(last).unwrap(), 0, "{mode}");
        assert_eq!(a.snapshot().reserved_bytes.current, reserved, "{mode}");
        assert_eq!(a.driver().held_bytes(), held, "{mode}");
        check(&a);
        a.resize_kv(10, 10).unwrap();
        a.free(w.ptr).unwrap();
        a.release_kv().unwrap();
        check(&a);
    }
}

#[test]
fn the_kv_cache_is_not_offloaded_and_a_refused_sleep_leaves_everything_awake() {
    for mode in VIRTUAL {
        let a = tags_apart(mode, 80 * GIB);
        let w = a.allocate_tagged(GIB, S, Tag::Weights).unwrap();
        let kv = a.reserve_kv(BLOCK, Some(4 * GIB), 100).unwrap();
        let e = a.sleep(&[Tag::Weights, Tag::KvCache], &[]).unwrap_err();
        assert!(e.to_string().contains("cannot be offloaded"), "{mode}: {e}");
        assert!(a.asleep_tags().is_empty(), "{mode}");
        assert!(readable(&a, kv.base) && readable(&a, w.ptr), "{mode}");
        check(&a);
    }
}

#[test]
fn a_kv_cache_released_asleep_gives_its_sleeping_bytes_up() {
    for mode in VIRTUAL {
        let a = tags_apart(mode, 80 * GIB);
        a.reserve_kv(BLOCK, Some(4 * GIB), 100).unwrap();
        a.sleep(&[], &[Tag::KvCache]).unwrap();
        a.release_kv().unwrap();
        assert_eq!(a.snapshot().sleeping_bytes[Tag::KvCache], 0, "{mode}");
        check(&a);
        a.wake(&[]).unwrap();
        assert!(
            a.kv_cache().is_none() && a.asleep_tags().is_empty(),
            "{mode}"
        );
        check(&a);
    }
}

#[test]
fn a_failed_wake_of_the_kv_cache_leaves_it_asleep_and_can_be_retried() {
    for mode in VIRTUAL {
        let a = tags_apart(mode, 80 * GIB);
        let kv = a.reserve_kv(BLOCK, Some(4 * GIB), 100).unwrap();
        a.sleep(&[], &[Tag::KvCache]).unwrap();
        for call in [
            DriverCall::CreatePhysical,
            DriverCall::Map,
            DriverCall::FillZero,
        ] {
            wake_fails_leaving_kv_asleep(&a, call, 1, &format!("{mode} {call:?}"));
            assert!(!readable(&a, kv.base), "{mode} {call:?}");
            check(&a);
        }
        a.wake(&[]).unwrap();
        assert_eq!(
            a.kv_cache().unwrap().mapped_bytes,
            kv.mapped_bytes,
            "{mode}"
        );
        check(&a);
    }
}

/// Sizing the KV cache while weights sleep keeps their room: their wake fits the cap.
#[test]
fn committing_the_kv_cache_while_a_tag_sleeps_leaves_it_room_to_wake() {
    for mode in VIRTUAL {
        let a = tags_apart(mode, 80 * GIB);
        let p = Profiler::new(&a).unwrap();
        let w = a.allocate_tagged(3 * GIB, S, Tag::Weights).unwrap();
        let options = ProfileOptions {
            utilization: 0.2,
            ..Default::default()
        };
        p.profile(options, || {
            let x = a.allocate_tagged(GIB, S, Tag::Activation).unwrap();
            a.free(x.ptr).unwrap();
        })
        .unwrap();
        a.reserve_kv(BLOCK, None, 16).unwrap();
        let awake = a.commit_kv().unwrap();
        a.sleep(&[Tag::Weights], &[]).unwrap();
        let asleep = a.commit_kv().unwrap();
        let weights_asleep = a.snapshot().sleeping_bytes[Tag::Weights];
        assert!(weights_asleep >= 3 * GIB, "{mode}");
        assert_eq!(asleep.room.asleep, weights_asleep, "{mode}");
        assert!(
            asleep.kv.mapped_bytes <= awake.kv.mapped_bytes + 2 * MIB,
            "{mode}"
        );
        a.wake(&[]).unwrap();
        assert!(a.asleep_tags().is_empty(), "{mode}");
        check(&a);
        a.free(w.ptr).unwrap();
    }
}

/// While a wake copies a tag's contents back, its memory is mapped but not yet reserved; the
/// cap must not count it twice (once in use, once committed) against other tags' growth.
#[test]
fn a_wake_in_progress_is_not_counted_twice_against_the_cap() {
    for mode in VIRTUAL {
        let a = Arc::new(tags_apart(mode, 80 * GIB));
        let dev = a.driver().device().clone();
        let _w = a.allocate_tagged(2 * GIB, S, Tag::Weights).unwrap();
        let usage = || dev.used() - dev.other_usage();
        a.set_cap(Some(usage() + 500 * MIB));
        a.sleep(&[Tag::Weights], &[]).unwrap();
        dev.hold_copies(true);
        let waker = {
            let a = a.clone();
            std::thread::spawn(move || a.wake(&[]).map(|_| ()))
        };
        let t = Instant::now();
        while dev.copies_held() == 0 {
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "{mode}: the wake never copied"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        let during = a.allocate_tagged(200 * MIB, S, Tag::Activation);
        dev.hold_copies(false);
        waker.join().unwrap().unwrap();
        let x = during.unwrap_or_else(|e| panic!("{mode}: refused during the wake: {e}"));
        a.free(x.ptr).unwrap();
        check(&a);
    }
}

#[test]
fn a_failed_release_of_the_kv_cache_leaves_no_block_usable() {
    for mode in [SegmentMode::Native, SegmentMode::Remap] {
        let a = tags_apart(mode, 80 * GIB);
        a.reserve_kv(BLOCK, Some(4 * GIB), 100).unwrap();
        let d = a.driver();
        d.fail_nth(DriverCall::ReleaseVa, 1);
        assert!(a.release_kv().is_err(), "{mode}");
        d.clear_faults();
        let kv = a.kv_cache().unwrap();
        assert_eq!((kv.usable_blocks, kv.mapped_bytes), (0, 0), "{mode}");
        check(&a);
        a.release_kv().unwrap();
        assert!(a.kv_cache().is_none(), "{mode}");
        check(&a);
    }
}

/// After a shrink that keeps a partly used piece mapped, growing within that piece needs no
/// new memory: it is not refused, even with no room left under the cap.
#[test]
fn growing_the_kv_cache_within_memory_it_keeps_mapped_needs_no_room() {
    for mode in [SegmentMode::Native, SegmentMode::Expandable] {
        let a = tags_apart(mode, 80 * GIB);
        a.reserve_kv(BLOCK, Some(GIB), 40).unwrap();
        let k = a.resize_kv(10, 10).unwrap();
        assert!(k.mapped_bytes >= 20 * BLOCK, "{mode}: {k:?}");
        a.set_cap(Some(GIB / 2));
        assert_eq!(a.resize_kv(20, 10).unwrap().usable_blocks, 20, "{mode}");
        // Past what is mapped, the cap refuses.
        assert!(a.resize_kv(600, 20).is_err(), "{mode}");
        check(&a);
    }
}

/// A wake refused during a capture changes nothing: the KV cache stays asleep with its tag.
#[test]
fn a_wake_refused_during_a_capture_leaves_the_kv_cache_asleep() {
    for mode in VIRTUAL {
        let a = tags_apart(mode, 80 * GIB);
        let kv = a.reserve_kv(BLOCK, Some(4 * GIB), 100).unwrap();
        a.sleep(&[], &[Tag::KvCache]).unwrap();
        let maps = a.driver().calls(DriverCall::Map);
        let pool = vram_ledger::driver::GraphPool(1, 1);
        let dev = a.driver().device().clone();
        dev.begin_capture(S);
        a.begin_graph_pool(pool, S).unwrap();
        let e = a.wake(&[]).unwrap_err();
        assert!(matches!(e, Error::Capturing(_)), "{mode}: {e}");
        assert_eq!(
            a.driver().calls(DriverCall::Map),
            maps,
            "{mode}: mapped during a capture"
        );
        assert!(!readable(&a, kv.base), "{mode}");
        assert!(dev.end_capture(S), "{mode}: the wake spoiled the capture");
        a.end_graph_pool(pool, S).unwrap();
        a.wake(&[]).unwrap();
        assert!(readable(&a, kv.base), "{mode}");
        check(&a);
    }
}

/// When the rest of the KV tag cannot wake, the KV cache, woken first, goes back to sleep with
/// it, and a later wake brings both.
#[test]
fn the_kv_cache_goes_back_to_sleep_when_the_rest_of_its_tag_cannot_wake() {
    for mode in VIRTUAL {
        let a = tags_apart(mode, 80 * GIB);
        let kv = a.reserve_kv(BLOCK, Some(4 * GIB), 100).unwrap();
        let x = a.allocate_tagged(64 * MIB, S, Tag::KvCache).unwrap();
        a.sleep(&[], &[Tag::KvCache]).unwrap();
        // The cache's own pieces map first; fail the first map after them.
        let pieces = kv.mapped_bytes.div_ceil(32 * MIB);
        wake_fails_leaving_kv_asleep(&a, DriverCall::Map, pieces + 1, &mode.to_string());
        assert!(
            !readable(&a, kv.base) && !readable(&a, x.ptr),
            "{mode}: half awake"
        );
        assert_eq!(a.kv_cache().unwrap().mapped_bytes, 0, "{mode}");
        check(&a);
        a.wake(&[]).unwrap();
        assert!(readable(&a, kv.base) && readable(&a, x.ptr), "{mode}");
        check(&a);
    }
}

/// Asleep, the KV cache stays one allocation of its tag, also after the peaks are reset (its
/// mapped bytes' peak then reads 0).
#[test]
fn the_asleep_kv_cache_is_counted_after_a_reset_of_the_peaks() {
    for mode in VIRTUAL {
        let a = tags_apart(mode, 80 * GIB);
        let kv = a.reserve_kv(BLOCK, Some(GIB), 20).unwrap();
        a.sleep(&[], &[Tag::KvCache]).unwrap();
        a.ledger().reset_peaks();
        let s = a.snapshot();
        assert_eq!(
            s.per_tag[Tag::KvCache].allocated_bytes.current,
            kv.mapped_bytes,
            "{mode}"
        );
        check(&a);
        a.wake(&[]).unwrap();
        check(&a);
    }
}
