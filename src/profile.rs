//! Profiling: an exact KV-cache budget from the ledger, with other processes never charged.
//!
//! The budget is `requested − non-KV − margin`, where `requested = ceil(total × utilization)`
//! and the non-KV memory is what this process needs besides the KV cache:
//! - the allocator's peak during the dummy pass (weights, activation and untracked peaks, and
//!   the cache slack the allocator reserved around them), from the ledger, with the CUDA graph
//!   pools held at the end added in full (graphs keep them for as long as they live); and
//! - memory outside the allocator (CUDA context, libraries, NCCL, `cudaMalloc` behind our
//!   back) = this process's usage as the driver reports it (NVML, per PID) − reserved bytes.
//!
//! Other processes' memory is `device used − this process's usage`: reported, never charged.
//! Unless told otherwise, the end of profiling sets the allocator's cap to the requested memory
//! (the budget contract), so the process stays inside its request while it serves.
//! When the driver cannot see this process, the non-allocator memory falls back to vLLM's
//! method (device-wide used bytes minus reserved, as a delta from a baseline), the result says
//! so, profiling fails if device free memory rose meanwhile (another process freed memory),
//! and warns if it fell by more than this process can account for.

use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;

use crate::allocator::Profiled;
use crate::driver::{Driver, MemInfo};
use crate::ledger::Snapshot;
use crate::units::Bytes;
use crate::{Allocator, Tag};

/// Where a snapshot's "this process's usage" came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum UsageSource {
    /// The driver's per-process accounting (NVML).
    Process,
    /// Not available: device-wide figures stand in for it (vLLM's method).
    DeviceWide,
}

/// The ledger, the device and this process at one moment.
#[derive(Clone, Debug, Serialize)]
pub struct MemorySnapshot {
    pub ledger: Snapshot,
    pub device: MemInfo,
    /// This process's usage (NVML), when the driver can tell.
    pub process_usage: Option<u64>,
    pub source: UsageSource,
    /// Seconds since the Unix epoch.
    pub time: f64,
}

impl MemorySnapshot {
    pub fn take<D: Driver>(alloc: &Allocator<D>) -> Result<Self, ProfileError> {
        let device = alloc.driver().mem_info()?;
        let process_usage = alloc.driver().process_usage()?;
        let ledger = alloc.snapshot();
        Ok(MemorySnapshot {
            ledger,
            device,
            process_usage,
            source: if process_usage.is_some() {
                UsageSource::Process
            } else {
                UsageSource::DeviceWide
            },
            time: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64()),
        })
    }

    /// Device-wide used bytes.
    pub fn device_used(&self) -> u64 {
        self.device.total - self.device.free
    }

    /// Memory of this process outside the allocator, when the driver can see the process.
    pub fn non_allocator(&self) -> Option<u64> {
        self.process_usage
            .map(|u| u.saturating_sub(self.ledger.reserved_bytes.current))
    }

    /// vLLM's "non-torch" memory: device used − reserved (other processes included).
    pub fn device_wide_non_allocator(&self) -> i64 {
        self.device_used() as i64 - self.ledger.reserved_bytes.current as i64
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error(
        "Free memory on device ({} / {}, counting this allocator's own) on startup is less than desired GPU memory utilization ({utilization}, {}). \
         Decrease GPU memory utilization or reduce GPU memory used by other processes.",
        Bytes(*free), Bytes(*total), Bytes(*requested)
    )]
    InsufficientFreeMemory {
        free: u64,
        total: u64,
        utilization: f64,
        requested: u64,
    },
    #[error("GPU memory utilization must be in (0, 1], not {0}")]
    BadUtilization(f64),
    #[error("safety margin {0} is not a byte count or a fraction in [0, 1)")]
    BadMargin(String),
    #[error(
        "device free memory rose by {} during profiling: another process freed memory, so the \
         device-wide measurement is wrong. Profile again, or make per-process usage (NVML) visible.",
        Bytes(*rose)
    )]
    OtherProcessFreed { rose: u64 },
    #[error("no memory left for the KV cache: {}", .0.report_lines().join(" "))]
    NoRoomForKvCache(Box<ProfileResult>),
    #[error(transparent)]
    Driver(#[from] crate::driver::DriverError),
    #[error(transparent)]
    Alloc(#[from] crate::Error),
}

/// A margin kept free on top of everything measured.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Margin {
    Bytes(u64),
    /// A fraction of the requested memory.
    Fraction(f64),
    /// The default: [`PLACEMENT_ROOM`] of the requested memory, in every mode. Serving has
    /// another history than the profiled pass and places blocks differently: in a virtual
    /// mode partly used pages and a few more live bytes, in native mode segments cut for other
    /// shapes (on an H200, the engine-order run left a native Llama 10 to 20 MiB short of its
    /// profiled shape with no margin).
    Auto,
}

