//! Reading PyTorch memory snapshots (`torch.cuda.memory._dump_snapshot`): a pickle, gzipped
//! or not, whose `device_traces` lists every allocator event of each device. Any byte string
//! is either read or refused with a [`TraceError`], whose message is one line.
//!
//! Invariants:
//! - A [`Trace`] holds only the events the replay acts on, in file order, after the events
//!   that put back what the recording found live ([`Trace::before`], `before.rs`); anything
//!   else in the file is counted, never silently dropped (see `skipped`, `unknown_tags`).
//! - An event's fields are within bounds: addresses below 2^63 (PyTorch writes them as
//!   int64), sizes below 2^60 ([`ABSURD_SIZE`], what the allocator refuses), except an `oom`
//!   event's, which records what was asked and is not replayed.
//! - An event's `stream` is the trace's own number for the stream it was recorded on: 0 for
//!   the default stream (recorded as 0, or not recorded), then 1, 2, … in order of first
//!   appearance; the recorded handles are kept in [`Trace::streams`]. Recorded values are
//!   never used as stream ids: a handle is a pointer, in the range where the simulated
//!   driver's own handles are, or any other integer, an allocator's own keys (bits 59 to 63)
//!   among them; first appearance keeps the order the allocator met the streams in. A trace
//!   names at most [`MAX_STREAMS`].

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use serde_pickle::{HashableValue, Value};

use super::before;
pub use super::before::Before;
pub use super::error::{FieldError, TraceError};
use super::input::{self, Limits};
use crate::allocator::history::{SLEEP, WAKE};
use crate::allocator::rules::ABSURD_SIZE;
pub use crate::allocator::Action;
use crate::tag::Tag;

/// The most streams one trace may name, the default stream included: PyTorch's stream pools
/// hold 32 streams per priority, real traces name a handful, and each stream costs the replay
/// tens of kilobytes of bookkeeping per mode (and each new one a segment of its own).
pub const MAX_STREAMS: usize = 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event {
    pub action: Action,
    pub addr: u64,
    pub size: u64,
    /// The trace's number for the stream (see the invariants above), not the recorded handle.
    pub stream: u64,
    pub tag: Tag,
    /// A segment event of sleep or wake (`user_metadata` "sleep TAG" or "wake TAG", as
    /// vram-ledger writes them): the tag's memory given back or mapped again, not the cache's.
    pub sleep: bool,
}

/// The events of one device.
#[derive(Clone, Debug, Default)]
pub struct Trace {
    pub device: usize,
    pub events: Vec<Event>,
    /// The recorded handle of each stream the events name, by the trace's number for it:
    /// `streams[0]` is 0, the default stream, whether or not an event uses it.
    pub streams: Vec<u64>,
    /// Metadata names that are not tags, with how many events carried each (replayed as
    /// untracked).
    pub unknown_tags: BTreeMap<String, u64>,
    /// Events of actions the replay does not act on (e.g. `snapshot`), by action.
    pub skipped: BTreeMap<String, u64>,
    /// Whether the recording allocator used expandable segments.
    pub expandable: Option<bool>,
    /// The mode, when vram-ledger recorded the trace (its snapshots say so).
    pub vram_ledger_mode: Option<String>,
    /// Memory the recording found live, put back as the first events (`before.rs`).
    pub before: Before,
}

/// Read a snapshot file (gzipped or not).
pub fn read_file(path: &Path, device: Option<usize>) -> Result<Trace, TraceError> {
    read_file_with(path, device, Limits::default())
}

/// [`read_file`] within `limits`.
pub fn read_file_with(
    path: &Path,
    device: Option<usize>,
    limits: Limits,
) -> Result<Trace, TraceError> {
    read_bytes_with(&input::read_file(path, limits)?, device, limits)
}

/// Parse snapshot bytes (gzipped or not). Without `device`, the device with the most events.
pub fn read_bytes(bytes: &[u8], device: Option<usize>) -> Result<Trace, TraceError> {
    read_bytes_with(bytes, device, Limits::default())
}

/// [`read_bytes`] within `limits`.
pub fn read_bytes_with(
    bytes: &[u8],
    device: Option<usize>,
    limits: Limits,
) -> Result<Trace, TraceError> {
    parse_snapshot(&input::decode(bytes, limits)?, device)
}

pub(super) fn get<'a>(d: &'a BTreeMap<HashableValue, Value>, key: &str) -> Option<&'a Value> {
    d.get(&HashableValue::String(key.to_owned()))
}

/// What kind of value `v` is, for messages.
pub(super) fn kind(v: &Value) -> &'static str {
    match v {
        Value::None => "None",
        Value::Bool(_) => "a bool",
        Value::I64(_) | Value::Int(_) => "an integer",
        Value::F64(_) => "a float",
        Value::Bytes(_) => "bytes",
        Value::String(_) => "a string",
        Value::List(_) => "a list",
        Value::Tuple(_) => "a tuple",
        Value::Set(_) | Value::FrozenSet(_) => "a set",
        Value::Dict(_) => "a dict",
    }
}

