//! Hostile snapshots (`tests/data/hostile/`, written by `scripts/hostile_corpus.py`, and a gzip
//! bomb written here): `vram-ledger replay` refuses each with one line on stderr and exit code
//! 2, within seconds and without a panic; the reader gives the typed error behind each line;
//! a trace whose stream handles are pointers, or have their high bits set, replays in every
//! mode; and a reader that goes away stops the command quietly.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[path = "common/sim.rs"]
mod common;

use vram_ledger::replay::input::Reading;
use vram_ledger::replay::trace::Action;
use vram_ledger::replay::{self, FieldError, Limits, Refusal, TraceError, MAX_INPUT_BYTES};
use vram_ledger::SegmentMode;

/// Each file of the corpus that must be refused, with what the refusal says.
#[rustfmt::skip]
const REFUSED: &[(&str, &str)] = &[
    ("deep-lists.pickle.gz", "refused: its values nest more than 100 deep"),
    ("deep-marks.pickle.gz", "refused: it opens more than 100 marks at once"),
    ("deep-memo-chain.pickle", "refused: its values nest more than 100 deep"),
    ("changed-after-fetch.pickle", "refused: it changes memo entry 0 after fetching it"),
    ("recursive-list.pickle", "refused: it changes memo entry 0 after fetching it"),
    ("memo-written-twice.pickle", "refused: it writes memo entry 0 twice"),
    ("memo-fan.pickle.gz", "refused: it would expand to at least"),
    ("huge-text-integer.pickle.gz", "refused: it holds an integer of more than 4300 digits"),
    ("huge-binary-integer.pickle.gz", "refused: it holds an integer of more than 4300 digits"),
    ("size-2-60.pickle", "(alloc): 'size' is 1152921504606846976, outside 0 to 2^60 - 1"),
    ("size-2-62.pickle", "(alloc): 'size' is 4611686018427387904, outside 0 to 2^60 - 1"),
    ("size-2-70.pickle", "(alloc): 'size' is 1180591620717411303424, outside"),
    ("size-negative.pickle", "(alloc): 'size' is -4096, outside 0 to 2^60 - 1"),
    ("size-a-string.pickle", "(alloc): 'size' is a string, not an integer"),
    ("addr-negative.pickle", "(free_requested): 'addr' is -1, outside 0 to 2^63 - 1"),
    ("addr-2-63.pickle", "(alloc): 'addr' is 9223372036854775808, outside 0 to 2^63 - 1"),
    ("addr-a-float.pickle", "(alloc): 'addr' is a float, not an integer"),
    ("stream-a-list.pickle", "(alloc): 'stream' is a list, not an integer"),
    ("too-many-streams.pickle.gz", "refused: trace entry 1023 names more streams than the 1024"),
    ("metadata-an-integer.pickle", "(alloc): 'user_metadata' is an integer, not a string"),
    ("action-missing.pickle", "trace entry 0 has no 'action' string"),
    ("entry-not-a-dict.pickle", "trace entry 0 is not a dict"),
    ("traces-not-a-list.pickle", "no 'device_traces' list"),
    ("no-devices.pickle", "'device_traces' is empty"),
    ("top-not-a-dict.pickle", "the pickle holds no dict"),
    ("segments-a-dict.pickle", "'segments' is a dict, not a list"),
    ("segment-block-negative.pickle", "segments[0]: 'address' is -1, outside 0 to 2^63 - 1"),
    (
        "segment-size-2-62.pickle",
        "segments[0]: 'total_size' is 4611686018427387904, outside 0 to 2^60 - 1",
    ),
    ("empty.pickle", "not a pickle: it does not start with a pickle protocol header"),
    ("truncated.pickle", "not a pickle: eval error at offset 97: EOF while parsing"),
    ("truncated.pickle.gz", "the gzip stream is corrupt"),
    ("gzip-of-gzip.pickle.gz", "not a pickle: it does not start with a pickle protocol header"),
    ("nan-set-member.pickle", "refused: it holds a float that is not a number (NaN)"),
    (
        "set-of-floats-and-integers.pickle",
        "refused: it holds both a set and a float, which the decoder cannot order",
    ),
    ("nan-dict-key.pickle", "refused: it holds a float that is not a number (NaN)"),
    ("nan-text-float.pickle", "refused: it holds a float that is not a number (NaN)"),
];

/// Files of the corpus that replay.
const REPLAYED: [&str; 2] = ["pointer-stream.pickle", "high-bit-streams.pickle"];

/// The longest any file may take, refused or replayed (they take milliseconds; the bomb under
/// a second).
const DEADLINE: Duration = Duration::from_secs(30);

fn hostile(name: &str) -> PathBuf {
    Path::new("tests/data/hostile").join(name)
}

struct Run {
    code: Option<i32>,
    stderr: String,
}

