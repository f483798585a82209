//! The driver trait: the only door to device memory.
//!
//! Everything above this module (allocator, ledger, profiler) talks to device memory through
//! [`Driver`] and nothing else. Two backends implement it: [`sim::SimDriver`], a simulated
//! device used by tests, fuzzing and replay, and (behind run-time detection) the CUDA driver.
//!
//! The trait mirrors the CUDA driver API one call per method so that a real implementation is a
//! thin checked wrapper: plain segments are `cuMemAlloc`/`cuMemFree`; virtual memory is
//! `cuMemAddressReserve`/`cuMemCreate`/`cuMemMap`/`cuMemSetAccess`/`cuMemUnmap`/`cuMemRelease`/
//! `cuMemAddressFree`; streams and events are `cuEventRecord`/`cuEventQuery`/
//! `cuEventSynchronize`/`cuStreamSynchronize`. Handles are plain integers (device pointers,
//! generic allocation handles, event pointers) so that the allocator can store them in its
//! tables without lifetimes or heap allocation. [`counting::Counting`] wraps any driver and
//! counts the calls made through it.

pub mod cost;
pub mod counting;
pub mod cuda;
mod cuda_result;
pub mod external;
mod host_buffers;
mod host_room;
pub mod nvml;
mod pinned;
pub mod sim;

use std::fmt;

use thiserror::Error;

/// A device virtual address (a `CUdeviceptr`).
pub type DevicePtr = u64;

/// A CUDA stream, identified by its raw handle value. `StreamId(0)` is the legacy default stream.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamId(pub u64);

impl StreamId {
    /// The legacy default stream.
    pub const DEFAULT: StreamId = StreamId(0);
}

/// A physical memory handle created by [`Driver::create_physical`] (`CUmemGenericAllocationHandle`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PhysHandle(pub u64);

/// Page-locked host memory from [`Driver::host_alloc`] (an address; `HostPtr(base + k)` is
/// `k` bytes into a buffer).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HostPtr(pub u64);

/// An event recorded on a stream by [`Driver::record_event`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EventId(pub u64);

/// Device-wide memory as the driver reports it (`cuMemGetInfo`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MemInfo {
    pub free: u64,
    pub total: u64,
}

/// A driver call, named in every [`DriverError`]. The first twenty-six are the allocator's
/// primitives ([`DriverCall::ALL`]: counted and faulted by the simulated driver); the rest
/// ([`DriverCall::SETUP`]) are the CUDA backend's one-off set-up of a device, which no allocator
/// path makes and no simulated device counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DriverCall {
    AllocSegment,
    FreeSegment,
    ReserveVa,
    ReleaseVa,
    CreatePhysical,
    ReleasePhysical,
    Map,
    SetAccess,
    Unmap,
    MemInfo,
    ProcessUsage,
    RecordEvent,
    QueryEvent,
    WaitEvent,
    DestroyEvent,
    SyncStream,
    SyncDevice,
    HostAlloc,
    HostFree,
    CreateStream,
    DestroyStream,
    CopyToHost,
    CopyToDevice,
    FillZero,
    HostAllocPageable,
    HostCopy,
    // Set-up calls: after the primitives, so that a primitive's discriminant is its index.
    Init,
    DeviceCount,
    DeviceGet,
    PrimaryContext,
    DeviceUuid,
    Granularity,
}

impl DriverCall {
    pub const ALL: [DriverCall; 26] = [
        DriverCall::AllocSegment,
        DriverCall::FreeSegment,
        DriverCall::ReserveVa,
        DriverCall::ReleaseVa,
        DriverCall::CreatePhysical,
        DriverCall::ReleasePhysical,
        DriverCall::Map,
        DriverCall::SetAccess,
        DriverCall::Unmap,
        DriverCall::MemInfo,
        DriverCall::ProcessUsage,
        DriverCall::RecordEvent,
        DriverCall::QueryEvent,
        DriverCall::WaitEvent,
        DriverCall::DestroyEvent,
        DriverCall::SyncStream,
        DriverCall::SyncDevice,
        DriverCall::HostAlloc,
        DriverCall::HostFree,
        DriverCall::CreateStream,
        DriverCall::DestroyStream,
        DriverCall::CopyToHost,
        DriverCall::CopyToDevice,
        DriverCall::FillZero,
        DriverCall::HostAllocPageable,
        DriverCall::HostCopy,
    ];

    /// The CUDA backend's set-up calls, none of which is in [`DriverCall::ALL`].
    pub const SETUP: [DriverCall; 6] = [
        DriverCall::Init,
        DriverCall::DeviceCount,
        DriverCall::DeviceGet,
        DriverCall::PrimaryContext,
        DriverCall::DeviceUuid,
        DriverCall::Granularity,
    ];

    /// Whether this is one of the allocator's primitives ([`DriverCall::ALL`]).
    pub const fn is_primitive(self) -> bool {
        (self as usize) < Self::ALL.len()
    }

    /// Position in [`DriverCall::ALL`], for per-primitive arrays sized by `ALL.len()`. A set-up
    /// call has none: asking panics here, with its name, instead of indexing past such an array.
    pub const fn index(self) -> usize {
        assert!(
            self.is_primitive(),
            "a set-up driver call has no index in DriverCall::ALL"
        );
        self as usize
    }

