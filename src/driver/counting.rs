//! Counting driver calls: an adaptor over any [`Driver`] that counts each primitive it
//! forwards and the time the calling thread spent in it, and the value types those figures are
//! read into.
//!
//! The allocator wraps its driver in [`Counting`], so the calls it made are counted in one
//! place, by the call's own name, whatever the backend; replay and `memory_stats` read them
//! from there. Every call is counted when it is made, whether it succeeds or fails (a failed
//! call costs the driver's time too), and its time added when it returns. A cached allocation
//! or free calls the driver only while events are pending (their queries are counted and
//! timed; `is_capturing`, a query of the stream's state, is neither), so the counters' atomics
//! and the clock stay off the plain cached path.
//!
//! Why the time: what an allocator adds to a warm step is its cached path, priced per
//! allocation by the benchmarks, plus whatever it waits for in the driver (maps, releases,
//! synchronisations). The second is read here, per call, inside the process that runs the
//! step, where a step's own time varies between identical runs far more than the allocator
//! costs.

use std::ops::Index;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::{
    Capture, DevicePtr, Driver, DriverCall, DriverResult, EventId, HostPtr, MemInfo, PhysHandle,
    StreamId,
};

const N: usize = DriverCall::ALL.len();

/// Live per-call counters, shared by any number of threads.
#[derive(Debug, Default)]
pub struct CallCounters([AtomicU64; N]);

impl CallCounters {
    /// Count one call of `call`; returns how many there have been, this one included.
    #[inline]
    pub fn bump(&self, call: DriverCall) -> u64 {
        self.0[call.index()].fetch_add(1, Relaxed) + 1
    }

    pub fn get(&self, call: DriverCall) -> u64 {
        self.0[call.index()].load(Relaxed)
    }

    /// The counts now.
    pub fn read(&self) -> DriverCalls {
        DriverCalls(std::array::from_fn(|i| self.0[i].load(Relaxed)))
    }
}

/// How many times each driver primitive was called. Serialised as a map from the call's name
/// ([`DriverCall::name`]) to its count.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DriverCalls([u64; N]);

impl DriverCalls {
    /// Count `n` more calls of `call` (for figures that come from elsewhere, such as a trace).
    pub fn add(&mut self, call: DriverCall, n: u64) {
        // Counts made from a trace's recorded sizes can be absurd; they saturate, never wrap.
        let c = &mut self.0[call.index()];
        *c = c.saturating_add(n);
    }

    /// Every call, of every kind.
    pub fn total(&self) -> u64 {
        self.0.iter().fold(0u64, |a, &c| a.saturating_add(c))
    }

    /// Calls that obtain device memory: plain segments and physical allocations.
    pub fn memory_allocations(&self) -> u64 {
        self[DriverCall::AllocSegment].saturating_add(self[DriverCall::CreatePhysical])
    }

    /// Calls that give device memory back: segment frees and physical releases.
    pub fn memory_frees(&self) -> u64 {
        self[DriverCall::FreeSegment].saturating_add(self[DriverCall::ReleasePhysical])
    }
}

impl Index<DriverCall> for DriverCalls {
    type Output = u64;
    fn index(&self, call: DriverCall) -> &u64 {
        &self.0[call.index()]
    }
}

/// What the per-call figures share: `since`, `nonzero`, and serde as a map from the call's name
/// to its figure.
macro_rules! per_call_figures {
    ($t:ident) => {
        impl $t {
            /// `self − earlier`, per call (figures only grow; a smaller later one reads as 0).
            pub fn since(&self, earlier: &$t) -> $t {
                $t(std::array::from_fn(|i| {
                    self.0[i].saturating_sub(earlier.0[i])
                }))
            }

            /// Every call with a non-zero figure, in [`DriverCall::ALL`] order.
            pub fn nonzero(&self) -> impl Iterator<Item = (DriverCall, u64)> + '_ {
                DriverCall::ALL
                    .into_iter()
                    .map(|c| (c, self.0[c.index()]))
                    .filter(|&(_, n)| n > 0)
            }
        }

        impl Serialize for $t {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                serialize_per_call(&self.0, s)
            }
        }

        impl<'de> Deserialize<'de> for $t {
            fn deserialize<De: serde::Deserializer<'de>>(d: De) -> Result<Self, De::Error> {
                deserialize_per_call(d).map($t)
            }
        }
    };
}

