//! Sleep's host memory on the simulated device. Retained, a tag whose contents take many
//! page-locked chunks is pinned on several threads while the copies into the chunks already
//! pinned are queued. Not retained, the contents go through the staging ring's workers into
//! pageable memory, piece by piece. Either way every byte comes back, and a failure partway
//! leaves the tag awake and, once host memory is no longer retained, none held.

use std::sync::Arc;
use std::time::{Duration, Instant};

#[path = "common/sim.rs"]
mod common;

use common::{check, engine, readable, stamp, stamped, tags_apart as allocator, VIRTUAL};
use vram_ledger::driver::sim::SimDriver;
use vram_ledger::driver::{Driver, DriverCall, HostPtr, StreamId};
use vram_ledger::units::{GIB, MIB};
use vram_ledger::{Allocation, Allocator, SegmentMode, Tag};

const S: StreamId = StreamId(0x10);

/// 2 GiB of weights in 16 pieces of a little under 128 MiB, stamped `salt` on.
fn two_gib_of_weights(a: &Allocator<SimDriver>, salt: u64) -> Vec<Allocation> {
    let w: Vec<Allocation> = (0..16)
        .map(|i| {
            a.allocate_tagged(128 * MIB - i * 4096, S, Tag::Weights)
                .unwrap()
        })
        .collect();
    for (i, x) in w.iter().enumerate() {
        stamp(a, x, salt + i as u64);
    }
    w
}

/// `op` run on another thread with every copy between host and device held at its start.
/// Once a copy waits, `until` is polled (for up to 20 s) and then `then` read, both while the
/// copy still waits; then the copies go on. Returns what `op` returned, whether `until` came
/// true, and what `then` read; fails if no copy was held, or if the copies did not wait
/// throughout.
fn with_copies_held<R: Send + 'static, T>(
    a: &Arc<Allocator<SimDriver>>,
    mode: SegmentMode,
    op: fn(&Allocator<SimDriver>) -> R,
    until: impl Fn() -> bool,
    then: impl FnOnce() -> T,
) -> (R, bool, T) {
    let dev = a.driver().device().clone();
    dev.hold_copies(true);
    let worker = {
        let a = a.clone();
        std::thread::spawn(move || op(&a))
    };
    let t = Instant::now();
    while dev.copies_held() == 0 {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "{mode}: no copy was held"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let t = Instant::now();
    let mut seen = until();
    while !seen && t.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(5));
        seen = until();
    }
    let read = then();
    let still_held = dev.copies_held() > 0;
    dev.hold_copies(false);
    let r = worker.join().unwrap();
    assert!(still_held, "{mode}: the copies were held throughout");
    (r, seen, read)
}

#[test]
fn sleep_of_a_tag_of_many_host_chunks_pins_and_copies_them_all() {
    // 2 GiB in pieces of several sizes: 8 host chunks pinned on several threads while the
    // copies into those already pinned are queued; after a failure partway, what was pinned
    // is kept for the next sleep, which frees it at wake once no longer retained.
    for fail in [None, Some(5)] {
        let a = allocator(SegmentMode::Remap, 80 * GIB);
        a.set_retain_host(true);
        let w = two_gib_of_weights(&a, 0x5000);
        if let Some(nth) = fail {
            a.driver().fail_nth(DriverCall::HostAlloc, nth);
            assert!(a.sleep(&[Tag::Weights], &[]).is_err());
            a.driver().clear_faults();
            assert!(a.asleep_tags().is_empty());
            assert!(
                a.driver().host_bytes() < 2 * GIB,
                "only what was pinned is kept"
            );
        } else {
            let r = a.sleep(&[Tag::Weights], &[]).unwrap();
            assert!(r.host_bytes >= 2 * GIB - 16 * 16 * 4096, "{r:?}");
            assert!(w.iter().all(|x| !readable(&a, x)));
            a.wake(&[]).unwrap();
            assert_eq!(a.driver().host_bytes(), r.host_bytes, "retained at wake");
        }
        a.set_retain_host(false);
        a.sleep(&[Tag::Weights], &[]).unwrap();
        assert_eq!(
            a.driver().calls(DriverCall::HostAllocPageable),
            0,
            "the pinned chunks serve the sleep"
        );
        a.wake(&[]).unwrap();
        assert_eq!(a.driver().host_bytes(), 0, "freed at wake");
        assert!(w
            .iter()
            .enumerate()
            .all(|(i, x)| stamped(&a, x, 0x5000 + i as u64)));
        check(&a);
    }
}

