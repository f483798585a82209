//! Workloads measured both on the simulated driver (`benches/alloc.rs`) and on a real GPU
//! (`examples/gpu_bench.rs`), written once so that the two measure the same thing.

use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use vram_ledger::{Allocator, Driver, StreamId, Tag};

/// 64 sizes from 512 B to 8 MiB, allocated together then freed in another order.
pub fn mixed_sizes() -> Vec<u64> {
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    (0..64)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let exp = 9 + state % 15; // 2^9 .. 2^23
            (1u64 << exp) + (state >> 40) % (1u64 << exp)
        })
        .collect()
}

/// Wall time of `pairs` cached 4 KiB allocate+free pairs on each of `streams`, a thread per
/// stream, all started together; each thread's first pair, before the start, caches its block.
pub fn pairs_on_threads<D: Driver>(
    a: &Arc<Allocator<D>>,
    streams: &[StreamId],
    pairs: u64,
) -> Duration {
    let barrier = Arc::new(Barrier::new(streams.len() + 1));
    let hs: Vec<_> = streams
        .iter()
        .map(|&s| {
            let (a, barrier) = (a.clone(), barrier.clone());
            std::thread::spawn(move || {
                let w = a.allocate(4096, s).unwrap();
                a.free_on(w.ptr, s).unwrap();
                barrier.wait();
                for _ in 0..pairs {
                    let x = a
                        .allocate_tagged(black_box(4096), s, Tag::Activation)
                        .unwrap();
                    a.free_on(x.ptr, s).unwrap();
                }
            })
        })
        .collect();
    barrier.wait();
    let start = Instant::now();
    for h in hs {
        h.join().unwrap();
    }
    start.elapsed()
}
