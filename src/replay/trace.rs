//! Reading PyTorch memory snapshots (`torch.cuda.memory._dump_snapshot`): a pickle, gzipped
//! or not, whose `device_traces` lists every allocator event of each device. Any byte string
//! is either read or refused with a [`TraceError`], whose message is one line.
//!
//! Invariant: a [`Trace`] holds only the events the replay acts on, in file order; anything
//! else in the file is counted, never silently dropped (see `skipped`, `unknown_tags`).

use std::collections::BTreeMap;
use std::path::Path;

use serde_pickle::{HashableValue, Value};
use thiserror::Error;

use super::input::{self, Limits, Reading};
use super::pickle_guard::Refusal;
pub use crate::allocator::Action;
use crate::tag::Tag;
use crate::units::Bytes;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event {
    pub action: Action,
    pub addr: u64,
    pub size: u64,
    pub stream: u64,
    pub tag: Tag,
}

/// The events of one device.
#[derive(Clone, Debug, Default)]
pub struct Trace {
    pub device: usize,
    pub events: Vec<Event>,
    /// Metadata names that are not tags, with how many events carried each (replayed as
    /// untracked).
    pub unknown_tags: BTreeMap<String, u64>,
    /// Events of actions the replay does not act on (e.g. `snapshot`), by action.
    pub skipped: BTreeMap<String, u64>,
    /// Whether the recording allocator used expandable segments.
    pub expandable: Option<bool>,
    /// The mode, when vram-ledger recorded the trace (its snapshots say so).
    pub vram_ledger_mode: Option<String>,
}

#[derive(Debug, Error)]
pub enum TraceError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("refused: {reading} {}", Bytes(*limit))]
    TooLarge { reading: Reading, limit: u64 },
    #[error("the gzip stream is corrupt: {0}")]
    Gzip(#[source] std::io::Error),
    #[error("not a pickle: it does not start with a pickle protocol header")]
    NoPickleHeader,
    #[error("refused: {0}")]
    Refused(#[from] Refusal),
    // The decoder's messages can quote a whole decoded value: the start is enough.
    #[error("not a pickle: {}", one_line(&.0.to_string(), 300))]
    Decode(#[source] serde_pickle::Error),
    #[error("not a PyTorch memory snapshot: {0} (expected a dict with a 'device_traces' list, as written by torch.cuda.memory._dump_snapshot)")]
    NotASnapshot(String),
    #[error("device {asked} has no trace; the snapshot has {available} device(s)")]
    NoSuchDevice { asked: usize, available: usize },
}

/// `text` on one line (control characters escaped), cut after `max` bytes or so.
pub(crate) fn one_line(text: &str, max: usize) -> String {
    let mut out = String::new();
    for c in text.chars() {
        if out.len() >= max {
            out.push('…');
            break;
        }
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
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

fn get<'a>(d: &'a BTreeMap<HashableValue, Value>, key: &str) -> Option<&'a Value> {
    d.get(&HashableValue::String(key.to_owned()))
}

fn as_u64(v: &Value) -> Option<u64> {
    match v {
        Value::I64(i) => u64::try_from(*i).ok(),
        Value::Int(b) => u64::try_from(b).ok(),
        _ => None,
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
    trace.events.reserve(entries.len());
    for (i, e) in entries.iter().enumerate() {
        let Value::Dict(e) = e else {
            return Err(TraceError::NotASnapshot(format!(
                "trace entry {i} is not a dict"
            )));
        };
        let action = match get(e, "action") {
            Some(Value::String(s)) => s,
            _ => {
                return Err(TraceError::NotASnapshot(format!(
                    "trace entry {i} has no 'action' string"
                )))
            }
        };
        let Some(action_kind) = Action::parse(action) else {
            *trace.skipped.entry(action.clone()).or_default() += 1;
            continue;
        };
        let field = |k: &str| {
            get(e, k).and_then(as_u64).ok_or_else(|| {
                TraceError::NotASnapshot(format!("trace entry {i} ({action}) has no integer '{k}'"))
            })
        };
        let tag = match get(e, "user_metadata") {
            Some(Value::String(s)) if !s.is_empty() => s.parse::<Tag>().unwrap_or_else(|_| {
                *trace.unknown_tags.entry(s.clone()).or_default() += 1;
                Tag::Untracked
            }),
            _ => Tag::Untracked,
        };
        trace.events.push(Event {
            action: action_kind,
            addr: field("addr")?,
            size: field("size")?,
            stream: get(e, "stream").and_then(as_u64).unwrap_or(0),
            tag,
        });
    }
    Ok(trace)
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn messages_are_one_line() {
        assert_eq!(one_line("a\nb\rc\u{0}", 100), "a\\nb\\rc\\u{0}");
        assert_eq!(one_line(&"x".repeat(10), 4), "xxxx…");
    }
}
