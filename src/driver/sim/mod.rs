//! A simulated device: a first-class [`Driver`] backend for tests, fuzzing and replay.
//!
//! Invariants kept here:
//! - Device used = Σ over simulated processes (context + memory allocated behind the
//!   allocator's back + plain segments + physical handles) + other tenants' usage; no call
//!   succeeds that would push it above capacity.
//! - Physical memory is charged from `create_physical` until `release_physical` *and* the last
//!   unmap (as in CUDA, a released handle stays alive while mapped).
//! - A mapping covers exactly one whole live handle (as CUDA requires) at a granularity-aligned
//!   address inside a live reservation, never overlapping another mapping; `unmap` takes
//!   exactly a mapped range.
//! - Every call is counted by kind before any fault or validation is applied, so tests can
//!   assert how many driver calls a policy makes and target the Nth call with a fault.
//!
//! - A stream capturing a graph refuses synchronisation, and queries of events recorded into
//!   the capture; the capture is then invalid, as in CUDA.
//!
//! Several [`SimDriver`]s can share one [`SimDevice`]: each is a process with its own PID,
//! context overhead and per-process usage, which is how profiling tests model engines
//! sharing one GPU.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use parking_lot::Mutex;

mod addresses;
mod config;
mod faults;
mod host;
mod inspect;
mod pricing;
mod streams;
mod touches;

pub use self::config::SimConfig;
use self::faults::Faults;
use super::{
    Capture, DevicePtr, Driver, DriverCall, DriverError, DriverErrorKind, DriverResult, EventId,
    HostPtr, MemInfo, PhysHandle, StreamId,
};

use crate::units::MIB;

/// Streams made by [`Driver::create_stream`] start here, away from the small ids tests use.
const OWN_STREAMS: u64 = 0x7000_0000_0000;

#[derive(Default)]
struct Process {
    context: u64,
    external: u64,
    segments: HashMap<DevicePtr, u64>,
    /// Physical handles: bytes, released flag, live mapping count.
    phys: HashMap<u64, Phys>,
    /// Bytes of `segments` and `phys`, kept as they change: the room check of every
    /// allocation reads it, and summing the maps at each check would be most of a replay's
    /// time in the driver.
    held: u64,
    reservations: BTreeMap<DevicePtr, u64>,
    /// Mapped ranges: va -> (bytes, handle, access set).
    mappings: BTreeMap<DevicePtr, Mapping>,
    usage_visible: bool,
    /// What tests wrote into physical handles, by handle (`host.rs`).
    contents: HashMap<u64, BTreeMap<u64, u64>>,
    /// Offset ranges of each handle filled with zeros since; elsewhere a word nothing wrote
    /// reads as stale data (`host.rs`).
    zeroed: HashMap<u64, Vec<(u64, u64)>>,
    /// Page-locked host buffers by address (`host.rs`).
    host: BTreeMap<u64, host::HostBuf>,
}

struct Phys {
    bytes: u64,
    released: bool,
    mapped: u32,
}

struct Mapping {
    bytes: u64,
    handle: u64,
    accessible: bool,
}

impl Process {
    fn usage(&self) -> u64 {
        self.context + self.external + self.held
    }
}

#[derive(Default, Clone, Copy)]
struct StreamState {
    submitted: u64,
    completed: u64,
    /// The capture this stream is part of: synchronising the stream or querying an event of
    /// it would invalidate the capture, as in CUDA.
    capture: Option<u64>,
    invalidated: bool,
    /// Work that stands for something outside this process's control (a replayed trace's other
    /// streams): it completes only when told to, never by a synchronisation.
    external: bool,
}