/// The room [`Margin::Auto`] keeps, as a fraction of the requested memory. On an H200 a transformer whose profiled pass left no room was refused its profiled
/// shape for want of 10 to 30 MiB of 28 GiB (0.04 to 0.1%).
pub const PLACEMENT_ROOM: f64 = 0.0025;

#[derive(Clone, Debug)]
pub struct ProfileOptions {
    pub utilization: f64,
    pub margin: Margin,
    /// Skip the dummy pass and use this many bytes for the KV cache; still reported.
    pub kv_override: Option<u64>,
    /// KV bytes per token (all layers), for the token and concurrency figures.
    pub kv_bytes_per_token: Option<u64>,
    /// The longest request in tokens, for the concurrency figure.
    pub max_model_len: Option<u64>,
    /// Hold the process to the requested memory from the end of profiling on (the budget
    /// contract, [`Allocator::set_cap`]). On by default.
    pub contract: bool,
}

impl Default for ProfileOptions {
    fn default() -> Self {
        ProfileOptions {
            utilization: 0.9,
            margin: Margin::Auto,
            kv_override: None,
            kv_bytes_per_token: None,
            max_model_len: None,
            contract: true,
        }
    }
}

/// `ceil(total × utilization)`, or an error worded like vLLM's when the device has less free.
/// Free memory is counted as vLLM counts it at startup, before the engine allocated anything:
/// free now plus what this allocator holds (the engine's weights, loaded before profiling, are
/// part of its request, not taken from it).
pub fn request_memory<D: Driver>(
    alloc: &Allocator<D>,
    utilization: f64,
) -> Result<u64, ProfileError> {
    if !(utilization > 0.0 && utilization <= 1.0) {
        return Err(ProfileError::BadUtilization(utilization));
    }
    let info = alloc.driver().mem_info()?;
    let requested = (info.total as f64 * utilization).ceil() as u64;
    let free = info.free.saturating_add(alloc.ledger().reserved());
    if free < requested {
        return Err(ProfileError::InsufficientFreeMemory {
            free,
            total: info.total,
            utilization,
            requested,
        });
    }
    Ok(requested)
}

/// What profiling found, and the budget.
#[derive(Clone, Debug, Serialize)]
pub struct ProfileResult {
    pub source: UsageSource,
    pub utilization: f64,
    pub requested: u64,
    /// Weights-tagged bytes allocated at the end.
    pub weights: u64,
    /// Peaks of activation- and untracked-tagged bytes during the pass.
    pub activation_peak: u64,
    pub untracked_peak: u64,
    /// KV-tagged bytes already allocated (not part of the non-KV memory).
    pub kv_allocated: u64,
    /// Reserved but unallocated at the allocator's peak (cache slack, fragmentation), beyond
    /// the graph pools.
    pub cached: u64,
    /// Memory outside the allocator at the end, and the part of it present at the baseline
    /// (the CUDA context and whatever else came before).
    pub non_allocator: u64,
    pub non_allocator_baseline: u64,
    /// Memory outside the allocator when the profiling scope opened. What appeared after it
    /// (`non_allocator` − this) is the pass's own: memory taken outside the allocator, and the
    /// libraries and kernels the pass was the first to use (cuBLAS's, when its first matmul runs
    /// in the pass).
    pub non_allocator_at_begin: u64,
    /// CUDA graph pools at the end: the memory allocations made during captures got (part of
    /// the allocator's figures above).
    pub graph_pools: u64,
    /// Memory outside the allocator that appeared while graphs were captured and instantiated
    /// during profiling (part of `non_allocator`; 0 when the driver cannot see the process).
    pub graph_outside: u64,
    /// Other processes' memory on the device (reported, never charged; 0 when unknown).
    pub other_processes: u64,
    pub non_kv: u64,
    pub margin: u64,
    /// requested − non-KV − margin, aligned down to 2 MiB.
    pub kv_budget: u64,
    /// What vLLM's device-wide method computes from the same snapshots (may be negative).
    pub device_wide_kv_budget: i64,
    pub kv_tokens: Option<u64>,
    pub max_concurrency: Option<f64>,
    /// Whether the budget came from `kv_override` rather than a pass.
    pub overridden: bool,
    pub seconds: f64,
    pub warnings: Vec<String>,
}

