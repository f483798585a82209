//! Sleep and wake by tag on the simulated device, in every virtual-memory mode. The simulated
//! device keeps what is written into its physical memory, so "nothing is lost" is checked on
//! the contents themselves: words written into every allocation before sleep are read back
//! after wake at the same addresses; while asleep the offloaded and discarded memory is not
//! accessible at all (a kernel touching it would fault), and the kept tags' memory is.
//! Faults are injected into every driver call sleep and wake make; each tag ends wholly asleep
//! or wholly awake, and nothing leaks (driver objects and page-locked host memory).

#[path = "common/sim.rs"]
mod common;

use common::{check, engine, readable, sim, sim_with, stamped, tags_apart as allocator, VIRTUAL};
use vram_ledger::driver::sim::SimDriver;
use vram_ledger::driver::{DriverCall, StreamId};
use vram_ledger::units::{GIB, MIB};
use vram_ledger::{Allocation, Allocator, Config, Error, SegmentMode, Tag};

const S: StreamId = StreamId(0x10);
const OTHER: StreamId = StreamId(0x20);

#[test]
fn sleep_offloads_and_wake_restores_at_the_same_addresses() {
    for mode in VIRTUAL {
        let a = allocator(mode, 80 * GIB);
        let e = engine(&a);
        let held_before = a.driver().held_bytes();
        let weights: u64 = e.weights.iter().map(|x| x.size).sum();
        let kv: u64 = e.kv.iter().map(|x| x.size).sum();

        let r = a.sleep(&[Tag::Weights], &[Tag::KvCache]).unwrap();
        assert_eq!(r.tags, vec![Tag::Weights, Tag::KvCache], "{mode}");
        assert_eq!(a.asleep_tags(), vec![Tag::Weights, Tag::KvCache]);
        assert!(
            r.offloaded_bytes >= weights && r.discarded_bytes >= kv,
            "{mode}: {r:?}"
        );
        assert_eq!(r.held_bytes, 0);
        // Asleep memory is gone from the device; the kept activation is still there.
        assert!(
            e.weights.iter().chain(&e.kv).all(|x| !readable(&a, x)),
            "{mode}"
        );
        assert!(
            stamped(&a, &e.act, 0x1000 + 7),
            "{mode}: the kept tag's contents"
        );
        let held_asleep = a.driver().held_bytes();
        assert!(
            held_before - held_asleep >= weights + kv,
            "{mode}: {held_before} -> {held_asleep}"
        );
        assert!(a.driver().host_bytes() >= r.offloaded_bytes);
        let snap = a.snapshot();
        assert_eq!(
            snap.sleeping_bytes[Tag::Weights] + snap.sleeping_bytes[Tag::KvCache],
            r.given_back_bytes
        );
        assert_eq!(
            snap.reserved_bytes.current, held_asleep,
            "{mode}: reserved is what the driver holds"
        );
        check(&a);

        // While asleep: its allocations are refused, the others' served.
        assert!(matches!(
            a.allocate_tagged(1 << 20, S, Tag::Weights),
            Err(Error::Asleep(Tag::Weights))
        ));
        let more = a.allocate_tagged(8 * MIB, S, Tag::Activation).unwrap();
        a.free(more.ptr).unwrap();

        let w = a.wake(&[]).unwrap();
        assert_eq!(w.tags, vec![Tag::Weights, Tag::KvCache]);
        assert_eq!(w.restored_bytes, r.offloaded_bytes);
        assert!(a.asleep_tags().is_empty());
        for (i, x) in e.weights.iter().enumerate() {
            assert!(
                stamped(&a, x, 0x1000 + i as u64),
                "{mode}: weights {i} restored"
            );
        }
        assert!(
            e.kv.iter().all(|x| readable(&a, x)),
            "{mode}: the discarded memory is back"
        );
        assert!(w.zeroed_bytes >= kv, "{mode}: {w:?}");
        assert_eq!(
            a.driver().host_bytes(),
            0,
            "{mode}: host memory freed at wake"
        );
        assert_eq!(a.snapshot().sleeping_bytes[Tag::Weights], 0);
        check(&a);
        // The woken memory is served and freed as before.
        for x in e.weights.iter().chain(&e.kv) {
            a.free(x.ptr).unwrap();
        }
        a.allocate_tagged(30 * MIB, S, Tag::Weights).unwrap();
        check(&a);
    }
}

