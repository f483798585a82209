//! The budget contract on the simulated device: once profiling has computed a budget, the
//! process stays inside what it requested while it serves, whatever other tenants do, with
//! memory outside the allocator growing and driver calls failing; and out of memory then says
//! the contract was the limit.
//!
//! Every check reads this process's usage from the simulated device (what NVML would report),
//! not from the allocator's own figures.

#[path = "common/sim.rs"]
mod common;

use common::Rng;
use vram_ledger::driver::sim::{SimConfig, SimDevice, SimDriver};
use vram_ledger::driver::DriverCall;
use vram_ledger::profile::{ProfileOptions, Profiler};
use vram_ledger::units::{GIB, MIB};
use vram_ledger::{invariants, Allocator, Config, Error, OomCause, SegmentMode, StreamId, Tag};

const PROFILED: StreamId = StreamId(0x10);
const SIDE: StreamId = StreamId(0x20);

/// The stream of a serving step: every third on the side stream.
fn stream_at(step: usize) -> StreamId {
    if step.is_multiple_of(3) {
        SIDE
    } else {
        PROFILED
    }
}
/// A fifth of the default 80 GiB device.
const UTILIZATION: f64 = 0.2;

struct Engine {
    dev: std::sync::Arc<SimDevice>,
    alloc: Allocator<SimDriver>,
    requested: u64,
    _weights: u64,
    _kv: u64,
}

impl Engine {
    /// This process's usage, read from the device (one process per device here): not through
    /// the driver calls, which the fault tests make fail.
    fn usage(&self) -> u64 {
        self.dev.used() - self.dev.other_usage()
    }
}

/// Weights, a dummy pass at the largest shape (one 1 GiB activation and 200 MiB behind the
/// allocator's back, like cuBLAS), then the KV budget allocated as one block.
fn engine(dev: &std::sync::Arc<SimDevice>, mode: SegmentMode, contract: bool) -> Engine {
    let alloc = Allocator::new(dev.spawn_process().unwrap(), Config::with_mode(mode)).unwrap();
    let p = Profiler::new(&alloc).unwrap();
    let weights = alloc
        .allocate_tagged(3 * GIB, PROFILED, Tag::Weights)
        .unwrap();
    let r = p
        .profile(
            ProfileOptions {
                utilization: UTILIZATION,
                contract,
                ..Default::default()
            },
            || {
                let x = alloc
                    .allocate_tagged(GIB, PROFILED, Tag::Activation)
                    .unwrap();
                alloc.driver().alloc_external(200 * MIB).unwrap();
                alloc.free(x.ptr).unwrap();
            },
        )
        .unwrap();
    assert_eq!(alloc.cap(), contract.then_some(r.requested));
    let kv = alloc
        .allocate_tagged(r.kv_budget, PROFILED, Tag::KvCache)
        .unwrap();
    let e = Engine {
        dev: dev.clone(),
        requested: r.requested,
        alloc,
        _weights: weights.ptr,
        _kv: kv.ptr,
    };
    assert!(
        e.usage() <= e.requested,
        "{mode}: the KV cache fits the request"
    );
    e
}

/// Serving: shapes other than the profiled one and never more live bytes than its 1 GiB, on
/// the profiled stream and on another one (whose allocations cannot reuse the first stream's
/// cache). Returns each allocation's outcome and the peak usage seen; checks after every step
/// that the process is inside its request whenever the step made the allocator grow.
fn serve(e: &Engine, mut between: impl FnMut(usize)) -> (Vec<bool>, u64) {
    let mut outcomes = Vec::new();
    let mut peak = e.usage();
    let mut rng = Rng(0x9E37_79B9);
    for step in 0..40 {
        between(step);
        let (state, stream) = (rng.next(), stream_at(step));
        // Two live buffers of 150..400 MiB: at most 800 MiB live.
        let sizes = [
            150 * MIB + (state % 250) * MIB,
            100 * MIB + (state >> 20) % 300 * MIB,
        ];
        let mut live = Vec::new();
        for size in sizes {
            let reserved = e.alloc.snapshot().reserved_bytes.current;
            let r = e.alloc.allocate_tagged(size, stream, Tag::Activation);
            let grew = e.alloc.snapshot().reserved_bytes.current > reserved;
            if grew {
                assert!(
                    e.usage() <= e.requested,
                    "step {step}: the allocator grew the process to {} past its request {}",
                    e.usage(),
                    e.requested
                );
            }
            outcomes.push(r.is_ok());
            peak = peak.max(e.usage());
            match r {
                Ok(a) => live.push(a.ptr),
                Err(Error::OutOfMemory(report)) => {
                    assert!(matches!(report.cause, OomCause::Cap { .. }), "{report}");
                }
                Err(other) => panic!("step {step}: {other}"),
            }
        }
        for p in live {
            e.alloc.free(p).unwrap();
        }
        invariants::check(&dump(e)).unwrap();
    }
    (outcomes, peak)
}