#[test]
fn sleep_of_a_tag_of_many_pieces_goes_through_the_staging_ring() {
    // 2 GiB: a thousand pieces of a slot spread over the ring's workers. A failure of any
    // piece stops every worker: the sleep fails with nothing asleep and no host memory kept;
    // a wake that fails partway leaves the tag asleep with its contents, and is retried.
    for (call, nth, during_wake) in [
        (None, 0, false),
        (Some(DriverCall::HostCopy), 300, false),
        (Some(DriverCall::CopyToHost), 700, false),
        (Some(DriverCall::WaitEvent), 2, false),
        (Some(DriverCall::HostCopy), 500, true),
        (Some(DriverCall::CopyToDevice), 900, true),
        (Some(DriverCall::RecordEvent), 10, true),
    ] {
        let a = allocator(SegmentMode::Remap, 80 * GIB);
        let w = two_gib_of_weights(&a, 0x6000);
        let what = format!("{call:?} #{nth} wake={during_wake}");
        if during_wake {
            a.sleep(&[Tag::Weights], &[]).unwrap();
        }
        if let Some(c) = call {
            a.driver().fail_nth(c, nth);
        }
        let r = if during_wake {
            a.wake(&[]).map(|_| ())
        } else {
            a.sleep(&[Tag::Weights], &[]).map(|_| ())
        };
        a.driver().clear_faults();
        assert_eq!(r.is_err(), call.is_some(), "{what}: {r:?}");
        if call.is_some() && during_wake {
            assert_eq!(a.asleep_tags(), vec![Tag::Weights], "{what}");
            assert!(
                a.driver().host_bytes() >= 2 * GIB - 16 * 16 * 4096,
                "{what}"
            );
            assert_eq!(a.driver().pinned_host_bytes(), 0, "{what}: the ring went");
            a.wake(&[]).unwrap();
        } else if call.is_some() {
            assert!(a.asleep_tags().is_empty(), "{what}");
            assert_eq!(a.driver().host_bytes(), 0, "{what}: nothing kept");
        } else {
            assert!(w.iter().all(|x| !readable(&a, x)));
            assert_eq!(
                a.driver().pinned_host_bytes(),
                0,
                "asleep, nothing is pinned"
            );
            a.wake(&[]).unwrap();
        }
        assert_eq!(a.driver().host_bytes(), 0, "{what}: freed at wake");
        assert!(
            w.iter()
                .enumerate()
                .all(|(i, x)| stamped(&a, x, 0x6000 + i as u64)),
            "{what}"
        );
        check(&a);
    }
}

#[test]
fn sleep_without_retained_memory_pins_only_a_small_ring_and_keeps_nothing_after_wake() {
    for mode in VIRTUAL {
        let a = allocator(mode, 80 * GIB);
        let e = engine(&a);
        let r = a
            .sleep(&[Tag::Weights, Tag::Activation], &[Tag::KvCache])
            .unwrap();
        // Asleep, the offloaded contents are in pageable memory, a buffer per tag, and nothing
        // is page-locked: the ring served the sleep and went with it.
        assert_eq!(a.driver().calls(DriverCall::HostAllocPageable), 2, "{mode}");
        assert_eq!(a.driver().pinned_host_bytes(), 0, "{mode}");
        assert_eq!(a.driver().host_bytes(), r.host_bytes, "{mode}");
        assert!(r.host_bytes >= r.offloaded_bytes, "{mode}: {r:?}");
        // What was pinned is the ring: slots of 2 MiB, two per worker, far below the contents.
        let slots = a.driver().calls(DriverCall::HostAlloc);
        assert!((2..=32).contains(&slots), "{mode}: {slots}");
        assert!(
            slots * 2 * MIB < r.offloaded_bytes,
            "{mode}: {slots} slots for {r:?}"
        );
        let w = a.wake(&[]).unwrap();
        assert_eq!(w.host_bytes_after, 0, "{mode}");
        assert_eq!(a.driver().host_bytes(), 0, "{mode}");
        assert!(e.weights_intact(&a), "{mode}");
        assert!(stamped(&a, &e.act, 0x1007), "{mode}");
        check(&a);
    }
}

