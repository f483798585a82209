//! The PyTorch snapshot reader on arbitrary bytes: an error or a trace, never a panic; a trace
//! that parses replays (or fails with an error) on a small simulated device.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vram_ledger::replay::{self, ReplayOptions};
use vram_ledger::SegmentMode;

fuzz_target!(|data: &[u8]| {
    if let Ok(trace) = replay::trace::read_bytes(data, None) {
        if trace.events.len() <= 20_000 {
            let opts = ReplayOptions { mode: SegmentMode::Remap, capacity: 4 << 30, timeline_points: 16, ..Default::default() };
            let _ = replay::replay(&trace, &opts, |_| {});
        }
    }
});
