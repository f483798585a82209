//! The allocation history in PyTorch's snapshot format: recorded while a real trace replays
//! through the allocator, written as a snapshot pickle, read back by the replay's reader and
//! replayed again, in every mode. The second replay must find what the first one did: the
//! segment events we recorded describe exactly what we reserved, and replaying our own
//! allocations reproduces our peak.

#[path = "common/sim.rs"]
mod common;

use common::{h200, replay_in, sim, trace};
use vram_ledger::replay::{self, engine, ReplayOptions};
use vram_ledger::units::MIB;
use vram_ledger::{SegmentMode, StreamId, Tag};

#[test]
fn history_round_trip_reproduces_our_own_peak_in_every_mode() {
    let trace = trace("gpt2-train");
    for mode in SegmentMode::ALL {
        let a = h200(mode);
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
        let again = replay_in(&ours, mode);
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
    let a = sim(SegmentMode::Native);
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

/// An allocation's and a free's entries carry the host's context for them (what the Python
/// package resolves to stack frames), written into the snapshot under its own key, which the
/// replay's reader passes over; entries made outside a context carry none.
#[test]
fn history_entries_carry_the_hosts_context_into_the_snapshot() {
    use vram_ledger::allocator::history::with_context;
    let a = sim(SegmentMode::Native);
    let s = StreamId::DEFAULT;
    a.record_history(true, 100).unwrap();
    let x = with_context(7, || a.allocate_tagged(4096, s, Tag::Weights)).unwrap();
    let y = a.allocate_tagged(8192, s, Tag::Weights).unwrap();
    with_context(9, || a.free(x.ptr)).unwrap();
    a.free(y.ptr).unwrap();
    let contexts: Vec<(&str, u64, u64)> = a
        .history()
        .0
        .iter()
        .map(|e| (e.action.name(), e.size, e.context))
        .collect();
    assert!(contexts.contains(&("alloc", 4096, 7)), "{contexts:?}");
    assert!(contexts.contains(&("alloc", 8192, 0)), "{contexts:?}");
    assert!(
        contexts.contains(&("free_requested", 4096, 9)),
        "{contexts:?}"
    );
    assert!(
        contexts.contains(&("free_requested", 8192, 0)),
        "{contexts:?}"
    );
    // Segment events and completed frees are the allocator's own: no context.
    assert!(contexts
        .iter()
        .all(|&(action, _, c)| c == 0 || action == "alloc" || action == "free_requested"));
    let bytes = replay::snapshot::write(&a, 0);
    let text = format!(
        "{:?}",
        serde_pickle::value_from_slice(&bytes, Default::default()).unwrap()
    );
    assert_eq!(
        text.matches(replay::snapshot::CONTEXT_KEY).count(),
        2,
        "one key per entry with a context"
    );
    let back = replay::trace::read_bytes(&bytes, Some(0)).unwrap();
    assert_eq!(back.events.len(), contexts.len(), "every entry read back");
    // A free without a context of its own carries its allocation's, as PyTorch's does.
    let z = with_context(11, || a.allocate_tagged(4096, s, Tag::Weights)).unwrap();
    a.free(z.ptr).unwrap();
    let (entries, _) = a.history();
    let freed = entries
        .iter()
        .rev()
        .find(|e| e.action.name() == "free_requested")
        .unwrap();
    assert_eq!((freed.addr, freed.context), (z.ptr, 11));
}

/// A live allocation keeps its context whatever the ring's bound dropped, until it is freed;
/// stopping and starting again forgets them (frees made while off are not seen).
#[test]
fn history_live_allocations_keep_their_context_past_the_bound() {
    use vram_ledger::allocator::history::with_context;
    let a = sim(SegmentMode::Native);
    let s = StreamId::DEFAULT;
    a.record_history(true, 2).unwrap();
    let x = with_context(5, || a.allocate_tagged(4096, s, Tag::Weights)).unwrap();
    for _ in 0..5 {
        let y = with_context(6, || a.allocate_tagged(8192, s, Tag::Activation)).unwrap();
        a.free(y.ptr).unwrap();
    }
    assert!(
        a.history().0.iter().all(|e| e.addr != x.ptr),
        "the bound dropped x's entry"
    );
    assert_eq!(a.live_contexts().get(&x.ptr), Some(&5));
    assert_eq!(
        a.live_contexts().len(),
        1,
        "freed allocations are forgotten"
    );
    let bytes = replay::snapshot::write(&a, 0);
    let text = format!(
        "{:?}",
        serde_pickle::value_from_slice(&bytes, Default::default()).unwrap()
    );
    let key = format!("String({:?}): I64(5)", replay::snapshot::CONTEXT_KEY);
    assert!(
        text.contains(&key),
        "the live block carries it: {text:.600}"
    );
    a.free(x.ptr).unwrap();
    assert!(a.live_contexts().is_empty());
    let z = with_context(7, || a.allocate_tagged(4096, s, Tag::Weights)).unwrap();
    a.record_history(false, 2).unwrap();
    assert!(a.live_contexts().is_empty(), "stopping forgets them");
    a.free(z.ptr).unwrap();
}

/// The host's metadata (PyTorch's `_set_memory_metadata`) rides on every entry written while it
/// is set, segment events too, and shows as their `user_metadata`; cleared, entries show their
/// tag again; the number of distinct strings is bounded.
#[test]
fn history_metadata_rides_on_every_entry_while_set() {
    let a = sim(SegmentMode::Native);
    let s = StreamId::DEFAULT;
    a.record_history(true, 100).unwrap();
    a.set_history_metadata(Some("phase 1"));
    assert_eq!(a.history_metadata().as_deref(), Some("phase 1"));
    let x = a.allocate_tagged(30 * MIB, s, Tag::Weights).unwrap();
    a.free(x.ptr).unwrap();
    a.empty_cache().unwrap();
    a.set_history_metadata(Some(""));
    assert_eq!(a.history_metadata(), None);
    let y = a.allocate_tagged(30 * MIB, s, Tag::Weights).unwrap();
    let (entries, _) = a.history();
    let table = a.history_metadata_table();
    let shown: Vec<(&str, Option<&str>)> = entries
        .iter()
        .map(|e| {
            let m = (e.metadata > 0).then(|| table[e.metadata as usize - 1].as_str());
            (e.action.name(), m)
        })
        .collect();
    let (set, cleared) = shown.split_at(shown.iter().position(|e| e.1.is_none()).unwrap());
    assert!(
        set.len() >= 5 && set.iter().all(|e| e.1 == Some("phase 1")),
        "{shown:?}"
    );
    assert!(set.iter().any(|e| e.0 == "segment_free"), "{shown:?}");
    assert!(cleared.iter().all(|e| e.1.is_none()), "{shown:?}");
    let text = format!(
        "{:?}",
        serde_pickle::value_from_slice(&replay::snapshot::write(&a, 0), Default::default())
            .unwrap()
    );
    assert_eq!(
        text.matches("String(\"phase 1\")").count(),
        set.len(),
        "{text:.400}"
    );
    a.free(y.ptr).unwrap();
    // "phase 1" is one of them, still named by kept entries; past the bound a string no entry
    // names any more is reused, and "phase 1" keeps its place.
    for i in 1..=vram_ledger::allocator::history::MAX_METADATA {
        a.set_history_metadata(Some(&format!("m{i}")));
    }
    assert_eq!(
        a.history_metadata().as_deref(),
        Some(&*format!(
            "m{}",
            vram_ledger::allocator::history::MAX_METADATA
        ))
    );
    let table = a.history_metadata_table();
    assert_eq!(table.len(), vram_ledger::allocator::history::MAX_METADATA);
    assert!(table.contains(&"phase 1".to_string()));
}
