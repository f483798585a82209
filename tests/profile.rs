//! Profiling on the simulated device: exact wherever our method is exact, and vLLM's
//! device-wide method shown wrong by other processes' bytes.

use std::sync::Arc;

#[path = "common/sim.rs"]
mod common;

use common::{fresh_segment, sim};
use vram_ledger::driver::sim::{SimConfig, SimDevice, SimDriver};
use vram_ledger::driver::Driver;
use vram_ledger::profile::{
    Margin, ProfileError, ProfileOptions, ProfileResult, Profiler, UsageSource,
};
use vram_ledger::units::{GIB, MIB};
use vram_ledger::{Allocator, Config, SegmentMode, StreamId, Tag};

const S: StreamId = StreamId::DEFAULT;

fn opts(utilization: f64) -> ProfileOptions {
    ProfileOptions {
        utilization,
        ..Default::default()
    }
}

// The expectations below are computed from each scenario's inputs (the bytes the test
// allocates, the device's capacity and context overhead, other tenants' bytes, the utilization)
// with PyTorch's sizing rules written out here (and in `tests/common/sim.rs`), never from the
// figures being checked.

/// The budget is aligned down to 2 MiB (a large segment's granule).
const ALIGN: u64 = 2 * MIB;

/// A request rounded to the allocator's block size: 512 B multiples, at least 512 B.
fn block(bytes: u64) -> u64 {
    bytes.max(1).div_ceil(512) * 512
}

/// The segment a request gets when nothing is cached.
fn segment(bytes: u64) -> u64 {
    fresh_segment(block(bytes))
}

/// Bytes handed out (and counted as allocated) for a request served by a fresh segment: the
/// segment's tail is split off, except a large-pool tail of at most 1 MiB, which stays attached.
fn handed_out(bytes: u64) -> u64 {
    let (b, seg) = (block(bytes), segment(bytes));
    if b > MIB && seg - b <= MIB {
        seg
    } else {
        b
    }
}

/// `ceil(capacity × utilization)`.
fn requested(capacity: u64, utilization: f64) -> u64 {
    (capacity as f64 * utilization).ceil() as u64
}

/// What is left of `requested` for the KV cache, aligned down, with the default margin:
/// 0.25% of the request kept free.
fn budget(requested: u64, non_kv: u64) -> u64 {
    let margin = (requested as f64 * 0.0025).ceil() as u64;
    (requested - non_kv - margin) / ALIGN * ALIGN
}

/// What appears outside the allocator before the profiling scope opens (a library the weights'
/// loading started) is told apart from what the pass itself brought: the report says which.
#[test]
fn profile_report_tells_memory_outside_from_before_the_pass_and_during_it() {
    let dev = SimDevice::new(SimConfig::default());
    let context = SimConfig::default().context_overhead;
    let a = Allocator::new(dev.spawn_process().unwrap(), Config::default()).unwrap();
    let p = Profiler::new(&a).unwrap();
    let w = a.allocate_tagged(512 * MIB, S, Tag::Weights).unwrap();
    a.driver().alloc_external(64 * MIB).unwrap();
    let r = p
        .profile(opts(0.9), || {
            a.driver().alloc_external(66 * MIB).unwrap();
        })
        .unwrap();
    assert_eq!(r.non_allocator_baseline, context);
    assert_eq!(r.non_allocator_at_begin, context + 64 * MIB);
    assert_eq!(r.non_allocator, context + 130 * MIB);
    let line = &r.report_lines()[0];
    assert!(
        line.contains("when profiling began; 66.00 MiB appeared during the pass"),
        "{line}"
    );
    a.free(w.ptr).unwrap();
}

