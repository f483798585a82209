//! Memory the recording found live. A snapshot whose history began after the program had
//! allocated (history turned on mid-run, or the oldest events dropped by PyTorch's
//! `max_entries`) frees blocks its trace never allocated, and its `segments` list (the state
//! when it was written) holds blocks and segments the trace never made. Replayed as recorded,
//! that memory would be missing from both sides: live bytes and PyTorch's reserved bytes too
//! low, and every free of it dropped. So the reader puts it back as events before the first
//! one, as PyTorch's own memory viewer does.
//!
//! Invariants:
//! - On a trace whose history holds every allocation of the program, nothing is added: a block
//!   counts as live before the recording only when the trace frees it before allocating it,
//!   or when the snapshot ends with it allocated and the trace never allocated it.
//! - Segments likewise (by address; for expandable segments, whose maps and unmaps need not
//!   line up, by the bytes mapped: what the snapshot ends with, less what the trace mapped).
//! - What is put back comes first: segments, then blocks in the order the trace first names
//!   them, then those only the end state names, by address, then the requested frees of blocks
//!   whose free was asked for before the recording and completes in it. Each keeps its
//!   recorded address, size and stream, and the tag of the event that frees it (untracked when
//!   none does).

use std::collections::{BTreeMap, HashSet};

use serde_pickle::{HashableValue, Value};

use super::error::{FieldError, TraceError};
use super::trace::{bounded, get, kind, stream_handle, Action, Event, Streams};
use crate::allocator::rules::ABSURD_SIZE;
use crate::tag::Tag;

/// A segment of the snapshot's `segments` list (the state when it was written), on the trace's
/// device.
#[derive(Clone, Debug, Default)]
pub(crate) struct EndSegment {
    pub addr: u64,
    pub size: u64,
    /// The trace's number for the segment's stream.
    pub stream: u64,
    /// Blocks allocated (or freed and awaiting other streams) at the end: address and the size
    /// asked for.
    pub live: Vec<(u64, u64)>,
}

/// The snapshot's `segments` list for `device`, read with the trace's stream numbers; `None`
/// when the snapshot has none. Its fields are bounded as the trace's are.
pub(crate) fn end_segments(
    top: &BTreeMap<HashableValue, Value>,
    device: usize,
    streams: &mut Streams,
) -> Result<Option<Vec<EndSegment>>, TraceError> {
    let list = match get(top, "segments") {
        None | Some(Value::None) => return Ok(None),
        Some(Value::List(l)) => l,
        Some(other) => {
            return Err(TraceError::NotASnapshot(format!(
                "'segments' is {}, not a list",
                kind(other)
            )))
        }
    };
    let mut out = Vec::new();
    for (index, s) in list.iter().enumerate() {
        let err = |field, problem| TraceError::Segment {
            index,
            field,
            problem,
        };
        let Value::Dict(fields) = s else {
            return Err(TraceError::NotASnapshot(format!(
                "segments[{index}] is {}, not a dict",
                kind(s)
            )));
        };
        let int = |d: &BTreeMap<HashableValue, Value>, field, hi: i128, range| {
            let v = get(d, field).ok_or_else(|| err(field, FieldError::Missing))?;
            bounded(v, 0, hi, range).map_err(|p| err(field, p))
        };
        if let Some(v) = get(fields, "device") {
            if bounded(v, 0, 1 << 31, "0 to 2^31 - 1").map_err(|p| err("device", p))?
                != device as u64
            {
                continue;
            }
        }
        let handle = stream_handle(fields).map_err(|p| err("stream", p))?;
        let stream = streams.number(handle).ok_or_else(|| {
            err(
                "stream",
                FieldError::TooManyStreams(super::trace::MAX_STREAMS),
            )
        })?;
        let mut seg = EndSegment {
            addr: int(fields, "address", 1 << 63, "0 to 2^63 - 1")?,
            size: int(
                fields,
                "total_size",
                i128::from(ABSURD_SIZE),
                "0 to 2^60 - 1",
            )?,
            stream,
            live: Vec::new(),
        };
        let blocks = match get(fields, "blocks") {
            None | Some(Value::None) => &[][..],
            Some(Value::List(b)) => &b[..],
            Some(other) => return Err(err("blocks", FieldError::NotAList(kind(other)))),
        };
        for b in blocks {
            let Value::Dict(b) = b else {
                return Err(err("blocks", FieldError::NotADict(kind(b))));
            };
            let live = match get(b, "state") {
                Some(Value::String(s)) => s == "active_allocated" || s == "active_pending_free",
                Some(other) => return Err(err("state", FieldError::NotAString(kind(other)))),
                None => return Err(err("state", FieldError::Missing)),
            };
            if live {
                let addr = int(b, "address", 1 << 63, "0 to 2^63 - 1")?;
                // The trace's alloc events record the size asked for, which the block keeps
                // as `requested_size` (its `size` may be larger: a remainder left unsplit).
                let size = int(
                    b,
                    "requested_size",
                    i128::from(ABSURD_SIZE),
                    "0 to 2^60 - 1",
                )?;
                seg.live.push((addr, size));
            }
        }
        out.push(seg);
    }
    Ok(Some(out))
}

