//! The driver trait on the real CUDA driver, through cudarc's dynamically loaded bindings: the
//! crate builds everywhere, and finds out at run time whether a driver and a device are there.
//!
//! Invariants:
//! - Every call first makes the device's primary context current on the calling thread (the
//!   allocator is called from any thread).
//! - Calls that allocate, map or free run in relaxed stream-capture mode, so that an engine
//!   capturing a CUDA graph on this thread may still grow the pool.
//! - Events are created without timing and pooled; a destroyed event goes back to the pool.
//! - A non-success `CUresult` becomes a typed [`DriverError`], never a panic.

use std::ffi::CStr;

use cudarc::driver::sys::{self, CUresult};
use parking_lot::Mutex;

use super::nvml::Nvml;
use super::{
    DevicePtr, Driver, DriverCall, DriverError, DriverErrorKind, DriverResult, EventId, MemInfo,
    PhysHandle, StreamId,
};

fn check(call: DriverCall, r: CUresult) -> DriverResult<()> {
    if r == CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let kind = match r {
        CUresult::CUDA_ERROR_OUT_OF_MEMORY => DriverErrorKind::OutOfMemory,
        CUresult::CUDA_ERROR_INVALID_VALUE | CUresult::CUDA_ERROR_INVALID_HANDLE => {
            DriverErrorKind::InvalidValue
        }
        CUresult::CUDA_ERROR_NO_DEVICE
        | CUresult::CUDA_ERROR_INVALID_DEVICE
        | CUresult::CUDA_ERROR_NOT_INITIALIZED => DriverErrorKind::NoDevice,
        other => DriverErrorKind::Other(other as i32),
    };
    let mut name: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorName writes a pointer to a static string, or leaves it null.
    let name = unsafe {
        if sys::cuGetErrorName(r, &mut name) == CUresult::CUDA_SUCCESS && !name.is_null() {
            CStr::from_ptr(name).to_string_lossy().into_owned()
        } else {
            format!("CUresult {}", r as i32)
        }
    };
    Err(DriverError::new(call, kind, name))
}

/// Whether a CUDA driver can be loaded and reports at least one device.
pub fn available() -> bool {
    device_count().is_ok_and(|n| n > 0)
}

/// The number of CUDA devices; an error when there is no driver.
pub fn device_count() -> DriverResult<usize> {
    // SAFETY: probing for the library has no side effects beyond loading it.
    if !unsafe { sys::is_culib_present() } {
        return Err(DriverError::new(
            DriverCall::MemInfo,
            DriverErrorKind::NoDevice,
            "no CUDA driver library (libcuda.so) found",
        ));
    }
    let mut n = 0;
    // SAFETY: plain driver API calls with valid out-pointers.
    unsafe {
        check(DriverCall::MemInfo, sys::cuInit(0))?;
        check(DriverCall::MemInfo, sys::cuDeviceGetCount(&mut n))?;
    }
    Ok(n as usize)
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
                DriverCall::MemInfo,
                DriverErrorKind::NoDevice,
                format!("no CUDA device {ordinal}: {count} device(s)"),
            ));
        }
        let mut device = 0;
        let mut ctx = std::ptr::null_mut();
        let mut uuid = sys::CUuuid { bytes: [0; 16] };
        // SAFETY: valid out-pointers; the retained context is released in Drop.
        unsafe {
            check(
                DriverCall::MemInfo,
                sys::cuDeviceGet(&mut device, ordinal as i32),
            )?;
            check(
                DriverCall::MemInfo,
                sys::cuDevicePrimaryCtxRetain(&mut ctx, device),
            )?;
            check(DriverCall::MemInfo, sys::cuCtxSetCurrent(ctx))?;
            check(
                DriverCall::MemInfo,
                sys::cuDeviceGetUuid_v2(&mut uuid, device),
            )?;
        }
        let b = uuid.bytes.map(|x| x as u8);
        let hex =
            |r: std::ops::Range<usize>| b[r].iter().map(|x| format!("{x:02x}")).collect::<String>();
        let uuid = format!(
            "GPU-{}-{}-{}-{}-{}",
            hex(0..4),
            hex(4..6),
            hex(6..8),
            hex(8..10),
            hex(10..16)
        );
        let mut d = CudaDriver {
            ordinal,
            device,
            ctx,
            granularity: 0,
            nvml: Nvml::open(&uuid),
            uuid,
            events: Mutex::new(Vec::new()),
        };
        let prop = d.prop();
        let mut g = 0usize;
        // SAFETY: valid property and out-pointer.
        unsafe {
            check(
                DriverCall::CreatePhysical,
                sys::cuMemGetAllocationGranularity(
                    &mut g,
                    &prop,
                    sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
                ),
            )?;
        }
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
        self.current(DriverCall::QueryEvent)?;
        // SAFETY: an event from record_event.
        match unsafe { sys::cuEventQuery(event.0 as sys::CUevent) } {
            CUresult::CUDA_SUCCESS => Ok(true),
            CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => check(DriverCall::QueryEvent, r).map(|()| false),
        }
    }

    fn wait_event(&self, event: EventId) -> DriverResult<()> {
        self.current(DriverCall::WaitEvent)?;
        // SAFETY: an event from record_event.
        check(DriverCall::WaitEvent, unsafe {
            sys::cuEventSynchronize(event.0 as sys::CUevent)
        })
    }

    fn destroy_event(&self, event: EventId) -> DriverResult<()> {
        self.events.lock().push(event.0 as sys::CUevent);
        Ok(())
    }

    fn sync_stream(&self, s: StreamId) -> DriverResult<()> {
        self.current(DriverCall::SyncStream)?;
        // SAFETY: a stream of this context (or the legacy default stream).
        check(DriverCall::SyncStream, unsafe {
            sys::cuStreamSynchronize(stream(s))
        })
    }

    fn is_capturing(&self, s: StreamId) -> bool {
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: valid out-pointer; on error we report "not capturing" and the caller's next
        // driver call reports the real problem.
        let r = unsafe {
            if self.current(DriverCall::QueryEvent).is_err() {
                return false;
            }
            sys::cuStreamIsCapturing(stream(s), &mut status)
        };
        r == CUresult::CUDA_SUCCESS
            && status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
    }
}
