//! Writing PyTorch's memory snapshot (what `torch.cuda.memory._dump_snapshot` writes) from an
//! allocator: its segments and blocks now, and the history it recorded as the device's trace,
//! each allocation's tag (or the host's metadata while one was set) as its `user_metadata`. PyTorch's memory_viz opens it and
//! [`super::read_file`] reads it back.
//!
//! Virtual segments (the expandable, compact and remap modes) are written as PyTorch writes its
//! expandable segments: one segment per contiguous mapped range, holding the blocks inside it.

use std::collections::HashMap;

use serde_pickle::{HashableValue, Value};

use super::trace::Action;
use crate::allocator::history::{HistoryEntry, SLEEP, WAKE};
use crate::allocator::rules::PoolKind;
use crate::driver::Driver;
use crate::invariants::{BlockDump, DumpState, SegmentDump};
use crate::tag::Tag;
use crate::Allocator;

/// The key of a trace entry's host context (`HistoryEntry::context`), when it has one.
pub const CONTEXT_KEY: &str = "vram-ledger:context";
/// The key of the list of every live allocation's context.
pub const LIVE_CONTEXTS_KEY: &str = "vram-ledger:live-contexts";

fn dict(pairs: Vec<(&str, Value)>) -> Value {
    Value::Dict(
        pairs
            .into_iter()
            .map(|(k, v)| (HashableValue::String(k.into()), v))
            .collect(),
    )
}

fn int(v: u64) -> Value {
    Value::I64(v as i64)
}

/// An entry's `user_metadata`: for a segment event of sleep or wake "sleep TAG" or "wake TAG"
/// (which the replay reads); else the host's metadata when one was set (PyTorch's
/// `_set_memory_metadata`, shown as it is; the replay then reads the entry as untracked), else
/// its tag's name ("" for untracked).
fn metadata(e: &HistoryEntry, table: &[String]) -> Value {
    if !e.sleep && e.metadata > 0 {
        if let Some(m) = table.get(e.metadata as usize - 1) {
            return Value::String(m.clone());
        }
    }
    if e.sleep {
        let how = if e.action == Action::SegmentUnmap {
            SLEEP
        } else {
            WAKE
        };
        return Value::String(format!("{how} {}", e.tag.name()));
    }
    Value::String(
        if e.tag == Tag::Untracked {
            ""
        } else {
            e.tag.name()
        }
        .into(),
    )
}

fn block(b: &BlockDump, contexts: &HashMap<u64, u64>) -> Value {
    let state = match b.state {
        DumpState::Allocated => "active_allocated",
        DumpState::Pending => "active_pending_free",
        DumpState::Free | DumpState::Unmapped => "inactive",
    };
    let mut fields = vec![
        ("address", int(b.addr)),
        ("size", int(b.size)),
        ("requested_size", int(b.requested)),
        ("state", Value::String(state.into())),
        ("frames", Value::List(vec![])),
    ];
    if let Some(&c) = contexts
        .get(&b.addr)
        .filter(|_| b.state == DumpState::Allocated)
    {
        fields.push((CONTEXT_KEY, int(c)));
    }
    dict(fields)
}

fn segment(
    device: usize,
    s: &SegmentDump,
    (base, size): (u64, u64),
    blocks: &[&BlockDump],
    contexts: &HashMap<u64, u64>,
) -> Value {
    let sum =
        |f: &dyn Fn(&BlockDump) -> Option<u64>| blocks.iter().filter_map(|b| f(b)).sum::<u64>();
    let allocated = sum(&|b| (b.state == DumpState::Allocated).then_some(b.size));
    let active =
        sum(&|b| matches!(b.state, DumpState::Allocated | DumpState::Pending).then_some(b.size));
    let requested = sum(&|b| (b.state == DumpState::Allocated).then_some(b.requested));
    let kind = match s.pool {
        PoolKind::Small => "small",
        PoolKind::Large => "large",
    };
    dict(vec![
        ("device", int(device as u64)),
        ("address", int(base)),
        ("total_size", int(size)),
        ("allocated_size", int(allocated)),
        ("active_size", int(active)),
        ("requested_size", int(requested)),
        ("stream", int(0)),
        ("segment_type", Value::String(kind.into())),
        (
            "segment_pool_id",
            Value::Tuple(match s.graph_pool {
                Some((a, b)) => vec![int(a), int(b)],
                None => vec![int(0), int(0)],
            }),
        ),
        ("is_expandable", Value::Bool(s.expandable)),
        ("frames", Value::List(vec![])),
        (
            "blocks",
            Value::List(blocks.iter().map(|b| block(b, contexts)).collect()),
        ),
    ])
}