struct DeviceState {
    other_usage: u64,
    processes: HashMap<u32, Process>,
    streams: HashMap<StreamId, StreamState>,
    /// (stream, work to complete, recorded while the stream was capturing).
    pub(super) events: HashMap<u64, (StreamId, u64, bool)>,
    next_addr: u64,
    placement: addresses::Placement,
    next_handle: u64,
    next_pid: u32,
    next_capture: u64,
    /// Bytes of segments and physical handles that exited processes still held: what only the
    /// process's exit gave back (a leak, as compute-sanitizer reports it).
    reclaimed_at_exit: u64,
    /// Unfinished work that uses device addresses, and unmaps made under it (`touches.rs`).
    touches: Vec<touches::Touch>,
    unsafe_unmaps: Vec<String>,
}

impl DeviceState {
    fn used(&self) -> u64 {
        self.other_usage + self.processes.values().map(Process::usage).sum::<u64>()
    }

    fn bump_addr(&mut self, bytes: u64, align: u64) -> DevicePtr {
        let base = self.next_addr.div_ceil(align) * align;
        // Leave a guard gap so that adjacent segments never look contiguous.
        self.next_addr = base + bytes + align;
        base
    }
}

/// A simulated GPU shared by one or more simulated processes.
pub struct SimDevice {
    config: SimConfig,
    state: Mutex<DeviceState>,
    /// Copies between host and device wait while this is set (`host.rs`), so that a test can
    /// see what other threads can do while a sleep or a wake copies.
    copies: host::CopyGate,
}

impl SimDevice {
    /// # Panics
    /// If `config.granularity` is not a power of two (no GPU's is).
    pub fn new(config: SimConfig) -> Arc<SimDevice> {
        assert!(
            config.granularity.is_power_of_two(),
            "granularity must be a power of two"
        );
        Arc::new(SimDevice {
            config,
            state: Mutex::new(DeviceState {
                other_usage: 0,
                processes: HashMap::new(),
                streams: HashMap::new(),
                events: HashMap::new(),
                next_addr: 1 << 40,
                placement: Default::default(),
                next_handle: 1,
                next_pid: 1000,
                next_capture: 0,
                reclaimed_at_exit: 0,
                touches: Vec::new(),
                unsafe_unmaps: Vec::new(),
            }),
            copies: Default::default(),
        })
    }

    pub fn config(&self) -> &SimConfig {
        &self.config
    }

    /// Start a new simulated process on this device: its context overhead is charged now.
    /// Fails when the device cannot hold the context.
    pub fn spawn_process(self: &Arc<Self>) -> DriverResult<SimDriver> {
        let mut st = self.state.lock();
        if st.used() + self.config.context_overhead > self.config.capacity {
            return Err(DriverError::new(
                DriverCall::AllocSegment,
                DriverErrorKind::OutOfMemory,
                "no room for a CUDA context",
            ));
        }
        let pid = st.next_pid;
        st.next_pid += 1;
        st.processes.insert(
            pid,
            Process {
                context: self.config.context_overhead,
                usage_visible: true,
                ..Default::default()
            },
        );
        drop(st);
        Ok(SimDriver {
            device: Arc::clone(self),
            pid,
            faults: Faults::default(),
            host_ns: Default::default(),
            drains: Mutex::new(crate::driver::cost::Drains::new(self.config.sync_ns)),
        })
    }

    /// Memory used by processes that are not simulated here (other tenants of the GPU).
    pub fn set_other_usage(&self, bytes: u64) {
        self.state.lock().other_usage = bytes;
    }

    pub fn other_usage(&self) -> u64 {
        self.state.lock().other_usage
    }

    /// Device-wide used bytes.
    pub fn used(&self) -> u64 {
        self.state.lock().used()
    }
}
/// One simulated process's view of a [`SimDevice`], implementing [`Driver`].
pub struct SimDriver {
    device: Arc<SimDevice>,
    pid: u32,
    faults: Faults,
    /// Estimated host time of the calls made, in nanoseconds (`pricing.rs`).
    host_ns: std::sync::atomic::AtomicU64,
    /// The streams with work queued since the host last waited for them, priced at
    /// [`SimConfig::sync_ns`] (`pricing.rs`).
    drains: Mutex<crate::driver::cost::Drains>,
}

