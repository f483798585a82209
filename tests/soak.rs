//! Soak: the shipped traces replayed ten times back to back through one allocator per mode; at
//! the end nothing is held, and each pass reserves what the first did (nothing accumulates).

use std::path::Path;

use vram_ledger::driver::sim::{SimConfig, SimDriver};
use vram_ledger::invariants;
use vram_ledger::replay::{self, engine::H200_CAPACITY, ReplayOptions};
use vram_ledger::{Allocator, Config, SegmentMode};

#[test]
fn soak_replay_ten_times_back_to_back() {
    let traces: Vec<_> = ["gpt2-train", "llama1b-serve"]
        .iter()
        .map(|t| replay::read_file(Path::new(&format!("tests/data/{t}.pickle.gz")), None).unwrap())
        .collect();
    for mode in [SegmentMode::Native, SegmentMode::Remap] {
        let drv = SimDriver::with_config(SimConfig {
            capacity: H200_CAPACITY,
            context_overhead: 0,
            ..Default::default()
        });
        let a = Allocator::new(drv, Config::with_mode(mode)).unwrap();
        let mut first = Vec::new();
        for round in 0..10 {
            for (i, t) in traces.iter().enumerate() {
                a.ledger().reset_peaks();
                let r = replay::engine::replay_on(
                    &a,
                    t,
                    &ReplayOptions {
                        mode,
                        timeline_points: 0,
                        ..Default::default()
                    },
                    |_| {},
                )
                .unwrap();
                assert_eq!(r.ooms, 0);
                assert_eq!(r.held_after, 0, "{mode:?} round {round}: all returned");
                if round == 0 {
                    first.push(r.peak_reserved);
                } else {
                    assert_eq!(
                        r.peak_reserved, first[i],
                        "{mode:?} round {round}: the same footprint every time"
                    );
                }
            }
        }
        let mut d = a.dump();
        d.driver_held = Some(a.driver().held_bytes());
        invariants::check(&d).unwrap();
        assert_eq!(a.live_allocations(), 0);
        assert_eq!(a.driver().live_objects(), 0);
    }
}