#[test]
fn profile_vllm_unit_scenario() {
    let config = SimConfig::default();
    let (weights, spike, outside, others) = (512 * MIB, GIB, 256 * MIB, 512 * MIB);
    let dev = SimDevice::new(config.clone());
    // Another process holds 512 MiB before the baseline: never charged to us.
    let other = dev.spawn_process().unwrap();
    other.alloc_external(others).unwrap();
    let a = Allocator::new(dev.spawn_process().unwrap(), Config::default()).unwrap();
    let p = Profiler::new(&a).unwrap();
    let w = a.allocate_tagged(weights, S, Tag::Weights).unwrap();
    let r = p
        .profile(opts(0.9), || {
            let spike = a.allocate_tagged(spike, S, Tag::Activation).unwrap();
            a.free(spike.ptr).unwrap();
            // 256 MiB behind the allocator's back (NCCL, cuBLAS...).
            a.driver().alloc_external(outside).unwrap();
        })
        .unwrap();
    let context = config.context_overhead;
    assert_eq!(r.source, UsageSource::Process);
    assert_eq!(r.weights, weights);
    assert_eq!(r.activation_peak, spike, "the spike, exactly");
    assert_eq!(r.non_allocator_baseline, context, "the CUDA context");
    assert_eq!(
        r.non_allocator,
        context + outside,
        "and the increase, exactly"
    );
    assert_eq!(
        r.other_processes,
        others + context,
        "its 512 MiB and its own context"
    );
    assert_eq!(
        r.non_allocator_at_begin, context,
        "nothing outside before the pass"
    );
    // Both segments are exactly their requests' sizes: nothing cached around them.
    assert_eq!(segment(weights) + segment(spike), weights + spike);
    assert_eq!(r.cached, 0);
    let want_requested = requested(config.capacity, 0.9);
    assert_eq!(r.requested, want_requested);
    let non_kv = segment(weights) + segment(spike) + context + outside;
    assert_eq!(r.non_kv, non_kv);
    assert_eq!(r.kv_budget, budget(want_requested, non_kv));
    // vLLM's method: weights, the activation peak's increase and the growth of memory outside
    // the allocator since its baseline; the context predates the baseline and is left out.
    assert_eq!(
        r.device_wide_kv_budget,
        want_requested as i64 - (weights + spike + outside) as i64
    );
    a.free(w.ptr).unwrap();
}

/// One engine: weights, a dummy pass, memory outside the allocator.
#[derive(Clone, Copy)]
struct Engine {
    weights: u64,
    activation: u64,
    outside: u64,
}

impl Engine {
    /// The weights are loaded in chunks of at most 64 MiB.
    fn chunks(&self) -> Vec<u64> {
        let mut left = self.weights;
        let mut v = Vec::new();
        while left > 0 {
            let n = left.min(64 * MIB);
            v.push(n);
            left -= n;
        }
        v
    }

    /// The dummy pass's two live activations.
    fn halves(&self) -> [u64; 2] {
        [self.activation / 2, self.activation - self.activation / 2]
    }

    fn load(&self, a: &Allocator<SimDriver>) {
        let _w = vram_ledger::tag::scope(Tag::Weights);
        for n in self.chunks() {
            a.allocate(n, S).unwrap();
        }
    }

    /// Expected figures, from the engine's sizes alone. Each chunk and each activation gets a
    /// fresh segment (no cached block is large enough for them), so the allocator's peak
    /// reserve is the sum of those segments.
    fn weights_allocated(&self) -> u64 {
        self.chunks().into_iter().map(handed_out).sum()
    }

    fn activation_allocated(&self) -> u64 {
        self.halves().into_iter().map(handed_out).sum()
    }

    fn reserved(&self) -> u64 {
        self.chunks()
            .into_iter()
            .chain(self.halves())
            .map(segment)
            .sum()
    }

    /// What the engine needs besides the KV cache: its peak reserve, its CUDA context and what
    /// it allocates outside the allocator.
    fn non_kv(&self, context: u64) -> u64 {
        self.reserved() + context + self.outside
    }

    fn pass(&self, a: &Allocator<SimDriver>) {
        let [x, y] = self.halves();
        let x = a.allocate_tagged(x, S, Tag::Activation).unwrap();
        let y = a.allocate_tagged(y, S, Tag::Activation).unwrap();
        a.free(x.ptr).unwrap();
        a.free(y.ptr).unwrap();
        a.driver().alloc_external(self.outside).unwrap();
    }

    /// The budget it gets alone on a device like `config` with `others` bytes used.
    fn solo(&self, config: &SimConfig, others: u64, utilization: f64) -> ProfileResult {
        let dev = SimDevice::new(config.clone());
        dev.set_other_usage(others);
        let a = Allocator::new(dev.spawn_process().unwrap(), Config::default()).unwrap();
        let p = Profiler::new(&a).unwrap();
        self.load(&a);
        p.profile(opts(utilization), || self.pass(&a)).unwrap()
    }
}