impl SimDriver {
    /// A process on a fresh device with default settings (80 GiB, 2 MiB, 512 MiB context).
    pub fn new() -> SimDriver {
        Self::with_config(SimConfig::default())
    }

    /// A process on a fresh device.
    ///
    /// # Panics
    /// If the device cannot hold a process's context (`capacity` below `context_overhead`), or
    /// as [`SimDevice::new`] does; [`SimDevice::spawn_process`] returns the first as an error.
    pub fn with_config(config: SimConfig) -> SimDriver {
        SimDevice::new(config)
            .spawn_process()
            .expect("a fresh device holds one context")
    }

    pub fn device(&self) -> &Arc<SimDevice> {
        &self.device
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The size of a physical handle of this process (0 if unknown).
    fn handle_bytes(&self, handle: PhysHandle) -> u64 {
        let st = self.device.state.lock();
        st.processes[&self.pid]
            .phys
            .get(&handle.0)
            .map_or(0, |p| p.bytes)
    }

    fn check_room(&self, st: &DeviceState, bytes: u64, call: DriverCall) -> DriverResult<()> {
        let used = st.used();
        if used.saturating_add(bytes) > self.device.config.capacity {
            return Err(DriverError::new(
                call,
                DriverErrorKind::OutOfMemory,
                format!(
                    "{} bytes requested, {} of {} bytes free",
                    bytes,
                    self.device.config.capacity - used.min(self.device.config.capacity),
                    self.device.config.capacity
                ),
            ));
        }
        Ok(())
    }

    fn invalid(call: DriverCall, detail: impl Into<String>) -> DriverError {
        DriverError::new(call, DriverErrorKind::InvalidValue, detail)
    }
}

impl Default for SimDriver {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for SimDriver {
    fn drop(&mut self) {
        // Process exit: the driver reclaims everything the process held.
        let held = self.held_bytes();
        let mut st = self.device.state.lock();
        st.processes.remove(&self.pid);
        st.reclaimed_at_exit += held;
    }
}

impl Driver for SimDriver {
    fn ordinal(&self) -> usize {
        0
    }

    fn alloc_segment(&self, bytes: u64, _stream: StreamId) -> DriverResult<DevicePtr> {
        const CALL: DriverCall = DriverCall::AllocSegment;
        self.count(CALL, bytes)?;
        if bytes == 0 {
            return Err(Self::invalid(CALL, "zero-byte segment"));
        }
        let mut st = self.device.state.lock();
        self.check_room(&st, bytes, CALL)?;
        // Like the CUDA driver: every segment PyTorch's allocator was seen to get on an H200
        // (314 in `tests/data`'s traces, all of 2 MiB or more) started on a 2 MiB boundary.
        let align = if bytes >= 2 * MIB { 2 * MIB } else { 512 };
        let ptr = st.segment_addr(bytes, align);
        let p = st.processes.get_mut(&self.pid).expect("process exists");
        p.segments.insert(ptr, bytes);
        p.held += bytes;
        Ok(ptr)
    }

    fn free_segment(&self, ptr: DevicePtr, bytes: u64) -> DriverResult<()> {
        const CALL: DriverCall = DriverCall::FreeSegment;
        self.count(CALL, bytes)?;
        // cuMemFree synchronises the device.
        self.waited(None);
        let mut st = self.device.state.lock();
        let p = st.processes.get_mut(&self.pid).expect("process exists");
        match p.segments.get(&ptr) {
            Some(&b) if b == bytes => {
                p.segments.remove(&ptr);
                p.held -= b;
                Ok(())
            }
            Some(&b) => Err(Self::invalid(
                CALL,
                format!("segment {ptr:#x} has {b} bytes, not {bytes}"),
            )),
            None => Err(Self::invalid(CALL, format!("{ptr:#x} is not a segment"))),
        }
    }

    fn granularity(&self) -> u64 {
        self.device.config.granularity
    }

