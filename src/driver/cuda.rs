//! The driver trait on the real CUDA driver, through cudarc's dynamically loaded bindings: the
//! crate builds everywhere, and finds out at run time whether a driver and a device are there.
//!
//! Invariants:
//! - Every call first makes the device's primary context current on the calling thread (the
//!   allocator is called from any thread).
//! - Calls that allocate, map, free, query, wait or synchronise run in relaxed stream-capture
//!   mode, so that an engine capturing a CUDA graph in the default (global) mode may still grow
//!   the pool and settle other streams' events; the allocator itself never aims them at a
//!   capturing stream.
//! - A capture status the driver cannot give counts as capturing ([`Capture::Unknown`]).
//! - Events are created without timing and pooled; a destroyed event goes back to the pool.
//! - A non-success `CUresult` becomes a typed [`DriverError`], never a panic, naming the call
//!   that failed (a primitive, or one of the set-up calls in [`DriverCall::SETUP`]) and keeping
//!   the driver's name and description of the code.
//! - [`probe`] is the one place that tells "no driver" and "no device" (nothing to run on)
//!   from a driver that loads and fails (a broken install, reported as such).

use std::path::Path;

use cudarc::driver::sys::{self, CUresult};
use parking_lot::Mutex;

use super::cuda_result::{check, describe, error};
use super::host_buffers::HostBuffers;
use super::nvml::Nvml;
use super::{
    Capture, DevicePtr, Driver, DriverCall, DriverError, DriverErrorKind, DriverResult, EventId,
    HostPtr, MemInfo, PhysHandle, StreamId,
};

/// What this machine offers the CUDA backend. Only the first two of "no driver" and "no device"
/// mean that there is no GPU to use; a driver that loads and then fails is broken, and callers
/// (tests above all) must not mistake it for an absent GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Probe {
    /// The driver loads and reports this many devices (at least one).
    Available(usize),
    /// The driver library (libcuda.so) cannot be loaded.
    NoDriver(String),
    /// The driver loads and has no device: `CUDA_ERROR_NO_DEVICE`, or a count of zero.
    NoDevice(String),
    /// The driver loads and fails in any other way.
    Failed(DriverError),
}

impl Probe {
    /// What a program that needs a GPU does: `Ok(None)` run, `Ok(Some(why))` skip saying why
    /// (no driver, no device), `Err` fail (the driver is there and broken).
    pub fn skip_reason(self) -> Result<Option<String>, DriverError> {
        match self {
            Probe::Available(_) => Ok(None),
            Probe::NoDriver(why) | Probe::NoDevice(why) => Ok(Some(why)),
            Probe::Failed(e) => Err(e),
        }
    }
}

/// Load the driver, initialise it and count its devices.
pub fn probe() -> Probe {
    // SAFETY: probing for the library has no side effects beyond loading it.
    if !unsafe { sys::is_culib_present() } {
        return Probe::NoDriver("no CUDA driver library (libcuda.so) could be loaded".into());
    }
    let mut n = 0;
    // SAFETY: plain driver API calls with a valid out-pointer; the count only once initialised.
    let init = unsafe { sys::cuInit(0) };
    let count = if init == CUresult::CUDA_SUCCESS {
        // SAFETY: as above.
        unsafe { sys::cuDeviceGetCount(&mut n) }
    } else {
        init
    };
    classify(init, count, n, describe)
}

/// [`probe`]'s verdict on what `cuInit` and `cuDeviceGetCount` returned.
fn classify(
    init: CUresult,
    count: CUresult,
    n: i32,
    describe: impl Fn(CUresult) -> String,
) -> Probe {
    for (call, r) in [(DriverCall::Init, init), (DriverCall::DeviceCount, count)] {
        match r {
            CUresult::CUDA_SUCCESS => {}
            CUresult::CUDA_ERROR_NO_DEVICE => return Probe::NoDevice(describe(r)),
            _ => return Probe::Failed(error(call, r, describe(r))),
        }
    }
    match usize::try_from(n) {
        Ok(0) => Probe::NoDevice("the CUDA driver reports 0 devices".into()),
        Ok(n) => Probe::Available(n),
        Err(_) => Probe::Failed(DriverError::new(
            DriverCall::DeviceCount,
            DriverErrorKind::Other(-1),
            format!("cuDeviceGetCount reported {n} devices"),
        )),
    }
}