#[test]
fn sleep_staging_never_lets_a_device_copy_touch_pageable_memory() {
    // The simulated driver refuses what a real one would do slowly or unsafely: a device copy
    // to pageable memory, and a host copy out of a slot whose device copy may still run.
    let a = allocator(SegmentMode::Remap, 8 * GIB);
    let x = a.allocate_tagged(4 * MIB, S, Tag::Weights).unwrap();
    stamp(&a, &x, 0x77);
    let d = a.driver();
    let pageable = d.host_alloc_pageable(4 * MIB, None).unwrap();
    let slot = d.host_alloc(4 * MIB).unwrap();
    let e = d.copy_to_host(pageable, x.ptr, 4 * MIB, S).unwrap_err();
    assert!(e.detail.contains("pageable"), "{e}");
    d.copy_to_host(slot, x.ptr, 4 * MIB, S).unwrap();
    let e = d.host_copy(pageable, slot, 4 * MIB).unwrap_err();
    assert!(e.detail.contains("may still use it"), "{e}");
    let ev = d.record_event(S).unwrap();
    d.wait_event(ev).unwrap();
    d.destroy_event(ev).unwrap();
    d.host_copy(pageable, slot, 4 * MIB).unwrap();
    // And back, the same way: the words travel.
    a.free(x.ptr).unwrap();
    let y = a.allocate_tagged(4 * MIB, S, Tag::Weights).unwrap();
    d.host_copy(slot, pageable, 4 * MIB).unwrap();
    d.copy_to_device(y.ptr, slot, 4 * MIB, S).unwrap();
    assert!(stamped(&a, &y, 0x77));
    d.sync_stream(S).unwrap();
    let e = d
        .host_copy(slot, HostPtr(pageable.0 + 2 * MIB), 4 * MIB)
        .unwrap_err();
    assert!(e.detail.contains("inside one host buffer"), "{e}");
    d.host_free(slot).unwrap();
    d.host_free(pageable).unwrap();
    a.free(y.ptr).unwrap();
}