fn dump(e: &Engine) -> invariants::StateDump {
    let mut d = e.alloc.dump();
    d.driver_held = Some(e.alloc.driver().held_bytes());
    d
}

#[test]
fn contract_holds_serving_to_the_request_in_every_mode() {
    for mode in SegmentMode::ALL {
        let dev = SimDevice::new(SimConfig::default());
        let e = engine(&dev, mode, true);
        let (outcomes, peak) = serve(&e, |_| {});
        assert!(
            outcomes.iter().all(|&ok| ok),
            "{mode}: serving within the profiled live bytes needs no more than the request"
        );
        assert!(
            peak <= e.requested,
            "{mode}: peak {peak} of {}",
            e.requested
        );
        assert!(
            peak * 1000 >= e.requested * 995,
            "{mode}: the budget uses the request (peak {peak} of {})",
            e.requested
        );
    }
}

#[test]
fn contract_opted_out_lets_serving_pass_the_request() {
    // The same engine and serving without the contract: the side stream's growth takes the
    // process past its request. This is what the contract prevents.
    let dev = SimDevice::new(SimConfig::default());
    let e = engine(&dev, SegmentMode::Native, false);
    assert_eq!(e.alloc.cap(), None);
    let mut worst = 0;
    let mut rng = Rng(0x9E37_79B9);
    for step in 0..40 {
        let (state, stream) = (rng.next(), stream_at(step));
        let x = e
            .alloc
            .allocate_tagged(150 * MIB + (state % 250) * MIB, stream, Tag::Activation)
            .unwrap();
        worst = worst.max(e.usage());
        e.alloc.free(x.ptr).unwrap();
    }
    assert!(worst > e.requested, "{worst} vs {}", e.requested);
    // Set explicitly, the cap holds the same process; lifted, it is gone.
    e.alloc.set_cap(Some(e.requested));
    assert_eq!(e.alloc.cap(), Some(e.requested));
    e.alloc.set_cap(None);
    assert_eq!(e.alloc.cap(), None);
}

#[test]
fn contract_counts_memory_outside_the_allocator_that_appears_later() {
    for mode in SegmentMode::ALL {
        let dev = SimDevice::new(SimConfig::default());
        let e = engine(&dev, mode, true);
        // Graphs instantiated after profiling take memory outside any allocator (less than
        // the 1 GiB profiled activation less the 800 MiB that serving holds at most).
        e.alloc.driver().alloc_external(128 * MIB).unwrap();
        let (outcomes, _) = serve(&e, |_| {});
        assert!(outcomes.iter().all(|&ok| ok), "{mode}");
        assert!(
            e.usage() <= e.requested,
            "{mode}: growth gave back cache to make room for the outside memory"
        );
    }
}

#[test]
fn contract_ignores_other_tenants() {
    let dev = SimDevice::new(SimConfig::default());
    let (quiet, _) = serve(&engine(&dev, SegmentMode::Remap, true), |_| {});
    // A tenant that takes and gives back 10 GiB between every step, on another device.
    let busy_dev = SimDevice::new(SimConfig::default());
    let e = engine(&busy_dev, SegmentMode::Remap, true);
    let (busy, _) = serve(&e, |step| {
        busy_dev.set_other_usage(if step % 2 == 0 { 10 * GIB } else { 0 })
    });
    assert_eq!(
        quiet, busy,
        "the contract is this process's, not the device's"
    );
}