/// The number of devices of the CUDA backend: 0 when there is no device, an error (with the
/// driver's cause) when there is no driver library or the driver fails.
pub fn device_count() -> DriverResult<usize> {
    match probe() {
        Probe::Available(n) => Ok(n),
        Probe::NoDevice(_) => Ok(0),
        Probe::NoDriver(why) => Err(DriverError::new(
            DriverCall::Init,
            DriverErrorKind::NoDevice,
            why,
        )),
        Probe::Failed(e) => Err(e),
    }
}

/// One CUDA device, through its primary context.
pub struct CudaDriver {
    ordinal: usize,
    device: sys::CUdevice,
    ctx: sys::CUcontext,
    granularity: u64,
    uuid: String,
    nvml: Result<Nvml, String>,
    events: Mutex<Vec<sys::CUevent>>,
    host: HostBuffers,
}

// SAFETY: CUDA contexts, events and device pointers may be used from any thread; the context is
// made current on each call.
unsafe impl Send for CudaDriver {}
unsafe impl Sync for CudaDriver {}

impl CudaDriver {
    /// Open device `ordinal`. Fails with `NoDevice` when there is no driver or no such device.
    pub fn new(ordinal: usize) -> DriverResult<CudaDriver> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(DriverError::new(
                DriverCall::DeviceGet,
                DriverErrorKind::NoDevice,
                format!("no CUDA device {ordinal}: {count} device(s)"),
            ));
        }
        let mut device = 0;
        let mut ctx = std::ptr::null_mut();
        // SAFETY: valid out-pointers; the retained context is released in Drop.
        unsafe {
            check(
                DriverCall::DeviceGet,
                sys::cuDeviceGet(&mut device, ordinal as i32),
            )?;
            check(
                DriverCall::PrimaryContext,
                sys::cuDevicePrimaryCtxRetain(&mut ctx, device),
            )?;
        }
        // Built as soon as the context is retained, so that a later failure releases it.
        let mut d = CudaDriver {
            ordinal,
            device,
            ctx,
            granularity: 0,
            uuid: String::new(),
            nvml: Err("not opened".into()),
            events: Mutex::new(Vec::new()),
            host: HostBuffers::default(),
        };
        d.current(DriverCall::PrimaryContext)?;
        let mut uuid = sys::CUuuid { bytes: [0; 16] };
        // SAFETY: valid out-pointer.
        check(DriverCall::DeviceUuid, unsafe {
            sys::cuDeviceGetUuid_v2(&mut uuid, device)
        })?;
        let b = uuid.bytes.map(|x| x as u8);
        let hex =
            |r: std::ops::Range<usize>| b[r].iter().map(|x| format!("{x:02x}")).collect::<String>();
        d.uuid = format!(
            "GPU-{}-{}-{}-{}-{}",
            hex(0..4),
            hex(4..6),
            hex(6..8),
            hex(8..10),
            hex(10..16)
        );
        d.nvml = Nvml::open(&d.uuid);
        let prop = d.prop();
        let mut g = 0usize;
        // SAFETY: valid property and out-pointer.
        check(DriverCall::Granularity, unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut g,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
            )
        })?;
        d.granularity = g as u64;
        if let Err(e) = &d.nvml {
            tracing::info!(device = ordinal, "per-process usage unavailable: {e}");
        }
        Ok(d)
    }

    /// The device's UUID, as NVML names it.
    pub fn uuid(&self) -> &str {
        &self.uuid
    }

    /// Why per-process usage is unavailable, if it is.
    pub fn nvml_error(&self) -> Option<&str> {
        self.nvml.as_ref().err().map(String::as_str)
    }

    fn prop(&self) -> sys::CUmemAllocationProp {
        // SAFETY: an all-zero CUmemAllocationProp is a valid starting value (reserved fields 0).
        let mut p: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        p.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        p.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        p.location.id = self.device;
        p
    }

    fn current(&self, call: DriverCall) -> DriverResult<()> {
        // SAFETY: the context was retained in `new` and lives as long as `self`.
        check(call, unsafe { sys::cuCtxSetCurrent(self.ctx) })
    }

    /// Run `f` with the primary context current and stream capture relaxed on this thread.
    fn relaxed<T>(&self, call: DriverCall, f: impl FnOnce() -> DriverResult<T>) -> DriverResult<T> {
        self.current(call)?;
        let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: exchanging this thread's capture mode, restored below.
        check(call, unsafe {
            sys::cuThreadExchangeStreamCaptureMode(&mut mode)
        })?;
        let r = f();
        // SAFETY: restores the mode saved above.
        unsafe {
            sys::cuThreadExchangeStreamCaptureMode(&mut mode);
        }
        r
    }
}