per_call_figures!(DriverCalls);
per_call_figures!(DriverTime);

/// A figure per call, as a map from the call's name to its figure.
fn serialize_per_call<S: serde::Serializer>(v: &[u64; N], s: S) -> Result<S::Ok, S::Error> {
    use serde::ser::SerializeMap;
    let mut m = s.serialize_map(Some(N))?;
    for c in DriverCall::ALL {
        m.serialize_entry(c.name(), &v[c.index()])?;
    }
    m.end()
}

/// The inverse of [`serialize_per_call`]; calls left out read 0, unknown names are refused.
fn deserialize_per_call<'de, De: serde::Deserializer<'de>>(d: De) -> Result<[u64; N], De::Error> {
    let map = std::collections::BTreeMap::<String, u64>::deserialize(d)?;
    let mut out = [0; N];
    for (k, v) in map {
        let call = DriverCall::ALL
            .into_iter()
            .find(|c| c.name() == k)
            .ok_or_else(|| serde::de::Error::custom(format!("unknown driver call {k:?}")))?;
        out[call.index()] = v;
    }
    Ok(out)
}

/// Nanoseconds the calling threads spent in each driver primitive (summed over threads: two
/// threads waiting at once count twice). Serialised as a map from the call's name to its
/// nanoseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DriverTime([u64; N]);

impl DriverTime {
    /// Nanoseconds spent in `call`.
    pub fn nanos(&self, call: DriverCall) -> u64 {
        self.0[call.index()]
    }

    /// Nanoseconds spent in every call.
    pub fn total_nanos(&self) -> u64 {
        self.0.iter().fold(0u64, |a, &c| a.saturating_add(c))
    }
}

/// A driver that counts every primitive it forwards to `D`.
#[derive(Debug)]
pub struct Counting<D> {
    inner: D,
    counts: CallCounters,
    /// Nanoseconds spent in each call, added as each returns.
    nanos: [AtomicU64; N],
}

impl<D> Counting<D> {
    pub fn new(inner: D) -> Self {
        Counting {
            inner,
            counts: CallCounters::default(),
            nanos: Default::default(),
        }
    }

    /// The wrapped driver.
    pub fn inner(&self) -> &D {
        &self.inner
    }

    /// Calls forwarded so far.
    pub fn calls(&self) -> DriverCalls {
        self.counts.read()
    }

    /// Time spent in the calls forwarded so far (those still in progress not yet counted).
    pub fn time(&self) -> DriverTime {
        DriverTime(std::array::from_fn(|i| self.nanos[i].load(Relaxed)))
    }

    /// Count `call`, make it, and add the time it took.
    #[inline]
    fn forward<R>(&self, call: DriverCall, f: impl FnOnce(&D) -> R) -> R {
        self.counts.bump(call);
        let t0 = Instant::now();
        let r = f(&self.inner);
        // One add, as the count's: event queries on the cached path come here while events are
        // pending, from every thread. A u64 of nanoseconds holds 584 years of summed waiting.
        let ns = u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.nanos[call.index()].fetch_add(ns, Relaxed);
        r
    }
}