#[test]
fn contract_out_of_memory_says_the_contract_was_the_limit() {
    for mode in SegmentMode::ALL {
        let dev = SimDevice::new(SimConfig::default());
        let e = engine(&dev, mode, true);
        let err = e
            .alloc
            .allocate_tagged(2 * GIB, SIDE, Tag::Activation)
            .unwrap_err();
        let Error::OutOfMemory(report) = &err else {
            panic!("{mode}: {err}")
        };
        assert_eq!(report.cap, Some(e.requested), "{mode}");
        let OomCause::Cap { wanted, cap, .. } = report.cause else {
            panic!("{mode}: {}", report.cause)
        };
        assert_eq!(cap, e.requested);
        assert!(wanted > 0, "{mode}");
        let text = err.to_string();
        assert!(text.contains("budget contract"), "{text}");
        // The device had room: only the contract said no.
        assert!(report.device_free > 2 * GIB, "{mode}");
        assert!(e.usage() <= e.requested);
        // Still working.
        let x = e
            .alloc
            .allocate_tagged(64 * MIB, SIDE, Tag::Activation)
            .unwrap();
        e.alloc.free(x.ptr).unwrap();
    }
}

#[test]
fn contract_holds_under_injected_driver_faults() {
    for mode in SegmentMode::ALL {
        for call in [
            DriverCall::ProcessUsage,
            DriverCall::AllocSegment,
            DriverCall::CreatePhysical,
            DriverCall::Map,
            DriverCall::Unmap,
            DriverCall::SyncStream,
        ] {
            let dev = SimDevice::new(SimConfig::default());
            let e = engine(&dev, mode, true);
            e.alloc.driver().fail_from(call, 3);
            let mut rng = Rng(0x2545_F491);
            for step in 0..30 {
                let (state, stream) = (rng.next(), stream_at(step));
                let size = 150 * MIB + (state % 250) * MIB;
                // Any outcome but a panic; the process stays inside its request either way.
                if let Ok(x) = e.alloc.allocate_tagged(size, stream, Tag::Activation) {
                    e.alloc.free(x.ptr).unwrap();
                }
                assert!(e.usage() <= e.requested, "{mode} {call} step {step}");
                invariants::check(&dump(&e)).unwrap();
            }
        }
    }
}

/// A decode graph captured after the largest pass (whose memory the capture's `empty_cache`
/// gave back, as `torch.cuda.graph` does) holds its pool for as long as it lives: the budget
/// must leave room for the pool and the largest pass again. Serving the profiled pass with the
/// graph alive is refused when the pool is left out of the budget.
#[test]
fn contract_graph_pools_are_part_of_the_budget() {
    const CAPTURE: StreamId = StreamId(0x30);
    let pool = vram_ledger::GraphPool(7, 0);
    for mode in SegmentMode::ALL {
        let dev = SimDevice::new(SimConfig::default());
        let alloc = Allocator::new(dev.spawn_process().unwrap(), Config::with_mode(mode)).unwrap();
        let p = Profiler::new(&alloc).unwrap();
        alloc
            .allocate_tagged(3 * GIB, PROFILED, Tag::Weights)
            .unwrap();
        let pass = |a: &Allocator<SimDriver>| -> vram_ledger::Result<()> {
            let x = a.allocate_tagged(GIB, PROFILED, Tag::Activation)?;
            let y = a.allocate_tagged(GIB / 4, PROFILED, Tag::Activation)?;
            a.free(x.ptr)?;
            a.free(y.ptr)
        };
        let r = p
            .profile(
                ProfileOptions {
                    utilization: UTILIZATION,
                    ..Default::default()
                },
                || {
                    pass(&alloc).unwrap();
                    alloc.empty_cache().unwrap();
                    dev.begin_capture(CAPTURE);
                    alloc.begin_graph_pool(pool, CAPTURE).unwrap();
                    let t = alloc
                        .allocate_tagged(96 * MIB, CAPTURE, Tag::Activation)
                        .unwrap();
                    alloc
                        .allocate_tagged(MIB, CAPTURE, Tag::Activation)
                        .unwrap(); // output
                    alloc.free(t.ptr).unwrap();
                    assert!(dev.end_capture(CAPTURE));
                    alloc.end_graph_pool(pool, CAPTURE).unwrap();
                },
            )
            .unwrap();
        assert!(r.graph_pools >= 97 * MIB, "{mode}: {}", r.graph_pools);
        alloc
            .allocate_tagged(r.kv_budget, PROFILED, Tag::KvCache)
            .unwrap();
        for _ in 0..3 {
            pass(&alloc).unwrap_or_else(|e| panic!("{mode}: the profiled pass was refused: {e}"));
        }
        let usage = dev.used() - dev.other_usage();
        assert!(usage <= r.requested, "{mode}");
    }
}