impl Drop for CudaDriver {
    fn drop(&mut self) {
        // SAFETY: destroying pooled events and releasing the context retained in `new`.
        unsafe {
            for e in self.events.get_mut().drain(..) {
                sys::cuEventDestroy_v2(e);
            }
            sys::cuDevicePrimaryCtxRelease_v2(self.device);
        }
    }
}

fn stream(s: StreamId) -> sys::CUstream {
    s.0 as sys::CUstream
}

impl Driver for CudaDriver {
    fn ordinal(&self) -> usize {
        self.ordinal
    }

    fn alloc_segment(&self, bytes: u64, _stream: StreamId) -> DriverResult<DevicePtr> {
        const CALL: DriverCall = DriverCall::AllocSegment;
        self.relaxed(CALL, || {
            let mut p = 0;
            // SAFETY: valid out-pointer.
            check(CALL, unsafe { sys::cuMemAlloc_v2(&mut p, bytes as usize) })?;
            Ok(p)
        })
    }

    fn free_segment(&self, ptr: DevicePtr, _bytes: u64) -> DriverResult<()> {
        const CALL: DriverCall = DriverCall::FreeSegment;
        // SAFETY: `ptr` came from cuMemAlloc; the allocator synchronised its users.
        self.relaxed(CALL, || check(CALL, unsafe { sys::cuMemFree_v2(ptr) }))
    }

    fn granularity(&self) -> u64 {
        self.granularity
    }

    fn reserve_va(&self, bytes: u64) -> DriverResult<DevicePtr> {
        const CALL: DriverCall = DriverCall::ReserveVa;
        self.current(CALL)?;
        let mut p = 0;
        // SAFETY: valid out-pointer; alignment 0 means the granularity.
        check(CALL, unsafe {
            sys::cuMemAddressReserve(&mut p, bytes as usize, 0, 0, 0)
        })?;
        Ok(p)
    }

    fn release_va(&self, ptr: DevicePtr, bytes: u64) -> DriverResult<()> {
        const CALL: DriverCall = DriverCall::ReleaseVa;
        self.current(CALL)?;
        // SAFETY: a range reserved by reserve_va with nothing mapped.
        check(CALL, unsafe { sys::cuMemAddressFree(ptr, bytes as usize) })
    }

    fn create_physical(&self, bytes: u64) -> DriverResult<PhysHandle> {
        const CALL: DriverCall = DriverCall::CreatePhysical;
        let prop = self.prop();
        self.relaxed(CALL, || {
            let mut h = 0;
            // SAFETY: valid property and out-pointer.
            check(CALL, unsafe {
                sys::cuMemCreate(&mut h, bytes as usize, &prop, 0)
            })?;
            Ok(PhysHandle(h))
        })
    }

    fn release_physical(&self, handle: PhysHandle) -> DriverResult<()> {
        const CALL: DriverCall = DriverCall::ReleasePhysical;
        // SAFETY: a handle from create_physical, released once.
        self.relaxed(CALL, || check(CALL, unsafe { sys::cuMemRelease(handle.0) }))
    }

    fn map(&self, va: DevicePtr, bytes: u64, handle: PhysHandle) -> DriverResult<()> {
        const CALL: DriverCall = DriverCall::Map;
        // SAFETY: an unmapped, granularity-aligned range inside a reservation.
        self.relaxed(CALL, || {
            check(CALL, unsafe {
                sys::cuMemMap(va, bytes as usize, 0, handle.0, 0)
            })
        })
    }

