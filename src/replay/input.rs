//! From a snapshot's bytes to the pickle's value, within bounds: the file and what its gzip
//! stream decompresses to are read up to [`Limits::max_bytes`] and refused past it (a small
//! gzip file can expand a thousandfold, and a path can name an endless device), and the pickle
//! is walked by the guard (`pickle_guard.rs`) before the decoder sees it.
//!
//! Invariant: no more than `max_bytes` (and one byte to tell) is ever held, read or
//! decompressed, whatever the input says about its own length.

use std::io::Read;
use std::path::Path;

use serde_pickle::Value;

pub use super::error::Reading;
use super::error::TraceError;
use super::pickle_guard;
use super::shared_pickle;
use crate::units::Bytes;

/// The most bytes read from a file, or decompressed from a gzip stream, by default: a
/// hundred times the largest trace shipped in `tests/data` (9 MB unpacked), and within what a
/// machine that decodes and replays it holds in memory.
pub const MAX_INPUT_BYTES: u64 = 1 << 30;

/// Bounds on what reading a snapshot may take in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// The most bytes read from the file, and the most its gzip stream may decompress to.
    pub max_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_bytes: MAX_INPUT_BYTES,
        }
    }
}

/// `r` read to its end, refused past `limit` bytes.
fn read_bounded(r: impl Read, limit: u64, reading: Reading) -> Result<Vec<u8>, std::io::Error> {
    let mut out = Vec::new();
    r.take(limit.saturating_add(1)).read_to_end(&mut out)?;
    if out.len() as u64 > limit {
        return Err(std::io::Error::other(TooLarge { reading, limit }));
    }
    Ok(out)
}

/// A read stopped at the limit: carried inside the reader's `io::Error` until it is told apart.
#[derive(Debug, thiserror::Error)]
#[error("{reading} {}", Bytes(*limit))]
struct TooLarge {
    reading: Reading,
    limit: u64,
}

/// The limit's refusal, if that is what `e` is.
fn too_large(e: &std::io::Error) -> Option<TraceError> {
    let t = e.get_ref()?.downcast_ref::<TooLarge>()?;
    Some(TraceError::TooLarge {
        reading: t.reading,
        limit: t.limit,
    })
}

/// The file at `path`, read within `limits`.
pub(super) fn read_file(path: &Path, limits: Limits) -> Result<Vec<u8>, TraceError> {
    let read =
        std::fs::File::open(path).and_then(|f| read_bounded(f, limits.max_bytes, Reading::File));
    read.map_err(|e| {
        too_large(&e).unwrap_or_else(|| TraceError::Io {
            path: path.display().to_string(),
            source: e,
        })
    })
}

/// The pickle's value in `bytes` (gzipped or not), within `limits`.
pub(super) fn decode(bytes: &[u8], limits: Limits) -> Result<Value, TraceError> {
    let raw;
    let bytes = if bytes.starts_with(&[0x1f, 0x8b]) {
        let gz = flate2::read::GzDecoder::new(bytes);
        raw = read_bounded(gz, limits.max_bytes, Reading::Gzip)
            .map_err(|e| too_large(&e).unwrap_or(TraceError::Gzip(e)))?;
        &raw[..]
    } else if bytes.len() as u64 > limits.max_bytes {
        return Err(TraceError::TooLarge {
            reading: Reading::File,
            limit: limits.max_bytes,
        });
    } else {
        bytes
    };
    if bytes.first() != Some(&0x80) {
        return Err(TraceError::NoPickleHeader);
    }
    pickle_guard::check(bytes)?;
    let opts = serde_pickle::DeOptions::new()
        .replace_unresolved_globals()
        .decode_strings();
    match serde_pickle::value_from_slice(bytes, opts) {
        // The guard refuses a value changed after it was fetched, so this is never a value that
        // holds itself: it is one with shared parts (`shared_pickle.rs`).
        Err(serde_pickle::Error::Syntax(serde_pickle::ErrorCode::Recursive)) => {
            shared_pickle::decode(bytes).map_err(TraceError::Shared)
        }
        other => other.map_err(TraceError::Decode),
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    fn gzip(data: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    #[test]
    fn what_is_read_and_decompressed_is_bounded() {
        let small = Limits { max_bytes: 1000 };
        let pickle = serde_pickle::to_vec(&vec![0u8; 2000], Default::default()).unwrap();
        let e = decode(&pickle, small).unwrap_err();
        assert!(
            matches!(
                e,
                TraceError::TooLarge {
                    reading: Reading::File,
                    limit: 1000
                }
            ),
            "{e}"
        );
        let e = decode(&gzip(&pickle), small).unwrap_err();
        assert!(
            matches!(
                e,
                TraceError::TooLarge {
                    reading: Reading::Gzip,
                    limit: 1000
                }
            ),
            "{e}"
        );
        assert_eq!(
            e.to_string(),
            "refused: the gzip stream decompresses to more than 1000 bytes"
        );
        // Exactly at the limit is fine.
        let exact = Limits {
            max_bytes: pickle.len() as u64,
        };
        assert!(decode(&gzip(&pickle), exact).is_ok());
        assert!(decode(&pickle, exact).is_ok());
        // A truncated stream is a gzip error, not a short pickle.
        let gz = gzip(&pickle);
        let e = decode(&gz[..gz.len() / 2], Limits::default()).unwrap_err();
        assert!(matches!(e, TraceError::Gzip(_)), "{e}");
        // An endless file stops at the limit.
        #[cfg(unix)]
        {
            let e = read_file(Path::new("/dev/zero"), small).unwrap_err();
            let file = TraceError::TooLarge {
                reading: Reading::File,
                limit: 1000,
            };
            assert_eq!(e.to_string(), file.to_string());
        }
    }
}
