//! Why a snapshot was not read: every refusal of the reader, as one-line messages that keep
//! their cause.

use thiserror::Error;

use super::pickle_guard::Refusal;
use super::shared_pickle::SharedPickleError;
use crate::units::Bytes;

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
    #[error("not a pickle: it does not start with a pickle protocol header (protocol 2 or later, as PyTorch writes)")]
    NoPickleHeader,
    #[error("refused: {0}")]
    Refused(#[from] Refusal),
    // The decoder's messages can quote a whole decoded value: the start is enough.
    #[error("not a pickle: {}", one_line(&.0.to_string(), 300))]
    Decode(#[source] serde_pickle::Error),
    #[error("not a pickle of plain data: {0}")]
    Shared(#[source] SharedPickleError),
    #[error("not a PyTorch memory snapshot: {0} (expected a dict with a 'device_traces' list, as written by torch.cuda.memory._dump_snapshot)")]
    NotASnapshot(String),
    #[error("trace entry {entry} ({action}): '{field}' {problem}")]
    Field {
        entry: usize,
        action: &'static str,
        field: &'static str,
        #[source]
        problem: FieldError,
    },
    #[error(
        "refused: trace entry {entry} names more streams than the {max} a trace may name (the \
         default stream among them)"
    )]
    TooManyStreams { entry: usize, max: usize },
    #[error("segments[{index}]: '{field}' {problem}")]
    Segment {
        index: usize,
        field: &'static str,
        #[source]
        problem: FieldError,
    },
    #[error("device {asked} has no trace; the snapshot has {available} device(s)")]
    NoSuchDevice { asked: usize, available: usize },
}

/// What is wrong with a field of a trace entry.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum FieldError {
    #[error("is missing")]
    Missing,
    #[error("is {0}, not an integer")]
    NotAnInteger(&'static str),
    #[error("is {0}, not a string")]
    NotAString(&'static str),
    #[error("is {0}, not a dict")]
    NotADict(&'static str),
    #[error("is {0}, not a list")]
    NotAList(&'static str),
    #[error("names a stream past the {0} a trace may name")]
    TooManyStreams(usize),
    #[error("is an integer of more than 128 bits")]
    Huge,
    #[error("is {value}, outside {range}")]
    OutOfRange { value: i128, range: &'static str },
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

/// What was being read when the limit was passed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reading {
    File,
    Gzip,
}

impl std::fmt::Display for Reading {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Reading::File => "the file is larger than",
            Reading::Gzip => "the gzip stream decompresses to more than",
        })
    }
}
