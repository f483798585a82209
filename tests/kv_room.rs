//! What the KV cache may take, and what its refusals say: the allocator's limit bounds the
//! commit as the cap does, a resize that maps nothing new needs no budget, and a refused
//! resize names every part of what the budget contract keeps. On the simulated device.

#[path = "common/sim.rs"]
mod common;

use common::{check, sim_on};
use vram_ledger::driver::sim::{SimConfig, SimDriver};
use vram_ledger::driver::StreamId;
use vram_ledger::units::{GIB, MIB};
use vram_ledger::{
    Allocator, Config, Error, Limit, OomCause, ProfileOptions, Profiler, SegmentMode, Tag,
};

const S: StreamId = StreamId(0x10);
const BLOCK: u64 = 2 * MIB;
const MODES: [SegmentMode; 4] = [
    SegmentMode::Native,
    SegmentMode::Expandable,
    SegmentMode::Compact,
    SegmentMode::Remap,
];

/// An allocator whose reserved bytes are limited to 1 GiB, on the default simulated device.
fn limited_to_1_gib(mode: SegmentMode) -> Allocator<SimDriver> {
    let config = Config {
        limit: Some(Limit::Bytes(GIB)),
        ..Config::with_mode(mode)
    };
    sim_on(SimConfig::default(), config)
}

/// With a limit on the allocator tighter than the cap, the commit maps what the limit leaves:
/// not nothing (the memory is there), and not past the limit (a commit that fails).
#[test]
fn kv_commit_stays_within_the_allocators_limit() {
    for mode in MODES {
        let a = limited_to_1_gib(mode);
        let w = a.allocate_tagged(100 * MIB, S, Tag::Weights).unwrap();
        a.reserve_kv(BLOCK, Some(10 * GIB), 10).unwrap();
        a.set_cap(Some(20 * GIB));
        let c = a.commit_kv().unwrap();
        assert_eq!(c.room.limit, Some(GIB), "{mode}");
        let held = a.snapshot().reserved_bytes.current;
        assert!(held <= GIB, "{mode}: {held} reserved past the 1 GiB limit");
        // Everything the limit leaves, to within a block (a native weights segment may round).
        assert!(
            c.kv.mapped_bytes + 100 * MIB + 2 * BLOCK + 20 * MIB >= GIB,
            "{mode}: only {} mapped under the limit",
            c.kv.mapped_bytes
        );
        assert!(c.kv.usable_blocks > 10, "{mode}: {:?}", c.kv);
        a.release_kv().unwrap();
        a.free(w.ptr).unwrap();
        check(&a);
    }
}

/// Growing within memory the KV cache keeps mapped needs no budget: no cap is needed.
#[test]
fn kv_resize_within_mapped_memory_needs_no_cap() {
    for mode in MODES {
        let a = sim_on(SimConfig::default(), Config::with_mode(mode));
        // 3 MiB blocks: 4 of them end inside a 32 MiB piece, so a shrink to 4 keeps it mapped.
        a.reserve_kv(3 * MIB, Some(GIB), 8).unwrap();
        let k = a.resize_kv(4, 4).unwrap();
        assert!(k.mapped_bytes >= 5 * 3 * MIB, "{mode}: {k:?}");
        assert_eq!(a.resize_kv(5, 0).unwrap().usable_blocks, 5, "{mode}");
        // Past what is mapped, sizing needs the contract.
        let e = a.resize_kv(100, 0).unwrap_err();
        assert!(
            e.to_string().contains("needs a budget contract"),
            "{mode}: {e}"
        );
        check(&a);
    }
}