    fn set_access(&self, va: DevicePtr, bytes: u64) -> DriverResult<()> {
        const CALL: DriverCall = DriverCall::SetAccess;
        let desc = sys::CUmemAccessDesc {
            location: self.prop().location,
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: a mapped range; one descriptor.
        self.relaxed(CALL, || {
            check(CALL, unsafe {
                sys::cuMemSetAccess(va, bytes as usize, &desc, 1)
            })
        })
    }

    fn unmap(&self, va: DevicePtr, bytes: u64) -> DriverResult<()> {
        const CALL: DriverCall = DriverCall::Unmap;
        // SAFETY: exactly a range mapped by one map call; its users were synchronised.
        self.relaxed(CALL, || {
            check(CALL, unsafe { sys::cuMemUnmap(va, bytes as usize) })
        })
    }

    fn mem_info(&self) -> DriverResult<MemInfo> {
        const CALL: DriverCall = DriverCall::MemInfo;
        self.current(CALL)?;
        let (mut free, mut total) = (0, 0);
        // SAFETY: valid out-pointers.
        check(CALL, unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) })?;
        Ok(MemInfo {
            free: free as u64,
            total: total as u64,
        })
    }

    fn process_usage(&self) -> DriverResult<Option<u64>> {
        match &self.nvml {
            Ok(n) => n.process_usage(std::process::id()).map_err(|e| {
                DriverError::new(DriverCall::ProcessUsage, DriverErrorKind::Other(-1), e)
            }),
            Err(_) => Ok(None),
        }
    }

    fn record_event(&self, s: StreamId) -> DriverResult<EventId> {
        const CALL: DriverCall = DriverCall::RecordEvent;
        self.current(CALL)?;
        let pooled = self.events.lock().pop();
        let e = match pooled {
            Some(e) => e,
            None => {
                let mut e = std::ptr::null_mut();
                // SAFETY: valid out-pointer.
                check(CALL, unsafe {
                    sys::cuEventCreate(&mut e, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
                })?;
                e
            }
        };
        // SAFETY: a live event and a stream of this context.
        if let Err(err) = check(CALL, unsafe { sys::cuEventRecord(e, stream(s)) }) {
            self.events.lock().push(e);
            return Err(err);
        }
        Ok(EventId(e as u64))
    }

    fn query_event(&self, event: EventId) -> DriverResult<bool> {
        const CALL: DriverCall = DriverCall::QueryEvent;
        self.relaxed(CALL, || {
            // SAFETY: an event from record_event.
            match unsafe { sys::cuEventQuery(event.0 as sys::CUevent) } {
                CUresult::CUDA_SUCCESS => Ok(true),
                CUresult::CUDA_ERROR_NOT_READY => Ok(false),
                r => check(CALL, r).map(|()| false),
            }
        })
    }

    fn wait_event(&self, event: EventId) -> DriverResult<()> {
        const CALL: DriverCall = DriverCall::WaitEvent;
        // SAFETY: an event from record_event.
        self.relaxed(CALL, || {
            check(CALL, unsafe {
                sys::cuEventSynchronize(event.0 as sys::CUevent)
            })
        })
    }

    fn destroy_event(&self, event: EventId) -> DriverResult<()> {
        self.events.lock().push(event.0 as sys::CUevent);
        Ok(())
    }

    fn sync_stream(&self, s: StreamId) -> DriverResult<()> {
        const CALL: DriverCall = DriverCall::SyncStream;
        // SAFETY: a stream of this context (or the legacy default stream).
        self.relaxed(CALL, || {
            check(CALL, unsafe { sys::cuStreamSynchronize(stream(s)) })
        })
    }

    fn sync_device(&self) -> DriverResult<()> {
        const CALL: DriverCall = DriverCall::SyncDevice;
        // SAFETY: the primary context is current.
        self.relaxed(CALL, || check(CALL, unsafe { sys::cuCtxSynchronize() }))
    }

    fn host_alloc(&self, bytes: u64) -> DriverResult<HostPtr> {
        self.current(DriverCall::HostAlloc)?;
        self.host.alloc_pinned(bytes)
    }

    fn host_free(&self, ptr: HostPtr) -> DriverResult<()> {
        self.host.free(ptr, || self.current(DriverCall::HostFree))
    }

    fn host_alloc_pageable(&self, bytes: u64, file: Option<&Path>) -> DriverResult<HostPtr> {
        self.host.alloc_pageable(bytes, file)
    }

    fn host_copy(&self, dst: HostPtr, src: HostPtr, bytes: u64) -> DriverResult<()> {
        self.host.copy(dst, src, bytes)
    }

    fn create_stream(&self) -> DriverResult<StreamId> {
        const CALL: DriverCall = DriverCall::CreateStream;
        self.current(CALL)?;
        let mut s = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: a valid out-pointer.
        check(CALL, unsafe { sys::cuStreamCreate(&mut s, flags) })?;
        Ok(StreamId(s as u64))
    }

    fn destroy_stream(&self, s: StreamId) -> DriverResult<()> {
        const CALL: DriverCall = DriverCall::DestroyStream;
        self.current(CALL)?;
        // SAFETY: `s` came from `create_stream` and its owner uses it no more.
        check(CALL, unsafe { sys::cuStreamDestroy_v2(stream(s)) })
    }

    fn copy_to_host(
        &self,
        dst: HostPtr,
        src: DevicePtr,
        bytes: u64,
        s: StreamId,
    ) -> DriverResult<()> {
        const CALL: DriverCall = DriverCall::CopyToHost;
        self.current(CALL)?;
        // SAFETY: `src` is accessible device memory and `dst` page-locked host memory of at
        // least `bytes`, both alive until the stream is synchronised (the caller's contract).
        check(CALL, unsafe {
            sys::cuMemcpyDtoHAsync_v2(
                dst.0 as *mut std::ffi::c_void,
                src,
                bytes as usize,
                stream(s),
            )
        })
    }

    fn copy_to_device(
        &self,
        dst: DevicePtr,
        src: HostPtr,
        bytes: u64,
        s: StreamId,
    ) -> DriverResult<()> {
        const CALL: DriverCall = DriverCall::CopyToDevice;
        self.current(CALL)?;
        // SAFETY: as for copy_to_host, the other way.
        check(CALL, unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                dst,
                src.0 as *const std::ffi::c_void,
                bytes as usize,
                stream(s),
            )
        })
    }

    fn fill_zero(&self, dst: DevicePtr, bytes: u64, s: StreamId) -> DriverResult<()> {
        const CALL: DriverCall = DriverCall::FillZero;
        self.current(CALL)?;
        // SAFETY: `dst` is device memory this process mapped, `bytes` long (the caller's
        // contract); the fill is queued on a live stream.
        check(CALL, unsafe {
            sys::cuMemsetD8Async(dst, 0, bytes as usize, stream(s))
        })
    }

    fn capture(&self, s: StreamId) -> Capture {
        use sys::CUstreamCaptureStatus::*;
        if self.current(DriverCall::PrimaryContext).is_err() {
            return Capture::Unknown;
        }
        let (mut status, mut id) = (CU_STREAM_CAPTURE_STATUS_NONE, 0);
        use std::ptr::null_mut;
        // SAFETY: valid out-pointers; the optional outputs are null, as the API allows.
        let r = unsafe {
            sys::cuStreamGetCaptureInfo_v3(
                stream(s),
                &mut status,
                &mut id,
                null_mut(),
                null_mut(),
                null_mut(),
                null_mut(),
            )
        };
        match (r, status) {
            (CUresult::CUDA_SUCCESS, CU_STREAM_CAPTURE_STATUS_NONE) => Capture::None,
            (CUresult::CUDA_SUCCESS, CU_STREAM_CAPTURE_STATUS_ACTIVE) => Capture::Active(id),
            // Invalidated captures and errors: treat as capturing (see `Capture::Unknown`).
            _ => Capture::Unknown,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(r: CUresult) -> String {
        format!("{r:?}")
    }

    #[test]
    fn only_a_missing_device_is_a_reason_to_skip() {
        use CUresult::*;
        assert_eq!(
            classify(CUDA_SUCCESS, CUDA_SUCCESS, 2, name),
            Probe::Available(2)
        );
        assert!(matches!(
            classify(CUDA_ERROR_NO_DEVICE, CUDA_ERROR_NO_DEVICE, 0, name),
            Probe::NoDevice(why) if why == "CUDA_ERROR_NO_DEVICE"
        ));
        assert!(matches!(
            classify(CUDA_SUCCESS, CUDA_SUCCESS, 0, name),
            Probe::NoDevice(_)
        ));
        // A driver that loads and fails is broken, not absent: it names the call and the code.
        for (init, count, call) in [
            (
                CUDA_ERROR_SYSTEM_DRIVER_MISMATCH,
                CUDA_SUCCESS,
                DriverCall::Init,
            ),
            (CUDA_ERROR_NOT_INITIALIZED, CUDA_SUCCESS, DriverCall::Init),
            (CUDA_ERROR_UNKNOWN, CUDA_SUCCESS, DriverCall::Init),
            (
                CUDA_SUCCESS,
                CUDA_ERROR_INVALID_VALUE,
                DriverCall::DeviceCount,
            ),
        ] {
            match classify(init, count, 1, name) {
                Probe::Failed(e) => {
                    assert_eq!(e.call, call);
                    assert_eq!(
                        e.detail,
                        name(if init == CUDA_SUCCESS { count } else { init })
                    );
                }
                other => panic!("{init:?}/{count:?}: {other:?}"),
            }
        }
        assert!(classify(CUDA_SUCCESS, CUDA_SUCCESS, -1, name)
            .skip_reason()
            .is_err());
    }

    #[test]
    fn set_up_calls_are_not_primitives() {
        for call in DriverCall::SETUP {
            assert!(!call.is_primitive(), "{call}");
            assert!(!DriverCall::ALL.contains(&call), "{call}");
        }
        for (i, call) in DriverCall::ALL.into_iter().enumerate() {
            assert_eq!(call.index(), i, "{call}");
        }
    }
}
