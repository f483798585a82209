//! The model's operations (`tests/model.rs`) and the strategy that draws them.

use proptest::prelude::*;
use vram_ledger::driver::{DriverCall, StreamId};
use vram_ledger::units::MIB;
use vram_ledger::Tag;

#[derive(Clone, Debug)]
pub enum Op {
    Alloc {
        size: u64,
        stream: u8,
        tag: u8,
    },
    Free {
        pick: usize,
        hint: bool,
    },
    RecordStream {
        pick: usize,
        stream: u8,
    },
    Submit {
        stream: u8,
    },
    Complete {
        stream: u8,
    },
    EmptyCache,
    SetLimit(Option<u64>),
    ResetPeaks,
    ResetTagPeaks(u8),
    Fault {
        call: usize,
        nth: u64,
        sticky: bool,
    },
    ClearFaults,
    /// Tags by bit mask (bit i: `Tag::ALL[i]`).
    Sleep {
        offload: u8,
        discard: u8,
    },
    Wake {
        mask: u8,
    },
}

pub fn tags_of(mask: u8) -> Vec<Tag> {
    Tag::ALL
        .into_iter()
        .filter(|t| mask & (1 << t.index()) != 0)
        .collect()
}

pub const FAULTABLE: [DriverCall; DriverCall::ALL.len()] = DriverCall::ALL;

pub fn stream(i: u8) -> StreamId {
    StreamId(u64::from(i) * 0x1000)
}

fn size_strategy() -> impl Strategy<Value = u64> {
    prop_oneof![
        4 => 0u64..=4096,
        4 => 4096u64..=MIB,
        3 => MIB..=10 * MIB,
        2 => 10 * MIB..=120 * MIB,
        1 => Just(0u64),
        // Next to whole MiB: the rules' edges (the 1 MiB small pool, 10 MiB segments, a
        // segment's tail of exactly 1 MiB, the 32 MiB max_split_size).
        3 => (1u64..=40, proptest::sample::select(vec![-512i64, -1, 0, 1, 512]))
            .prop_map(|(m, d)| (m * MIB).saturating_add_signed(d)),
    ]
}

pub fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        12 => (size_strategy(), 0u8..4, 0u8..4).prop_map(|(size, stream, tag)| Op::Alloc { size, stream, tag }),
        8 => (any::<usize>(), any::<bool>()).prop_map(|(pick, hint)| Op::Free { pick, hint }),
        2 => (any::<usize>(), 0u8..4).prop_map(|(pick, stream)| Op::RecordStream { pick, stream }),
        2 => (0u8..4).prop_map(|stream| Op::Submit { stream }),
        2 => (0u8..4).prop_map(|stream| Op::Complete { stream }),
        1 => Just(Op::EmptyCache),
        1 => proptest::option::of(64u64..=600).prop_map(|m| Op::SetLimit(m.map(|m| m * MIB))),
        1 => Just(Op::ResetPeaks),
        1 => (0u8..4).prop_map(Op::ResetTagPeaks),
        2 => (0..FAULTABLE.len(), 1u64..4, proptest::bool::weighted(0.2)).prop_map(|(call, nth, sticky)| Op::Fault { call, nth, sticky }),
        1 => Just(Op::ClearFaults),
        1 => (0u8..16, 0u8..16).prop_map(|(offload, discard)| Op::Sleep { offload, discard }),
        1 => (0u8..16).prop_map(|mask| Op::Wake { mask }),
    ]
}