/// Discarded memory reads as zeros after wake, written words and words nothing wrote alike
/// (fresh memory on the simulated device holds stale data, as on a GPU); told to leave it, wake
/// maps fresh memory and fills nothing.
#[test]
fn sleep_discarded_memory_reads_zeros_after_wake_unless_told_to_leave_it() {
    let zeros = |a: &Allocator<SimDriver>, x: &Allocation| {
        let d = a.driver();
        [x.ptr, x.ptr + 4096, x.ptr + x.requested / 8 * 8 - 8]
            .iter()
            .all(|&w| d.read_word(w).ok() == Some(0))
    };
    for mode in VIRTUAL {
        for zero in [true, false] {
            let a = allocator(mode, 80 * GIB);
            let e = engine(&a);
            assert!(
                !zeros(&a, &e.kv[0]),
                "{mode}: fresh memory reads stale data"
            );
            a.set_zero_discarded(zero);
            let r = a.sleep(&[Tag::Weights], &[Tag::KvCache]).unwrap();
            let w = a.wake(&[]).unwrap();
            for x in &e.kv {
                assert_eq!(zeros(&a, x), zero, "{mode}, zero {zero}: {x:?}");
            }
            let want = if zero { r.discarded_bytes } else { 0 };
            assert_eq!(w.zeroed_bytes, want, "{mode}");
            assert_eq!(
                a.driver_calls()[DriverCall::FillZero] > 0,
                zero,
                "{mode}: one fill per discarded mapping, none when told to leave them"
            );
            for (i, x) in e.weights.iter().enumerate() {
                assert!(stamped(&a, x, 0x1000 + i as u64), "{mode}: offloaded kept");
            }
            check(&a);
        }
    }
}

#[test]
fn sleep_in_native_mode_or_without_separate_tags_is_a_clear_error() {
    let native = sim_with(Config {
        separate_tags: true,
        ..Config::default()
    });
    let e = native.sleep(&[Tag::Weights], &[]).unwrap_err();
    assert!(matches!(e, Error::SleepNeedsVirtualMemory("native")));
    assert!(
        e.to_string().contains("expandable, compact or remap"),
        "{e}"
    );
    let mixed = sim(SegmentMode::Expandable);
    let e = mixed.sleep(&[Tag::Weights], &[]).unwrap_err();
    assert!(matches!(e, Error::SleepNeedsSeparateTags), "{e}");
    let a = allocator(SegmentMode::Expandable, 80 * GIB);
    let e = a.sleep(&[Tag::Weights], &[Tag::Weights]).unwrap_err();
    assert!(
        e.to_string().contains("both offloaded and discarded"),
        "{e}"
    );
}

#[test]
fn sleep_frees_while_asleep_are_deferred_to_the_wake() {
    for mode in VIRTUAL {
        let a = allocator(mode, 80 * GIB);
        let e = engine(&a);
        a.record_stream(e.kv[0].ptr, OTHER).unwrap();
        a.sleep(&[Tag::Weights], &[Tag::KvCache]).unwrap();
        let live = a.live_allocations();
        a.free(e.weights[2].ptr).unwrap();
        a.free(e.kv[0].ptr).unwrap();
        assert!(
            matches!(a.free(e.kv[0].ptr), Err(Error::UnknownPointer(_))),
            "double free"
        );
        assert_eq!(a.live_allocations(), live, "{mode}: deferred, not applied");
        check(&a);
        a.wake(&[]).unwrap();
        assert_eq!(a.live_allocations(), live - 2, "{mode}: applied at wake");
        assert!(stamped(&a, &e.weights[3], 0x1003), "{mode}");
        check(&a);
    }
}

