//! What driver calls cost the host on an H200 (driver 580, CUDA 13.0), from single-call
//! measurements: the middle of two runs of 40 calls each, at 2 MiB, 20 MiB, 88 MiB, 512 MiB
//! and 1 GiB. Used to estimate the driver time of a replay, ours and PyTorch's alike.
//!
//! Between measured sizes the cost is interpolated linearly in log2(size); below 2 MiB it is
//! the 2 MiB figure; above 1 GiB it grows on the slope from 512 MiB to 1 GiB. Calls that were
//! not measured by size cost a constant (synchronising an idle stream 0.2 µs, `cuMemGetInfo`
//! 6 µs, the NVML per-process query 27 µs); events and address reservations were not measured
//! and count as free: they are counted in the call figures, not timed.
//!
//! Those are idle figures. Inside a running program a wait for the device also costs the work
//! it drains: the host stops queueing kernels until the device is empty, and the device then
//! idles while the host catches up. [`LOADED_SYNC_NS`] is that price as measured; an estimate
//! that uses it charges it ([`drain_extra_ns`]) to the first wait for a stream after the program
//! queued work there: a stream synchronisation drains that stream, a device synchronisation or
//! a segment free (`cuMemFree` synchronises the device; unmapping does not, which is why
//! callers synchronise a stream before they unmap) drains every stream, and waits right after
//! find nothing to drain.

use super::DriverCall;
use crate::units::MIB;

/// Measured sizes, in bytes.
const SIZES: [u64; 5] = [2 * MIB, 20 * MIB, 88 * MIB, 512 * MIB, 1024 * MIB];

/// Microseconds per call at each of [`SIZES`].
fn table(call: DriverCall) -> Option<[f64; 5]> {
    Some(match call {
        DriverCall::CreatePhysical => [12.5, 10.5, 11.5, 25.0, 35.0],
        DriverCall::Map => [1.5, 1.0, 1.0, 1.0, 1.0],
        DriverCall::SetAccess => [37.5, 27.0, 29.5, 55.5, 64.5],
        DriverCall::Unmap => [20.0, 18.0, 19.0, 28.0, 31.5],
        DriverCall::ReleasePhysical => [13.0, 21.0, 50.0, 218.5, 428.5],
        DriverCall::AllocSegment => [45.0, 51.0, 58.0, 85.5, 112.0],
        DriverCall::FreeSegment => [37.5, 50.5, 81.0, 257.0, 497.5],
        _ => return None,
    })
}

/// What a synchronisation added to a training step that had work queued before it, in
/// nanoseconds: in an activation-checkpointed Llama step of 166 ms, each of 10 steps with 16
/// synchronisations against the median of the plain steps of the same shapes, divided by 16;
/// the median of those 10 (`scripts/sync_load_bench.py`, H100 machine, torch 2.11; their mean
/// 553 µs). The call itself blocked a median of 53 µs: most of the price is the device idling
/// after it.
pub const LOADED_SYNC_NS: u64 = 437_900;

/// What a wait that drains queued work costs above its idle price, in nanoseconds, when a
/// drain costs `drain_ns` in all.
pub fn drain_extra_ns(drain_ns: u64) -> u64 {
    let idle = (host_seconds(DriverCall::SyncStream, 0) * 1e9).round() as u64;
    drain_ns.saturating_sub(idle)
}

/// The drain rule for one process's waits (the module's doc): the streams that have work
/// queued since they were last waited for, and the drains so far. The simulated driver prices
/// our waits with it and the replay PyTorch's, so both sides follow one rule.
#[derive(Debug, Default)]
pub struct Drains {
    /// What a drain costs in all, in nanoseconds; `None`: every wait priced idle, nothing kept.
    price_ns: Option<u64>,
    queued: Vec<u64>,
    count: u64,
}

impl Drains {
    pub fn new(price_ns: Option<u64>) -> Self {
        Drains {
            price_ns,
            ..Default::default()
        }
    }

    pub fn price_ns(&self) -> Option<u64> {
        self.price_ns
    }

    /// Waits so far that drained queued work.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// The program queued work on `stream`; whether the stream had none queued since it was
    /// last waited for (always, when nothing is kept).
    pub fn work_queued(&mut self, stream: u64) -> bool {
        if self.price_ns.is_none() {
            return true;
        }
        let fresh = !self.queued.contains(&stream);
        if fresh {
            self.queued.push(stream);
        }
        fresh
    }

    /// Nothing is queued any more (the device is idle).
    pub fn forget(&mut self) {
        self.queued.clear();
    }

    /// A wait for `stream`'s work (`None`: every stream's, as a device synchronisation or a
    /// segment free waits): what it costs above its idle price, in nanoseconds, 0 when
    /// nothing was queued there.
    pub fn waited(&mut self, stream: Option<u64>) -> u64 {
        let Some(price) = self.price_ns else {
            return 0;
        };
        let before = self.queued.len();
        match stream {
            Some(s) => self.queued.retain(|&x| x != s),
            None => self.queued.clear(),
        }
        if self.queued.len() == before {
            return 0;
        }
        self.count += 1;
        drain_extra_ns(price)
    }
}

/// Estimated host time of one `call` on `bytes`, in seconds.
pub fn host_seconds(call: DriverCall, bytes: u64) -> f64 {
    let micros = match table(call) {
        Some(t) => interpolate(&t, bytes),
        None => match call {
            DriverCall::SyncStream | DriverCall::SyncDevice => 0.2,
            DriverCall::MemInfo => 6.0,
            DriverCall::ProcessUsage => 27.0,
            _ => 0.0,
        },
    };
    micros * 1e-6
}

fn interpolate(t: &[f64; 5], bytes: u64) -> f64 {
    let b = bytes as f64;
    if bytes <= SIZES[0] {
        return t[0];
    }
    let last = SIZES.len() - 1;
    if bytes >= SIZES[last] {
        let slope = (t[last] - t[last - 1]) / (SIZES[last] - SIZES[last - 1]) as f64;
        return t[last] + slope * (b - SIZES[last] as f64);
    }
    let i = SIZES
        .iter()
        .position(|&s| s >= bytes)
        .expect("inside the table")
        - 1;
    let (lo, hi) = ((SIZES[i] as f64).log2(), (SIZES[i + 1] as f64).log2());
    let f = (b.log2() - lo) / (hi - lo);
    t[i] + f * (t[i + 1] - t[i])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measured_points_and_between() {
        let us = |c, b| host_seconds(c, b) * 1e6;
        assert!((us(DriverCall::AllocSegment, 20 * MIB) - 51.0).abs() < 1e-9);
        assert!((us(DriverCall::AllocSegment, 512) - 45.0).abs() < 1e-9);
        let mid = us(DriverCall::FreeSegment, 40 * MIB);
        assert!(mid > 50.5 && mid < 81.0, "{mid}");
        // Beyond 1 GiB: the last slope, (497.5 - 257) per 512 MiB.
        let two = us(DriverCall::FreeSegment, 2048 * MIB);
        assert!((two - (497.5 + 2.0 * 240.5)).abs() < 1e-6, "{two}");
        assert_eq!(us(DriverCall::RecordEvent, 0), 0.0);
    }
}