/// How much memory the recording found live, put back as events before its first.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Before {
    pub blocks: u64,
    pub block_bytes: u64,
    pub segments: u64,
    pub segment_bytes: u64,
}

impl Before {
    pub fn is_empty(&self) -> bool {
        self.blocks == 0 && self.segments == 0
    }
}

/// The events that put back what was live before `events` began, and their count. `end`: the
/// snapshot's segments, when it has the list; `expandable`: the recording used expandable
/// segments.
pub(crate) fn live_before(
    events: &[Event],
    end: Option<&[EndSegment]>,
    expandable: bool,
) -> (Vec<Event>, Before) {
    let mut before = Before::default();
    let mut segments = Vec::new();
    if expandable {
        // Maps and unmaps cover ranges that need not match: count bytes. The trace's running
        // balance never goes below what was mapped before it; the end state says how much more.
        let (mut net, mut lowest) = (0i128, 0i128);
        for e in events {
            match e.action {
                Action::SegmentMap => net += i128::from(e.size),
                Action::SegmentUnmap => net -= i128::from(e.size),
                _ => {}
            }
            lowest = lowest.min(net);
        }
        let mut bytes = -lowest;
        if let Some(end) = end {
            let at_end: i128 = end.iter().map(|s| i128::from(s.size)).sum();
            bytes = bytes.max(at_end - net);
        }
        if bytes > 0 {
            let at = end
                .and_then(|s| s.first())
                .map_or((0, 0), |s| (s.addr, s.stream));
            segments.push(event(
                Action::SegmentMap,
                at.0,
                bytes as u64,
                at.1,
                Tag::Untracked,
            ));
        }
    } else {
        let mut made: HashSet<u64> = HashSet::new();
        let mut seen: HashSet<u64> = HashSet::new();
        for e in events {
            match e.action {
                Action::SegmentAlloc => {
                    made.insert(e.addr);
                    seen.insert(e.addr);
                }
                Action::SegmentFree if !made.remove(&e.addr) && seen.insert(e.addr) => {
                    segments.push(event(
                        Action::SegmentAlloc,
                        e.addr,
                        e.size,
                        e.stream,
                        Tag::Untracked,
                    ));
                }
                _ => {}
            }
        }
        for s in end.unwrap_or_default() {
            if !seen.contains(&s.addr) {
                segments.push(event(
                    Action::SegmentAlloc,
                    s.addr,
                    s.size,
                    s.stream,
                    Tag::Untracked,
                ));
            }
        }
    }
    // Addresses the trace holds a block at: allocated, or freed and not yet completed.
    let mut held: HashSet<u64> = HashSet::new();
    let mut put_back: HashSet<u64> = HashSet::new();
    let mut blocks = Vec::new();
    let mut requested = Vec::new();
    for e in events {
        match e.action {
            Action::Alloc => {
                held.insert(e.addr);
            }
            Action::FreeRequested | Action::FreeCompleted => {
                if !held.contains(&e.addr) && put_back.insert(e.addr) {
                    blocks.push(event(Action::Alloc, e.addr, e.size, e.stream, e.tag));
                    // Its free was asked for before the recording; only its completion is in
                    // the trace (the block awaited other streams' work).
                    if e.action == Action::FreeCompleted {
                        requested.push(event(
                            Action::FreeRequested,
                            e.addr,
                            e.size,
                            e.stream,
                            e.tag,
                        ));
                    }
                }
                if e.action == Action::FreeRequested {
                    held.insert(e.addr);
                } else {
                    held.remove(&e.addr);
                }
            }
            _ => {}
        }
    }
    let mut only_at_end = BTreeMap::new();
    for s in end.unwrap_or_default() {
        for &(addr, size) in &s.live {
            if !held.contains(&addr) && !put_back.contains(&addr) {
                only_at_end.insert(
                    addr,
                    event(Action::Alloc, addr, size, s.stream, Tag::Untracked),
                );
            }
        }
    }
    blocks.extend(only_at_end.into_values());
    before.segments = segments.len() as u64;
    before.segment_bytes = segments.iter().map(|e| e.size).sum();
    before.blocks = blocks.len() as u64;
    before.block_bytes = blocks.iter().map(|e| e.size).sum();
    segments.extend(blocks);
    segments.extend(requested);
    (segments, before)
}

