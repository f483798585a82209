//! The invariant checker must catch a broken state: a checker that cannot fail proves nothing.
//! Each test breaks one thing in a copy of a real allocator's dump (which passes unbroken) and
//! checks that the checker names what was broken.

#[path = "common/sim.rs"]
mod common;

use common::sim;
use vram_ledger::invariants::{check, sim_dump, BlockDump, DumpState, StateDump};
use vram_ledger::units::MIB;
use vram_ledger::{SegmentMode, StreamId, Tag};

fn real_state(mode: SegmentMode) -> StateDump {
    let a = sim(mode);
    let s = StreamId::DEFAULT;
    let x = a.allocate_tagged(4096, s, Tag::Weights).unwrap();
    a.allocate_tagged(8192, s, Tag::Activation).unwrap();
    a.allocate_tagged(30 * MIB, s, Tag::KvCache).unwrap();
    a.free(x.ptr).unwrap();
    let d = sim_dump(&a);
    check(&d).expect("a real state is consistent");
    d
}

fn both() -> [StateDump; 2] {
    [
        real_state(SegmentMode::Native),
        real_state(SegmentMode::Expandable),
    ]
}

fn every_mode() -> Vec<StateDump> {
    SegmentMode::ALL.into_iter().map(real_state).collect()
}

/// The checker rejects `d`, saying `what`.
#[track_caller]
fn rejected(d: &StateDump, what: &str) {
    match check(d) {
        Ok(()) => panic!("a broken state passed the checker (expected {what:?})"),
        Err(v) => assert!(v.0.contains(what), "expected {what:?}, got: {v}"),
    }
}

/// Every mode's state broken by `breaks`: the checker rejects each, saying `what`.
#[track_caller]
fn rejected_in_every_mode(what: &str, breaks: impl Fn(&mut StateDump)) {
    for mut d in every_mode() {
        breaks(&mut d);
        rejected(&d, what);
    }
}

/// In every mode's state, the allocated block of `tag` broken by `breaks`: the checker rejects
/// it, saying `what`.
#[track_caller]
fn rejected_block(tag: Tag, what: &str, breaks: impl Fn(&mut BlockDump)) {
    rejected_in_every_mode(what, |d| {
        let (si, bi) = block_of(d, tag);
        breaks(&mut d.segments[si].blocks[bi]);
    });
}

