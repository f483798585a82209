//! Profiling on the simulated device: exact wherever our method is exact, and vLLM's
//! device-wide method shown wrong by other processes' bytes.

use std::sync::Arc;

use vram_ledger::driver::sim::{SimConfig, SimDevice, SimDriver};
use vram_ledger::driver::Driver;
use vram_ledger::profile::{
    Margin, ProfileError, ProfileOptions, ProfileResult, Profiler, UsageSource,
};
use vram_ledger::units::{GIB, MIB};
use vram_ledger::{Allocator, Config, StreamId, Tag};

const S: StreamId = StreamId::DEFAULT;

fn opts(utilization: f64) -> ProfileOptions {
    ProfileOptions {
        utilization,
        ..Default::default()
    }
}

#[test]
fn profile_vllm_unit_scenario() {
    let dev = SimDevice::new(SimConfig::default());
    // Another process holds 512 MiB before the baseline: never charged to us.
    let other = dev.spawn_process().unwrap();
    other.alloc_external(512 * MIB).unwrap();
    let a = Allocator::new(dev.spawn_process().unwrap(), Config::default()).unwrap();
    let p = Profiler::new(&a).unwrap();
    let w = a.allocate_tagged(512 * MIB, S, Tag::Weights).unwrap();
    let r = p
        .profile(opts(0.9), || {
            let spike = a.allocate_tagged(GIB, S, Tag::Activation).unwrap();
            a.free(spike.ptr).unwrap();
            // 256 MiB behind the allocator's back (NCCL, cuBLAS...).
            a.driver().alloc_external(256 * MIB).unwrap();
        })
        .unwrap();
    assert_eq!(r.source, UsageSource::Process);
    assert_eq!(r.weights, 512 * MIB);
    assert_eq!(r.activation_peak, GIB, "the spike, exactly");
    assert_eq!(r.non_allocator_baseline, 512 * MIB, "the CUDA context");
    assert_eq!(
        r.non_allocator - r.non_allocator_baseline,
        256 * MIB,
        "the increase, exactly"
    );
    assert_eq!(r.other_processes, GIB, "its 512 MiB and its own context");
    assert_eq!(r.cached, 0);
    assert_eq!(r.non_kv, 512 * MIB + GIB + 768 * MIB);
    assert_eq!(
        r.kv_budget,
        (r.requested - r.non_kv) / (2 * MIB) * (2 * MIB)
    );
    assert_eq!(r.requested, (80.0 * GIB as f64 * 0.9).ceil() as u64);
    // vLLM's method leaves out the context (it predates its baseline).
    let unaligned = (r.requested - r.non_kv) as i64;
    assert_eq!(r.device_wide_kv_budget, unaligned + (512 * MIB) as i64);
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
    fn load(&self, a: &Allocator<SimDriver>) {
        let _w = vram_ledger::tag::scope(Tag::Weights);
        let mut left = self.weights;
        while left > 0 {
            let n = left.min(64 * MIB);
            a.allocate(n, S).unwrap();
            left -= n;
        }
    }

    fn pass(&self, a: &Allocator<SimDriver>) {
        let x = a
            .allocate_tagged(self.activation / 2, S, Tag::Activation)
            .unwrap();
        let y = a
            .allocate_tagged(self.activation - self.activation / 2, S, Tag::Activation)
            .unwrap();
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
    let dev = SimDevice::new(config);
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
    assert_eq!(format!("{:.2}", r.requested as f64 / GIB as f64), "27.94");
    assert_eq!(
        r.kv_budget,
        (r.requested - r.non_kv) / (2 * MIB) * (2 * MIB)
    );
    assert_eq!(
        r.non_kv,
        r.weights + r.activation_peak + r.cached + r.non_allocator
    );
    assert_eq!(r.non_allocator, 512 * MIB + 150 * MIB);
    // The KV cache fits, and the process stays within what it requested.
    let kv = a.allocate_tagged(r.kv_budget, S, Tag::KvCache).unwrap();
    let usage = a.driver().process_usage().unwrap().unwrap();
    assert!(
        usage <= r.requested,
        "usage {usage} > requested {}",
        r.requested
    );
    assert!(
        r.requested - usage < 64 * MIB,
        "and the budget leaves little unused: {}",
        r.requested - usage
    );
    a.free(kv.ptr).unwrap();
}

fn simultaneous(n: usize) {
    let config = SimConfig::default();
    let dev: Arc<SimDevice> = SimDevice::new(config.clone());
    let engines: Vec<Engine> = (0..n as u64)
        .map(|i| Engine {
            weights: (3 + i) * GIB,
            activation: (1 + i) * GIB + 20 * MIB,
            outside: (64 + 32 * i) * MIB,
        })
        .collect();
    let allocs: Vec<Allocator<SimDriver>> = (0..n)
        .map(|_| Allocator::new(dev.spawn_process().unwrap(), Config::default()).unwrap())
        .collect();
    let profilers: Vec<Profiler<SimDriver>> =
        allocs.iter().map(|a| Profiler::new(a).unwrap()).collect();
    let usage = |a: &Allocator<SimDriver>| a.driver().process_usage().unwrap().unwrap();
    let at_baseline: Vec<u64> = allocs.iter().map(usage).collect();
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
    // Alone on a device, with the other engines' contexts as other tenants.
    let contexts = (n as u64 - 1) * config.context_overhead;
    for (i, (e, r)) in engines.iter().zip(&results).enumerate() {
        let solo = e.solo(&config, contexts, 0.25);
        assert_eq!(
            r.kv_budget, solo.kv_budget,
            "engine {i}: exactly its own budget"
        );
        assert_eq!(r.non_kv, solo.non_kv);
        // vLLM's method charges engine i with everything the others did after i's baseline
        // (and misses i's context, which predates it, and i's cache slack).
        let others_grew: u64 = (0..n)
            .filter(|&j| j != i)
            .map(|j| usage(&allocs[j]) - at_baseline[j])
            .sum();
        assert!(others_grew > 2 * GIB);
        let unaligned = (r.requested - r.non_kv) as i64;
        let expected =
            unaligned + r.non_allocator_baseline as i64 + r.cached as i64 - others_grew as i64;
        assert_eq!(
            r.device_wide_kv_budget, expected,
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
fn profile_fails_fast_when_free_is_below_the_request() {
    let dev = SimDevice::new(SimConfig::default());
    dev.set_other_usage(40 * GIB);
    let a = Allocator::new(dev.spawn_process().unwrap(), Config::default()).unwrap();
    let p = Profiler::new(&a).unwrap();
    let err = p.profile(opts(0.6), || panic!("must not run")).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, ProfileError::InsufficientFreeMemory { .. }));
    assert!(
        text.contains("Free memory on device (39.50 GiB / 80.00 GiB)")
            && text.contains("(0.6, 48.00 GiB)"),
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
}

#[test]
fn profile_override_margin_and_token_figures() {
    let a = Allocator::new(SimDriver::new(), Config::default()).unwrap();
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
    assert_eq!(r.margin, 4 * GIB);
    assert_eq!(
        r.kv_budget,
        (r.requested - r.non_kv - 4 * GIB) / (2 * MIB) * (2 * MIB)
    );
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
    match p.profile(o, || {}) {
        Err(ProfileError::NoRoomForKvCache(r)) => assert!(r.non_kv > r.requested),
        other => panic!("{other:?}"),
    }
}