fn event(action: Action, addr: u64, size: u64, stream: u64, tag: Tag) -> Event {
    Event {
        action,
        addr,
        size,
        stream,
        tag,
        sleep: false,
    }
}

#[cfg(test)]
mod tests {
    use super::super::trace::read_bytes;
    use super::super::trace::tests::entry as d;
    use super::*;

    fn ev(action: &str, addr: i64, size: i64, stream: i64) -> Value {
        d(&[
            ("action", Value::String(action.into())),
            ("addr", Value::I64(addr)),
            ("size", Value::I64(size)),
            ("stream", Value::I64(stream)),
        ])
    }

    fn snapshot(events: Vec<Value>, segments: Option<Vec<Value>>, expandable: bool) -> Vec<u8> {
        let mut top = vec![
            ("device_traces", Value::List(vec![Value::List(events)])),
            (
                "allocator_settings",
                d(&[("expandable_segments", Value::Bool(expandable))]),
            ),
        ];
        if let Some(s) = segments {
            top.push(("segments", Value::List(s)));
        }
        serde_pickle::value_to_vec(&d(&top), Default::default()).unwrap()
    }

    fn segment(device: i64, addr: i64, size: i64, stream: i64, blocks: &[(i64, i64)]) -> Value {
        let blocks = blocks
            .iter()
            .map(|&(a, s)| {
                d(&[
                    ("address", Value::I64(a)),
                    ("size", Value::I64(s)),
                    ("requested_size", Value::I64(s)),
                    ("state", Value::String("active_allocated".into())),
                ])
            })
            .collect();
        d(&[
            ("device", Value::I64(device)),
            ("address", Value::I64(addr)),
            ("total_size", Value::I64(size)),
            ("stream", Value::I64(stream)),
            ("blocks", Value::List(blocks)),
        ])
    }

    const MIB: i64 = 1 << 20;

    #[test]
    fn an_expandable_recording_gets_back_the_bytes_it_unmaps_and_ends_with() {
        // 20 MiB unmapped that the trace never mapped; the end state holds 60 MiB, of which the
        // trace mapped 40 (and unmapped 20): 40 MiB were mapped before it.
        let events = vec![
            ev("segment_unmap", 0x1000_0000, 20 * MIB, 0),
            ev("segment_map", 0x2000_0000, 40 * MIB, 0),
        ];
        let end = vec![segment(0, 0x1000_0000, 60 * MIB, 0, &[])];
        let t = read_bytes(&snapshot(events.clone(), Some(end), true), None).unwrap();
        assert_eq!((t.before.segments, t.before.segment_bytes), (1, 40 << 20));
        assert_eq!(t.events[0].action, Action::SegmentMap);
        // Without the end state, only what the trace itself unmaps.
        let t = read_bytes(&snapshot(events, None, true), None).unwrap();
        assert_eq!(t.before.segment_bytes, 20 << 20);
    }

    #[test]
    fn another_devices_segments_and_a_whole_recording_add_nothing() {
        let events = vec![
            ev("segment_alloc", 0x1000_0000, 2 * MIB, 0),
            ev("alloc", 0x1000_0000, 512, 0),
        ];
        let end = vec![
            segment(0, 0x1000_0000, 2 * MIB, 0, &[(0x1000_0000, 512)]),
            segment(1, 0x9000_0000, 2 * MIB, 0, &[(0x9000_0000, 512)]),
        ];
        let t = read_bytes(&snapshot(events, Some(end), false), None).unwrap();
        assert!(t.before.is_empty(), "{:?}", t.before);
        assert_eq!(t.events.len(), 2);
    }

    #[test]
    fn what_is_put_back_comes_first_and_streams_are_numbered_as_they_appear() {
        // Stream 0xA0 appears first in the file; the block put back is on 0xB0, which the
        // trace names later: after renumbering 0xB0 is stream 1, as it is met first.
        let events = vec![
            ev("alloc", 0x2000_0000, 512, 0xA0),
            ev("free_requested", 0x3000_0000, 1024, 0xB0),
            ev("free_completed", 0x3000_0000, 1024, 0xB0),
            ev("free_completed", 0x4000_0000, 2048, 0xA0),
        ];
        let t = read_bytes(&snapshot(events, None, false), None).unwrap();
        assert_eq!(t.before.blocks, 2);
        assert_eq!(t.before.block_bytes, 3072);
        let acts: Vec<_> = t
            .events
            .iter()
            .map(|e| (e.action, e.addr, e.stream))
            .collect();
        assert_eq!(
            acts[..3],
            [
                (Action::Alloc, 0x3000_0000, 1),
                (Action::Alloc, 0x4000_0000, 2),
                // Asked to be freed before the recording: only its completion is in it.
                (Action::FreeRequested, 0x4000_0000, 2),
            ]
        );
        assert_eq!(t.streams, vec![0, 0xB0, 0xA0]);
    }
}