#[test]
fn profile_seed_end_to_end_case() {
    // One server holds 70% of an H200 (139.72 GiB); a second starts at utilization 0.2.
    let capacity = (139.72 * GIB as f64) as u64;
    let config = SimConfig {
        capacity,
        ..Default::default()
    };
    let dev = SimDevice::new(config.clone());
    dev.set_other_usage((capacity as f64 * 0.7) as u64);
    let a = Allocator::new(dev.spawn_process().unwrap(), Config::default()).unwrap();
    let p = Profiler::new(&a).unwrap();
    let e = Engine {
        weights: (2.32 * GIB as f64) as u64 / MIB * MIB,
        activation: (4.69 * GIB as f64) as u64 / MIB * MIB,
        outside: 150 * MIB,
    };
    e.load(&a);
    let r = p.profile(opts(0.2), || e.pass(&a)).unwrap();
    let want_requested = requested(capacity, 0.2);
    assert_eq!(
        format!("{:.2}", want_requested as f64 / GIB as f64),
        "27.94"
    );
    assert_eq!(r.requested, want_requested);
    // 2375 MiB of weights: 37 chunks of 64 MiB and one of 7 MiB in a 20 MiB segment (13 MiB
    // cached); each 2401 MiB activation in a 2402 MiB segment, its 1 MiB tail attached.
    assert_eq!(r.weights, e.weights);
    assert_eq!(r.weights, e.weights_allocated());
    assert_eq!(e.activation_allocated(), 2 * 2402 * MIB);
    assert_eq!(r.activation_peak, e.activation_allocated());
    assert_eq!(e.reserved(), 37 * 64 * MIB + 20 * MIB + 2 * 2402 * MIB);
    let cached = e.reserved() - e.weights_allocated() - e.activation_allocated();
    assert_eq!(cached, 13 * MIB);
    assert_eq!(r.cached, cached);
    assert_eq!(r.non_allocator, config.context_overhead + e.outside);
    let non_kv = e.non_kv(config.context_overhead);
    assert_eq!(r.non_kv, non_kv);
    assert_eq!(r.kv_budget, budget(want_requested, non_kv));
    // The KV cache fits, and the process stays within what it requested.
    let kv = a.allocate_tagged(r.kv_budget, S, Tag::KvCache).unwrap();
    let usage = a.driver().process_usage().unwrap().unwrap();
    assert!(
        usage <= r.requested,
        "usage {usage} > requested {}",
        r.requested
    );
    assert!(
        r.requested - r.margin - usage < 64 * MIB,
        "and the budget leaves little unused below the margin: {}",
        r.requested - r.margin - usage
    );
    a.free(kv.ptr).unwrap();
}

fn simultaneous(n: usize) {
    let config = SimConfig::default();
    let dev: Arc<SimDevice> = SimDevice::new(config.clone());
    let engines: Vec<Engine> = (0..n as u64)
        // The weights' last 5 MiB chunk sits in a 20 MiB segment (15 MiB cached), and the
        // outside bytes are an odd number of MiB: the budget's cache and alignment terms matter.
        .map(|i| Engine {
            weights: (3 + i) * GIB + 5 * MIB,
            activation: (1 + i) * GIB + 20 * MIB,
            outside: (65 + 32 * i) * MIB,
        })
        .collect();
    let allocs: Vec<Allocator<SimDriver>> = (0..n)
        .map(|_| Allocator::new(dev.spawn_process().unwrap(), Config::default()).unwrap())
        .collect();
    let profilers: Vec<Profiler<SimDriver>> =
        allocs.iter().map(|a| Profiler::new(a).unwrap()).collect();
    // Interleaved start-up: weights, then every engine opens its scope before any finishes.
    for (e, a) in engines.iter().zip(&allocs) {
        e.load(a);
    }
    let scopes: Vec<_> = profilers
        .iter()
        .map(|p| p.begin(opts(0.25)).unwrap())
        .collect();
    for (e, a) in engines.iter().zip(&allocs) {
        e.pass(a);
    }
    let results: Vec<ProfileResult> = scopes.into_iter().map(|s| s.end().unwrap()).collect();
    let context = config.context_overhead;
    let want_requested = requested(config.capacity, 0.25);
    // Alone on a device, with the other engines' contexts as other tenants.
    let contexts = (n as u64 - 1) * context;
    for (i, (e, r)) in engines.iter().zip(&results).enumerate() {
        let non_kv = e.non_kv(context);
        assert_eq!(e.reserved() - e.weights - e.activation, 15 * MIB);
        assert_eq!(r.requested, want_requested);
        assert_eq!(r.non_kv, non_kv, "engine {i}: only its own memory");
        assert_eq!(
            r.kv_budget,
            budget(want_requested, non_kv),
            "engine {i}: exactly its own budget"
        );
        let solo = e.solo(&config, contexts, 0.25);
        assert_eq!(r.kv_budget, solo.kv_budget, "engine {i}: as if alone");
        assert_eq!(r.non_kv, solo.non_kv);
        // vLLM's method charges engine i with everything the others did after i's baseline
        // (their segments and outside memory), besides its own weights, activations and outside
        // memory; their contexts and i's predate the baseline.
        let others: u64 = engines
            .iter()
            .enumerate()
            .filter(|&(j, _)| j != i)
            .map(|(_, o)| o.reserved() + o.outside)
            .sum();
        assert!(others > 2 * GIB);
        let own = e.weights_allocated() + e.activation_allocated() + e.outside;
        assert_eq!(
            r.device_wide_kv_budget,
            want_requested as i64 - (own + others) as i64,
            "engine {i}: device-wide method off by the others' bytes"
        );
        assert!(r.device_wide_kv_budget < r.kv_budget as i64 - GIB as i64);
    }
}

