//! Sleep's host memory on the simulated device: a tag whose contents take many page-locked
//! chunks is pinned on several threads while the copies into the chunks already pinned are
//! queued; every byte comes back, and a failure partway frees every chunk it pinned.

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
    // copies into those already pinned are queued; a failure partway frees every chunk.
    for fail in [None, Some(5)] {
        let a = allocator(SegmentMode::Remap, 80 * GIB);
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
            assert_eq!(a.driver().host_bytes(), 0, "every chunk pinned is freed");
        } else {
            let r = a.sleep(&[Tag::Weights], &[]).unwrap();
            assert!(r.host_bytes >= 2 * GIB - 16 * 16 * 4096, "{r:?}");
            assert!(w.iter().all(|x| !readable(&a, x)));
            a.wake(&[]).unwrap();
            assert_eq!(a.driver().host_bytes(), 0, "freed at wake");
        }
        assert!(w
            .iter()
            .enumerate()
            .all(|(i, x)| stamped(&a, x, 0x5000 + i as u64)));
        check(&a);
    }
}