/// `vram-ledger replay ARGS`, killed past the deadline.
fn replay_cli(args: &[&std::ffi::OsStr]) -> Run {
    let exe = std::env::var("VRAM_LEDGER_BIN")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_vram-ledger").to_string());
    let mut child = Command::new(exe)
        .arg("replay")
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Read stderr beside the wait, so that a chatty child cannot block on a full pipe.
    let mut pipe = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut pipe, &mut s).map(|_| s)
    });
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > DEADLINE {
            child.kill().unwrap();
            panic!("{args:?} ran past {DEADLINE:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Run {
        code: status.code(),
        stderr: reader.join().unwrap().unwrap(),
    }
}

/// A refusal as the command line must give it: exit code 2, one line, no panic.
#[track_caller]
fn assert_refused(run: &Run, what: &str, says: &str) {
    let err = &run.stderr;
    assert_eq!(run.code, Some(2), "{what}: {err}");
    assert!(!err.contains("panicked"), "{what}: {err}");
    assert_eq!(err.lines().count(), 1, "{what}: one line, got {err:?}");
    assert!(err.starts_with("vram-ledger: "), "{what}: {err}");
    assert!(err.contains(says), "{what}: {err:?} should say {says:?}");
}

#[test]
fn every_hostile_file_is_refused_in_one_line_with_code_2() {
    for &(name, says) in REFUSED {
        let path = hostile(name);
        let run = replay_cli(&[path.as_os_str()]);
        assert_refused(&run, name, says);
        // The reader's own message is the line.
        let e = replay::read_file(&path, None).unwrap_err();
        assert_eq!(run.stderr.trim_end(), format!("vram-ledger: {e}"), "{name}");
    }
    let listed: Vec<&str> = REFUSED.iter().map(|r| r.0).chain(REPLAYED).collect();
    for f in std::fs::read_dir("tests/data/hostile").unwrap() {
        let name = f.unwrap().file_name().into_string().unwrap();
        assert!(listed.contains(&name.as_str()), "{name} is not tested");
    }
}

#[test]
fn the_reader_gives_the_typed_error_behind_each_refusal() {
    let read = |name: &str| replay::read_file(&hostile(name), None).unwrap_err();
    for name in ["deep-lists.pickle.gz", "deep-memo-chain.pickle"] {
        assert!(
            matches!(read(name), TraceError::Refused(Refusal::TooDeep)),
            "{name}"
        );
    }
    assert!(matches!(
        read("deep-marks.pickle.gz"),
        TraceError::Refused(Refusal::TooManyMarks)
    ));
    for name in [
        "nan-set-member.pickle",
        "nan-dict-key.pickle",
        "nan-text-float.pickle",
    ] {
        assert!(
            matches!(read(name), TraceError::Refused(Refusal::NotANumber)),
            "{name}"
        );
    }
    assert!(matches!(
        read("set-of-floats-and-integers.pickle"),
        TraceError::Refused(Refusal::SetBesideFloat)
    ));
    for name in ["changed-after-fetch.pickle", "recursive-list.pickle"] {
        let e = read(name);
        assert!(
            matches!(e, TraceError::Refused(Refusal::ChangedAfterFetch(0))),
            "{name}: {e}"
        );
    }
    assert!(matches!(
        read("memo-fan.pickle.gz"),
        TraceError::Refused(Refusal::TooMany { .. })
    ));
    for name in [
        "huge-text-integer.pickle.gz",
        "huge-binary-integer.pickle.gz",
    ] {
        assert!(
            matches!(read(name), TraceError::Refused(Refusal::HugeInteger)),
            "{name}"
        );
    }
    let field = |name: &str| match read(name) {
        TraceError::Field { field, problem, .. } => (field, problem),
        e => panic!("{name}: {e}"),
    };
    assert_eq!(
        field("size-negative.pickle"),
        (
            "size",
            FieldError::OutOfRange {
                value: -4096,
                range: "0 to 2^60 - 1"
            }
        )
    );
    assert_eq!(
        field("size-a-string.pickle"),
        ("size", FieldError::NotAnInteger("a string"))
    );
    assert_eq!(
        field("stream-a-list.pickle"),
        ("stream", FieldError::NotAnInteger("a list"))
    );
    assert!(matches!(read("truncated.pickle.gz"), TraceError::Gzip(_)));
    assert!(matches!(read("truncated.pickle"), TraceError::Decode(_)));
    assert!(matches!(read("empty.pickle"), TraceError::NoPickleHeader));
    // The 600 KB pickle of 300,000 nested lists, not gzipped, that overflowed the stack.
    let n = 300_000;
    let deep = [&[0x80, 4][..], &b"]".repeat(n), &b"a".repeat(n - 1), b"."].concat();
    assert!(deep.len() > 600_000);
    let e = replay::trace::read_bytes(&deep, None).unwrap_err();
    assert!(matches!(e, TraceError::Refused(Refusal::TooDeep)), "{e}");
}