#[test]
fn sleep_wake_of_every_tag_goes_on_past_one_that_lacks_room() {
    // Found by fuzzing (compact): a tag put to sleep while an unmap fails keeps its memory,
    // and the free of its allocation waits for its wake. Waking every tag must not stop at a
    // tag that needs that memory: the tag that holds it wakes, its free is applied, and the
    // first tag wakes in the next round.
    for mode in VIRTUAL {
        let a = allocator(mode, 2 * GIB);
        let act = a
            .allocate_tagged(400 * MIB, StreamId(0), Tag::Activation)
            .unwrap();
        a.sleep(&[], &[Tag::Activation]).unwrap();
        let big = a
            .allocate_tagged(1200 * MIB, StreamId(0), Tag::Untracked)
            .unwrap();
        a.driver().fail_from(DriverCall::Unmap, 1);
        let r = a.sleep(&[], &[Tag::Untracked]).unwrap();
        assert!(
            r.held_bytes > 0,
            "{mode}: the unmap failed, the memory is held"
        );
        a.driver().clear_faults();
        a.free(big.ptr).unwrap();
        let woke = a.wake(&[]).unwrap();
        assert_eq!(
            woke.tags,
            vec![Tag::Activation, Tag::Untracked],
            "{mode}: in tag order"
        );
        assert!(a.asleep_tags().is_empty(), "{mode}");
        a.free(act.ptr).unwrap();
        check(&a);
    }
}

