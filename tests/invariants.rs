//! The invariant checker must catch a broken state: a checker that cannot fail proves nothing.
//! Each test breaks one thing in a copy of a real allocator's dump.

use vram_ledger::driver::sim::SimDriver;
use vram_ledger::invariants::{check, DumpState, StateDump};
use vram_ledger::units::MIB;
use vram_ledger::{Allocator, Config, SegmentMode, StreamId, Tag};

fn real_state(mode: SegmentMode) -> StateDump {
    let a = Allocator::new(
        SimDriver::new(),
        Config {
            mode,
            ..Default::default()
        },
    )
    .unwrap();
    let s = StreamId::DEFAULT;
    let x = a.allocate_tagged(4096, s, Tag::Weights).unwrap();
    a.allocate_tagged(8192, s, Tag::Activation).unwrap();
    a.allocate_tagged(30 * MIB, s, Tag::KvCache).unwrap();
    a.free(x.ptr).unwrap();
    let mut d = a.dump();
    d.driver_held = Some(a.driver().held_bytes());
    check(&d).expect("a real state is consistent");
    d
}

fn both() -> [StateDump; 2] {
    [
        real_state(SegmentMode::Native),
        real_state(SegmentMode::Expandable),
    ]
}

fn first_allocated(d: &mut StateDump) -> (usize, usize) {
    for (si, s) in d.segments.iter().enumerate() {
        if let Some(bi) = s
            .blocks
            .iter()
            .position(|b| b.state == DumpState::Allocated)
        {
            return (si, bi);
        }
    }
    panic!("no allocated block");
}

#[test]
fn catches_overlapping_blocks() {
    for mut d in both() {
        let (si, bi) = first_allocated(&mut d);
        d.segments[si].blocks[bi + 1].addr -= 512;
        d.segments[si].blocks[bi + 1].size += 512;
        let v = check(&d).unwrap_err();
        assert!(v.0.contains("overlap"), "{v}");
    }
}

#[test]
fn catches_overlapping_segments() {
    let mut d = real_state(SegmentMode::Native);
    let other = d.segments[0].clone();
    d.segments.push(other);
    assert!(check(&d).is_err());
}

#[test]
fn catches_a_wrong_tag_counter() {
    for mut d in both() {
        d.ledger.per_tag[Tag::Activation].allocated_bytes.current += 512;
        d.ledger.per_tag[Tag::Activation].allocated_bytes.peak += 512;
        assert!(check(&d).unwrap_err().0.contains("activation"));
    }
}

#[test]
fn catches_sum_of_tags_differing_from_total() {
    for mut d in both() {
        d.ledger.all.allocated_bytes.current -= 512;
        assert!(check(&d).is_err());
    }
}

#[test]
fn catches_a_peak_below_current() {
    for mut d in both() {
        d.ledger.reserved_bytes.peak = d.ledger.reserved_bytes.current - 1;
        assert!(check(&d).unwrap_err().0.contains("peak"));
    }
}

#[test]
fn catches_reserved_differing_from_the_driver() {
    for mut d in both() {
        d.driver_held = Some(d.driver_held.unwrap() + 2 * MIB);
        assert!(check(&d).unwrap_err().0.contains("driver holds"));
    }
}

#[test]
fn catches_an_allocation_in_unmapped_memory() {
    let mut d = real_state(SegmentMode::Expandable);
    let s = d
        .segments
        .iter_mut()
        .find(|s| {
            s.blocks
                .iter()
                .any(|b| b.tag == Tag::KvCache && b.state == DumpState::Allocated)
        })
        .unwrap();
    s.mapped.pop();
    let v = check(&d).unwrap_err();
    assert!(
        v.0.contains("not in mapped memory") || v.0.contains("reserved"),
        "{v}"
    );
}

#[test]
fn catches_allocated_above_active() {
    for mut d in both() {
        d.ledger.active_bytes.current = d.ledger.all.allocated_bytes.current - 512;
        assert!(check(&d).is_err());
    }
}

#[test]
fn catches_internal_structure_problems() {
    let mut d = real_state(SegmentMode::Native);
    d.problems
        .push("free index has 3 entries for 2 free blocks".into());
    assert!(check(&d).is_err());
}
