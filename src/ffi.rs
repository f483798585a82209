//! The C ABI of `libvram_ledger.so`: PyTorch's pluggable-allocator entry points and hooks,
//! tags, statistics and profiling.
//!
//! Invariants:
//! - No panic crosses the boundary: every entry point runs under `catch_unwind`.
//! - Every failure is a return value (NULL, -1, or nothing for `void` functions) plus a
//!   readable message from `vram_ledger_last_error()` on the failing thread; the allocator
//!   keeps working.
//! - Strings returned to the caller are owned by it and given back with
//!   `vram_ledger_string_free`; the last-error string stays valid until the next call that
//!   fails on the same thread.
//!
//! Out of memory: `vram_ledger_malloc` returns NULL after releasing the cache and retrying,
//! and prints the full breakdown to stderr (and the log). PyTorch's pluggable allocator does not
//! check for NULL: the tensor it builds points at address 0 and the first kernel that touches it
//! fails with an illegal address, which ends the CUDA context. A `torch.cuda.MemPool` backed by
//! this library does check, and turns NULL into `torch.OutOfMemoryError`.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_char, c_double, c_int, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;

use parking_lot::Mutex;

use crate::driver::cuda::CudaDriver;
use crate::driver::sim::SimDriver;
use crate::driver::Driver;
use crate::driver::StreamId;
use crate::profile::{Margin, ProfileOptions, ProfileScope, Profiler};
use crate::stats::memory_stats;
use crate::{cuda, Allocator, Config, Limit, SegmentMode, Tag};

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
    static TAG_STACK: RefCell<Vec<Tag>> = const { RefCell::new(Vec::new()) };
}

fn set_error(msg: impl Into<String>) {
    let msg = msg.into();
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = c);
}

/// Run `f`, turning errors and panics into `on_err` and a last-error message.
fn guard<T>(on_err: T, f: impl FnOnce() -> Result<T, String>) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => v,
        Ok(Err(msg)) => {
            set_error(msg);
            on_err
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            set_error(format!("internal error (caught at the C boundary): {what}"));
            on_err
        }
    }
}

fn device_index(device: c_int) -> Result<usize, String> {
    usize::try_from(device).map_err(|_| format!("device {device} is not a device ordinal"))
}

/// A device's allocator and profiler, created at the device's first use and kept for the life
/// of the process (so that the hot path borrows them without reference counting).
struct Dev<D: Driver> {
    alloc: &'static Allocator<D>,
    profiler: Profiler<'static, D>,
}

/// The real device, or (with `VRAM_LEDGER_DRIVER=sim`) a simulated one: the whole C ABI then
/// runs on machines without a GPU, for tests and fuzzing.
enum DeviceState {
    Cuda(Dev<CudaDriver>),
    Sim(Dev<SimDriver>),
}

enum Scope {
    Cuda(ProfileScope<'static, 'static, CudaDriver>),
    Sim(ProfileScope<'static, 'static, SimDriver>),
}

/// Run `$body` with `$d` bound to the device's `Dev`, whichever driver it has.
macro_rules! on_device {
    ($state:expr, $d:ident => $body:expr) => {
        match $state {
            DeviceState::Cuda($d) => $body,
            DeviceState::Sim($d) => $body,
        }
    };
}

