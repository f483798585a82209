//! Soak: the shipped traces replayed back to back through one allocator per mode, the cache
//! kept warm between passes (nothing reset but the peaks). Each figure checked comes from
//! outside the replay: the trace's events, the allocator's own count of live allocations, and
//! the simulated driver and device.

use std::collections::HashMap;

#[path = "common/sim.rs"]
mod common;

use common::{check, h200, trace};
use vram_ledger::driver::DriverCall;
use vram_ledger::replay::trace::{Action, Trace};
use vram_ledger::replay::{self, ReplayOptions};
use vram_ledger::SegmentMode;

/// Passes per mode. Pass 1 warms the cache; the later ones are where a leak would show.
const PASSES: usize = 10;

/// The trace's own peak of live bytes, from its events: what was allocated and not yet freed
/// (an address allocated again while live replaces the old allocation, as the replay does).
fn trace_peak_live(t: &Trace) -> u64 {
    let mut live: HashMap<u64, u64> = HashMap::new();
    let (mut now, mut peak) = (0u64, 0u64);
    for e in &t.events {
        match e.action {
            Action::Alloc => {
                if let Some(old) = live.insert(e.addr, e.size) {
                    now -= old;
                }
                now += e.size;
                peak = peak.max(now);
            }
            Action::FreeRequested => {
                if let Some(size) = live.remove(&e.addr) {
                    now -= size;
                }
            }
            _ => {}
        }
    }
    peak
}

#[test]
fn soak_replay_back_to_back_with_a_warm_cache() {
    let traces: Vec<(&str, Trace)> = ["gpt2-train", "llama1b-serve"]
        .iter()
        .map(|&t| (t, trace(t)))
        .collect();
    let peaks: Vec<u64> = traces.iter().map(|(_, t)| trace_peak_live(t)).collect();
    for mode in SegmentMode::ALL {
        let a = h200(mode);
        let dev = a.driver().device().clone();
        let opts = ReplayOptions {
            mode,
            timeline_points: 0,
            release_at_end: false,
            ..Default::default()
        };
        let mut first_peak_reserved = None;
        // Driver calls that obtain memory (plain segments, physical allocations), counted by
        // the simulated driver itself.
        let obtained = || {
            a.driver().calls(DriverCall::AllocSegment)
                + a.driver().calls(DriverCall::CreatePhysical)
        };
        let mut after_first_pass = None;
        // Remap's pieces, made in pass 1 for a cold layout, serve other blocks once the cache is
        // warm: a warm pass may find less of its free memory in whole pieces at its peak, and
        // create a piece more (gpt2-train: one of 40 MiB at pass 2, then nothing up to pass 30).
        // Never more than one largest piece above pass 1; the other modes, nothing.
        let slack = match mode {
            SegmentMode::Remap => vram_ledger::allocator::DEFAULT_REMAP_PIECE,
            _ => 0,
        };
        for pass in 1..=PASSES {
            // Peaks are reset per trace, so each replay's figures are its own; the pass's peak
            // reserved is the largest of them.
            let mut pass_peak_reserved = 0;
            for ((name, t), &peak_live) in traces.iter().zip(&peaks) {
                a.ledger().reset_peaks();
                let r = replay::engine::replay_on(&a, t, &opts, |_| {}).unwrap();
                let at = format!("{mode} pass {pass} {name}");
                assert_eq!(r.ooms, 0, "{at}");
                assert_eq!(r.peak_live, peak_live, "{at}: the trace's own peak live");
                // The allocator's count of requested bytes peaks where the trace's live bytes
                // do: each trace runs on one stream, so its peak is one shard's, not a sum.
                assert_eq!(
                    a.snapshot().all.requested_bytes.peak,
                    peak_live,
                    "{at}: the allocator saw the trace's peak live"
                );
                assert_eq!(a.live_allocations(), 0, "{at}: nothing live at the end");
                pass_peak_reserved = pass_peak_reserved.max(r.peak_reserved);
            }
            // From pass 2 on the cache is warm: the same requests find their memory in it, so a
            // leaked block or segment shows as growth above pass 1.
            let first = *first_peak_reserved.get_or_insert(pass_peak_reserved);
            assert!(
                pass_peak_reserved <= first + slack,
                "{mode} pass {pass}: peak reserved {pass_peak_reserved} above pass 1's {first}"
            );
            // The driver's own figure: what the warm cache holds never exceeds that peak.
            let held = a.driver().held_bytes();
            assert!(
                held <= first + slack,
                "{mode} pass {pass}: the driver holds {held}, above pass 1's peak {first}"
            );
            // And the cache really is warm: after pass 1 the driver is never asked for memory
            // again (a cache emptied between passes, or a leak, would make it ask).
            let calls = *after_first_pass.get_or_insert(obtained());
            // (Remap: the pieces within the slack above, counted from the end of pass 1 over
            // all later passes, fewer than a twentieth of what pass 1 asked for; an emptied cache
            // would ask for nearly all of it again.)
            let again = obtained() - calls;
            assert!(
                if slack == 0 { again == 0 } else { again * 20 < calls },
                "{mode} pass {pass}: memory obtained from the driver again ({again} calls; pass 1 made {calls})"
            );
        }
        check(&a);
        a.empty_cache().unwrap();
        assert_eq!(
            a.driver().held_bytes(),
            0,
            "{mode}: the driver holds nothing"
        );
        assert_eq!(dev.used(), 0, "{mode}: the device is empty");
        assert_eq!(a.driver().live_objects(), 0);
    }
}
