//! Rust engines on cudarc: one allocator per device, and RAII buffers that are kernel
//! arguments through cudarc's `DevicePtr`/`DevicePtrMut`.
//!
//! Invariants: the allocator of an ordinal is created once, with the configuration set before
//! its first use, and lives for the rest of the process (device memory outlives any one
//! engine object); a `DeviceBuffer` frees exactly once, on drop, on the stream it was
//! allocated on, and records every other stream it is used on so that its memory is not
//! reused before their work completes.

use std::marker::PhantomData;
use std::sync::{Arc, OnceLock};

use cudarc::driver::{
    CudaStream, DevicePtr as CudaDevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop,
};
use parking_lot::Mutex;

use crate::driver::cuda::{self, CudaDriver};
use crate::driver::{DevicePtr, StreamId};
use crate::{Allocator, Config, Error, Result, Tag};

static REGISTRY: OnceLock<Vec<OnceLock<Arc<Allocator<CudaDriver>>>>> = OnceLock::new();
static CONFIG: Mutex<Option<Config>> = Mutex::new(None);

/// Set the configuration of allocators created from now on (call before the first
/// [`allocator`] call for a device).
pub fn configure(config: Config) {
    *CONFIG.lock() = Some(config);
}

/// The configuration set by [`configure`] (the default if none).
pub fn configured() -> Config {
    CONFIG.lock().clone().unwrap_or_default()
}

/// The number of CUDA devices (0 without a driver).
pub fn device_count() -> usize {
    cuda::device_count().unwrap_or(0)
}

/// The allocator of device `ordinal`, created on first use.
pub fn allocator(ordinal: usize) -> Result<Arc<Allocator<CudaDriver>>> {
    let slots = REGISTRY.get_or_init(|| (0..device_count()).map(|_| OnceLock::new()).collect());
    let slot = slots.get(ordinal).ok_or(Error::NoSuchDevice {
        ordinal,
        available: slots.len(),
    })?;
    if let Some(a) = slot.get() {
        return Ok(a.clone());
    }
    let config = configured();
    let made = Arc::new(Allocator::new(CudaDriver::new(ordinal)?, config)?);
    // Two threads may race to create it; the first one wins and the other's is dropped.
    Ok(slot.get_or_init(|| made).clone())
}

/// The stream id the allocator uses for a cudarc stream.
pub fn stream_id(stream: &CudaStream) -> StreamId {
    StreamId(stream.cu_stream() as u64)
}

/// Device memory for `len` values of `T`, from a vram-ledger allocator, freed on drop.
pub struct DeviceBuffer<T> {
    alloc: Arc<Allocator<CudaDriver>>,
    ptr: DevicePtr,
    len: usize,
    tag: Tag,
    stream: Arc<CudaStream>,
    _type: PhantomData<T>,
}

impl<T> DeviceBuffer<T> {
    /// Allocate with this thread's current tag.
    pub fn new(
        alloc: &Arc<Allocator<CudaDriver>>,
        len: usize,
        stream: &Arc<CudaStream>,
    ) -> Result<Self> {
        Self::new_tagged(alloc, len, stream, Tag::current())
    }

    pub fn new_tagged(
        alloc: &Arc<Allocator<CudaDriver>>,
        len: usize,
        stream: &Arc<CudaStream>,
        tag: Tag,
    ) -> Result<Self> {
        let bytes = (len as u64)
            .checked_mul(std::mem::size_of::<T>() as u64)
            .ok_or(Error::SizeTooLarge(u64::MAX))?;
        let a = alloc.allocate_tagged(bytes, stream_id(stream), tag)?;
        Ok(DeviceBuffer {
            alloc: alloc.clone(),
            ptr: a.ptr,
            len,
            tag,
            stream: stream.clone(),
            _type: PhantomData,
        })
    }

    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }

    /// Number of values.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn tag(&self) -> Tag {
        self.tag
    }

    fn used_on(&self, stream: &CudaStream) {
        if stream.cu_stream() != self.stream.cu_stream() {
            if let Err(e) = self.alloc.record_stream(self.ptr, stream_id(stream)) {
                tracing::error!(error = %e, "could not record a buffer's use on another stream");
            }
        }
    }
}

impl<T> DeviceSlice<T> for DeviceBuffer<T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<T> CudaDevicePtr<T> for DeviceBuffer<T> {
    fn device_ptr<'a>(
        &'a self,
        stream: &'a CudaStream,
    ) -> (cudarc::driver::sys::CUdeviceptr, SyncOnDrop<'a>) {
        self.used_on(stream);
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

impl<T> DevicePtrMut<T> for DeviceBuffer<T> {
    fn device_ptr_mut<'a>(
        &'a mut self,
        stream: &'a CudaStream,
    ) -> (cudarc::driver::sys::CUdeviceptr, SyncOnDrop<'a>) {
        self.used_on(stream);
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

impl<T> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        if let Err(e) = self.alloc.free_on(self.ptr, stream_id(&self.stream)) {
            tracing::error!(error = %e, "freeing a device buffer failed");
        }
    }
}

impl<T> std::fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("tag", &self.tag)
            .finish()
    }
}