    fn reserve_va(&self, bytes: u64) -> DriverResult<DevicePtr> {
        const CALL: DriverCall = DriverCall::ReserveVa;
        self.count(CALL, 0)?;
        let g = self.device.config.granularity;
        if bytes == 0 || !bytes.is_multiple_of(g) {
            return Err(Self::invalid(
                CALL,
                format!("{bytes} is not a positive multiple of {g}"),
            ));
        }
        let mut st = self.device.state.lock();
        let va = st.bump_addr(bytes, g);
        st.processes
            .get_mut(&self.pid)
            .expect("process exists")
            .reservations
            .insert(va, bytes);
        Ok(va)
    }

    fn release_va(&self, ptr: DevicePtr, bytes: u64) -> DriverResult<()> {
        const CALL: DriverCall = DriverCall::ReleaseVa;
        self.count(CALL, 0)?;
        let mut st = self.device.state.lock();
        let p = st.processes.get_mut(&self.pid).expect("process exists");
        if p.reservations.get(&ptr) != Some(&bytes) {
            return Err(Self::invalid(
                CALL,
                format!("{ptr:#x}+{bytes} is not a reservation"),
            ));
        }
        if p.mappings.range(ptr..ptr + bytes).next().is_some() {
            return Err(Self::invalid(CALL, "reservation still has mappings"));
        }
        p.reservations.remove(&ptr);
        Ok(())
    }

    fn create_physical(&self, bytes: u64) -> DriverResult<PhysHandle> {
        const CALL: DriverCall = DriverCall::CreatePhysical;
        self.count(CALL, bytes)?;
        let g = self.device.config.granularity;
        if bytes == 0 || !bytes.is_multiple_of(g) {
            return Err(Self::invalid(
                CALL,
                format!("{bytes} is not a positive multiple of {g}"),
            ));
        }
        let mut st = self.device.state.lock();
        self.check_room(&st, bytes, CALL)?;
        let h = st.next_handle;
        st.next_handle += 1;
        let p = st.processes.get_mut(&self.pid).expect("process exists");
        let fresh = Phys {
            bytes,
            released: false,
            mapped: 0,
        };
        p.phys.insert(h, fresh);
        p.held += bytes;
        Ok(PhysHandle(h))
    }

    fn release_physical(&self, handle: PhysHandle) -> DriverResult<()> {
        const CALL: DriverCall = DriverCall::ReleasePhysical;
        self.count(CALL, self.handle_bytes(handle))?;
        let mut st = self.device.state.lock();
        let p = st.processes.get_mut(&self.pid).expect("process exists");
        match p.phys.get_mut(&handle.0) {
            Some(ph) if !ph.released => {
                ph.released = true;
                if ph.mapped == 0 {
                    p.held -= ph.bytes;
                    p.phys.remove(&handle.0);
                    p.contents.remove(&handle.0);
                    p.zeroed.remove(&handle.0);
                }
                Ok(())
            }
            _ => Err(Self::invalid(CALL, format!("unknown handle {}", handle.0))),
        }
    }

    fn map(&self, va: DevicePtr, bytes: u64, handle: PhysHandle) -> DriverResult<()> {
        const CALL: DriverCall = DriverCall::Map;
        self.count(CALL, bytes)?;
        let g = self.device.config.granularity;
        let mut st = self.device.state.lock();
        let p = st.processes.get_mut(&self.pid).expect("process exists");
        if !va.is_multiple_of(g) {
            return Err(Self::invalid(CALL, "unaligned address"));
        }
        match p.phys.get(&handle.0) {
            Some(ph) if !ph.released && ph.bytes == bytes => {}
            _ => {
                return Err(Self::invalid(
                    CALL,
                    "handle unknown, released, or not exactly this size",
                ))
            }
        }
        let inside = p
            .reservations
            .range(..=va)
            .next_back()
            .is_some_and(|(&b, &s)| va + bytes <= b + s);
        if !inside {
            return Err(Self::invalid(CALL, "range is not inside a reservation"));
        }
        let overlaps = p
            .mappings
            .range(..va + bytes)
            .next_back()
            .is_some_and(|(&m, mm)| m + mm.bytes > va);
        if overlaps {
            return Err(Self::invalid(CALL, "range is already mapped"));
        }
        p.mappings.insert(
            va,
            Mapping {
                bytes,
                handle: handle.0,
                accessible: false,
            },
        );
        p.phys.get_mut(&handle.0).expect("checked").mapped += 1;
        Ok(())
    }