impl ProfileResult {
    /// The report, one line per category in GiB with two decimals.
    pub fn report_lines(&self) -> Vec<String> {
        let g = Bytes;
        let mut v = vec![format!(
            "Memory profiling takes {:.2} seconds ({}). Total non KV cache memory: {}; weights memory: {}; \
             activation peak: {}; untracked peak: {}; cached by the allocator: {}; outside the allocator: {} \
             ({}, {} when profiling began; {} appeared during the pass: memory taken outside the \
             allocator, and libraries and kernels the pass was the first to use).",
            self.seconds,
            match self.source {
                UsageSource::Process => "this process's usage from the driver",
                UsageSource::DeviceWide => "device-wide fallback: other processes' changes are charged to us",
            },
            g(self.non_kv),
            g(self.weights),
            g(self.activation_peak),
            g(self.untracked_peak),
            g(self.cached),
            g(self.non_allocator),
            match self.source {
                UsageSource::Process => format!("{} at the baseline", g(self.non_allocator_baseline)),
                // The device-wide figure counts from the baseline, so it has no part before it
                // to show.
                UsageSource::DeviceWide => "counted from the baseline".to_string(),
            },
            g(self.non_allocator_at_begin),
            g(self.non_allocator.saturating_sub(self.non_allocator_at_begin)),
        )];
        v.push(format!(
            "Requested memory: {} (utilization {}); other processes: {} (not charged); safety margin: {}.",
            g(self.requested),
            self.utilization,
            g(self.other_processes),
            g(self.margin)
        ));
        v.push(format!(
            "Available KV cache memory: {}{}",
            g(self.kv_budget),
            if self.overridden {
                " (set explicitly)"
            } else {
                ""
            }
        ));
        if self.graph_pools > 0 || self.graph_outside > 0 {
            v.push(format!(
                "CUDA graphs: {} in their pools (part of the non KV cache memory), {} outside the \
                 allocator from capturing and instantiating them (part of the memory outside).",
                g(self.graph_pools),
                g(self.graph_outside)
            ));
        }
        if let Some(t) = self.kv_tokens {
            v.push(format!("KV cache size: {t} tokens"));
        }
        if let Some(c) = self.max_concurrency {
            v.push(format!("Maximum concurrency: {c:.2}x"));
        }
        v.extend(self.warnings.iter().cloned());
        v
    }

    /// Log the report: the summary at info, the breakdown at debug, warnings at warn.
    pub fn log(&self) {
        let lines = self.report_lines();
        tracing::info!("{}", lines[2]);
        tracing::debug!("{}", lines[0]);
        tracing::debug!("{}", lines[1]);
        for w in &self.warnings {
            tracing::warn!("{w}");
        }
    }
}

/// Profiling for one allocator: a baseline taken at start-up (before weights are loaded).
pub struct Profiler<'a, D: Driver> {
    alloc: &'a Allocator<D>,
    baseline: MemorySnapshot,
}

/// An open profiling scope (see [`Profiler::begin`]).
pub struct ProfileScope<'p, 'a, D: Driver> {
    profiler: &'p Profiler<'a, D>,
    options: ProfileOptions,
    requested: u64,
    entry: MemorySnapshot,
    start: Instant,
}

impl<'a, D: Driver> Profiler<'a, D> {
    /// Take the baseline. Call it at start-up, before loading weights.
    pub fn new(alloc: &'a Allocator<D>) -> Result<Self, ProfileError> {
        Ok(Profiler {
            alloc,
            baseline: MemorySnapshot::take(alloc)?,
        })
    }

    pub fn baseline(&self) -> &MemorySnapshot {
        &self.baseline
    }

    /// Open a profiling scope: check the request against free memory, give the cache back,
    /// reset peaks. Run the dummy pass, then [`ProfileScope::end`].
    pub fn begin(&self, options: ProfileOptions) -> Result<ProfileScope<'_, 'a, D>, ProfileError> {
        if let Margin::Fraction(f) = options.margin {
            if !(0.0..1.0).contains(&f) {
                return Err(ProfileError::BadMargin(f.to_string()));
            }
        }
        let requested = request_memory(self.alloc, options.utilization)?;
        self.alloc.empty_cache()?;
        self.alloc.ledger().reset_peaks();
        let entry = MemorySnapshot::take(self.alloc)?;
        Ok(ProfileScope {
            profiler: self,
            options,
            requested,
            entry,
            start: Instant::now(),
        })
    }