#[test]
fn profile_two_engines_started_together() {
    simultaneous(2);
}

#[test]
fn profile_three_engines_started_together() {
    simultaneous(3);
}

#[test]
fn profile_counts_the_engines_own_weights_as_part_of_its_request() {
    // 40 GiB of another process and 8 GiB of this engine's weights leave 31.5 GiB free of 80;
    // the engine asks for 0.4 (32 GiB), which its weights are part of: it fits.
    let dev = SimDevice::new(SimConfig::default());
    dev.set_other_usage(40 * GIB);
    let a = Allocator::new(dev.spawn_process().unwrap(), Config::default()).unwrap();
    let p = Profiler::new(&a).unwrap();
    a.allocate_tagged(8 * GIB, S, Tag::Weights).unwrap();
    assert!(a.driver().mem_info().unwrap().free < 32 * GIB);
    let r = p.profile(opts(0.4), || {}).unwrap();
    assert_eq!(r.requested, 32 * GIB);
    // At 0.5 (40 GiB) it does not: 31.5 GiB free and 8 GiB held.
    let err = p.profile(opts(0.5), || panic!("must not run")).unwrap_err();
    assert!(
        matches!(err, ProfileError::InsufficientFreeMemory { free, .. } if free == 31 * GIB + GIB / 2 + 8 * GIB),
        "{err}"
    );
}

#[test]
fn profile_fails_fast_when_free_is_below_the_request() {
    let dev = SimDevice::new(SimConfig::default());
    dev.set_other_usage(40 * GIB);
    let a = Allocator::new(dev.spawn_process().unwrap(), Config::default()).unwrap();
    let p = Profiler::new(&a).unwrap();
    let err = p.profile(opts(0.6), || panic!("must not run")).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, ProfileError::InsufficientFreeMemory { .. }));
    assert!(
        text.contains(
            "Free memory on device (39.50 GiB / 80.00 GiB, counting this allocator's own)"
        ) && text.contains("(0.6, 48.00 GiB)"),
        "{text}"
    );
    assert!(matches!(
        p.begin(opts(0.0)),
        Err(ProfileError::BadUtilization(_))
    ));
    assert!(matches!(
        p.begin(opts(1.5)),
        Err(ProfileError::BadUtilization(_))
    ));
    assert!(matches!(
        p.begin(opts(f64::NAN)),
        Err(ProfileError::BadUtilization(_))
    ));
}

#[test]
fn profile_fallback_errors_when_another_process_frees_memory() {
    let dev = SimDevice::new(SimConfig::default());
    dev.set_other_usage(10 * GIB);
    let a = Allocator::new(dev.spawn_process().unwrap(), Config::default()).unwrap();
    a.driver().set_usage_visible(false);
    let p = Profiler::new(&a).unwrap();
    let err = p
        .profile(opts(0.5), || dev.set_other_usage(6 * GIB))
        .unwrap_err();
    assert!(
        matches!(err, ProfileError::OtherProcessFreed { rose } if rose == 4 * GIB),
        "{err}"
    );
}

#[test]
fn profile_fallback_warns_when_another_process_allocates() {
    let dev = SimDevice::new(SimConfig::default());
    let a = Allocator::new(dev.spawn_process().unwrap(), Config::default()).unwrap();
    a.driver().set_usage_visible(false);
    let p = Profiler::new(&a).unwrap();
    let r = p
        .profile(opts(0.5), || {
            let x = a.allocate_tagged(GIB, S, Tag::Activation).unwrap();
            a.free(x.ptr).unwrap();
            dev.set_other_usage(3 * GIB);
        })
        .unwrap();
    assert_eq!(r.source, UsageSource::DeviceWide);
    assert_eq!(r.activation_peak, GIB);
    assert_eq!(
        r.non_allocator,
        3 * GIB,
        "device-wide: the other process is charged"
    );
    assert!(
        r.warnings
            .iter()
            .any(|w| w.contains("3.00 GiB more than the allocator's growth")),
        "{:?}",
        r.warnings
    );
    assert!(r.report_lines()[0].contains("device-wide fallback"));
    // Warnings are read by people: whole sentences, no runs of spaces from line continuations.
    assert_eq!(r.warnings.len(), 2, "{:?}", r.warnings);
    for w in r.warnings.iter().chain(&r.report_lines()) {
        assert!(!w.contains("  "), "{w:?}");
    }
}