    pub const fn name(self) -> &'static str {
        match self {
            DriverCall::AllocSegment => "alloc_segment",
            DriverCall::FreeSegment => "free_segment",
            DriverCall::ReserveVa => "reserve_va",
            DriverCall::ReleaseVa => "release_va",
            DriverCall::CreatePhysical => "create_physical",
            DriverCall::ReleasePhysical => "release_physical",
            DriverCall::Map => "map",
            DriverCall::SetAccess => "set_access",
            DriverCall::Unmap => "unmap",
            DriverCall::MemInfo => "mem_info",
            DriverCall::ProcessUsage => "process_usage",
            DriverCall::RecordEvent => "record_event",
            DriverCall::QueryEvent => "query_event",
            DriverCall::WaitEvent => "wait_event",
            DriverCall::DestroyEvent => "destroy_event",
            DriverCall::SyncStream => "sync_stream",
            DriverCall::SyncDevice => "sync_device",
            DriverCall::HostAlloc => "host_alloc",
            DriverCall::HostFree => "host_free",
            DriverCall::HostAllocPageable => "host_alloc_pageable",
            DriverCall::HostCopy => "host_copy",
            DriverCall::CreateStream => "create_stream",
            DriverCall::DestroyStream => "destroy_stream",
            DriverCall::CopyToHost => "copy_to_host",
            DriverCall::CopyToDevice => "copy_to_device",
            DriverCall::FillZero => "fill_zero",
            DriverCall::Init => "init",
            DriverCall::DeviceCount => "device_count",
            DriverCall::DeviceGet => "device_get",
            DriverCall::PrimaryContext => "primary_context",
            DriverCall::DeviceUuid => "device_uuid",
            DriverCall::Granularity => "granularity",
        }
    }
}

impl fmt::Display for DriverCall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What went wrong in a driver call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DriverErrorKind {
    /// The device (or the simulated device) has no memory for the request.
    OutOfMemory,
    /// A fault injected by the simulated driver.
    Injected,
    /// Arguments the driver rejected (unknown handle, misaligned size, ...).
    InvalidValue,
    /// No driver or no device: CUDA is not installed, or the ordinal does not exist.
    NoDevice,
    /// Any other driver error, with the raw `CUresult` code.
    Other(i32),
}

/// A failed driver call.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
#[error("driver call {call} failed ({kind:?}): {detail}")]
pub struct DriverError {
    pub call: DriverCall,
    pub kind: DriverErrorKind,
    pub detail: String,
}

impl DriverError {
    pub fn new(call: DriverCall, kind: DriverErrorKind, detail: impl Into<String>) -> Self {
        DriverError {
            call,
            kind,
            detail: detail.into(),
        }
    }

    pub fn is_out_of_memory(&self) -> bool {
        self.kind == DriverErrorKind::OutOfMemory
    }
}

pub type DriverResult<T> = Result<T, DriverError>;

/// Whether a stream is capturing a CUDA graph, and which capture.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Capture {
    /// Not capturing.
    None,
    /// Capturing; the id is the driver's, unique among this process's captures.
    Active(u64),
    /// The driver could not say. Counts as capturing: a wrong "no" would let a query or a
    /// synchronisation spoil a capture, a wrong "yes" only defers them.
    Unknown,
}

/// A CUDA graph memory pool's identity, as PyTorch names its memory pools (`MempoolId_t`):
/// two integers, one of them non-zero. Captures that name the same pool share its memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GraphPool(pub u64, pub u64);