/// A gzip stream of `gib` GiB of zeros (a few kilobytes per GiB): blocks of zeros compressed
/// once, each ending on a full flush so that the same bytes can follow themselves.
fn gzip_bomb(gib: usize) -> Vec<u8> {
    let mut deflate = flate2::Compress::new(flate2::Compression::best(), false);
    let zeros = vec![0u8; 1 << 20];
    let mut block = Vec::with_capacity(1 << 16);
    deflate
        .compress_vec(&zeros, &mut block, flate2::FlushCompress::Full)
        .unwrap();
    assert_eq!(deflate.total_in(), zeros.len() as u64);
    let mut gz = vec![0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 2, 0xff];
    for _ in 0..gib << 10 {
        gz.extend_from_slice(&block);
    }
    // The final empty block; the trailer's checksum is never reached.
    gz.extend_from_slice(&[3, 0]);
    gz.extend_from_slice(&[0; 8]);
    gz
}

#[test]
fn a_gzip_bomb_stops_at_the_limit() {
    let bomb = gzip_bomb(2);
    assert!(bomb.len() < 4 << 20, "{} bytes on disk", bomb.len());
    // Through the reader with a small limit, then through the command line with the default.
    let small = Limits { max_bytes: 1 << 20 };
    let e = replay::trace::read_bytes_with(&bomb, None, small).unwrap_err();
    assert!(
        matches!(e, TraceError::TooLarge { reading: Reading::Gzip, limit } if limit == 1 << 20),
        "{e}"
    );
    let path = std::env::temp_dir().join(format!("vram-ledger-bomb-{}.gz", std::process::id()));
    std::fs::File::create(&path)
        .unwrap()
        .write_all(&bomb)
        .unwrap();
    let start = Instant::now();
    let run = replay_cli(&[path.as_os_str()]);
    let took = start.elapsed();
    let limited = replay_cli(&[path.as_os_str(), "--max-input".as_ref(), "64M".as_ref()]);
    let _ = std::fs::remove_file(&path);
    assert_eq!(MAX_INPUT_BYTES, 1 << 30);
    assert_refused(
        &run,
        "bomb",
        "refused: the gzip stream decompresses to more than 1.00 GiB",
    );
    assert_refused(&limited, "bomb", "decompresses to more than 64.00 MiB");
    eprintln!("a 2 GiB bomb of {} bytes refused in {took:?}", bomb.len());
}

#[test]
fn streams_recorded_as_pointers_or_with_high_bits_replay_in_every_mode() {
    for name in REPLAYED {
        let path = hostile(name);
        let t = replay::read_file(&path, None).unwrap();
        assert!(t.streams.len() > 1, "{name}");
        let dense: Vec<u64> = (0..t.streams.len() as u64).collect();
        let mut used: Vec<u64> = t.events.iter().map(|e| e.stream).collect();
        used.sort_unstable();
        used.dedup();
        assert!(used.iter().all(|s| dense.contains(s)), "{name}: {used:?}");
        for mode in SegmentMode::ALL {
            let r = common::replay_in(&t, mode);
            assert_eq!((r.ooms, r.held_after), (0, 0), "{name} {mode}");
            assert!(
                r.peak_reserved >= r.peak_live && r.peak_live > 0,
                "{name} {mode}"
            );
            let allocs = t
                .events
                .iter()
                .filter(|e| e.action == Action::Alloc)
                .count();
            assert_eq!(r.allocations as usize, allocs, "{name} {mode}");
        }
        // `replay FILE` compares every mode.
        let run = replay_cli(&[path.as_os_str()]);
        assert_eq!(run.code, Some(0), "{name}: {}", run.stderr);
        assert!(run.stderr.is_empty(), "{name}: {}", run.stderr);
    }
    let t = replay::read_file(&hostile("high-bit-streams.pickle"), None).unwrap();
    assert_eq!(
        t.streams,
        [
            0,
            1 << 59,
            (1 << 63) | 0x10,
            u64::MAX,
            -8i64 as u64,
            0x7000_0000_0000,
            0x7f12_3456_7000
        ]
    );
}

/// A reader that has gone (`replay FILE | head`) stops the command as it stops `cat`, by
/// SIGPIPE, with nothing on stderr: no panic, no backtrace. The pipe's read end is closed
/// before the command starts, so its first line meets a closed pipe whatever the timing.
#[test]
fn replay_into_a_closed_pipe_stops_quietly() {
    use std::os::unix::process::ExitStatusExt;
    let exe = std::env::var("VRAM_LEDGER_BIN")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_vram-ledger").to_string());
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = Command::new(exe)
        .args([
            "replay",
            "tests/data/streams-train-0.pickle.gz",
            "--mode",
            "remap",
        ])
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGPIPE),
        "{:?}: {err}",
        out.status
    );
    assert!(err.is_empty(), "{err}");
}