#[test]
fn sleep_to_a_named_file_offloads_there_and_refuses_a_taken_name_or_a_missing_directory() {
    let dir = std::env::temp_dir().join(format!("vram-ledger-sleep-file-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let a = allocator(SegmentMode::Remap, 80 * GIB);
    let e = engine(&a);
    a.set_sleep_file(Some(dir.join("engine")));
    let name = dir.join(format!("engine.dev{}.weights", a.driver().ordinal()));
    // A name that is taken is not written over: the sleep is refused, nothing is lost.
    std::fs::write(&name, b"the user's").unwrap();
    let err = a.sleep(&[Tag::Weights], &[]).unwrap_err().to_string();
    assert!(
        err.contains("engine.dev") && err.contains("exists"),
        "{err}"
    );
    assert!(a.asleep_tags().is_empty());
    assert_eq!(std::fs::read(&name).unwrap(), b"the user's");
    assert!(e.weights_intact(&a));
    std::fs::remove_file(&name).unwrap();
    // Offloaded to the file's pages: nothing page-locked, the name gone at once.
    let r = a.sleep(&[Tag::Weights], &[]).unwrap();
    assert!(!name.exists(), "the file is removed as soon as it is made");
    assert_eq!(a.driver().pinned_host_bytes(), 0);
    assert_eq!(a.driver().host_bytes(), r.host_bytes);
    a.wake(&[]).unwrap();
    assert!(e.weights_intact(&a));
    assert_eq!(a.driver().host_bytes(), 0);
    // A directory that does not exist: a clear error, and a sleep to memory still works.
    a.set_sleep_file(Some(dir.join("no/such/dir/engine")));
    let err = a.sleep(&[Tag::Weights], &[]).unwrap_err().to_string();
    assert!(err.contains("no/such/dir"), "{err}");
    assert!(a.asleep_tags().is_empty());
    a.set_sleep_file(None);
    a.sleep(&[Tag::Weights], &[]).unwrap();
    a.wake(&[]).unwrap();
    assert!(e.weights_intact(&a));
    check(&a);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn wake_maps_the_next_tag_while_the_contents_of_one_are_copied_back() {
    // Weights (offloaded) wake before the KV cache (discarded): with the weights' copies held
    // at their start, the KV cache's memory is mapped and accessible all the same; once the
    // copies go on, both tags are awake with their contents.
    for mode in VIRTUAL {
        let a = Arc::new(allocator(mode, 80 * GIB));
        let e = engine(&a);
        a.sleep(&[Tag::Weights], &[Tag::KvCache]).unwrap();
        assert!(
            !a.driver().is_accessible(e.kv[0].ptr, e.kv[0].size),
            "{mode}"
        );
        let (report, mapped_while_held, ()) = with_copies_held(
            &a,
            mode,
            |a| a.wake(&[]).unwrap(),
            || e.kv.iter().all(|x| a.driver().is_accessible(x.ptr, x.size)),
            || (),
        );
        assert!(
            mapped_while_held,
            "{mode}: the KV cache was not mapped while the weights' copies waited"
        );
        assert_eq!(report.tags, vec![Tag::Weights, Tag::KvCache], "{mode}");
        for (i, x) in e.weights.iter().enumerate() {
            assert!(stamped(&a, x, 0x1000 + i as u64), "{mode}: weights {i}");
        }
        assert!(e.kv.iter().all(|x| readable(&a, x)), "{mode}");
        check(&a);
    }
}

#[test]
fn wake_under_a_tight_cap_maps_the_next_tag_once_one_is_awake_and_keeps_the_cache() {
    // Mapped ahead while the weights are copied back, the KV cache would be charged twice
    // against a cap (the weights' memory mapped, not yet counted as reserved). Under a cap with
    // room for everything once, both tags wake in one call and the activation tag's cache,
    // built while they slept, is not given back to make room.
    for mode in VIRTUAL {
        let a = allocator(mode, 80 * GIB);
        let _e = engine(&a);
        a.sleep(&[Tag::Weights], &[Tag::KvCache]).unwrap();
        let x = a.allocate_tagged(40 * MIB, S, Tag::Activation).unwrap();
        a.free(x.ptr).unwrap();
        let before = a.ledger().reserved();
        let asleep = a.ledger().sleeping(Tag::Weights) + a.ledger().sleeping(Tag::KvCache);
        let usage = a.driver().process_usage().unwrap().unwrap();
        a.set_cap(Some(usage + asleep + 4 * MIB));
        let r = a.wake(&[]).unwrap();
        assert_eq!(r.tags, vec![Tag::Weights, Tag::KvCache], "{mode}");
        assert_eq!(
            a.ledger().reserved(),
            before + asleep,
            "{mode}: the activation tag's cache was given back"
        );
        check(&a);
    }
}

#[test]
fn sleep_gives_back_the_discarded_tags_while_the_offloaded_ones_are_copied() {
    // With the weights' copies held at their start, the KV cache (discarded) is given back all
    // the same; once the copies go on, both tags are asleep.
    for mode in VIRTUAL {
        let a = Arc::new(allocator(mode, 80 * GIB));
        let e = engine(&a);
        let (report, gone_while_held, weights_there) = with_copies_held(
            &a,
            mode,
            |a| a.sleep(&[Tag::Weights], &[Tag::KvCache]).unwrap(),
            || {
                e.kv.iter()
                    .all(|x| !a.driver().is_accessible(x.ptr, x.size))
            },
            || e.weights.iter().all(|x| readable(&a, x)),
        );
        assert!(
            weights_there,
            "{mode}: the weights were given back before their copies"
        );
        assert!(
            gone_while_held,
            "{mode}: the KV cache was not given back while the weights' copies waited"
        );
        assert_eq!(report.tags, vec![Tag::Weights, Tag::KvCache], "{mode}");
        let kv = a.ledger().sleeping(Tag::KvCache);
        assert_eq!(report.discarded_bytes, kv, "{mode}");
        assert_eq!(
            report.given_back_bytes,
            kv + a.ledger().sleeping(Tag::Weights),
            "{mode}"
        );
        check(&a);
        a.wake(&[]).unwrap();
        assert!(e.weights_intact(&a), "{mode}");
        check(&a);
    }
}

#[test]
fn sleep_whose_copies_fail_keeps_the_offloaded_tags_awake_and_the_discarded_asleep() {
    for mode in VIRTUAL {
        let a = allocator(mode, 80 * GIB);
        let e = engine(&a);
        let kv: u64 = e.kv.iter().map(|x| x.size).sum();
        a.driver().fail_from(DriverCall::CopyToHost, 1);
        let err = a.sleep(&[Tag::Weights], &[Tag::KvCache]).unwrap_err();
        a.driver().clear_faults();
        assert!(
            matches!(err, vram_ledger::Error::Driver(_)),
            "{mode}: {err}"
        );
        assert_eq!(a.asleep_tags(), vec![Tag::KvCache], "{mode}");
        assert!(a.ledger().sleeping(Tag::KvCache) >= kv, "{mode}");
        assert!(e.weights_intact(&a), "{mode}");
        assert_eq!(a.driver().host_bytes(), 0, "{mode}: host memory freed");
        check(&a);
        // Sleeping again puts the weights to sleep; the KV cache is left as it is.
        let r = a.sleep(&[Tag::Weights], &[Tag::KvCache]).unwrap();
        assert_eq!(r.tags, vec![Tag::Weights], "{mode}");
        a.wake(&[]).unwrap();
        assert!(e.weights_intact(&a), "{mode}");
        assert!(e.kv.iter().all(|x| readable(&a, x)), "{mode}");
        check(&a);
    }
}

#[test]
fn sleep_noting_names_only_the_tags_the_failed_call_left_asleep() {
    for mode in VIRTUAL {
        let a = allocator(mode, 80 * GIB);
        let e = engine(&a);
        // Asleep before the call: not this call's to undo.
        let (r, left) = a.sleep_noting(&[], &[Tag::Activation]);
        assert_eq!(r.unwrap().tags, vec![Tag::Activation], "{mode}");
        assert_eq!(
            left,
            vec![Tag::Activation],
            "{mode}: a sleep that succeeds notes its tags"
        );
        a.driver().fail_from(DriverCall::CopyToHost, 1);
        let (r, left) = a.sleep_noting(&[Tag::Weights], &[Tag::KvCache]);
        a.driver().clear_faults();
        assert!(r.is_err(), "{mode}");
        assert_eq!(
            left,
            vec![Tag::KvCache],
            "{mode}: the discarded tag, not the one asleep before"
        );
        let mut asleep = a.asleep_tags();
        asleep.sort_by_key(|t| t.index());
        assert_eq!(asleep, vec![Tag::Activation, Tag::KvCache], "{mode}");
        // Undoing what the call did leaves the earlier sleep in place.
        a.wake(&left).unwrap();
        assert_eq!(a.asleep_tags(), vec![Tag::Activation], "{mode}");
        assert!(e.weights_intact(&a), "{mode}");
        a.wake(&[]).unwrap();
        check(&a);
    }
}