/// A resize the budget contract cannot hold is refused with what the contract keeps, each
/// part named: the figures add up to the cap, and the room left is what it says.
#[test]
fn kv_resize_refusal_names_what_the_contract_keeps() {
    for mode in MODES {
        let device = SimConfig {
            capacity: 20 * GIB,
            ..SimConfig::default()
        };
        let a = sim_on(device, Config::with_mode(mode));
        let p = Profiler::new(&a).unwrap();
        a.allocate_tagged(2 * GIB, S, Tag::Weights).unwrap();
        let r = p
            .profile(
                ProfileOptions {
                    utilization: 0.5,
                    ..Default::default()
                },
                || {
                    let x = a.allocate_tagged(3 * GIB, S, Tag::Activation).unwrap();
                    a.free(x.ptr).unwrap();
                },
            )
            .unwrap();
        let kv = a.reserve_kv(BLOCK, Some(10 * GIB), 8).unwrap();
        let c = a.commit_kv().unwrap();
        let e = a.resize_kv(kv.reserved_blocks, 0).unwrap_err();
        let Error::KvShort(cause) = &e else {
            panic!("{mode}: {e}")
        };
        let OomCause::KvRoom { to, wanted, room } = cause.as_ref() else {
            panic!("{mode}: {cause}")
        };
        assert_eq!(room.cap, r.requested, "{mode}");
        // The weights held and the pass's rise above them: the pass's peak, 5 GiB.
        assert!(
            room.eager_now + room.transient >= 5 * GIB,
            "{mode}: the pass's peak is kept: {room:?}"
        );
        let kept = room.eager_now
            + room.transient
            + room.graph_pools
            + room.outside
            + room.asleep
            + room.margin;
        assert_eq!(room.room, room.cap - kept, "{mode}");
        assert_eq!(room.room, c.room.room, "{mode}: the commit's room");
        assert_eq!(
            (*to, *wanted),
            (10 * GIB, 10 * GIB - c.kv.mapped_bytes),
            "{mode}"
        );
        let text = e.to_string();
        for part in [
            "requested",
            "held by eager work",
            "kept for its passes",
            "margin",
        ] {
            assert!(text.contains(part), "{mode}: {part:?} not in {text}");
        }
        // On an error the KV cache is as it was.
        assert_eq!(a.kv_cache().unwrap(), c.kv, "{mode}");
        check(&a);
    }
}

/// A device whose granularity is larger than the KV cache's 32 MiB pieces maps whole granules.
#[test]
fn kv_cache_on_a_device_with_granules_larger_than_its_pieces() {
    for mode in [SegmentMode::Native, SegmentMode::Remap] {
        let device = SimConfig {
            granularity: GIB,
            ..SimConfig::default()
        };
        let a = sim_on(device, Config::with_mode(mode));
        let k = a.reserve_kv(32 * MIB, Some(4 * GIB), 40).unwrap();
        assert_eq!(k.mapped_bytes, 2 * GIB, "{mode}: {k:?}");
        a.release_kv().unwrap();
        check(&a);
    }
}

/// Under a limit tighter than the contract, a resize past it is refused naming the limit, and
/// one within it maps.
#[test]
fn kv_resize_is_refused_past_the_limit_naming_it() {
    for mode in MODES {
        let a = limited_to_1_gib(mode);
        a.reserve_kv(BLOCK, Some(4 * GIB), 10).unwrap();
        a.set_cap(Some(20 * GIB));
        let e = a.resize_kv(1024, 0).unwrap_err();
        let text = e.to_string();
        assert!(
            matches!(&e, Error::KvShort(c) if matches!(**c, OomCause::KvRoom { .. })),
            "{mode}: {e}"
        );
        assert!(
            text.contains("the allocator's limit of 1.00 GiB leaves no more"),
            "{mode}: {text}"
        );
        assert_eq!(a.kv_cache().unwrap().usable_blocks, 10, "{mode}");
        assert_eq!(a.resize_kv(500, 0).unwrap().usable_blocks, 500, "{mode}");
        check(&a);
    }
}

/// A margin of every byte, with the KV cache's size given to profiling (which then does not
/// weigh the margin against the request), leaves the KV cache nothing: the room does not wrap
/// around.
#[test]
fn a_margin_of_every_byte_leaves_the_kv_cache_nothing() {
    for mode in [SegmentMode::Native, SegmentMode::Remap] {
        let a = sim_on(SimConfig::default(), Config::with_mode(mode));
        let p = Profiler::new(&a).unwrap();
        p.profile(
            ProfileOptions {
                utilization: 0.5,
                margin: vram_ledger::Margin::Bytes(u64::MAX),
                kv_override: Some(GIB),
                ..Default::default()
            },
            || {},
        )
        .unwrap();
        a.reserve_kv(BLOCK, Some(4 * GIB), 4).unwrap();
        let c = a.commit_kv().unwrap();
        assert_eq!(c.room.room, 0, "{mode}: {:?}", c.room);
        assert_eq!(c.kv.usable_blocks, 4, "{mode}: nothing more mapped");
        check(&a);
    }
}
