//! The allocation history in PyTorch's snapshot format: recorded while a real trace replays
//! through the allocator, written as a snapshot pickle, read back by the replay's reader and
//! replayed again, in every mode. The second replay must find what the first one did: the
//! segment events we recorded describe exactly what we reserved, and replaying our own
//! allocations reproduces our peak.

use std::path::Path;

use vram_ledger::driver::sim::{SimConfig, SimDriver};
use vram_ledger::replay::{self, engine, ReplayOptions};
use vram_ledger::{Allocator, Config, SegmentMode, StreamId, Tag};

#[test]
fn history_round_trip_reproduces_our_own_peak_in_every_mode() {
    let trace = replay::read_file(Path::new("tests/data/gpt2-train.pickle.gz"), None).unwrap();
    for mode in SegmentMode::ALL {
        let drv = SimDriver::with_config(SimConfig {
            capacity: engine::H200_CAPACITY,
            context_overhead: 0,
            ..Default::default()
        });
        let a = Allocator::new(drv, Config::with_mode(mode)).unwrap();
        a.record_history(true, 1 << 20).unwrap();
        let opts = ReplayOptions {
            mode,
            release_at_end: false,
            ..Default::default()
        };
        let first = engine::replay_on(&a, &trace, &opts, |_| {}).unwrap();
        let bytes = replay::snapshot::write(&a, 0);
        let ours = replay::trace::read_bytes(&bytes, Some(0)).unwrap();
        assert_eq!(ours.expandable, Some(mode.is_virtual()), "{mode}");
        assert!(
            ours.unknown_tags.is_empty(),
            "{mode}: {:?}",
            ours.unknown_tags
        );
        let again = replay::replay(
            &ours,
            &ReplayOptions {
                mode,
                ..Default::default()
            },
            |_| {},
        )
        .unwrap();
        // What our segment events add up to is what we reserved.
        assert_eq!(again.torch_peak_reserved, first.peak_reserved, "{mode}");
        // Our own allocations, replayed, reserve what they reserved the first time.
        assert_eq!(again.peak_reserved, first.peak_reserved, "{mode}");
        assert_eq!(again.allocations, first.allocations, "{mode}");
        assert_eq!(again.per_tag, first.per_tag, "{mode}");
    }
}

#[test]
fn history_is_bounded_and_off_by_default() {
    let a = Allocator::new(SimDriver::new(), Config::default()).unwrap();
    let s = StreamId::DEFAULT;
    let x = a.allocate_tagged(4096, s, Tag::Weights).unwrap();
    a.free(x.ptr).unwrap();
    assert!(a.history().0.is_empty(), "nothing is recorded unless asked");
    a.record_history(true, 5).unwrap();
    for _ in 0..4 {
        let x = a.allocate_tagged(4096, s, Tag::KvCache).unwrap();
        a.free(x.ptr).unwrap();
    }
    let (entries, dropped) = a.history();
    assert_eq!(entries.len(), 5);
    // Four allocations and four frees requested and completed: 12 entries, the oldest 7 gone.
    assert_eq!(dropped, 7);
    assert!(entries.iter().all(|e| e.tag == Tag::KvCache));
    a.record_history(false, 5).unwrap();
    let x = a.allocate_tagged(4096, s, Tag::KvCache).unwrap();
    a.free(x.ptr).unwrap();
    assert_eq!(a.history().0, entries, "stopping keeps what was recorded");
}