fn integer(v: &Value) -> Result<i128, FieldError> {
    match v {
        Value::I64(i) => Ok(i128::from(*i)),
        Value::Int(b) => i128::try_from(b).map_err(|_| FieldError::Huge),
        other => Err(FieldError::NotAnInteger(kind(other))),
    }
}

/// An integer in `lo..hi`.
pub(super) fn bounded(
    v: &Value,
    lo: i128,
    hi: i128,
    range: &'static str,
) -> Result<u64, FieldError> {
    let i = integer(v)?;
    if !(lo..hi).contains(&i) {
        return Err(FieldError::OutOfRange { value: i, range });
    }
    // Negative values are allowed only for stream handles, taken as their 64 bits.
    Ok(i as u64)
}

/// The recorded stream handle of a trace entry or an end-state segment: any 64-bit integer,
/// signed (as PyTorch writes it) or not; the default stream when absent.
pub(super) fn stream_handle(fields: &BTreeMap<HashableValue, Value>) -> Result<u64, FieldError> {
    match get(fields, "stream") {
        None | Some(Value::None) => Ok(0),
        Some(v) => bounded(v, i128::from(i64::MIN), 1 << 64, "-2^63 to 2^64 - 1"),
    }
}

/// One trace entry's fields, read as the replay needs them.
struct Entry<'a> {
    fields: &'a BTreeMap<HashableValue, Value>,
    index: usize,
    action: Action,
}

impl Entry<'_> {
    fn error(&self, field: &'static str, problem: FieldError) -> TraceError {
        TraceError::Field {
            entry: self.index,
            action: self.action.name(),
            field,
            problem,
        }
    }

    /// A required integer field in `lo..hi`.
    fn int(&self, field: &'static str, hi: i128, range: &'static str) -> Result<u64, TraceError> {
        let v = get(self.fields, field).ok_or_else(|| self.error(field, FieldError::Missing))?;
        bounded(v, 0, hi, range).map_err(|p| self.error(field, p))
    }

    fn addr(&self) -> Result<u64, TraceError> {
        self.int("addr", 1 << 63, "0 to 2^63 - 1")
    }

    fn size(&self) -> Result<u64, TraceError> {
        if self.action == Action::Oom {
            return self.int("size", 1 << 63, "0 to 2^63 - 1");
        }
        self.int("size", i128::from(ABSURD_SIZE), "0 to 2^60 - 1")
    }

    /// The recorded stream handle ([`stream_handle`]).
    fn stream(&self) -> Result<u64, TraceError> {
        stream_handle(self.fields).map_err(|p| self.error("stream", p))
    }

    /// The tag named by `user_metadata`, and whether it marks a segment event of sleep or
    /// wake; a name that is no tag is counted in `unknown`.
    fn tag(&self, unknown: &mut BTreeMap<String, u64>) -> Result<(Tag, bool), TraceError> {
        let s = match get(self.fields, "user_metadata") {
            None | Some(Value::None) => return Ok((Tag::Untracked, false)),
            Some(Value::String(s)) if s.is_empty() => return Ok((Tag::Untracked, false)),
            Some(Value::String(s)) => s,
            Some(other) => {
                return Err(self.error("user_metadata", FieldError::NotAString(kind(other))))
            }
        };
        let segment = matches!(self.action, Action::SegmentMap | Action::SegmentUnmap);
        let marked = [SLEEP, WAKE]
            .iter()
            .find_map(|m| s.strip_prefix(m)?.strip_prefix(' '))
            .filter(|_| segment)
            .and_then(|t| t.parse::<Tag>().ok());
        if let Some(t) = marked {
            return Ok((t, true));
        }
        Ok((
            s.parse::<Tag>().unwrap_or_else(|_| {
                *unknown.entry(s.clone()).or_default() += 1;
                Tag::Untracked
            }),
            false,
        ))
    }
}

/// The trace's numbers for recorded stream handles (see the invariants above).
pub(super) struct Streams {
    ids: HashMap<u64, u64>,
    handles: Vec<u64>,
}

impl Streams {
    fn new() -> Streams {
        Streams {
            ids: HashMap::from([(0, 0)]),
            handles: vec![0],
        }
    }

    /// The number for `handle`, a new one on its first appearance (in trace entry `entry`).
    fn id(&mut self, handle: u64, entry: usize) -> Result<u64, TraceError> {
        self.number(handle).ok_or(TraceError::TooManyStreams {
            entry,
            max: MAX_STREAMS,
        })
    }

