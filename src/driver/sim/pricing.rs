//! What a simulated process's driver calls would cost the host: each call at its measured idle
//! price ([`crate::driver::cost`]), and each wait that drains work the program queued at
//! [`super::SimConfig::sync_ns`] above that ([`cost::Drains`], the rule PyTorch's side of a
//! replay is priced by too). Only the estimate reads the prices. The work said to be queued
//! (`work_queued`) is also queued on the device, where it finishes when waited for, so events
//! recorded after it answer as they would on a host that runs ahead of its device.

use super::SimDriver;
use crate::driver::cost;
use crate::driver::{DriverCall, DriverResult, StreamId};
use std::sync::atomic::Ordering::Relaxed;

impl SimDriver {
    /// The host time the calls made so far would have taken on an H200, in seconds (an
    /// estimate from measured per-call costs: [`crate::driver::cost`]).
    pub fn estimated_host_seconds(&self) -> f64 {
        self.host_ns.load(Relaxed) as f64 * 1e-9
    }

    /// How many waits so far drained queued work and paid [`super::SimConfig::sync_ns`] (0 when it
    /// is `None`).
    pub fn drains(&self) -> u64 {
        self.drains.lock().count()
    }

    /// Say that the program queued work on `stream` (a replay: between two of the trace's
    /// allocations or frees on it, where its kernels ran). The work finishes only when waited
    /// for: the host is taken to run ahead of the device, so an event recorded on the stream
    /// after it is done only after a wait. What was queued since the last wait is one unit of
    /// the device's work, queued when the first of it was.
    pub fn work_queued(&self, stream: StreamId) {
        if self.drains.lock().work_queued(stream.0) {
            self.device.submit(stream);
        }
    }

    /// Forget what was queued: the device is idle (a new replay on this process starts).
    pub fn forget_queued_work(&self) {
        self.drains.lock().forget();
    }

    /// A wait for `stream`'s work (or, with `None`, the whole device's) succeeded: what it
    /// drained is charged ([`cost::Drains::waited`]).
    pub(super) fn waited(&self, stream: Option<StreamId>) {
        let extra = self.drains.lock().waited(stream.map(|s| s.0));
        self.host_ns.fetch_add(extra, Relaxed);
    }

    /// Count `call` on `bytes` (0 when the call has no size), charge its estimated host time,
    /// and fail it if a fault is planted.
    pub(super) fn count(&self, call: DriverCall, bytes: u64) -> DriverResult<()> {
        let ns = (cost::host_seconds(call, bytes) * 1e9).round() as u64;
        self.host_ns.fetch_add(ns, Relaxed);
        self.faults.count(call)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::sim::SimConfig;
    use crate::driver::Driver;

    #[test]
    fn a_wait_drains_only_the_work_queued_where_it_waits() {
        let priced = |sync_ns| {
            SimDriver::with_config(SimConfig {
                sync_ns,
                ..Default::default()
            })
        };
        let (d, idle) = (priced(Some(1_000_000)), priced(None));
        let (a, b) = (StreamId(1), StreamId(2));
        let mut drains = vec![];
        for d in [&d, &idle] {
            d.work_queued(a);
            d.work_queued(b);
            d.work_queued(a);
            d.sync_stream(a).unwrap();
            drains.push(d.drains());
            d.sync_stream(a).unwrap();
            drains.push(d.drains());
            d.sync_device().unwrap();
            drains.push(d.drains());
            d.sync_device().unwrap();
            d.work_queued(b);
            d.forget_queued_work();
            d.sync_stream(b).unwrap();
            drains.push(d.drains());
        }
        // a's work once, nothing left on a, b's work, nothing after the device was forgotten.
        assert_eq!(drains, [1, 1, 2, 2, 0, 0, 0, 0]);
        let extra = d.estimated_host_seconds() - idle.estimated_host_seconds();
        let idle_sync = crate::driver::cost::host_seconds(crate::driver::DriverCall::SyncStream, 0);
        assert!((extra - 2.0 * (1e-3 - idle_sync)).abs() < 1e-12, "{extra}");
    }
}