static DEVICES: OnceLock<Box<[OnceLock<&'static DeviceState>]>> = OnceLock::new();
static SCOPES: OnceLock<Mutex<HashMap<usize, Scope>>> = OnceLock::new();

fn simulated() -> bool {
    static SIM: OnceLock<bool> = OnceLock::new();
    *SIM.get_or_init(|| std::env::var("VRAM_LEDGER_DRIVER").is_ok_and(|v| v == "sim"))
}

fn device_count() -> usize {
    if simulated() {
        std::env::var("VRAM_LEDGER_SIM_DEVICES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1)
    } else {
        cuda::device_count()
    }
}

fn dev<D: Driver>(alloc: &'static Allocator<D>) -> Result<Dev<D>, String> {
    Ok(Dev {
        alloc,
        profiler: Profiler::new(alloc).map_err(|e| e.to_string())?,
    })
}

/// The device's state. Its first use takes the profiling baseline: PyTorch has created the
/// CUDA context by then, and nothing has been allocated through us yet.
#[inline]
fn state(device: c_int) -> Result<&'static DeviceState, String> {
    let d = device_index(device)?;
    let slots = DEVICES.get_or_init(|| (0..device_count()).map(|_| OnceLock::new()).collect());
    let slot = slots.get(d).ok_or_else(|| {
        crate::Error::NoSuchDevice {
            ordinal: d,
            available: slots.len(),
        }
        .to_string()
    })?;
    if let Some(s) = slot.get() {
        return Ok(s);
    }
    let made = if simulated() {
        let a = Allocator::new(SimDriver::new(), cuda::configured()).map_err(|e| e.to_string())?;
        DeviceState::Sim(dev(Box::leak(Box::new(a)))?)
    } else {
        // The registry keeps its Arc; this state borrows the allocator for the process's life.
        let a: &'static Allocator<CudaDriver> =
            Box::leak(Box::new(cuda::allocator(d).map_err(|e| e.to_string())?));
        DeviceState::Cuda(dev(a)?)
    };
    Ok(slot.get_or_init(|| Box::leak(Box::new(made))))
}

fn c_str<'a>(p: *const c_char, what: &str) -> Result<&'a str, String> {
    if p.is_null() {
        return Err(format!("{what} is NULL"));
    }
    // SAFETY: the caller passes a NUL-terminated string (checked for NULL above).
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .map_err(|_| format!("{what} is not UTF-8"))
}

fn into_c_string(s: String) -> *mut c_char {
    CString::new(s).map_or(std::ptr::null_mut(), CString::into_raw)
}

// ---------------------------------------------------------------------------------------------
// PyTorch's pluggable allocator.

/// `void* alloc(ssize_t size, int device, cudaStream_t stream)`. Size 0 returns NULL (as
/// PyTorch's own allocator does), which is not an error.
#[no_mangle]
pub extern "C" fn vram_ledger_malloc(
    size: isize,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    guard(std::ptr::null_mut(), || {
        let size = u64::try_from(size).map_err(|_| format!("negative size {size}"))?;
        let r = on_device!(state(device)?, d => d.alloc.allocate(size, StreamId(stream as u64)));
        match r {
            Ok(x) => Ok(x.ptr as *mut c_void),
            Err(e) => {
                if matches!(e, crate::Error::OutOfMemory(_)) {
                    eprintln!("vram-ledger: {e}");
                }
                tracing::error!(device, "allocation failed: {e}");
                Err(e.to_string())
            }
        }
    })
}

/// `void free(void* ptr, ssize_t size, int device, cudaStream_t stream)`.
#[no_mangle]
pub extern "C" fn vram_ledger_free(
    ptr: *mut c_void,
    _size: isize,
    device: c_int,
    stream: *mut c_void,
) {
    guard((), || {
        let r =
            on_device!(state(device)?, d => d.alloc.free_on(ptr as u64, StreamId(stream as u64)));
        r.map_err(|e| {
            tracing::error!(device, "free failed: {e}");
            e.to_string()
        })
    })
}

/// `void init(int device)`. PyTorch calls it for every device at start-up, also in processes
/// that use only one, so it creates nothing: a device's allocator and profiling baseline come
/// with its first use.
#[no_mangle]
pub extern "C" fn vram_ledger_init(device: c_int) {
    guard((), || device_index(device).map(|_| ()));
}

/// `void reset(void)`: `torch.cuda.empty_cache()`.
#[no_mangle]
pub extern "C" fn vram_ledger_reset() {
    guard((), || {
        for s in DEVICES
            .get()
            .into_iter()
            .flat_map(|d| d.iter())
            .filter_map(OnceLock::get)
        {
            on_device!(s, d => d.alloc.empty_cache()).map_err(|e| e.to_string())?;
        }
        Ok(())
    });
}

/// `void memory_fraction(double fraction, int device)`.
#[no_mangle]
pub extern "C" fn vram_ledger_memory_fraction(fraction: c_double, device: c_int) {
    guard((), || {
        let limit = Some(Limit::Fraction(fraction));
        on_device!(state(device)?, d => d.alloc.set_limit(limit)).map_err(|e| e.to_string())
    });
}

/// `void record_stream(void* ptr, cudaStream_t stream)`.
#[no_mangle]
pub extern "C" fn vram_ledger_record_stream(ptr: *mut c_void, stream: *mut c_void) {
    guard((), || {
        let mut last = String::from("no device has been used");
        for s in DEVICES
            .get()
            .into_iter()
            .flat_map(|d| d.iter())
            .filter_map(OnceLock::get)
        {
            match on_device!(s, d => d.alloc.record_stream(ptr as u64, StreamId(stream as u64))) {
                Ok(()) => return Ok(()),
                Err(e) => last = e.to_string(),
            }
        }
        Err(last)
    });
}

// ---------------------------------------------------------------------------------------------
// Configuration, tags, statistics, profiling. Functions returning int give 0 or -1.

/// Choose the segment mode ("native", "expandable", "compact" or "remap") of allocators not yet
/// created.
#[no_mangle]
pub extern "C" fn vram_ledger_configure(mode: *const c_char) -> c_int {
    guard(-1, || {
        let mode: SegmentMode = c_str(mode, "mode")?.parse().map_err(|e| format!("{e}"))?;
        cuda::configure(Config {
            mode,
            ..Default::default()
        });
        Ok(0)
    })
}

/// Set this thread's tag (weights, activation, kv_cache or kv, untracked).
#[no_mangle]
pub extern "C" fn vram_ledger_set_tag(name: *const c_char) -> c_int {
    guard(-1, || {
        let tag: Tag = c_str(name, "tag name")?
            .parse()
            .map_err(|e: crate::tag::UnknownTag| e.to_string())?;
        crate::tag::set_current(tag);
        Ok(0)
    })
}

/// Make `name` this thread's tag until the matching `vram_ledger_pop_tag`.
#[no_mangle]
pub extern "C" fn vram_ledger_push_tag(name: *const c_char) -> c_int {
    guard(-1, || {
        let tag: Tag = c_str(name, "tag name")?
            .parse()
            .map_err(|e: crate::tag::UnknownTag| e.to_string())?;
        let previous = crate::tag::set_current(tag);
        TAG_STACK.with(|s| s.borrow_mut().push(previous));
        Ok(0)
    })
}

#[no_mangle]
pub extern "C" fn vram_ledger_pop_tag() -> c_int {
    guard(-1, || {
        let previous = TAG_STACK
            .with(|s| s.borrow_mut().pop())
            .ok_or("pop_tag without a matching push_tag")?;
        crate::tag::set_current(previous);
        Ok(0)
    })
}

/// This thread's tag, as a static string (never NULL).
#[no_mangle]
pub extern "C" fn vram_ledger_current_tag() -> *const c_char {
    match Tag::current() {
        Tag::Weights => c"weights".as_ptr(),
        Tag::Activation => c"activation".as_ptr(),
        Tag::KvCache => c"kv_cache".as_ptr(),
        Tag::Untracked => c"untracked".as_ptr(),
    }
}

/// The ledger snapshot as JSON (free with `vram_ledger_string_free`), or NULL.
#[no_mangle]
pub extern "C" fn vram_ledger_stats_json(device: c_int) -> *mut c_char {
    guard(std::ptr::null_mut(), || {
        let snap = on_device!(state(device)?, d => d.alloc.snapshot());
        Ok(into_c_string(
            serde_json::to_string(&snap).map_err(|e| e.to_string())?,
        ))
    })
}

/// Statistics under PyTorch's `memory_stats()` keys, plus per-tag keys, as JSON.
#[no_mangle]
pub extern "C" fn vram_ledger_memory_stats_json(device: c_int) -> *mut c_char {
    guard(std::ptr::null_mut(), || {
        let stats = on_device!(state(device)?, d => memory_stats(d.alloc));
        Ok(into_c_string(
            serde_json::to_string(&stats).map_err(|e| e.to_string())?,
        ))
    })
}

#[no_mangle]
pub extern "C" fn vram_ledger_reset_peaks(device: c_int) -> c_int {
    guard(-1, || {
        on_device!(state(device)?, d => d.alloc.ledger().reset_peaks());
        Ok(0)
    })
}

#[no_mangle]
pub extern "C" fn vram_ledger_empty_cache(device: c_int) -> c_int {
    guard(-1, || {
        on_device!(state(device)?, d => d.alloc.empty_cache())
            .map(|()| 0)
            .map_err(|e| e.to_string())
    })
}

/// Open a profiling scope on `device` (its baseline was taken at the device's first use). A
/// negative `margin_bytes` means none.
#[no_mangle]
pub extern "C" fn vram_ledger_profile_begin(
    device: c_int,
    utilization: c_double,
    margin_bytes: i64,
) -> c_int {
    guard(-1, || {
        let d = device_index(device)?;
        let margin = Margin::Bytes(margin_bytes.max(0) as u64);
        let options = ProfileOptions {
            utilization,
            margin,
            ..Default::default()
        };
        let scope = match state(device)? {
            DeviceState::Cuda(dev) => {
                Scope::Cuda(dev.profiler.begin(options).map_err(|e| e.to_string())?)
            }
            DeviceState::Sim(dev) => {
                Scope::Sim(dev.profiler.begin(options).map_err(|e| e.to_string())?)
            }
        };
        let scopes = SCOPES.get_or_init(Default::default);
        if scopes.lock().insert(d, scope).is_some() {
            tracing::warn!(
                device = d,
                "a profiling scope was open already; it was replaced"
            );
        }
        Ok(0)
    })
}

/// Close the profiling scope of `device`: the result as JSON (free with
/// `vram_ledger_string_free`), or NULL.
#[no_mangle]
pub extern "C" fn vram_ledger_profile_end(device: c_int) -> *mut c_char {
    guard(std::ptr::null_mut(), || {
        let d = device_index(device)?;
        let scope = SCOPES
            .get_or_init(Default::default)
            .lock()
            .remove(&d)
            .ok_or("no profiling scope is open on this device")?;
        let r = match scope {
            Scope::Cuda(s) => s.end(),
            Scope::Sim(s) => s.end(),
        }
        .map_err(|e| e.to_string())?;
        let mut v = serde_json::to_value(&r).map_err(|e| e.to_string())?;
        v["report"] = serde_json::json!(r.report_lines());
        Ok(into_c_string(v.to_string()))
    })
}

/// The message of the last failure on this thread ("" if none). Valid until the next failure.
#[no_mangle]
pub extern "C" fn vram_ledger_last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

/// Free a string returned by this library. NULL is ignored.
///
/// # Safety
/// `s` is NULL or a string this library returned, not freed before.
#[no_mangle]
pub unsafe extern "C" fn vram_ledger_string_free(s: *mut c_char) {
    if !s.is_null() {
        // SAFETY: `s` came from CString::into_raw in this library.
        drop(unsafe { CString::from_raw(s) });
    }
}

/// The number of CUDA devices (0 without a driver).
#[no_mangle]
pub extern "C" fn vram_ledger_device_count() -> c_int {
    guard(0, || Ok(device_count() as c_int))
}
