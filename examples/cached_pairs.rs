//! A fixed number of cached allocation+free pairs on the simulated driver, for counting the
//! instructions one pair costs (`valgrind --tool=callgrind`, run with 0 and with N pairs and
//! take the difference): a figure that, unlike wall-clock time, does not move between runs.
//!
//!     cached_pairs [PAIRS] [SIZE] [MODE] [FREE]
//!
//! MODE is a segment mode's name (default native). FREE is `on` (default: `free_on` with the
//! allocation's stream, as PyTorch's allocator interface frees) or `any` (`free` with no
//! stream, on a stream of the last shard, where a search of the shards in order would be
//! longest).

use vram_ledger::driver::sim::SimDriver;
use vram_ledger::{Allocator, Config, SegmentMode, StreamId, Tag};

fn main() {
    let mut args = std::env::args().skip(1);
    let pairs: u64 = args.next().map_or(100_000, |a| a.parse().expect("PAIRS"));
    let size: u64 = args.next().map_or(4096, |a| a.parse().expect("SIZE"));
    let mode: SegmentMode = args
        .next()
        .map_or(SegmentMode::Native, |a| a.parse().expect("MODE"));
    let any = match args.next().as_deref() {
        None | Some("on") => false,
        Some("any") => true,
        Some(other) => panic!("FREE is `on` or `any`, not {other:?}"),
    };
    let a = Allocator::new(SimDriver::new(), Config::with_mode(mode)).expect("allocator");
    let s = if any {
        // Streams take shards in turn as they are first seen: the sixteenth takes the last.
        let last = (0..16).map(|k| a.shard_of(StreamId(k))).last();
        assert_eq!(last, Some(15), "stream 15 on the last shard");
        StreamId(15)
    } else {
        StreamId::DEFAULT
    };
    // Warm: the pairs below never reach the driver.
    let w = a.allocate(size, s).expect("warm-up allocation");
    a.free_on(w.ptr, s).expect("warm-up free");
    for _ in 0..pairs {
        let x = a
            .allocate_tagged(std::hint::black_box(size), s, Tag::Activation)
            .expect("cached allocation");
        if any {
            a.free(x.ptr).expect("cached free");
        } else {
            a.free_on(x.ptr, s).expect("cached free");
        }
    }
}