    /// The number for `handle`; `None` past [`MAX_STREAMS`].
    pub(super) fn number(&mut self, handle: u64) -> Option<u64> {
        if let Some(&id) = self.ids.get(&handle) {
            return Some(id);
        }
        if self.handles.len() == MAX_STREAMS {
            return None;
        }
        let id = self.handles.len() as u64;
        self.ids.insert(handle, id);
        self.handles.push(handle);
        Some(id)
    }

    /// Number the streams again in order of first appearance in `events` (the default stream
    /// staying 0), keeping only those the events name, after events were put before the first
    /// (or the end state named streams of its own).
    fn renumber(&mut self, events: &mut [Event]) {
        let mut new: HashMap<u64, u64> = HashMap::from([(0, 0)]);
        let mut handles = vec![0];
        for e in events.iter_mut() {
            let next = new.len() as u64;
            let id = *new.entry(e.stream).or_insert_with(|| {
                handles.push(self.handles[e.stream as usize]);
                next
            });
            e.stream = id;
        }
        // Streams only the end state's idle segments named are left out: no event uses them.
        self.ids = handles
            .iter()
            .enumerate()
            .map(|(i, &h)| (h, i as u64))
            .collect();
        self.handles = handles;
    }
}

fn parse_snapshot(value: &Value, device: Option<usize>) -> Result<Trace, TraceError> {
    let Value::Dict(top) = value else {
        return Err(TraceError::NotASnapshot("the pickle holds no dict".into()));
    };
    let Some(Value::List(devices)) = get(top, "device_traces") else {
        return Err(TraceError::NotASnapshot("no 'device_traces' list".into()));
    };
    let idx = match device {
        Some(d) if d < devices.len() => d,
        Some(d) => {
            return Err(TraceError::NoSuchDevice {
                asked: d,
                available: devices.len(),
            })
        }
        None => (0..devices.len())
            .max_by_key(|&i| match &devices[i] {
                Value::List(l) => l.len(),
                _ => 0,
            })
            .ok_or_else(|| TraceError::NotASnapshot("'device_traces' is empty".into()))?,
    };
    let Value::List(entries) = &devices[idx] else {
        return Err(TraceError::NotASnapshot(format!(
            "device_traces[{idx}] is not a list"
        )));
    };
    let mut trace = Trace {
        device: idx,
        ..Default::default()
    };
    if let Some(Value::Dict(settings)) = get(top, "allocator_settings") {
        if let Some(Value::Bool(b)) = get(settings, "expandable_segments") {
            trace.expandable = Some(*b);
        }
        if let Some(Value::String(m)) = get(settings, "vram_ledger_mode") {
            trace.vram_ledger_mode = Some(m.clone());
        }
    }
    let mut streams = Streams::new();
    trace.events.reserve(entries.len());
    for (index, e) in entries.iter().enumerate() {
        let Value::Dict(fields) = e else {
            return Err(TraceError::NotASnapshot(format!(
                "trace entry {index} is not a dict"
            )));
        };
        let action = match get(fields, "action") {
            Some(Value::String(s)) => s,
            _ => {
                return Err(TraceError::NotASnapshot(format!(
                    "trace entry {index} has no 'action' string"
                )))
            }
        };
        let Some(action) = Action::parse(action) else {
            *trace.skipped.entry(action.clone()).or_default() += 1;
            continue;
        };
        let entry = Entry {
            fields,
            index,
            action,
        };
        let (tag, sleep) = entry.tag(&mut trace.unknown_tags)?;
        trace.events.push(Event {
            action,
            addr: entry.addr()?,
            size: entry.size()?,
            stream: streams.id(entry.stream()?, index)?,
            tag,
            sleep,
        });
    }
    let end = before::end_segments(top, idx, &mut streams)?;
    let (mut events, live) = before::live_before(
        &trace.events,
        end.as_deref(),
        trace.expandable == Some(true),
    );
    events.append(&mut trace.events);
    trace.events = events;
    streams.renumber(&mut trace.events);
    trace.before = live;
    trace.streams = streams.handles;
    Ok(trace)
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    fn snapshot(entries: Vec<Value>) -> Vec<u8> {
        let mut top = BTreeMap::new();
        top.insert(
            HashableValue::String("device_traces".into()),
            Value::List(vec![Value::List(entries)]),
        );
        serde_pickle::value_to_vec(&Value::Dict(top), Default::default()).unwrap()
    }

    pub(in crate::replay) fn entry(fields: &[(&str, Value)]) -> Value {
        Value::Dict(
            fields
                .iter()
                .map(|(k, v)| (HashableValue::String((*k).into()), v.clone()))
                .collect(),
        )
    }

    fn alloc(size: Value, stream: Value) -> Value {
        entry(&[
            ("action", Value::String("alloc".into())),
            ("addr", Value::I64(0x1000)),
            ("size", size),
            ("stream", stream),
        ])
    }

    #[test]
    fn rejects_what_is_not_a_snapshot() {
        let e = read_bytes(b"hello", None).unwrap_err();
        assert!(matches!(e, TraceError::NoPickleHeader), "{e}");
        let list = serde_pickle::to_vec(&vec![1, 2, 3], Default::default()).unwrap();
        let e = read_bytes(&list, None).unwrap_err();
        assert!(e.to_string().contains("device_traces"), "{e}");
        let mut d = BTreeMap::new();
        d.insert("segments", vec![1]);
        let e =
            read_bytes(&serde_pickle::to_vec(&d, Default::default()).unwrap(), None).unwrap_err();
        assert!(e.to_string().contains("no 'device_traces' list"), "{e}");
        let e = read_bytes(&[0x1f, 0x8b, 0, 1, 2], None).unwrap_err();
        assert!(matches!(e, TraceError::Gzip(_)), "{e}");
        assert!(std::error::Error::source(&e).is_some(), "the cause is kept");
    }

    #[test]
    fn sizes_addresses_and_types_are_checked() {
        let int = Value::I64;
        let cases = [
            (
                alloc(int(-4096), int(0)),
                "'size' is -4096, outside 0 to 2^60 - 1",
            ),
            (
                alloc(int(1 << 60), int(0)),
                "'size' is 1152921504606846976, outside",
            ),
            (
                alloc(Value::String("4096".into()), int(0)),
                "'size' is a string, not an integer",
            ),
            (
                alloc(Value::F64(1.0), int(0)),
                "'size' is a float, not an integer",
            ),
            (
                alloc(int(512), Value::String("s".into())),
                "'stream' is a string",
            ),
            (alloc(int(512), Value::List(vec![])), "'stream' is a list"),
        ];
        for (e, want) in cases {
            let err = read_bytes(&snapshot(vec![e]), None).unwrap_err();
            let msg = err.to_string();
            assert!(
                msg.starts_with("trace entry 0 (alloc): ") && msg.contains(want),
                "{msg}"
            );
            assert!(std::error::Error::source(&err).is_some(), "{msg}");
        }
        let negative_addr = entry(&[
            ("action", Value::String("free_requested".into())),
            ("addr", Value::I64(-1)),
            ("size", Value::I64(512)),
        ]);
        let e = read_bytes(&snapshot(vec![negative_addr]), None).unwrap_err();
        assert!(e.to_string().contains("'addr' is -1, outside"), "{e}");
        let meta = entry(&[
            ("action", Value::String("alloc".into())),
            ("addr", Value::I64(1)),
            ("size", Value::I64(512)),
            ("user_metadata", Value::I64(3)),
        ]);
        let e = read_bytes(&snapshot(vec![meta]), None).unwrap_err();
        assert!(
            e.to_string()
                .contains("'user_metadata' is an integer, not a string"),
            "{e}"
        );
        // An oom event records what was asked, however absurd: it is read, not refused.
        let oom = entry(&[
            ("action", Value::String("oom".into())),
            ("addr", Value::I64(1 << 40)),
            ("size", Value::I64(1 << 62)),
        ]);
        assert_eq!(
            read_bytes(&snapshot(vec![oom]), None).unwrap().events.len(),
            1
        );
    }

    #[test]
    fn streams_are_numbered_by_first_appearance() {
        let int = Value::I64;
        let handle = 0x7f12_3456_7000;
        let t = read_bytes(
            &snapshot(vec![
                alloc(int(512), int(handle)),
                alloc(int(512), int(0)),
                alloc(int(512), int(-8)),
                alloc(int(512), int(handle)),
                alloc(int(512), Value::None),
            ]),
            None,
        )
        .unwrap();
        let ids: Vec<u64> = t.events.iter().map(|e| e.stream).collect();
        assert_eq!(ids, [1, 0, 2, 1, 0]);
        assert_eq!(t.streams, [0, handle as u64, (-8i64) as u64]);
        let many: Vec<Value> = (1..=MAX_STREAMS as i64)
            .map(|s| alloc(int(512), int(s)))
            .collect();
        let e = read_bytes(&snapshot(many.clone()), None).unwrap_err();
        assert!(
            matches!(e, TraceError::TooManyStreams { entry, .. } if entry == MAX_STREAMS - 1),
            "{e}"
        );
        // The default stream is one of them.
        let t = read_bytes(&snapshot(many[..MAX_STREAMS - 1].to_vec()), None).unwrap();
        assert_eq!(t.streams.len(), MAX_STREAMS);
    }

    #[test]
    fn messages_are_one_line() {
        use crate::replay::error::one_line;
        assert_eq!(one_line("a\nb\rc\u{0}", 100), "a\\nb\\rc\\u{0}");
        assert_eq!(one_line(&"x".repeat(10), 4), "xxxx…");
    }
}