#[test]
fn sleep_wake_without_room_is_a_clear_error_and_can_be_retried() {
    for mode in VIRTUAL {
        let a = allocator(mode, 4 * GIB);
        let e = engine(&a);
        a.sleep(&[Tag::Weights], &[Tag::KvCache]).unwrap();
        // Another process takes the freed memory.
        let other = a.driver().device().spawn_process().unwrap();
        let free = a.driver().device().config().capacity - a.driver().device().used();
        other.alloc_external(free - 8 * MIB).unwrap();
        let err = a.wake(&[Tag::Weights]).unwrap_err();
        assert!(
            matches!(
                err,
                Error::Wake {
                    tag: Tag::Weights,
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("could not wake weights"), "{err}");
        assert_eq!(
            a.asleep_tags(),
            vec![Tag::Weights, Tag::KvCache],
            "{mode}: still asleep"
        );
        assert!(a.driver().host_bytes() > 0, "{mode}: the host copy is kept");
        check(&a);
        other.free_external(free - 8 * MIB);
        a.wake(&[]).unwrap();
        for (i, x) in e.weights.iter().enumerate() {
            assert!(stamped(&a, x, 0x1000 + i as u64), "{mode}: weights {i}");
        }
        check(&a);
    }
}

#[test]
fn sleep_and_wake_faults_leave_each_tag_wholly_asleep_or_awake_with_nothing_leaked() {
    let calls = [
        DriverCall::SyncDevice,
        DriverCall::HostAlloc,
        DriverCall::HostAllocPageable,
        DriverCall::HostCopy,
        DriverCall::HostFree,
        DriverCall::CreateStream,
        DriverCall::RecordEvent,
        DriverCall::WaitEvent,
        DriverCall::DestroyEvent,
        DriverCall::CopyToHost,
        DriverCall::CopyToDevice,
        DriverCall::SyncStream,
        DriverCall::ReleasePhysical,
        DriverCall::Unmap,
        DriverCall::CreatePhysical,
        DriverCall::Map,
        DriverCall::SetAccess,
        DriverCall::FillZero,
    ];
    let mut struck = std::collections::BTreeSet::new();
    for mode in VIRTUAL {
        for call in calls {
            for nth in [1, 2, 5] {
                for during_wake in [false, true] {
                    let a = allocator(mode, 80 * GIB);
                    let e = engine(&a);
                    if during_wake {
                        a.sleep(&[Tag::Weights], &[Tag::KvCache]).unwrap();
                    }
                    let before = a.driver().calls(call);
                    a.driver().fail_nth(call, nth);
                    let r = if during_wake {
                        a.wake(&[]).map(|_| ())
                    } else {
                        a.sleep(&[Tag::Weights], &[Tag::KvCache]).map(|_| ())
                    };
                    let hit = a.driver().calls(call) >= before + nth;
                    a.driver().clear_faults();
                    if hit {
                        struck.insert(call);
                    }
                    let asleep = a.asleep_tags();
                    // Wholly: a tag is asleep or awake in every shard, and an awake tag's
                    // memory is all there.
                    for tag in [Tag::Weights, Tag::KvCache] {
                        let mine: Vec<&Allocation> = if tag == Tag::Weights {
                            e.weights.iter().collect()
                        } else {
                            e.kv.iter().collect()
                        };
                        if !asleep.contains(&tag) {
                            assert!(mine.iter().all(|x| readable(&a, x)), "{mode} {call} #{nth} wake={during_wake}: awake {tag} is all there ({r:?})");
                        }
                    }
                    check(&a);
                    // Whatever happened, a wake now brings everything back, contents included.
                    a.wake(&[]).unwrap();
                    for (i, x) in e.weights.iter().enumerate() {
                        assert!(
                            stamped(&a, x, 0x1000 + i as u64),
                            "{mode} {call} #{nth} wake={during_wake}: weights {i} ({r:?})"
                        );
                    }
                    assert!(stamped(&a, &e.act, 0x1007));
                    check(&a);
                    // Nothing leaked: once everything is freed and the cache emptied, the
                    // driver holds nothing of ours and no host memory is left pinned.
                    for x in e.weights.iter().chain(&e.kv).chain([&e.act]) {
                        a.free(x.ptr).unwrap();
                    }
                    a.empty_cache().unwrap_or_else(|e| {
                        panic!("{mode} {call} #{nth} wake={during_wake}: {e} ({r:?})")
                    });
                    assert_eq!(
                        a.driver().held_bytes(),
                        0,
                        "{mode} {call} #{nth} wake={during_wake}"
                    );
                    assert_eq!(
                        a.driver().host_bytes(),
                        0,
                        "{mode} {call} #{nth} wake={during_wake}"
                    );
                }
            }
        }
    }
    // Every kind of call sleep or wake makes was struck at least once.
    assert_eq!(struck.len(), calls.len(), "struck: {struck:?}");
}

#[test]
fn sleep_per_device_leaves_other_devices_alone() {
    let a = allocator(SegmentMode::Expandable, 80 * GIB);
    let b = allocator(SegmentMode::Expandable, 80 * GIB);
    let ea = engine(&a);
    let eb = engine(&b);
    a.sleep(&[Tag::Weights], &[]).unwrap();
    assert!(ea.weights.iter().all(|x| !readable(&a, x)));
    assert!(eb
        .weights
        .iter()
        .enumerate()
        .all(|(i, x)| stamped(&b, x, 0x1000 + i as u64)));
    assert!(b.asleep_tags().is_empty());
    a.wake(&[]).unwrap();
    assert!(ea.weights_intact(&a));
}

#[test]
fn sleep_retained_host_memory_is_reused_by_the_next_sleep() {
    let a = allocator(SegmentMode::Compact, 80 * GIB);
    let e = engine(&a);
    a.set_retain_host(true);
    let r1 = a.sleep(&[Tag::Weights], &[]).unwrap();
    a.wake(&[]).unwrap();
    assert_eq!(
        a.driver().host_bytes(),
        r1.host_bytes,
        "retained after wake"
    );
    let pins = a.driver().calls(DriverCall::HostAlloc);
    a.sleep(&[Tag::Weights], &[]).unwrap();
    assert_eq!(
        a.driver().calls(DriverCall::HostAlloc),
        pins,
        "no new pinning"
    );
    a.wake(&[]).unwrap();
    assert!(e.weights_intact(&a));
    a.set_retain_host(false);
    a.sleep(&[Tag::Weights], &[]).unwrap();
    a.wake(&[]).unwrap();
    assert_eq!(a.driver().host_bytes(), 0);
}

#[test]
fn sleep_that_fails_to_pin_wakes_every_tag_and_frees_what_it_pinned() {
    // With host memory retained, it is page-locked and copies are queued while it is still
    // being pinned: a failure to pin a later chunk or tag comes after copies into earlier
    // ones, which are waited for before any host memory is freed.
    // The weights take one chunk, the KV cache two: #2 and #3 fail after the weights' copies.
    for nth in [1, 2, 3] {
        let a = allocator(SegmentMode::Expandable, 80 * GIB);
        let e = engine(&a);
        a.set_retain_host(true);
        let pins = a.driver().calls(DriverCall::HostAlloc);
        let copies = a.driver().calls(DriverCall::CopyToHost);
        a.driver().fail_from(DriverCall::HostAlloc, nth);
        let err = a.sleep(&[Tag::Weights, Tag::KvCache], &[]).unwrap_err();
        a.driver().clear_faults();
        assert!(matches!(err, Error::Driver(_)), "#{nth}: {err}");
        assert!(a.driver().calls(DriverCall::HostAlloc) >= pins + nth);
        assert_eq!(
            a.driver().calls(DriverCall::CopyToHost) > copies,
            nth > 1,
            "#{nth}: the weights' copies were queued before the KV cache was pinned"
        );
        assert!(a.asleep_tags().is_empty(), "#{nth}");
        assert!(e.weights.iter().chain(&e.kv).all(|x| readable(&a, x)));
        assert!(e.weights_intact(&a));
        check(&a);
        // And the next sleep works, on what was pinned; not retained, it is freed at wake.
        a.set_retain_host(false);
        a.sleep(&[Tag::Weights, Tag::KvCache], &[]).unwrap();
        a.wake(&[]).unwrap();
        assert!(e.weights_intact(&a));
        assert_eq!(
            a.driver().host_bytes(),
            0,
            "#{nth}: what was pinned is freed"
        );
        check(&a);
    }
}

#[test]
fn sleep_wake_gives_back_the_cache_of_awake_tags_when_it_needs_room() {
    for mode in VIRTUAL {
        let a = allocator(mode, 4 * GIB);
        let e = engine(&a);
        a.sleep(&[Tag::Weights], &[Tag::KvCache]).unwrap();
        // While they sleep, activations fill the device and leave it all cached.
        let mut acts = Vec::new();
        while let Ok(x) = a.allocate_tagged(64 * MIB, S, Tag::Activation) {
            acts.push(x);
        }
        for x in acts {
            a.free(x.ptr).unwrap();
        }
        assert!(a.snapshot().cached_bytes > 2 * GIB, "{mode}");
        a.wake(&[]).unwrap();
        assert!(e.weights_intact(&a), "{mode}");
        check(&a);
    }
}

#[test]
fn sleep_copy_stream_goes_with_the_allocator() {
    for mode in VIRTUAL {
        for fail in [
            None,
            Some(DriverCall::DestroyStream),
            Some(DriverCall::SyncStream),
        ] {
            let a = allocator(mode, 80 * GIB);
            let _e = engine(&a);
            let device = a.driver().device().clone();
            assert_eq!(
                device.own_streams(),
                0,
                "{mode}: no stream before the first sleep"
            );
            a.sleep(&[Tag::Weights], &[Tag::KvCache]).unwrap();
            a.wake(&[]).unwrap();
            assert_eq!(device.own_streams(), 1, "{mode}: one copy stream, reused");
            if let Some(call) = fail {
                // A failed synchronisation or destroy is logged, never a panic in drop; after
                // a failed synchronisation nothing is destroyed or freed.
                a.driver().fail_nth(call, 1);
            }
            drop(a);
            let left = usize::from(fail.is_some());
            assert_eq!(device.own_streams(), left, "{mode}: {fail:?}");
        }
    }
}

/// Sleep and wake show in the allocation history as segment events of their tag ("sleep TAG",
/// "wake TAG" in PyTorch's snapshot), and a replay of that snapshot shows what the recording
/// held falling at the sleep and rising at the wake, with no cache release counted for them.
#[test]
fn sleep_and_wake_show_in_the_history_and_its_replay() {
    use vram_ledger::replay::{self, trace::Action, ReplayOptions};
    for mode in VIRTUAL {
        let a = allocator(mode, 80 * GIB);
        a.record_history(true, 100_000).unwrap();
        let e = engine(&a);
        // The cache goes first, and an allocation stands between its release and the sleep.
        a.empty_cache().unwrap();
        let _kept = a.allocate_tagged(MIB, S, Tag::Activation).unwrap();
        let s = a.sleep(&[Tag::Weights], &[Tag::KvCache]).unwrap();
        let w = a.wake(&[]).unwrap();
        let t = replay::trace::read_bytes(&replay::snapshot::write(&a, 0), None).unwrap();
        let bytes = |action: Action, tag: Tag| -> u64 {
            let of = t.events.iter().filter(|ev| ev.sleep && ev.action == action);
            of.filter(|ev| ev.tag == tag).map(|ev| ev.size).sum()
        };
        let slept =
            bytes(Action::SegmentUnmap, Tag::Weights) + bytes(Action::SegmentUnmap, Tag::KvCache);
        let woke =
            bytes(Action::SegmentMap, Tag::Weights) + bytes(Action::SegmentMap, Tag::KvCache);
        assert_eq!(slept, s.given_back_bytes, "{mode}");
        assert_eq!(woke, w.mapped_bytes, "{mode}");
        assert!(bytes(Action::SegmentUnmap, Tag::KvCache) >= e.kv.iter().map(|x| x.size).sum());
        let sleep_at = t.events.iter().position(|ev| ev.sleep).unwrap();
        let wake_at = t.events.iter().rposition(|ev| ev.sleep).unwrap();
        let opts = ReplayOptions {
            mode,
            timeline_points: t.events.len(),
            ..Default::default()
        };
        let r = replay::replay(&t, &opts, |_| {}).unwrap();
        let at = |i: usize| {
            r.timeline
                .iter()
                .find(|p| p.event == i)
                .unwrap()
                .torch_reserved
        };
        let (before, asleep, after) = (at(sleep_at - 1), at(wake_at - 1), at(wake_at));
        assert!(
            asleep + slept - woke.min(slept) <= before + 1,
            "{mode}: {before} {asleep}"
        );
        assert!(
            asleep < before && after > asleep,
            "{mode}: {before} → {asleep} → {after}"
        );
        // The one release is the `empty_cache`; read as cache events, the sleep's unmaps would
        // count as one more (in expandable mode, where unmaps are not moves).
        assert!(r.cache_releases <= 1, "{mode}: {}", r.cache_releases);
        let mut plain = t.clone();
        plain.events.iter_mut().for_each(|ev| ev.sleep = false);
        let as_cache = replay::replay(&plain, &opts, |_| {})
            .unwrap()
            .cache_releases;
        if mode == SegmentMode::Expandable {
            assert!(as_cache > r.cache_releases, "{as_cache}");
        }
    }
}

/// Sleep and wake copy with no shard locked: while their copies are held (the simulated
/// device's gate), another thread's allocations of awake tags are served, from the cache and
/// by growth, its frees go through, and an allocation of a sleeping tag is refused as asleep.
/// (With every shard locked across the copies, that thread would wait for them instead; the
/// channel's limit turns such a wait into a failure.)
#[test]
fn sleep_and_wake_copy_with_no_shard_locked() {
    use std::sync::{mpsc, Arc};
    use std::time::{Duration, Instant};
    let meanwhile = |a: &Arc<Allocator<SimDriver>>| {
        let a = a.clone();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut served = Vec::new();
            for (n, s) in [(5 * MIB, S), (300 * MIB, OTHER), (4096, S)] {
                let x = a.allocate_tagged(n, s, Tag::Activation).unwrap();
                a.free(x.ptr).unwrap();
                served.push(x.size);
            }
            let refused = a.allocate_tagged(MIB, S, Tag::Weights);
            tx.send((served, matches!(refused, Err(Error::Asleep(Tag::Weights)))))
                .unwrap();
        });
        rx.recv_timeout(Duration::from_secs(60))
    };
    let held = |dev: &vram_ledger::driver::sim::SimDevice| {
        let t = Instant::now();
        while dev.copies_held() == 0 {
            assert!(t.elapsed() < Duration::from_secs(60), "no copy was held");
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    for mode in VIRTUAL {
        let a = Arc::new(allocator(mode, 80 * GIB));
        let dev = a.driver().device().clone();
        let e = engine(&a);
        dev.hold_copies(true);
        let sleeper = {
            let a = a.clone();
            std::thread::spawn(move || a.sleep(&[Tag::Weights], &[Tag::KvCache]).map(|_| ()))
        };
        held(&dev);
        let during_sleep = meanwhile(&a);
        dev.hold_copies(false);
        sleeper.join().unwrap().unwrap();
        let (served, refused) = during_sleep.expect("allocations waited for the sleep's copies");
        assert_eq!(served.len(), 3, "{mode}");
        assert!(refused, "{mode}: weights were being put to sleep");
        dev.hold_copies(true);
        let waker = {
            let a = a.clone();
            std::thread::spawn(move || a.wake(&[]).map(|_| ()))
        };
        held(&dev);
        let during_wake = meanwhile(&a);
        dev.hold_copies(false);
        waker.join().unwrap().unwrap();
        let (_, refused) = during_wake.expect("allocations waited for the wake's copies");
        assert!(
            refused,
            "{mode}: weights were asleep until the wake finished"
        );
        for (i, x) in e.weights.iter().enumerate() {
            assert!(stamped(&a, x, 0x1000 + i as u64), "{mode}: weights {i}");
        }
        check(&a);
    }
}

/// An out-of-memory while a tag sleeps sets beside this process's usage only what holds
/// device memory: the awake tags' allocations, and the asleep tag's bytes apart.
#[test]
fn an_out_of_memory_while_a_tag_sleeps_counts_only_awake_memory_as_in_use() {
    for mode in VIRTUAL {
        let a = allocator(mode, 8 * GIB);
        let w = a.allocate_tagged(3 * GIB, S, Tag::Weights).unwrap();
        a.sleep(&[Tag::Weights], &[]).unwrap();
        let x = a.allocate_tagged(2 * GIB, S, Tag::Activation).unwrap();
        let err = a.allocate_tagged(6 * GIB, S, Tag::Activation).unwrap_err();
        let Error::OutOfMemory(r) = &err else {
            panic!("{mode}: {err}")
        };
        let usage = r.process_usage.expect("the simulated driver reports usage");
        assert_eq!(r.allocated, 2 * GIB, "{mode}: {r:?}");
        assert!(r.allocated + r.cached <= usage, "{mode}: {r:?}");
        // Its memory, pages or pieces rounded: 3 GiB and at most one piece more.
        let asleep = r.asleep[Tag::Weights];
        assert!(
            (3 * GIB..3 * GIB + 68 * MIB).contains(&asleep),
            "{mode}: {asleep}"
        );
        assert_eq!(r.per_tag[Tag::Weights], 3 * GIB, "{mode}: still allocated");
        let text = err.to_string();
        assert!(
            text.contains("Asleep (given back to the driver until they wake): weights 3."),
            "{mode}: {text}"
        );
        a.free(x.ptr).unwrap();
        a.wake(&[]).unwrap();
        a.free(w.ptr).unwrap();
        check(&a);
    }
}
