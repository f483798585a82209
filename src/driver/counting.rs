//! Counting driver calls: an adaptor over any [`Driver`] that counts each primitive it
//! forwards, and the value type those counts are read into.
//!
//! The allocator wraps its driver in [`Counting`], so the calls it made are counted in one
//! place, by the call's own name, whatever the backend; replay and `memory_stats` read them
//! from there. Every call is counted when it is made, whether it succeeds or fails (a failed
//! call costs the driver's time too). A cached allocation or free calls the driver only while
//! events are pending (their queries are counted; `is_capturing`, a query of the stream's
//! state, is not), so the counters' atomics stay off the plain cached path.

use std::ops::Index;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

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

    /// `self − earlier`, per call (counts only grow; a smaller later count reads as 0).
    pub fn since(&self, earlier: &DriverCalls) -> DriverCalls {
        DriverCalls(std::array::from_fn(|i| {
            self.0[i].saturating_sub(earlier.0[i])
        }))
    }

    /// Every call with a non-zero count, in [`DriverCall::ALL`] order.
    pub fn nonzero(&self) -> impl Iterator<Item = (DriverCall, u64)> + '_ {
        DriverCall::ALL
            .into_iter()
            .map(|c| (c, self[c]))
            .filter(|&(_, n)| n > 0)
    }
}

impl Index<DriverCall> for DriverCalls {
    type Output = u64;
    fn index(&self, call: DriverCall) -> &u64 {
        &self.0[call.index()]
    }
}

impl Serialize for DriverCalls {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(N))?;
        for c in DriverCall::ALL {
            m.serialize_entry(c.name(), &self[c])?;
        }
        m.end()
    }
}

impl<'de> Deserialize<'de> for DriverCalls {
    fn deserialize<De: serde::Deserializer<'de>>(d: De) -> Result<Self, De::Error> {
        let map = std::collections::BTreeMap::<String, u64>::deserialize(d)?;
        let mut out = DriverCalls::default();
        for (k, v) in map {
            let call = DriverCall::ALL
                .into_iter()
                .find(|c| c.name() == k)
                .ok_or_else(|| serde::de::Error::custom(format!("unknown driver call {k:?}")))?;
            out.0[call.index()] = v;
        }
        Ok(out)
    }
}

/// A driver that counts every primitive it forwards to `D`.
#[derive(Debug)]
pub struct Counting<D> {
    inner: D,
    counts: CallCounters,
}