/// The segments of a dump as PyTorch lists them.
fn segments(device: usize, dump: &[SegmentDump], contexts: &HashMap<u64, u64>) -> Vec<Value> {
    let mut out = Vec::new();
    for s in dump {
        if !s.expandable {
            let blocks: Vec<&BlockDump> = s.blocks.iter().collect();
            out.push(segment(device, s, (s.base, s.size), &blocks, contexts));
            continue;
        }
        // Contiguous mapped runs.
        let mut runs: Vec<(u64, u64)> = Vec::new();
        let mut mapped = s.mapped.clone();
        mapped.sort_unstable();
        for (a, l) in mapped {
            match runs.last_mut() {
                Some((ra, rl)) if *ra + *rl == a => *rl += l,
                _ => runs.push((a, l)),
            }
        }
        for (a, l) in runs {
            let blocks: Vec<&BlockDump> = s
                .blocks
                .iter()
                .filter(|b| b.state != DumpState::Unmapped && b.addr >= a && b.addr < a + l)
                .collect();
            out.push(segment(device, s, (a, l), &blocks, contexts));
        }
    }
    out
}

/// The snapshot pickle of `alloc` as device `device`: its segments now and its recorded
/// history (empty unless [`Allocator::record_history`] was on).
pub fn write<D: Driver>(alloc: &Allocator<D>, device: usize) -> Vec<u8> {
    let dump = alloc.dump();
    let (entries, _) = alloc.history();
    let table = alloc.history_metadata_table();
    let trace: Vec<Value> = entries
        .iter()
        .map(|e| {
            let mut fields = vec![
                ("action", Value::String(Action::name(e.action).into())),
                ("addr", int(e.addr)),
                ("size", int(e.size)),
                ("stream", int(e.stream.0)),
                ("time_us", int(e.time_us)),
                ("frames", Value::List(vec![])),
                ("user_metadata", metadata(e, &table)),
            ];
            if e.context != 0 {
                // For the host to resolve into frames (the Python package does); PyTorch's
                // readers ignore keys they do not know.
                fields.push((CONTEXT_KEY, int(e.context)));
            }
            dict(fields)
        })
        .collect();
    let mut devices = vec![Value::List(vec![]); device + 1];
    devices[device] = Value::List(trace);
    let live = alloc.live_contexts();
    let mut live_ids: Vec<u64> = live.values().copied().collect();
    live_ids.sort_unstable();
    let top = dict(vec![
        (
            "segments",
            Value::List(segments(device, &dump.segments, &live)),
        ),
        // Every live allocation's context, those of asleep memory too (whose blocks are not
        // written): the host keeps their stacks for when they show again.
        (
            LIVE_CONTEXTS_KEY,
            Value::List(live_ids.into_iter().map(int).collect()),
        ),
        ("device_traces", Value::List(devices)),
        (
            "allocator_settings",
            dict(vec![
                (
                    "expandable_segments",
                    Value::Bool(alloc.mode().is_virtual()),
                ),
                (
                    "vram_ledger_mode",
                    Value::String(alloc.mode().name().into()),
                ),
            ]),
        ),
    ]);
    serde_pickle::value_to_vec(&top, serde_pickle::SerOptions::new())
        .expect("a tree of dicts, lists and numbers always serialises")
}
