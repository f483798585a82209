//! This process's devices: the one registry of per-device state (allocator and profiling
//! baseline) that the Rust API ([`allocator`]) and the C ABI (`crate::ffi`) share, and
//! [`DeviceBuffer`], RAII device memory for Rust engines on cudarc (kernel arguments through
//! cudarc's `DevicePtr`/`DevicePtrMut`).
//!
//! Invariants:
//! - The backend is chosen once per process, at the registry's first use: the CUDA driver, or
//!   with `VRAM_LEDGER_DRIVER=sim` simulated devices (`VRAM_LEDGER_SIM_DEVICES` of them,
//!   default 1), so that the C ABI runs on machines without a GPU. A value that names neither
//!   is refused at every device's use, never read as the CUDA driver.
//! - The registry has one slot per device of that backend, counted once. When the backend
//!   cannot count its devices, every use of a device reports the driver's cause.
//! - A device's state is created once, at the device's first use (whichever API uses it
//!   first), with the configuration set before it (from then on a change of configuration is
//!   refused, and the sleep settings given for every device reach it as it is registered),
//!   and lives for the rest of the process:
//!   device memory outlives any one engine object, and the C ABI's hot path borrows the state
//!   without reference counting. Its profiling baseline is taken then: PyTorch has created the
//!   CUDA context by that time, and nothing has been allocated through us yet.
//! - A `DeviceBuffer` frees exactly once, on drop, on the stream it was allocated on, and
//!   records every other stream it is used on so that its memory is not reused before their
//!   work completes.

use std::marker::PhantomData;
use std::sync::{Arc, OnceLock};

use cudarc::driver::{
    CudaStream, DevicePtr as CudaDevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop,
};
use parking_lot::Mutex;

use crate::driver::cuda::{self, CudaDriver};
use crate::driver::sim::SimDriver;
use crate::driver::{DevicePtr, Driver, DriverCall, DriverError, DriverErrorKind, StreamId};
use crate::profile::Profiler;
use crate::{Allocator, Config, Error, Result, Tag};

/// Where this process's devices come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Cuda,
    Sim { devices: usize },
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::Cuda => "cuda",
            Backend::Sim { .. } => "sim",
        }
    }
}

/// This process's backend, read from the environment at the first call: `VRAM_LEDGER_DRIVER`
/// unset, empty or `cuda`, the CUDA driver; `sim`, simulated devices. Any other value, or a
/// `VRAM_LEDGER_SIM_DEVICES` that is no count, is refused: every device call then fails and
/// says why, rather than run on a backend the user did not name.
fn chosen() -> &'static std::result::Result<Backend, String> {
    static BACKEND: OnceLock<std::result::Result<Backend, String>> = OnceLock::new();
    BACKEND.get_or_init(|| match std::env::var("VRAM_LEDGER_DRIVER").as_deref() {
        Err(std::env::VarError::NotPresent) | Ok("" | "cuda") => Ok(Backend::Cuda),
        Ok("sim") => sim_device_count().map(|devices| Backend::Sim { devices }),
        Ok(v) => Err(format!(
            "VRAM_LEDGER_DRIVER={v:?} names no backend (cuda, or sim for simulated devices)"
        )),
        Err(std::env::VarError::NotUnicode(_)) => {
            Err("VRAM_LEDGER_DRIVER is not text: it names no backend (cuda or sim)".into())
        }
    })
}

/// This process's backend, as the environment chose it (the CUDA driver when the environment
/// names none that exists, for naming only: no device is made then).
pub fn backend() -> Backend {
    chosen().clone().unwrap_or(Backend::Cuda)
}

/// The most simulated devices a process may ask for.
const MAX_SIM_DEVICES: usize = 1024;

/// The number of devices of the simulated backend: `VRAM_LEDGER_SIM_DEVICES`, default 1.
fn sim_device_count() -> std::result::Result<usize, String> {
    match std::env::var("VRAM_LEDGER_SIM_DEVICES") {
        Err(std::env::VarError::NotPresent) => Ok(1),
        Ok(v) => v
            .trim()
            .parse()
            .ok()
            .filter(|&n| n <= MAX_SIM_DEVICES)
            .ok_or_else(|| {
                format!("VRAM_LEDGER_SIM_DEVICES={v:?} is not a count of devices (0 to {MAX_SIM_DEVICES})")
            }),
        Err(std::env::VarError::NotUnicode(_)) => {
            Err("VRAM_LEDGER_SIM_DEVICES is not text: it is no count of devices".into())
        }
    }
}

/// The configuration of allocators not yet created, and whether one has been: once a device's
/// allocator has read it (under this lock), no change is taken.
struct Configuration {
    config: Option<Config>,
    read: bool,
}