/// The primitives the allocator needs from a device. Implementations must be thread-safe:
/// the allocator calls them from any thread, without holding a global lock.
pub trait Driver: Send + Sync + 'static {
    /// The device ordinal this driver talks to.
    fn ordinal(&self) -> usize;

    /// Allocate a plain segment (`cuMemAlloc`). `stream` is the stream the caller is on, so a
    /// real driver can switch to relaxed capture mode while that stream captures a graph.
    fn alloc_segment(&self, bytes: u64, stream: StreamId) -> DriverResult<DevicePtr>;
    /// Free a plain segment (`cuMemFree`). The caller has synchronised every stream that used it.
    fn free_segment(&self, ptr: DevicePtr, bytes: u64) -> DriverResult<()>;

    /// The physical allocation granularity for virtual-memory mappings.
    fn granularity(&self) -> u64;
    /// Reserve a range of device virtual addresses (`cuMemAddressReserve`).
    fn reserve_va(&self, bytes: u64) -> DriverResult<DevicePtr>;
    /// Give a reserved range back (`cuMemAddressFree`). Nothing may be mapped in it.
    fn release_va(&self, ptr: DevicePtr, bytes: u64) -> DriverResult<()>;
    /// Create physical memory of `bytes` (a multiple of the granularity) (`cuMemCreate`).
    fn create_physical(&self, bytes: u64) -> DriverResult<PhysHandle>;
    /// Release physical memory (`cuMemRelease`); the memory is freed once it is unmapped.
    fn release_physical(&self, handle: PhysHandle) -> DriverResult<()>;
    /// Map a whole physical handle of `bytes` at `va` (`cuMemMap`; CUDA maps whole handles
    /// only: a non-zero offset is not supported).
    fn map(&self, va: DevicePtr, bytes: u64, handle: PhysHandle) -> DriverResult<()>;
    /// Make a mapped range readable and writable by this device (`cuMemSetAccess`).
    fn set_access(&self, va: DevicePtr, bytes: u64) -> DriverResult<()>;
    /// Unmap a range mapped by one [`Driver::map`] call (`cuMemUnmap`).
    fn unmap(&self, va: DevicePtr, bytes: u64) -> DriverResult<()>;

    /// Device-wide free and total memory (`cuMemGetInfo`).
    fn mem_info(&self) -> DriverResult<MemInfo>;
    /// This process's memory on the device as the driver accounts it (NVML's per-process used
    /// memory). `None` when the driver cannot tell (no NVML, or our PID is not visible).
    fn process_usage(&self) -> DriverResult<Option<u64>>;

    /// Record an event on `stream` capturing all work queued on it so far.
    fn record_event(&self, stream: StreamId) -> DriverResult<EventId>;
    /// Whether all work captured by the event has completed.
    fn query_event(&self, event: EventId) -> DriverResult<bool>;
    /// Block until the event's work completes.
    fn wait_event(&self, event: EventId) -> DriverResult<()>;
    /// Give the event back (it may be pooled).
    fn destroy_event(&self, event: EventId) -> DriverResult<()>;
    /// Block until all work queued on `stream` completes.
    fn sync_stream(&self, stream: StreamId) -> DriverResult<()>;
    /// Block until all work on the device completes (`cuCtxSynchronize`): for memory that
    /// graphs replayed on streams the allocator never saw.
    fn sync_device(&self) -> DriverResult<()>;

    /// Allocate `bytes` of page-locked host memory (`cuMemHostAlloc`): copies to and from it
    /// run at the copy engine's full speed.
    fn host_alloc(&self, bytes: u64) -> DriverResult<HostPtr>;
    /// Free host memory from [`Driver::host_alloc`] or [`Driver::host_alloc_pageable`]
    /// (`cuMemFreeHost`, or unmapped). No copy queued on it may be pending.
    fn host_free(&self, ptr: HostPtr) -> DriverResult<()>;
    /// Allocate `bytes` of ordinary (pageable) host memory, not page-locked: the host's pages
    /// come as it is first written, and no device copy may use it, only [`Driver::host_copy`]
    /// (through page-locked memory). Refused, before a page is touched, when the host cannot
    /// spare that much. With `file`, the pages are those of a new file at that path (which must
    /// not exist, and is removed at once: its space is held until the buffer is freed), with
    /// its blocks reserved first.
    fn host_alloc_pageable(
        &self,
        bytes: u64,
        file: Option<&std::path::Path>,
    ) -> DriverResult<HostPtr>;
    /// Copy `bytes` between two host buffers on the calling thread (a CPU copy). Neither range
    /// may be used by a device copy that can still run: its stream synchronised, or an event
    /// recorded after it waited for.
    fn host_copy(&self, dst: HostPtr, src: HostPtr, bytes: u64) -> DriverResult<()>;
    /// A stream of the allocator's own that does not wait for the legacy default stream
    /// (`cuStreamCreate`, non-blocking): sleep's and wake's copies.
    fn create_stream(&self) -> DriverResult<StreamId>;
    /// Destroy a stream made by [`Driver::create_stream`] (`cuStreamDestroy`); work queued on
    /// it still completes.
    fn destroy_stream(&self, stream: StreamId) -> DriverResult<()>;
    /// Queue a copy of `bytes` from device `src` to host `dst` on `stream`
    /// (`cuMemcpyDtoHAsync`).
    fn copy_to_host(
        &self,
        dst: HostPtr,
        src: DevicePtr,
        bytes: u64,
        stream: StreamId,
    ) -> DriverResult<()>;
    /// Queue a copy of `bytes` from host `src` to device `dst` on `stream`
    /// (`cuMemcpyHtoDAsync`).
    fn copy_to_device(
        &self,
        dst: DevicePtr,
        src: HostPtr,
        bytes: u64,
        stream: StreamId,
    ) -> DriverResult<()>;

    /// Queue zeros into `bytes` of device memory at `dst` on `stream` (`cuMemsetD8Async`):
    /// fresh physical memory holds whatever it held before, in this process.
    fn fill_zero(&self, dst: DevicePtr, bytes: u64, stream: StreamId) -> DriverResult<()>;

    /// Whether `stream` is capturing a CUDA graph, and which capture. Not counted: it queues
    /// nothing and reads no memory figure.
    fn capture(&self, _stream: StreamId) -> Capture {
        Capture::None
    }

    /// Whether `stream` is capturing a CUDA graph (or the driver cannot tell): events must not
    /// be queried nor the stream synchronised then.
    fn is_capturing(&self, stream: StreamId) -> bool {
        self.capture(stream) != Capture::None
    }
}