impl<D: Driver> Driver for Counting<D> {
    fn ordinal(&self) -> usize {
        self.inner.ordinal()
    }
    fn alloc_segment(&self, bytes: u64, stream: StreamId) -> DriverResult<DevicePtr> {
        self.forward(DriverCall::AllocSegment, |d| d.alloc_segment(bytes, stream))
    }
    fn free_segment(&self, ptr: DevicePtr, bytes: u64) -> DriverResult<()> {
        self.forward(DriverCall::FreeSegment, |d| d.free_segment(ptr, bytes))
    }
    fn granularity(&self) -> u64 {
        self.inner.granularity()
    }
    fn reserve_va(&self, bytes: u64) -> DriverResult<DevicePtr> {
        self.forward(DriverCall::ReserveVa, |d| d.reserve_va(bytes))
    }
    fn release_va(&self, ptr: DevicePtr, bytes: u64) -> DriverResult<()> {
        self.forward(DriverCall::ReleaseVa, |d| d.release_va(ptr, bytes))
    }
    fn create_physical(&self, bytes: u64) -> DriverResult<PhysHandle> {
        self.forward(DriverCall::CreatePhysical, |d| d.create_physical(bytes))
    }
    fn release_physical(&self, handle: PhysHandle) -> DriverResult<()> {
        self.forward(DriverCall::ReleasePhysical, |d| d.release_physical(handle))
    }
    fn map(&self, va: DevicePtr, bytes: u64, handle: PhysHandle) -> DriverResult<()> {
        self.forward(DriverCall::Map, |d| d.map(va, bytes, handle))
    }
    fn set_access(&self, va: DevicePtr, bytes: u64) -> DriverResult<()> {
        self.forward(DriverCall::SetAccess, |d| d.set_access(va, bytes))
    }
    fn unmap(&self, va: DevicePtr, bytes: u64) -> DriverResult<()> {
        self.forward(DriverCall::Unmap, |d| d.unmap(va, bytes))
    }
    fn mem_info(&self) -> DriverResult<MemInfo> {
        self.forward(DriverCall::MemInfo, |d| d.mem_info())
    }
    fn process_usage(&self) -> DriverResult<Option<u64>> {
        self.forward(DriverCall::ProcessUsage, |d| d.process_usage())
    }
    fn record_event(&self, stream: StreamId) -> DriverResult<EventId> {
        self.forward(DriverCall::RecordEvent, |d| d.record_event(stream))
    }
    fn query_event(&self, event: EventId) -> DriverResult<bool> {
        self.forward(DriverCall::QueryEvent, |d| d.query_event(event))
    }
    fn wait_event(&self, event: EventId) -> DriverResult<()> {
        self.forward(DriverCall::WaitEvent, |d| d.wait_event(event))
    }
    fn destroy_event(&self, event: EventId) -> DriverResult<()> {
        self.forward(DriverCall::DestroyEvent, |d| d.destroy_event(event))
    }
    fn sync_stream(&self, stream: StreamId) -> DriverResult<()> {
        self.forward(DriverCall::SyncStream, |d| d.sync_stream(stream))
    }
    fn sync_device(&self) -> DriverResult<()> {
        self.forward(DriverCall::SyncDevice, |d| d.sync_device())
    }
    fn host_alloc(&self, bytes: u64) -> DriverResult<HostPtr> {
        self.forward(DriverCall::HostAlloc, |d| d.host_alloc(bytes))
    }
    fn host_free(&self, ptr: HostPtr) -> DriverResult<()> {
        self.forward(DriverCall::HostFree, |d| d.host_free(ptr))
    }
    fn host_alloc_pageable(
        &self,
        bytes: u64,
        file: Option<&std::path::Path>,
    ) -> DriverResult<HostPtr> {
        self.forward(DriverCall::HostAllocPageable, |d| {
            d.host_alloc_pageable(bytes, file)
        })
    }
    fn host_copy(&self, dst: HostPtr, src: HostPtr, bytes: u64) -> DriverResult<()> {
        self.forward(DriverCall::HostCopy, |d| d.host_copy(dst, src, bytes))
    }
    fn create_stream(&self) -> DriverResult<StreamId> {
        self.forward(DriverCall::CreateStream, |d| d.create_stream())
    }
    fn destroy_stream(&self, stream: StreamId) -> DriverResult<()> {
        self.forward(DriverCall::DestroyStream, |d| d.destroy_stream(stream))
    }
    fn copy_to_host(
        &self,
        dst: HostPtr,
        src: DevicePtr,
        bytes: u64,
        stream: StreamId,
    ) -> DriverResult<()> {
        self.forward(DriverCall::CopyToHost, |d| {
            d.copy_to_host(dst, src, bytes, stream)
        })
    }
    fn copy_to_device(
        &self,
        dst: DevicePtr,
        src: HostPtr,
        bytes: u64,
        stream: StreamId,
    ) -> DriverResult<()> {
        self.forward(DriverCall::CopyToDevice, |d| {
            d.copy_to_device(dst, src, bytes, stream)
        })
    }
    fn fill_zero(&self, dst: DevicePtr, bytes: u64, stream: StreamId) -> DriverResult<()> {
        self.forward(DriverCall::FillZero, |d| d.fill_zero(dst, bytes, stream))
    }
    fn capture(&self, stream: StreamId) -> Capture {
        self.inner.capture(stream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::sim::SimDriver;

    #[test]
    fn counts_what_it_forwards_and_agrees_with_the_device() {
        let d = Counting::new(SimDriver::new());
        let p = d.alloc_segment(2 << 20, StreamId::DEFAULT).unwrap();
        d.free_segment(p, 2 << 20).unwrap();
        d.inner().fail_nth(DriverCall::AllocSegment, 1);
        assert!(d.alloc_segment(2 << 20, StreamId::DEFAULT).is_err());
        let c = d.calls();
        // Failed calls count: the device saw them too.
        for call in DriverCall::ALL {
            assert_eq!(c[call], d.inner().calls(call), "{call}");
        }
        assert_eq!(c[DriverCall::AllocSegment], 2);
        assert_eq!(c.memory_allocations(), 2);
        assert_eq!(c.nonzero().count(), 2);
        let json = serde_json::to_string(&c).unwrap();
        assert!(json.contains("\"alloc_segment\":2"), "{json}");
        let back: DriverCalls = serde_json::from_str(&json).unwrap();
        assert_eq!(back, c);
        assert_eq!(c.since(&back), DriverCalls::default());
    }

    #[test]
    fn the_time_spent_in_a_call_is_added_to_that_call() {
        use std::time::Duration;
        let d = Counting::new(SimDriver::new());
        let s = d.create_stream().unwrap();
        let wait = Duration::from_millis(30);
        // The second of three synchronisations waits; so does the third, which fails.
        d.inner().stall_nth(DriverCall::SyncStream, 2, wait);
        d.inner().stall_nth(DriverCall::SyncStream, 3, wait);
        d.inner().fail_nth(DriverCall::SyncStream, 3);
        let before = d.time();
        d.sync_stream(s).unwrap();
        d.sync_stream(s).unwrap();
        let ok = d.time().since(&before);
        assert!(
            ok.nanos(DriverCall::SyncStream) >= wait.as_nanos() as u64,
            "{ok:?}"
        );
        assert!(d.sync_stream(s).is_err());
        let t = d.time().since(&before);
        assert!(
            t.nanos(DriverCall::SyncStream)
                >= ok.nanos(DriverCall::SyncStream) + wait.as_nanos() as u64,
            "the failed call's wait is counted: {t:?}"
        );
        assert_eq!(
            t.nonzero().count(),
            1,
            "only the synchronisations ran: {t:?}"
        );
        assert_eq!(t.total_nanos(), t.nanos(DriverCall::SyncStream));
        let json = serde_json::to_string(&t).unwrap();
        let back: DriverTime = serde_json::from_str(&json).unwrap();
        assert_eq!(back, t);
        assert!(serde_json::from_str::<DriverTime>("{\"no_such_call\":1}").is_err());
    }
}