    /// Profile `pass` (the engine's dummy forward pass) and compute the KV budget. With
    /// `kv_override`, the pass is not run and the budget is the override.
    pub fn profile(
        &self,
        options: ProfileOptions,
        pass: impl FnOnce(),
    ) -> Result<ProfileResult, ProfileError> {
        let scope = self.begin(options)?;
        if scope.options.kv_override.is_none() {
            pass();
        }
        scope.end()
    }
}

/// vLLM's budget, from device-wide figures: `requested − (weights + peak increase of allocated
/// bytes during the pass + increase of (device used − reserved) since the baseline)`. Other
/// processes' changes since the baseline land in it; kept to show the difference.
pub fn device_wide_budget(
    baseline: &MemorySnapshot,
    entry: &MemorySnapshot,
    exit: &MemorySnapshot,
    requested: u64,
) -> i64 {
    let weights = exit.ledger.per_tag[Tag::Weights].allocated_bytes.current as i64;
    let peak_increase = exit.ledger.all.allocated_bytes.peak as i64
        - entry.ledger.all.allocated_bytes.current as i64;
    let non_torch_increase =
        exit.device_wide_non_allocator() - baseline.device_wide_non_allocator();
    requested as i64 - (weights + peak_increase + non_torch_increase)
}

/// What the allocator held at the pass's peak, apart from the KV cache.
struct AllocatorPeak {
    weights: u64,
    activation_peak: u64,
    untracked_peak: u64,
    kv_allocated: u64,
    graph_pools: u64,
    /// Everything but the KV cache at the peak, graph pools included.
    total: u64,
    cached: u64,
}

impl AllocatorPeak {
    fn of(l: &Snapshot) -> AllocatorPeak {
        let weights = l.per_tag[Tag::Weights].allocated_bytes.current;
        let activation_peak = l.per_tag[Tag::Activation].allocated_bytes.peak;
        let untracked_peak = l.per_tag[Tag::Untracked].allocated_bytes.peak;
        let kv_allocated = l.per_tag[Tag::KvCache].allocated_bytes.current;
        let tags_peak =
            l.per_tag[Tag::Weights].allocated_bytes.peak + activation_peak + untracked_peak;
        // Never less than the tags' peaks, and including the slack reserved around them. Graph
        // pools are held as long as their graphs live and serve nothing else, free blocks
        // included, so they come on top of the tags' peaks in full (a capture usually follows
        // the largest pass, whose memory the capture's `empty_cache` gave back: the reserved
        // peak misses them).
        let graph_pools = l.graph_reserved_bytes.current;
        let total = l
            .reserved_bytes
            .peak
            .saturating_sub(kv_allocated)
            .max(tags_peak + graph_pools);
        AllocatorPeak {
            weights,
            activation_peak,
            untracked_peak,
            kv_allocated,
            graph_pools,
            total,
            cached: total.saturating_sub(tags_peak + graph_pools),
        }
    }
}

/// This process's memory outside the allocator at the end of profiling, the part of it present
/// at the baseline, and other processes' memory (when the driver can see this process), with
/// the warnings of the device-wide fallback.
struct Outside {
    now: u64,
    baseline: u64,
    at_begin: u64,
    other_processes: Option<u64>,
    warnings: Vec<String>,
}

impl<D: Driver> ProfileScope<'_, '_, D> {
    /// Close the scope: measure, compute the budget, and (unless told not to) hold the process
    /// to what it requested.
    pub fn end(self) -> Result<ProfileResult, ProfileError> {
        let alloc = self.profiler.alloc;
        let exit = MemorySnapshot::take(alloc)?;
        let peak = AllocatorPeak::of(&exit.ledger);
        let outside = self.outside(&exit)?;
        let result = self.compute(&exit, &peak, outside);
        result.log();
        if !result.overridden && self.requested <= result.non_kv.saturating_add(result.margin) {
            return Err(ProfileError::NoRoomForKvCache(Box::new(result)));
        }
        // Eager work's peak, what it still holds at the end (the weights, mostly) and what it
        // still reserves once its cache is given back (unless a capture runs): the KV cache is
        // sized for the pass's rise above them (allocator/kv.rs). The pools'
        // allocations are in the tags' peaks and in the pools both (the part still allocated
        // shows which; freed ones go uncounted, on the safe side).
        let in_pools = alloc.graph_memory().allocated;
        let eager_peak = peak.total.saturating_sub(peak.graph_pools + in_pools);
        let held = exit
            .ledger
            .all
            .allocated_bytes
            .current
            .saturating_sub(peak.kv_allocated + in_pools);
        let kept = alloc.eager_kept()?.unwrap_or(held);
        alloc.note_profile(Profiled {
            eager_peak,
            held,
            kept,
            margin: result.margin,
        });
        if self.options.contract {
            // What lies outside the allocator now is the floor for when the driver cannot
            // report it later (the device-wide figure cannot be re-read per process).
            alloc.arm_cap(Some(self.requested), result.non_allocator);
        }
        Ok(result)
    }