static CONFIG: Mutex<Configuration> = Mutex::new(Configuration {
    config: None,
    read: false,
});

/// Set the configuration of allocators created from now on: refused once a device is in use
/// (or being created), unless it changes nothing, as [`configure_with`].
pub fn configure(config: Config) -> std::result::Result<(), String> {
    configure_with(|c| *c = config)
}

/// Change one setting of the configuration of allocators created from now on, under one lock
/// (two settings changed at once from two threads both stay). Refused once a device is in use,
/// or being created, unless nothing changes: that device's allocator keeps the configuration it
/// was made with, and a setting that reached only devices used later would pass silently for
/// the one in use.
pub fn configure_with(change: impl FnOnce(&mut Config)) -> std::result::Result<(), String> {
    let mut c = CONFIG.lock();
    let now = c.config.clone().unwrap_or_default();
    let mut next = now.clone();
    change(&mut next);
    if next == now {
        return Ok(());
    }
    if c.read {
        return Err(
            "a device is in use already with the configuration it was created with: \
             configure before the first use of any device"
                .into(),
        );
    }
    c.config = Some(next);
    Ok(())
}

/// The configuration set by [`configure`] (the default if none).
pub fn configured() -> Config {
    CONFIG.lock().config.clone().unwrap_or_default()
}

/// The configuration for a device's allocator being created: from here on it is fixed.
fn configuration_for_a_device() -> Config {
    let mut c = CONFIG.lock();
    c.read = true;
    c.config.clone().unwrap_or_default()
}

/// Sleep settings given for every device (a negative device through the C ABI): kept, so that
/// devices first used later get them too, as those in use did.
#[derive(Clone, Debug, Default)]
pub struct SleepDefaults {
    pub retain_host: Option<bool>,
    pub file: Option<Option<std::path::PathBuf>>,
    pub zero_discarded: Option<bool>,
}

static SLEEP_DEFAULTS: Mutex<SleepDefaults> = Mutex::new(SleepDefaults {
    retain_host: None,
    file: None,
    zero_discarded: None,
});

/// Change the sleep settings of every device, those in use (`apply`, for each) and those used
/// later. Under one lock with the defaults a device is given once it is in use, so that no
/// device created meanwhile misses the change.
pub fn set_sleep_defaults(
    change: impl FnOnce(&mut SleepDefaults),
    apply: impl Fn(&'static Device),
) {
    let mut d = SLEEP_DEFAULTS.lock();
    change(&mut d);
    for dev in created() {
        apply(dev);
    }
}

/// Give a device in use the sleep settings given for every device.
fn apply_sleep_defaults(dev: &'static Device) {
    let d = SLEEP_DEFAULTS.lock();
    fn set<D: Driver>(a: &Allocator<D>, d: &SleepDefaults) {
        if let Some(retain) = d.retain_host {
            a.set_retain_host(retain);
        }
        if let Some(file) = &d.file {
            a.set_sleep_file(file.clone());
        }
        if let Some(zero) = d.zero_discarded {
            a.set_zero_discarded(zero);
        }
    }
    match dev {
        Device::Cuda(p) => set(p.allocator(), &d),
        Device::Sim(p) => set(p.allocator(), &d),
    }
}

/// One device's state: its allocator and the profiling baseline taken when it was created.
pub struct PerDevice<D: Driver> {
    alloc: &'static Arc<Allocator<D>>,
    profiler: std::result::Result<Profiler<'static, D>, String>,
    /// Where PyTorch's accumulated statistics count from (`memory_stats` through the C ABI).
    accumulated: Mutex<crate::stats::Accumulated>,
}

impl<D: Driver> PerDevice<D> {
    fn new(driver: D) -> Result<PerDevice<D>> {
        let alloc: &'static Arc<Allocator<D>> = Box::leak(Box::new(Arc::new(Allocator::new(
            driver,
            configuration_for_a_device(),
        )?)));
        // A failed baseline is reported when profiling starts: allocating does not need it.
        let profiler = Profiler::new(alloc).map_err(|e| e.to_string());
        if let Err(e) = &profiler {
            tracing::warn!(
                device = alloc.driver().ordinal(),
                "no profiling baseline: {e}"
            );
        }
        Ok(PerDevice {
            alloc,
            profiler,
            accumulated: Mutex::default(),
        })
    }

    pub fn allocator(&self) -> &'static Arc<Allocator<D>> {
        self.alloc
    }

    /// `torch.cuda.memory_stats()`'s keys for this device, the accumulated ones counted since
    /// [`PerDevice::reset_accumulated`].
    pub fn memory_stats(&self) -> std::collections::BTreeMap<String, u64> {
        let mut m = crate::stats::memory_stats(self.alloc);
        self.accumulated.lock().apply(&mut m);
        m
    }

    /// Count PyTorch's accumulated statistics from now on.
    pub fn reset_accumulated(&self) {
        let now = crate::stats::memory_stats(self.alloc);
        self.accumulated.lock().reset(&now);
    }

    /// The device's profiler, or why its baseline could not be taken.
    pub fn profiler(&self) -> std::result::Result<&Profiler<'static, D>, &str> {
        self.profiler.as_ref().map_err(String::as_str)
    }
}