    fn set_access(&self, va: DevicePtr, bytes: u64) -> DriverResult<()> {
        const CALL: DriverCall = DriverCall::SetAccess;
        self.count(CALL, bytes)?;
        let mut st = self.device.state.lock();
        let p = st.processes.get_mut(&self.pid).expect("process exists");
        let mut cursor = va;
        while cursor < va + bytes {
            match p.mappings.get_mut(&cursor) {
                Some(m) => {
                    m.accessible = true;
                    cursor += m.bytes;
                }
                None => return Err(Self::invalid(CALL, format!("{cursor:#x} is not mapped"))),
            }
        }
        Ok(())
    }

    fn unmap(&self, va: DevicePtr, bytes: u64) -> DriverResult<()> {
        const CALL: DriverCall = DriverCall::Unmap;
        self.count(CALL, bytes)?;
        let mut st = self.device.state.lock();
        let p = st.processes.get_mut(&self.pid).expect("process exists");
        let m = match p.mappings.get(&va) {
            Some(m) if m.bytes == bytes => p.mappings.remove(&va).expect("present"),
            _ => {
                return Err(Self::invalid(
                    CALL,
                    format!("{va:#x}+{bytes} is not a mapped range"),
                ))
            }
        };
        let ph = p.phys.get_mut(&m.handle).expect("mapped handle exists");
        ph.mapped -= 1;
        if ph.released && ph.mapped == 0 {
            p.held -= ph.bytes;
            p.phys.remove(&m.handle);
            p.contents.remove(&m.handle);
            p.zeroed.remove(&m.handle);
        }
        st.check_unmap(va, bytes);
        Ok(())
    }

    fn mem_info(&self) -> DriverResult<MemInfo> {
        self.count(DriverCall::MemInfo, 0)?;
        let st = self.device.state.lock();
        let total = self.device.config.capacity;
        Ok(MemInfo {
            free: total.saturating_sub(st.used()),
            total,
        })
    }

    fn process_usage(&self) -> DriverResult<Option<u64>> {
        self.count(DriverCall::ProcessUsage, 0)?;
        let st = self.device.state.lock();
        let p = &st.processes[&self.pid];
        Ok(p.usage_visible.then(|| p.usage()))
    }

    fn record_event(&self, stream: StreamId) -> DriverResult<EventId> {
        self.device.real_stream(stream);
        self.count(DriverCall::RecordEvent, 0)?;
        let mut st = self.device.state.lock();
        let s = st.streams.entry(stream).or_default();
        let (target, captured) = (s.submitted, s.capture.is_some());
        let id = st.next_handle;
        st.next_handle += 1;
        st.events.insert(id, (stream, target, captured));
        Ok(EventId(id))
    }

    fn query_event(&self, event: EventId) -> DriverResult<bool> {
        const CALL: DriverCall = DriverCall::QueryEvent;
        self.count(CALL, 0)?;
        let mut st = self.device.state.lock();
        let (stream, target) = st.recorded(event, CALL)?;
        Ok(st.streams.get(&stream).map_or(0, |s| s.completed) >= target)
    }

    fn wait_event(&self, event: EventId) -> DriverResult<()> {
        const CALL: DriverCall = DriverCall::WaitEvent;
        self.count(CALL, 0)?;
        let mut st = self.device.state.lock();
        let (stream, target) = st.recorded(event, CALL)?;
        // Blocking until the event completes is, on a simulated device, completing it; it
        // drains the stream's queued work as a synchronisation of the stream does.
        let s = st.streams.entry(stream).or_default();
        s.completed = s.completed.max(target);
        drop(st);
        self.waited(Some(stream));
        Ok(())
    }