    /// Memory outside the allocator, per process when the driver can see it, otherwise the
    /// change in (device used − reserved) since the baseline (vLLM's method), refusing a
    /// measurement that another process's free spoiled.
    fn outside(&self, exit: &MemorySnapshot) -> Result<Outside, ProfileError> {
        let base = &self.profiler.baseline;
        if let (Some(now), Some(before)) = (exit.non_allocator(), base.non_allocator()) {
            return Ok(Outside {
                now,
                baseline: before,
                at_begin: self.entry.non_allocator().unwrap_or(before),
                other_processes: Some(
                    exit.device_used()
                        .saturating_sub(exit.process_usage.unwrap_or(0)),
                ),
                warnings: Vec::new(),
            });
        }
        let granule = self.profiler.alloc.driver().granularity() as i64;
        let delta = exit.device_wide_non_allocator() - base.device_wide_non_allocator();
        if delta < -granule {
            return Err(ProfileError::OtherProcessFreed {
                rose: delta.unsigned_abs(),
            });
        }
        let mut warnings = Vec::new();
        let grown = exit.device_wide_non_allocator() - self.entry.device_wide_non_allocator();
        if grown > granule {
            warnings.push(format!(
                "Device free memory fell by {} more than the allocator's growth during profiling; if another \
                 process allocated meanwhile, it is charged to this engine and the KV budget may be short by \
                 up to that much.",
                Bytes(grown as u64)
            ));
        }
        warnings.push(
            "This process's usage is not visible to the driver (NVML): memory outside the allocator is \
             measured device-wide since the baseline, and what predates the baseline (the CUDA context) is \
             not counted."
                .to_string(),
        );
        let at_begin = self.entry.device_wide_non_allocator() - base.device_wide_non_allocator();
        Ok(Outside {
            now: delta.max(0) as u64,
            baseline: 0,
            at_begin: at_begin.clamp(0, delta.max(0)) as u64,
            other_processes: None,
            warnings,
        })
    }

    /// The budget from what was measured.
    fn compute(
        &self,
        exit: &MemorySnapshot,
        peak: &AllocatorPeak,
        outside: Outside,
    ) -> ProfileResult {
        let non_kv = peak.total + outside.now;
        let margin = match self.options.margin {
            Margin::Bytes(b) => b,
            Margin::Fraction(f) => (self.requested as f64 * f).ceil() as u64,
            Margin::Auto => (self.requested as f64 * PLACEMENT_ROOM).ceil() as u64,
        };
        let (kv_budget, overridden) = match self.options.kv_override {
            Some(k) => (k, true),
            // Aligned down to 2 MiB, so that the budget allocated as one block fits exactly in
            // what was requested (a large allocation's segment is rounded up to 2 MiB).
            None => {
                let left = self.requested.saturating_sub(non_kv).saturating_sub(margin);
                (
                    left / crate::allocator::rules::ROUND_LARGE
                        * crate::allocator::rules::ROUND_LARGE,
                    false,
                )
            }
        };
        let kv_tokens = self
            .options
            .kv_bytes_per_token
            .filter(|&b| b > 0)
            .map(|b| kv_budget / b);
        let max_concurrency = kv_tokens
            .zip(self.options.max_model_len.filter(|&m| m > 0))
            .map(|(t, m)| t as f64 / m as f64);
        ProfileResult {
            source: exit.source,
            utilization: self.options.utilization,
            requested: self.requested,
            weights: peak.weights,
            activation_peak: peak.activation_peak,
            untracked_peak: peak.untracked_peak,
            kv_allocated: peak.kv_allocated,
            cached: peak.cached,
            non_allocator: outside.now,
            non_allocator_baseline: outside.baseline,
            non_allocator_at_begin: outside.at_begin,
            graph_pools: peak.graph_pools,
            graph_outside: exit
                .ledger
                .graph_outside_bytes
                .saturating_sub(self.entry.ledger.graph_outside_bytes),
            other_processes: outside.other_processes.unwrap_or(0),
            non_kv,
            margin,
            kv_budget,
            kv_tokens,
            max_concurrency,
            overridden,
            device_wide_kv_budget: device_wide_budget(
                &self.profiler.baseline,
                &self.entry,
                exit,
                self.requested,
            ),
            seconds: self.start.elapsed().as_secs_f64(),
            warnings: outside.warnings,
        }
    }
}