/// A device of either backend.
pub enum Device {
    Cuda(PerDevice<CudaDriver>),
    Sim(PerDevice<SimDriver>),
}

type Slots = Box<[OnceLock<&'static Device>]>;

static REGISTRY: OnceLock<std::result::Result<Slots, DriverError>> = OnceLock::new();

fn slots() -> Result<&'static Slots> {
    REGISTRY
        .get_or_init(|| {
            let chosen = chosen().clone().map_err(|why| {
                DriverError::new(DriverCall::Init, DriverErrorKind::InvalidValue, why)
            })?;
            let n = match chosen {
                Backend::Sim { devices } => devices,
                Backend::Cuda => cuda::device_count()?,
            };
            Ok((0..n).map(|_| OnceLock::new()).collect())
        })
        .as_ref()
        .map_err(|e| Error::Driver(e.clone()))
}

/// The number of this process's devices (0 when its backend has none, or cannot count them:
/// [`device`] then says why).
pub fn count() -> usize {
    try_count().unwrap_or(0)
}

/// The number of this process's devices, or why the backend cannot count them (no driver, or
/// a backend variable that names nothing).
pub fn try_count() -> Result<usize> {
    slots().map(|s| s.len())
}

/// Device `ordinal`'s state, created at its first use.
#[inline]
pub fn device(ordinal: usize) -> Result<&'static Device> {
    // Every allocation and free through the C ABI comes here: a made device is two loads.
    if let Some(Ok(slots)) = REGISTRY.get() {
        if let Some(d) = slots.get(ordinal).and_then(|s| s.get()) {
            return Ok(d);
        }
    }
    make_device(ordinal)
}

#[cold]
fn make_device(ordinal: usize) -> Result<&'static Device> {
    let slots = slots()?;
    let slot = slots.get(ordinal).ok_or(Error::NoSuchDevice {
        ordinal,
        available: slots.len(),
    })?;
    if let Some(d) = slot.get() {
        return Ok(d);
    }
    // Creation is rare and opens a context: one at a time, so that no thread builds a state
    // (and leaks it) that loses a race.
    static CREATING: Mutex<()> = Mutex::new(());
    let _one = CREATING.lock();
    if let Some(d) = slot.get() {
        return Ok(d);
    }
    let made = match backend() {
        Backend::Cuda => Device::Cuda(PerDevice::new(CudaDriver::new(ordinal)?)?),
        Backend::Sim { .. } => Device::Sim(PerDevice::new(SimDriver::new())?),
    };
    let dev: &'static Device = slot.get_or_init(|| Box::leak(Box::new(made)));
    apply_sleep_defaults(dev);
    Ok(dev)
}

/// The devices used so far, in ordinal order.
pub fn created() -> impl Iterator<Item = &'static Device> {
    created_ordinals().map(|(_, d)| d)
}

/// The devices used so far with their ordinals, in ordinal order.
pub fn created_ordinals() -> impl Iterator<Item = (usize, &'static Device)> {
    REGISTRY
        .get()
        .and_then(|r| r.as_ref().ok())
        .into_iter()
        .flat_map(|s| s.iter().enumerate())
        .filter_map(|(i, s)| Some((i, *s.get()?)))
}

fn wrong_backend(ordinal: usize, wanted: Backend) -> Error {
    Error::WrongBackend {
        ordinal,
        wanted: wanted.name(),
        active: backend().name(),
    }
}

/// The allocator of CUDA device `ordinal`, created on first use (the C ABI uses the same one).
pub fn allocator(ordinal: usize) -> Result<Arc<Allocator<CudaDriver>>> {
    match device(ordinal)? {
        Device::Cuda(d) => Ok(d.alloc.clone()),
        Device::Sim(_) => Err(wrong_backend(ordinal, Backend::Cuda)),
    }
}

/// The allocator of simulated device `ordinal` (with `VRAM_LEDGER_DRIVER=sim`), created on
/// first use (the C ABI uses the same one).
pub fn sim_allocator(ordinal: usize) -> Result<Arc<Allocator<SimDriver>>> {
    match device(ordinal)? {
        Device::Sim(d) => Ok(d.alloc.clone()),
        Device::Cuda(_) => Err(wrong_backend(ordinal, Backend::Sim { devices: 0 })),
    }
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