impl<D> Counting<D> {
    pub fn new(inner: D) -> Self {
        Counting {
            inner,
            counts: CallCounters::default(),
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
}

impl<D: Driver> Driver for Counting<D> {
    fn ordinal(&self) -> usize {
        self.inner.ordinal()
    }
    fn alloc_segment(&self, bytes: u64, stream: StreamId) -> DriverResult<DevicePtr> {
        self.counts.bump(DriverCall::AllocSegment);
        self.inner.alloc_segment(bytes, stream)
    }
    fn free_segment(&self, ptr: DevicePtr, bytes: u64) -> DriverResult<()> {
        self.counts.bump(DriverCall::FreeSegment);
        self.inner.free_segment(ptr, bytes)
    }
    fn granularity(&self) -> u64 {
        self.inner.granularity()
    }
    fn reserve_va(&self, bytes: u64) -> DriverResult<DevicePtr> {
        self.counts.bump(DriverCall::ReserveVa);
        self.inner.reserve_va(bytes)
    }
    fn release_va(&self, ptr: DevicePtr, bytes: u64) -> DriverResult<()> {
        self.counts.bump(DriverCall::ReleaseVa);
        self.inner.release_va(ptr, bytes)
    }
    fn create_physical(&self, bytes: u64) -> DriverResult<PhysHandle> {
        self.counts.bump(DriverCall::CreatePhysical);
        self.inner.create_physical(bytes)
    }
    fn release_physical(&self, handle: PhysHandle) -> DriverResult<()> {
        self.counts.bump(DriverCall::ReleasePhysical);
        self.inner.release_physical(handle)
    }
    fn map(&self, va: DevicePtr, bytes: u64, handle: PhysHandle) -> DriverResult<()> {
        self.counts.bump(DriverCall::Map);
        self.inner.map(va, bytes, handle)
    }
    fn set_access(&self, va: DevicePtr, bytes: u64) -> DriverResult<()> {
        self.counts.bump(DriverCall::SetAccess);
        self.inner.set_access(va, bytes)
    }
    fn unmap(&self, va: DevicePtr, bytes: u64) -> DriverResult<()> {
        self.counts.bump(DriverCall::Unmap);
        self.inner.unmap(va, bytes)
    }
    fn mem_info(&self) -> DriverResult<MemInfo> {
        self.counts.bump(DriverCall::MemInfo);
        self.inner.mem_info()
    }
    fn process_usage(&self) -> DriverResult<Option<u64>> {
        self.counts.bump(DriverCall::ProcessUsage);
        self.inner.process_usage()
    }
    fn record_event(&self, stream: StreamId) -> DriverResult<EventId> {
        self.counts.bump(DriverCall::RecordEvent);
        self.inner.record_event(stream)
    }
    fn query_event(&self, event: EventId) -> DriverResult<bool> {
        self.counts.bump(DriverCall::QueryEvent);
        self.inner.query_event(event)
    }
    fn wait_event(&self, event: EventId) -> DriverResult<()> {
        self.counts.bump(DriverCall::WaitEvent);
        self.inner.wait_event(event)
    }
    fn destroy_event(&self, event: EventId) -> DriverResult<()> {
        self.counts.bump(DriverCall::DestroyEvent);
        self.inner.destroy_event(event)
    }
    fn sync_stream(&self, stream: StreamId) -> DriverResult<()> {
        self.counts.bump(DriverCall::SyncStream);
        self.inner.sync_stream(stream)
    }
    fn sync_device(&self) -> DriverResult<()> {
        self.counts.bump(DriverCall::SyncDevice);
        self.inner.sync_device()
    }
    fn host_alloc(&self, bytes: u64) -> DriverResult<HostPtr> {
        self.counts.bump(DriverCall::HostAlloc);
        self.inner.host_alloc(bytes)
    }
    fn host_free(&self, ptr: HostPtr) -> DriverResult<()> {
        self.counts.bump(DriverCall::HostFree);
        self.inner.host_free(ptr)
    }
    fn host_alloc_pageable(
        &self,
        bytes: u64,
        file: Option<&std::path::Path>,
    ) -> DriverResult<HostPtr> {
        self.counts.bump(DriverCall::HostAllocPageable);
        self.inner.host_alloc_pageable(bytes, file)
    }
    fn host_copy(&self, dst: HostPtr, src: HostPtr, bytes: u64) -> DriverResult<()> {
        self.counts.bump(DriverCall::HostCopy);
        self.inner.host_copy(dst, src, bytes)
    }
    fn create_stream(&self) -> DriverResult<StreamId> {
        self.counts.bump(DriverCall::CreateStream);
        self.inner.create_stream()
    }
    fn destroy_stream(&self, stream: StreamId) -> DriverResult<()> {
        self.counts.bump(DriverCall::DestroyStream);
        self.inner.destroy_stream(stream)
    }
    fn copy_to_host(
        &self,
        dst: HostPtr,
        src: DevicePtr,
        bytes: u64,
        stream: StreamId,
    ) -> DriverResult<()> {
        self.counts.bump(DriverCall::CopyToHost);
        self.inner.copy_to_host(dst, src, bytes, stream)
    }
    fn copy_to_device(
        &self,
        dst: DevicePtr,
        src: HostPtr,
        bytes: u64,
        stream: StreamId,
    ) -> DriverResult<()> {
        self.counts.bump(DriverCall::CopyToDevice);
        self.inner.copy_to_device(dst, src, bytes, stream)
    }
    fn fill_zero(&self, dst: DevicePtr, bytes: u64, stream: StreamId) -> DriverResult<()> {
        self.counts.bump(DriverCall::FillZero);
        self.inner.fill_zero(dst, bytes, stream)
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
}
