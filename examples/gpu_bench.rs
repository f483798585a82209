//! Host-side latency of allocation on a real GPU, all in one process: vram-ledger's cached
//! pair, raw cuMemAlloc/cuMemFree, and cuMemAllocAsync/cuMemFreeAsync from a pool whose
//! release threshold is raised (memory stays cached in the pool); plus vram-ledger's
//! throughput with 1, 2, 4, 8 threads on distinct streams. Prints one JSON object per line.

use std::sync::Arc;
use std::time::Instant;

#[path = "../benches/common/workload.rs"]
mod workload;

use workload::{mixed_sizes, pairs_on_threads};

use cudarc::driver::sys;
use cudarc::driver::CudaContext;
use vram_ledger::devices::stream_id;
use vram_ledger::driver::cuda::probe;
use vram_ledger::driver::cuda::CudaDriver;
use vram_ledger::{Allocator, Config, StreamId, Tag};

fn ns_per(iters: u64, f: impl FnMut()) -> f64 {
    let mut f = f;
    let t = Instant::now();
    for _ in 0..iters {
        f();
    }
    t.elapsed().as_nanos() as f64 / iters as f64
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if let Some(why) = probe().skip_reason()? {
        println!("gpu_bench: skipped: {why}");
        return Ok(());
    }
    let ctx = CudaContext::new(0)?;
    let stream = ctx.new_stream()?;
    let cu_stream = stream.cu_stream();
    let a = Arc::new(Allocator::new(CudaDriver::new(0)?, Config::default())?);
    let s = stream_id(&stream);
    let sizes = [("512B", 512u64), ("1MiB", 1 << 20), ("20MiB", 20 << 20)];
    for (name, n) in sizes {
        let w = a.allocate(n, s)?;
        a.free_on(w.ptr, s)?;
        let ns = ns_per(2_000_000, || {
            let x = a
                .allocate_tagged(std::hint::black_box(n), s, Tag::Activation)
                .unwrap();
            a.free_on(x.ptr, s).unwrap();
        });
        println!(
            "{{\"what\":\"vram-ledger cached pair\",\"size\":\"{name}\",\"ns_per_pair\":{ns:.1}}}"
        );
    }
    // `free` with no stream, on a stream of the last shard (streams take shards in turn as
    // they are first seen): the address table names the shard, where a search in order would
    // lock all sixteen.
    let streams = (0..16)
        .map(|_| ctx.new_stream())
        .collect::<Result<Vec<_>, _>>()?;
    let shards = streams
        .iter()
        .map(|st| (a.shard_of(stream_id(st)), stream_id(st)));
    let (shard, far) = shards.max_by_key(|&(i, _)| i).expect("sixteen streams");
    let w = a.allocate(1 << 20, far)?;
    a.free(w.ptr)?;
    let ns = ns_per(2_000_000, || {
        let x = a
            .allocate_tagged(std::hint::black_box(1 << 20), far, Tag::Activation)
            .unwrap();
        a.free(x.ptr).unwrap();
    });
    println!(
        "{{\"what\":\"vram-ledger cached pair, free without a stream\",\"size\":\"1MiB\",\"shard\":{shard},\"ns_per_pair\":{ns:.1}}}"
    );
    let sizes64 = mixed_sizes();
    let mut ptrs = Vec::with_capacity(64);
    let round = |ptrs: &mut Vec<u64>| {
        ptrs.extend(sizes64.iter().map(|&n| a.allocate(n, s).unwrap().ptr));
        for i in (1..64).step_by(2).chain((0..64).step_by(2)) {
            a.free_on(ptrs[i], s).unwrap();
        }
        ptrs.clear();
    };
    round(&mut ptrs);
    let ns = ns_per(50_000, || round(&mut ptrs)) / 64.0;
    println!("{{\"what\":\"vram-ledger mixed 64\",\"ns_per_pair\":{ns:.1}}}");

    // Raw driver allocation.
    for (name, n) in sizes {
        let iters = if n >= 20 << 20 { 500 } else { 2000 };
        let ns = ns_per(iters, || unsafe {
            let mut p = 0;
            sys::cuMemAlloc_v2(&mut p, n as usize).result().unwrap();
            sys::cuMemFree_v2(p).result().unwrap();
        });
        println!(
            "{{\"what\":\"cuMemAlloc+cuMemFree\",\"size\":\"{name}\",\"ns_per_pair\":{ns:.1}}}"
        );
    }

    // Stream-ordered pool with the release threshold raised.
    let pool = unsafe {
        let mut props: sys::CUmemPoolProps = std::mem::zeroed();
        props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        props.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        props.location.id = 0;
        let mut pool = std::ptr::null_mut();
        sys::cuMemPoolCreate(&mut pool, &props).result()?;
        let mut threshold = u64::MAX;
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut threshold as *mut u64 as *mut _,
        )
        .result()?;
        pool
    };
    for (name, n) in sizes {
        let pair = || unsafe {
            let mut p = 0;
            sys::cuMemAllocFromPoolAsync(&mut p, n as usize, pool, cu_stream)
                .result()
                .unwrap();
            sys::cuMemFreeAsync(p, cu_stream).result().unwrap();
        };
        ns_per(1000, pair);
        let ns = ns_per(200_000, pair);
        stream.synchronize()?;
        println!("{{\"what\":\"cuMemAllocAsync+cuMemFreeAsync (pool)\",\"size\":\"{name}\",\"ns_per_pair\":{ns:.1}}}");
    }

    // Throughput with threads on distinct streams.
    let mut base = 0.0;
    for threads in [1usize, 2, 4, 8] {
        const PAIRS: u64 = 2_000_000;
        // Keep the streams alive: a destroyed stream's handle is reused by the next one, and
        // every thread would land on the same stream.
        let live: Vec<_> = (0..threads).map(|_| ctx.new_stream().unwrap()).collect();
        let streams: Vec<StreamId> = live.iter().map(|s| stream_id(s)).collect();
        let elapsed = pairs_on_threads(&a, &streams, PAIRS);
        let mpairs = (PAIRS * threads as u64) as f64 / elapsed.as_secs_f64() / 1e6;
        if threads == 1 {
            base = mpairs;
        }
        println!("{{\"what\":\"vram-ledger threads\",\"threads\":{threads},\"mpairs_per_s\":{mpairs:.2},\"speedup\":{:.2}}}", mpairs / base);
        drop(live);
    }
    a.empty_cache()?;
    Ok(())
}
