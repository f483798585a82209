//! Sleep's host memory on the simulated device. Retained, a tag whose contents take many
//! page-locked chunks is pinned on several threads while the copies into the chunks already
//! pinned are queued. Not retained, the contents go through the staging ring's workers into
//! pageable memory, piece by piece. Either way every byte comes back, and a failure partway
//! leaves the tag awake and, once host memory is no longer retained, none held.

#[path = "common/sim.rs"]
mod common;

use common::{check, readable, stamp, stamped, tags_apart as allocator};
use vram_ledger::driver::{DriverCall, StreamId};
use vram_ledger::units::{GIB, MIB};
use vram_ledger::{Allocation, SegmentMode, Tag};

const S: StreamId = StreamId(0x10);

#[test]
fn sleep_of_a_tag_of_many_host_chunks_pins_and_copies_them_all() {
    // 2 GiB in pieces of several sizes: 8 host chunks pinned on several threads while the
    // copies into those already pinned are queued; after a failure partway, what was pinned
    // is kept for the next sleep, which frees it at wake once no longer retained.
    for fail in [None, Some(5)] {
        let a = allocator(SegmentMode::Remap, 80 * GIB);
        a.set_retain_host(true);
        let w: Vec<Allocation> = (0..16)
            .map(|i| {
                a.allocate_tagged(128 * MIB - i * 4096, S, Tag::Weights)
                    .unwrap()
            })
            .collect();
        for (i, x) in w.iter().enumerate() {
            stamp(&a, x, 0x5000 + i as u64);
        }
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
        let w: Vec<Allocation> = (0..16)
            .map(|i| {
                a.allocate_tagged(128 * MIB - i * 4096, S, Tag::Weights)
                    .unwrap()
            })
            .collect();
        for (i, x) in w.iter().enumerate() {
            stamp(&a, x, 0x6000 + i as u64);
        }
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
