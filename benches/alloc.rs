//! Host-side cost of the allocator's hot path on the simulated driver: cached alloc+free
//! pairs, mixed sizes, and multi-thread throughput on distinct streams.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

#[path = "common/workload.rs"]
mod workload;

use workload::{mixed_sizes, pairs_on_threads};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use vram_ledger::driver::sim::SimDriver;
use vram_ledger::units::MIB;
use vram_ledger::{Allocator, Config, SegmentMode, StreamId, Tag};

fn allocator(mode: SegmentMode) -> Allocator<SimDriver> {
    Allocator::new(
        SimDriver::new(),
        Config {
            mode,
            ..Default::default()
        },
    )
    .unwrap()
}

fn cached_pair(c: &mut Criterion) {
    let mut g = c.benchmark_group("cached_pair");
    for mode in [
        SegmentMode::Native,
        SegmentMode::Expandable,
        SegmentMode::Remap,
    ] {
        for (name, size) in [("512B", 512u64), ("1MiB", MIB), ("20MiB", 20 * MIB)] {
            let a = allocator(mode);
            let s = StreamId::DEFAULT;
            // Warm the cache: the pair below never reaches the driver.
            let w = a.allocate(size, s).unwrap();
            a.free(w.ptr).unwrap();
            g.throughput(Throughput::Elements(1));
            g.bench_function(BenchmarkId::new(format!("{mode:?}"), name), |b| {
                b.iter(|| {
                    let x = a
                        .allocate_tagged(black_box(size), s, Tag::Activation)
                        .unwrap();
                    a.free_on(x.ptr, s).unwrap();
                })
            });
        }
    }
    g.finish();
}

fn mixed(c: &mut Criterion) {
    let sizes = mixed_sizes();
    let mut g = c.benchmark_group("mixed64");
    g.throughput(Throughput::Elements(64));
    for mode in [
        SegmentMode::Native,
        SegmentMode::Expandable,
        SegmentMode::Remap,
    ] {
        let a = allocator(mode);
        let s = StreamId::DEFAULT;
        let mut ptrs = Vec::with_capacity(64);
        // Warm up so every size is served from the cache.
        for _ in 0..2 {
            ptrs.extend(sizes.iter().map(|&n| a.allocate(n, s).unwrap().ptr));
            for p in ptrs.drain(..) {
                a.free_on(p, s).unwrap();
            }
        }
        g.bench_function(format!("{mode:?}"), |b| {
            b.iter(|| {
                ptrs.extend(
                    sizes
                        .iter()
                        .map(|&n| a.allocate(black_box(n), s).unwrap().ptr),
                );
                // Free odd positions first, then even: frees interleave with merges.
                for i in (1..64).step_by(2).chain((0..64).step_by(2)) {
                    a.free_on(ptrs[i], s).unwrap();
                }
                ptrs.clear();
            })
        });
    }
    g.finish();
}

fn threads(c: &mut Criterion) {
    let mut g = c.benchmark_group("threads");
    g.measurement_time(Duration::from_secs(6)).sample_size(10);
    const PAIRS: u64 = 200_000;
    for n in [1usize, 2, 4, 8] {
        let a = Arc::new(allocator(SegmentMode::Native));
        g.throughput(Throughput::Elements(PAIRS * n as u64));
        g.bench_function(BenchmarkId::from_parameter(n), |b| {
            let streams: Vec<StreamId> = (0..n)
                .map(|t| StreamId(0x7f00_0000 + 0x100 * t as u64))
                .collect();
            b.iter_custom(|iters| {
                (0..iters)
                    .map(|_| pairs_on_threads(&a, &streams, PAIRS))
                    .sum()
            })
        });
    }
    g.finish();
}

/// What `free(ptr)` without a stream costs: it searches the shards in order, so a pointer of the
/// first shard is found at once and one of the sixteenth after fifteen misses. Beside it, what
/// routing every pointer through a concurrent map (dashmap) would add to every allocation and
/// free, `free_on` included: one insert and one remove per pair.
fn free_without_stream(c: &mut Criterion) {
    let mut g = c.benchmark_group("free_without_stream");
    let a = allocator(SegmentMode::Native);
    // The stream table deals the first sixteen streams to shards 0..16 in order.
    let streams: Vec<StreamId> = (0..16).map(|i| StreamId(0x1000 + i)).collect();
    for &s in &streams {
        let w = a.allocate(4096, s).unwrap();
        a.free_on(w.ptr, s).unwrap();
    }
    for (name, s) in [("first_shard", streams[0]), ("last_shard", streams[15])] {
        assert_eq!(a.shard_of(s), if name == "first_shard" { 0 } else { 15 });
        g.bench_function(BenchmarkId::new("free_on", name), |b| {
            b.iter(|| {
                let x = a.allocate(black_box(4096), s).unwrap();
                a.free_on(x.ptr, s).unwrap();
            })
        });
        g.bench_function(BenchmarkId::new("free", name), |b| {
            b.iter(|| {
                let x = a.allocate(black_box(4096), s).unwrap();
                a.free(x.ptr).unwrap();
            })
        });
    }
    let routes: dashmap::DashMap<u64, u8> = dashmap::DashMap::new();
    let mut ptr = 0x7f00_0000_0000u64;
    g.bench_function("dashmap_insert_remove", |b| {
        b.iter(|| {
            ptr = ptr.wrapping_add(512);
            routes.insert(black_box(ptr), 3);
            black_box(routes.remove(&ptr));
        })
    });
    g.finish();
}

criterion_group!(benches, cached_pair, mixed, threads, free_without_stream);
criterion_main!(benches);