/// The segment holding the allocated block of `tag`, and the block's index in it.
fn block_of(d: &StateDump, tag: Tag) -> (usize, usize) {
    for (si, s) in d.segments.iter().enumerate() {
        if let Some(bi) = s
            .blocks
            .iter()
            .position(|b| b.state == DumpState::Allocated && b.tag == tag)
        {
            return (si, bi);
        }
    }
    panic!("no allocated {tag} block");
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
    rejected(&d, "overlap");
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
        rejected(&d, "Σ tags ≠ allocated");
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
fn catches_an_allocation_outside_mapped_memory() {
    // The mapping under the end of the 30 MiB KV block moves to unmapped address space past
    // it: as many bytes mapped as before, but not under the block.
    for mode in [
        SegmentMode::Expandable,
        SegmentMode::Compact,
        SegmentMode::Remap,
    ] {
        let mut d = real_state(mode);
        let (si, bi) = block_of(&d, Tag::KvCache);
        let s = &mut d.segments[si];
        let b = s.blocks[bi].clone();
        let end = b.addr + b.size - 1;
        let m = s
            .mapped
            .iter()
            .position(|&(a, l)| a <= end && end < a + l)
            .expect("the block's end is mapped");
        let (_, len) = s.mapped.remove(m);
        let hole = s
            .blocks
            .iter()
            .find(|x| x.state == DumpState::Unmapped && x.size >= len)
            .expect("unmapped address space")
            .addr;
        s.mapped.push((hole, len));
        s.mapped.sort_unstable();
        rejected(&d, "Allocated block");
        rejected(&d, "is not in mapped memory");
    }
}

#[test]
fn catches_free_memory_claimed_where_nothing_is_mapped() {
    for mode in [SegmentMode::Expandable, SegmentMode::Remap] {
        let mut d = real_state(mode);
        let b = d
            .segments
            .iter_mut()
            .flat_map(|s| s.blocks.iter_mut())
            .find(|b| b.state == DumpState::Unmapped)
            .expect("an expandable segment has unmapped address space");
        b.state = DumpState::Free;
        rejected(&d, "Free block");
    }
}

#[test]
fn catches_a_gap_between_blocks() {
    // The allocated block shrinks; the next one still starts where it used to end.
    rejected_block(Tag::Activation, "(overlap or gap)", |b| b.size -= 512);
}

#[test]
fn catches_blocks_that_stop_short_of_the_segment_end() {
    rejected_in_every_mode("not at its end", |d| {
        d.segments[0].blocks.last_mut().unwrap().size -= 512;
    });
}

#[test]
fn catches_an_empty_block() {
    rejected_in_every_mode("empty block", |d| {
        let (si, bi) = block_of(d, Tag::KvCache);
        let mut empty = d.segments[si].blocks[bi].clone();
        empty.size = 0;
        d.segments[si].blocks.insert(bi, empty);
    });
}

#[test]
fn catches_a_block_whose_tag_the_ledger_does_not_count() {
    // The blocks say the activation is untracked; the ledger still counts it as an activation.
    rejected_block(
        Tag::Activation,
        "activation: ledger says 8192 allocated, blocks say 0",
        |b| b.tag = Tag::Untracked,
    );
}

#[test]
fn catches_requested_bytes_differing_from_the_blocks() {
    rejected_block(Tag::KvCache, "kv_cache: requested", |b| b.requested -= 1);
}

#[test]
fn catches_an_allocation_count_differing_from_the_blocks() {
    // The KV block becomes two allocated blocks with the same bytes and requested bytes in
    // all: only the count is wrong.
    rejected_in_every_mode("kv_cache: 1 allocations vs 2 blocks", |d| {
        let (si, bi) = block_of(d, Tag::KvCache);
        let blocks = &mut d.segments[si].blocks;
        let mut second = blocks[bi].clone();
        blocks[bi].size = 512;
        blocks[bi].requested = 512;
        second.addr += 512;
        second.size -= 512;
        second.requested -= 512;
        blocks.insert(bi + 1, second);
    });
}

#[test]
fn catches_a_tag_peak_below_its_current() {
    rejected_in_every_mode("kv_cache: peak", |d| {
        let c = &mut d.ledger.per_tag[Tag::KvCache].allocated_bytes;
        c.peak = c.current - 512;
    });
}

#[test]
fn catches_total_allocations_differing_from_the_tags() {
    rejected_in_every_mode("total allocations", |d| d.ledger.all.total_allocations += 1);
}

#[test]
fn catches_pending_bytes_missing_from_active() {
    // A free block claims to wait on a stream, but active bytes do not count it.
    rejected_in_every_mode("+ pending", |d| {
        let b = d
            .segments
            .iter_mut()
            .flat_map(|s| s.blocks.iter_mut())
            .find(|b| b.state == DumpState::Free)
            .expect("the freed weights left a free block");
        b.state = DumpState::Pending;
    });
}

#[test]
fn catches_reserved_differing_from_mapped_plus_spare() {
    // Spare physical memory that the ledger's reserved bytes do not include.
    rejected_in_every_mode("≠ mapped", |d| d.spare += 2 * MIB);
}

#[test]
fn catches_a_mapping_the_ledger_does_not_reserve() {
    // One more page mapped in unmapped address space, nothing else changed.
    for mode in [SegmentMode::Expandable, SegmentMode::Remap] {
        let mut d = real_state(mode);
        let s = d.segments.iter_mut().find(|s| s.expandable).unwrap();
        let hole = s
            .blocks
            .iter()
            .find(|b| b.state == DumpState::Unmapped)
            .unwrap()
            .addr;
        s.mapped.push((hole, 2 * MIB));
        s.mapped.sort_unstable();
        rejected(&d, "≠ mapped");
    }
}

#[test]
fn catches_cached_differing_from_reserved_minus_allocated() {
    rejected_in_every_mode("cached ≠ reserved + sleeping − allocated", |d| {
        d.ledger.cached_bytes += 512
    });
}

#[test]
fn catches_a_wrong_segment_count() {
    let mut d = real_state(SegmentMode::Native);
    d.ledger.segments.current += 1;
    d.ledger.segments.peak += 1;
    rejected(&d, "ledger counts 3 segments, 2 exist");
}

#[test]
fn catches_committed_differing_from_reserved() {
    rejected_in_every_mode("committed", |d| d.committed += 2 * MIB);
}

#[test]
fn catches_allocated_above_active() {
    for mut d in both() {
        d.ledger.active_bytes.current = d.ledger.all.allocated_bytes.current - 512;
        rejected(&d, "≤ active");
    }
}
