//! Fault injection on the undo path of a map: when a map fails and undoing it fails too, the
//! memory the driver still holds is counted as lost (the ledger stays consistent with the
//! driver), none of it is handed out, and a later undo gives it back.

#[macro_use]
#[path = "common/sim.rs"]
mod common;

use common::sim;
use vram_ledger::driver::sim::SimDriver;
use vram_ledger::driver::{DriverCall, StreamId};
use vram_ledger::units::MIB;
use vram_ledger::{invariants, Allocator, SegmentMode};

const S0: StreamId = StreamId(0);

fn check(a: &Allocator<SimDriver>, when: &str) {
    if let Err(v) = invariants::check_sim(a) {
        panic!("{when}: {v}");
    }
}

fn lost(a: &Allocator<SimDriver>) -> u64 {
    a.snapshot().lost_bytes
}

/// Every allocation handed out lies in memory the device lets this process use: a stranded
/// mapping (mapped, never made accessible) is never among them.
fn usable(a: &Allocator<SimDriver>, ptr: u64, size: u64) {
    assert!(
        a.driver().is_accessible(ptr, size),
        "{ptr:#x}+{size} was handed out but is not accessible"
    );
}

/// The failed map is undone only in part: `first` fails the map itself (or making it
/// accessible), `undo` fails the step of the undo that follows.
fn stranded_then_recovered(mode: SegmentMode, first: DriverCall, undo: DriverCall) {
    let a = sim(mode);
    a.driver().fail_nth(first, 1);
    a.driver().fail_nth(undo, 1);
    assert!(
        a.allocate(8 * MIB, S0).is_err(),
        "{mode}: the failed map is reported"
    );
    assert!(
        lost(&a) > 0,
        "{mode}: the memory left with the driver is counted lost"
    );
    assert_eq!(
        a.snapshot().reserved_bytes.current,
        0,
        "{mode}: and not reserved"
    );
    check(&a, "after the failed undo");
    // The next growth undoes the stranded mapping first, then maps where it was.
    let x = a.allocate(8 * MIB, S0).unwrap();
    usable(&a, x.ptr, x.size);
    assert_eq!(lost(&a), 0, "{mode}: a later undo gave it back");
    check(&a, "after the next growth");
    a.free(x.ptr).unwrap();
    a.empty_cache().unwrap();
    check(&a, "at the end");
    assert_eq!(
        a.driver().held_bytes(),
        0,
        "{mode}: every byte back with the driver"
    );
}

fn unmap_fails_in_the_undo(mode: SegmentMode) {
    stranded_then_recovered(mode, DriverCall::SetAccess, DriverCall::Unmap);
}

fn release_fails_in_the_undo(mode: SegmentMode) {
    stranded_then_recovered(mode, DriverCall::SetAccess, DriverCall::ReleasePhysical);
}

fn release_fails_after_a_failed_map(mode: SegmentMode) {
    stranded_then_recovered(mode, DriverCall::Map, DriverCall::ReleasePhysical);
}

per_mode!(unmap_fails_in_the_undo: expandable, compact, remap);
// Remap's undo releases nothing: a piece whose map failed stays spare, reserved.
per_mode!(release_fails_in_the_undo: expandable, compact);
per_mode!(release_fails_after_a_failed_map: expandable, compact);

/// The undo keeps failing: the memory stays lost, allocations go on elsewhere or fail with the
/// driver's error, nothing handed out overlaps it, and once the driver recovers, giving the
/// cache back frees it.
fn undo_failing_for_a_while(mode: SegmentMode) {
    let a = sim(mode);
    a.driver().fail_nth(DriverCall::SetAccess, 1);
    a.driver().fail_from(DriverCall::Unmap, 1);
    assert!(a.allocate(8 * MIB, S0).is_err());
    let stuck = lost(&a);
    assert!(stuck > 0);
    let mut live = Vec::new();
    for size in [MIB, 8 * MIB, 30 * MIB, 3 * MIB] {
        if let Ok(x) = a.allocate(size, S0) {
            usable(&a, x.ptr, x.size);
            live.push(x);
        }
        check(&a, "while the undo keeps failing");
        assert_eq!(lost(&a), stuck, "{mode}: still lost, counted once");
    }
    a.driver().clear_faults();
    for x in live {
        a.free(x.ptr).unwrap();
    }
    a.empty_cache().unwrap();
    assert_eq!(lost(&a), 0, "{mode}: given back once the driver lets it");
    check(&a, "after recovery");
    assert_eq!(a.driver().held_bytes(), 0);
}

per_mode!(undo_failing_for_a_while: expandable, compact, remap);
