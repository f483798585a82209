//! Remap's moves without a wait (`Config::unmap_later`) on the simulated device: which calls a
//! move within a stream's own memory makes, and when the old mapping goes. The model
//! (`tests/model.rs`, `model_unmapping_later*`) checks the same against every operation.

#[path = "common/sim.rs"]
mod common;

use common::{check, sim_on, trace};
use vram_ledger::driver::sim::{SimConfig, SimDriver};
use vram_ledger::driver::{DriverCall, StreamId};
use vram_ledger::replay::{self, ReplayOptions};
use vram_ledger::units::MIB;
use vram_ledger::{Allocator, Config, SegmentMode};

const S0: StreamId = StreamId::DEFAULT;

fn remap(unmap_later: bool) -> Allocator<SimDriver> {
    let config = Config {
        unmap_later,
        ..Config::with_mode(SegmentMode::Remap)
    };
    sim_on(SimConfig::default(), config)
}

/// Free 40 MiB that the stream's queued work still uses, then ask for more than the cache
/// holds: the growth moves the free piece. Returns the calls the growth made.
fn move_under_work(a: &Allocator<SimDriver>) -> vram_ledger::driver::counting::DriverCalls {
    let dev = a.driver().device().clone();
    let x = a.allocate(40 * MIB, S0).unwrap();
    let y = a.allocate(20 * MIB, S0).unwrap();
    dev.submit_touching(S0, x.ptr, x.size);
    a.free(x.ptr).unwrap();
    let before = a.driver_calls();
    let z = a.allocate(60 * MIB, S0).unwrap();
    let calls = a.driver_calls().since(&before);
    assert!(z.ptr >= y.ptr + y.size, "the growth went past y");
    // x's 40 MiB piece moved to z, beside 20 MiB new: y and z hold all.
    assert_eq!(a.ledger().reserved(), 80 * MIB, "x's piece was not moved");
    check(a);
    calls
}

#[test]
fn a_move_within_a_streams_own_memory_waits_for_nothing() {
    let synced = move_under_work(&remap(false));
    assert_eq!(
        (synced[DriverCall::SyncStream], synced[DriverCall::Unmap]),
        (1, 1),
        "without unmap_later the stream is synchronised before the unmap"
    );
    let a = remap(true);
    let later = move_under_work(&a);
    assert_eq!(
        (
            later[DriverCall::SyncStream],
            later[DriverCall::SyncDevice],
            later[DriverCall::WaitEvent],
            later[DriverCall::Unmap],
            later[DriverCall::RecordEvent],
        ),
        (0, 0, 0, 0, 1),
        "{:?}",
        later.nonzero().collect::<Vec<_>>()
    );
    assert_eq!(later[DriverCall::Map], synced[DriverCall::Map]);
    // The old mapping stays while the work that used it runs: the next growth only asks.
    let dev = a.driver().device().clone();
    let before = a.driver_calls();
    let w = a.allocate(30 * MIB, S0).unwrap();
    let calls = a.driver_calls().since(&before);
    assert_eq!(
        (
            calls[DriverCall::QueryEvent],
            calls[DriverCall::Unmap],
            calls[DriverCall::WaitEvent]
        ),
        (1, 0, 0)
    );
    // Once it has finished, the next growth unmaps it, and nothing was unmapped under work.
    dev.complete(S0);
    let before = a.driver_calls();
    let v = a.allocate(30 * MIB, S0).unwrap();
    let calls = a.driver_calls().since(&before);
    assert_eq!(
        (
            calls[DriverCall::Unmap],
            calls[DriverCall::DestroyEvent],
            calls[DriverCall::WaitEvent]
        ),
        (1, 1, 0)
    );
    assert!(dev.unsafe_unmaps().is_empty(), "{:?}", dev.unsafe_unmaps());
    check(&a);
    for p in [w.ptr, v.ptr] {
        a.free(p).unwrap();
    }
}

#[test]
fn empty_cache_unmaps_what_still_waits_and_leaves_nothing() {
    let a = remap(true);
    move_under_work(&a);
    let dev = a.driver().device().clone();
    // Still running: empty_cache waits for it, then gives everything free back.
    let before = a.driver_calls();
    a.empty_cache().unwrap();
    let calls = a.driver_calls().since(&before);
    assert!(
        calls[DriverCall::WaitEvent] >= 1,
        "{:?}",
        calls.nonzero().collect::<Vec<_>>()
    );
    assert!(dev.unsafe_unmaps().is_empty(), "{:?}", dev.unsafe_unmaps());
    check(&a);
}

#[test]
fn replayed_training_moves_memory_without_draining_its_stream() {
    // gpt2-train runs on one stream: every move is within the stream's own memory. The replay
    // finishes the stream's work only when something waits for it, so every old mapping is
    // still waiting at the end, and unmapped then.
    let t = trace("gpt2-train");
    let run = |unmap_later| {
        let opts = ReplayOptions {
            mode: SegmentMode::Remap,
            timeline_points: 0,
            unmap_later,
            ..Default::default()
        };
        replay::replay(&t, &opts, |_| {}).unwrap()
    };
    let (synced, later) = (run(false), run(true));
    assert!(synced.drains > 0 && synced.driver_calls[DriverCall::SyncStream] > 0);
    assert_eq!(
        (later.drains, later.driver_calls[DriverCall::SyncStream]),
        (0, 0)
    );
    assert_eq!(
        later.driver_calls[DriverCall::RecordEvent],
        synced.driver_calls[DriverCall::SyncStream],
        "one event where each synchronisation was"
    );
    // The same moves: the same memory, and the same pieces mapped.
    assert_eq!(later.peak_reserved, synced.peak_reserved);
    assert_eq!(
        later.driver_calls[DriverCall::Map],
        synced.driver_calls[DriverCall::Map]
    );
    assert_eq!(
        later.driver_calls[DriverCall::Unmap],
        0,
        "nothing waited for the stream"
    );
    assert!(later.driver_seconds < synced.driver_seconds);
    assert_eq!(later.held_after, 0);
}