    fn destroy_event(&self, event: EventId) -> DriverResult<()> {
        const CALL: DriverCall = DriverCall::DestroyEvent;
        self.count(CALL, 0)?;
        let mut st = self.device.state.lock();
        st.events
            .remove(&event.0)
            .map(|_| ())
            .ok_or_else(|| Self::invalid(CALL, "unknown event"))
    }

    fn sync_stream(&self, stream: StreamId) -> DriverResult<()> {
        self.device.real_stream(stream);
        self.count(DriverCall::SyncStream, 0)?;
        let mut st = self.device.state.lock();
        st.not_while_capturing(stream, DriverCall::SyncStream)?;
        let s = st.streams.entry(stream).or_default();
        s.completed = s.submitted;
        drop(st);
        self.waited(Some(stream));
        Ok(())
    }

    fn sync_device(&self) -> DriverResult<()> {
        self.count(DriverCall::SyncDevice, 0)?;
        let mut st = self.device.state.lock();
        let capturing: Vec<StreamId> = st
            .streams
            .iter()
            .filter(|(_, s)| s.capture.is_some())
            .map(|(&id, _)| id)
            .collect();
        for id in capturing {
            st.not_while_capturing(id, DriverCall::SyncDevice)?;
        }
        for s in st.streams.values_mut().filter(|s| !s.external) {
            s.completed = s.submitted;
        }
        drop(st);
        self.waited(None);
        Ok(())
    }

    fn host_alloc(&self, bytes: u64) -> DriverResult<HostPtr> {
        self.count(DriverCall::HostAlloc, bytes)?;
        self.alloc_host(bytes, false)
    }

    fn host_alloc_pageable(
        &self,
        bytes: u64,
        file: Option<&std::path::Path>,
    ) -> DriverResult<HostPtr> {
        self.count(DriverCall::HostAllocPageable, bytes)?;
        if let Some(path) = file {
            self.make_file(path)?;
        }
        self.alloc_host(bytes, true)
    }

    fn host_copy(&self, dst: HostPtr, src: HostPtr, bytes: u64) -> DriverResult<()> {
        self.count(DriverCall::HostCopy, bytes)?;
        self.copy_host(dst, src, bytes)
    }

    fn host_free(&self, ptr: HostPtr) -> DriverResult<()> {
        self.count(DriverCall::HostFree, 0)?;
        self.free_host(ptr)
    }

    fn create_stream(&self) -> DriverResult<StreamId> {
        self.count(DriverCall::CreateStream, 0)?;
        Ok(self.device.new_stream())
    }

    fn destroy_stream(&self, stream: StreamId) -> DriverResult<()> {
        self.count(DriverCall::DestroyStream, 0)?;
        self.device.drop_stream(stream)
    }

    fn copy_to_host(
        &self,
        dst: HostPtr,
        src: DevicePtr,
        bytes: u64,
        s: StreamId,
    ) -> DriverResult<()> {
        self.count(DriverCall::CopyToHost, bytes)?;
        self.copy(host::Direction::ToHost, dst, src, bytes, s)
    }

    fn copy_to_device(
        &self,
        dst: DevicePtr,
        src: HostPtr,
        bytes: u64,
        s: StreamId,
    ) -> DriverResult<()> {
        self.count(DriverCall::CopyToDevice, bytes)?;
        self.copy(host::Direction::ToDevice, src, dst, bytes, s)
    }

    fn fill_zero(&self, dst: DevicePtr, bytes: u64, s: StreamId) -> DriverResult<()> {
        self.count(DriverCall::FillZero, bytes)?;
        self.zero(dst, bytes, s)
    }

    fn capture(&self, stream: StreamId) -> Capture {
        self.device.real_stream(stream);
        let st = self.device.state.lock();
        match st.streams.get(&stream).and_then(|s| s.capture) {
            Some(id) => Capture::Active(id),
            None => Capture::None,
        }
    }
}