#[test]
fn profile_override_margin_and_token_figures() {
    let a = sim(SegmentMode::Native);
    let p = Profiler::new(&a).unwrap();
    a.allocate_tagged(GIB, S, Tag::Weights).unwrap();
    let o = ProfileOptions {
        utilization: 0.5,
        kv_override: Some(10 * GIB),
        kv_bytes_per_token: Some(128 * 1024),
        max_model_len: Some(8192),
        ..Default::default()
    };
    let r = p
        .profile(o, || panic!("an override skips the pass"))
        .unwrap();
    assert!(r.overridden);
    assert_eq!(r.kv_budget, 10 * GIB);
    assert_eq!(r.kv_tokens, Some(81920));
    assert_eq!(r.max_concurrency, Some(10.0));
    assert!(r
        .report_lines()
        .iter()
        .any(|l| l == "KV cache size: 81920 tokens"));
    assert!(r
        .report_lines()
        .iter()
        .any(|l| l == "Maximum concurrency: 10.00x"));

    let o = ProfileOptions {
        utilization: 0.5,
        margin: Margin::Fraction(0.1),
        ..Default::default()
    };
    let r = p.profile(o, || {}).unwrap();
    // 10% of 40 GiB requested; the 1 GiB of weights in their own segment and the context.
    let non_kv = GIB + SimConfig::default().context_overhead;
    assert_eq!(r.margin, 4 * GIB);
    assert_eq!(r.non_kv, non_kv);
    assert_eq!(r.kv_budget, (36 * GIB - non_kv) / ALIGN * ALIGN);
    let json = serde_json::to_value(&r).unwrap();
    for k in [
        "kv_budget",
        "non_kv",
        "weights",
        "activation_peak",
        "non_allocator",
        "other_processes",
        "source",
        "device_wide_kv_budget",
    ] {
        assert!(json.get(k).is_some(), "{k}");
    }
    let o = ProfileOptions {
        utilization: 0.5,
        margin: Margin::Fraction(1.0),
        ..Default::default()
    };
    assert!(matches!(p.begin(o), Err(ProfileError::BadMargin(_))));
    // No room left: an error that carries the figures.
    let o = ProfileOptions {
        utilization: 0.015,
        ..Default::default()
    };
    let want_requested = requested(80 * GIB, 0.015);
    assert!(want_requested < non_kv);
    match p.profile(o, || {}) {
        Err(ProfileError::NoRoomForKvCache(r)) => {
            assert_eq!((r.requested, r.non_kv), (want_requested, non_kv))
        }
        other => panic!("{other:?}"),
    }
}

/// A margin too large to add to what was measured leaves no room for the KV cache: refused,
/// not wrapped around to a budget of 0 with the contract armed.
#[test]
fn a_margin_of_every_byte_leaves_no_room() {
    let a = sim(SegmentMode::Native);
    let p = Profiler::new(&a).unwrap();
    let o = ProfileOptions {
        utilization: 0.5,
        margin: Margin::Bytes(u64::MAX),
        ..Default::default()
    };
    match p.profile(o, || {}) {
        Err(ProfileError::NoRoomForKvCache(r)) => assert_eq!(r.margin, u64::MAX),
        other => panic!("{other:?}"),
    }
    assert_eq!(a.cap(), None, "no contract armed");
}

/// An engine's start-up in one function returning the crate's `Result`, as the README shows
/// it: profiling's errors convert with `?`, and its types are at the crate's root.
#[test]
fn profiling_errors_convert_into_the_crates_error() {
    fn start(a: &Allocator<SimDriver>, utilization: f64) -> vram_ledger::Result<u64> {
        let p = vram_ledger::Profiler::new(a)?;
        let o = vram_ledger::ProfileOptions {
            utilization,
            margin: vram_ledger::Margin::Auto,
            ..Default::default()
        };
        Ok(p.profile(o, || {})?.kv_budget)
    }
    let a = sim(SegmentMode::Native);
    assert!(start(&a, 0.5).unwrap() > 0);
    let e = start(&a, 1.5).unwrap_err();
    assert!(
        matches!(&e, vram_ledger::Error::Profile(p) if matches!(**p, ProfileError::BadUtilization(_))),
        "{e}"
    );
    assert!(
        e.to_string().contains("utilization must be in (0, 1]"),
        "{e}"
    );
}
