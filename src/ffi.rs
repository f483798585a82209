//! The C ABI of `libvram_ledger.so`: PyTorch's pluggable-allocator entry points and hooks,
//! tags, statistics and profiling.
//!
//! Invariants:
//! - No panic crosses the boundary: every entry point runs under `catch_unwind`, and so does
//!   recording its error message (a panic there leaves a static message instead). The one
//!   exception that does cross is deliberate: `vram_ledger_malloc_or_throw` throws a C++
//!   `std::runtime_error` (csrc/throw.cpp) for PyTorch to turn into a Python exception.
//! - Entry points that read or trust a caller's pointer (a C string, a stream) are `unsafe`,
//!   with what the caller guarantees under `# Safety`; those taking only numbers are safe.
//! - Device state comes from [`crate::devices`], the registry the Rust API uses too: a device
//!   used from Rust and from C has one allocator and one ledger.
//! - Every failure is a return value (NULL, -1, or nothing for `void` functions) plus a
//!   readable message from `vram_ledger_last_error()` on the failing thread, and a warning in
//!   the log (stderr unless the host installed its own `tracing` subscriber; `VRAM_LEDGER_LOG`
//!   sets the level); the allocator keeps working.
//! - Strings returned to the caller are owned by it and given back with
//!   `vram_ledger_string_free`; the last-error string stays valid until the next call that
//!   fails on the same thread.
//!
//! Out of memory: `vram_ledger_malloc` returns NULL after releasing the cache and retrying,
//! and prints the full breakdown to stderr (and the log). PyTorch's pluggable allocator does not
//! check for NULL (the first kernel touching a tensor at address 0 ends the CUDA context), so
//! `install()` hands it `vram_ledger_malloc_or_throw`, whose "CUDA out of memory." exception
//! reaches Python as a RuntimeError. A `torch.cuda.MemPool` backed by this library checks for
//! NULL itself and raises `torch.OutOfMemoryError`.

use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_char, c_double, c_int, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;

use parking_lot::Mutex;

use crate::devices::{self, Device};
use crate::driver::cuda::CudaDriver;
use crate::driver::sim::SimDriver;
use crate::driver::StreamId;
use crate::profile::{Margin, ProfileOptions, ProfileScope};
use crate::stats::memory_stats;
use crate::{Config, Limit, SegmentMode, Tag};

thread_local! {
    static LAST_ERROR: RefCell<Cow<'static, CStr>> = const { RefCell::new(Cow::Borrowed(c"")) };
    static TAG_STACK: RefCell<Vec<Tag>> = const { RefCell::new(Vec::new()) };
}

/// What the last error reads when the real message could not be recorded.
const UNRECORDED: &CStr = c"internal error: the message of a failure could not be recorded";

/// Record this thread's last error. Never panics: when the thread-local is gone (thread exit)
/// or borrowed (a caller still reading the previous message), the message is dropped.
fn set_error(msg: Cow<'static, CStr>) {
    let _ = LAST_ERROR.try_with(|e| {
        if let Ok(mut e) = e.try_borrow_mut() {
            *e = msg;
        }
    });
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("unknown panic")
}

/// Install the library's log output for processes that reach it through the C ABI (a Rust
/// host has its own subscriber, which is kept): stderr, filtered by `VRAM_LEDGER_LOG` (an
/// `EnvFilter` directive such as `debug` or `vram_ledger=info`; warnings and errors when
/// unset). Called where a process starts using the library and on every failure, never on the
/// cached path.
fn ensure_logging() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let filter = tracing_subscriber::EnvFilter::try_from_env("VRAM_LEDGER_LOG")
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .try_init();
    });
}

/// Run `f`, turning errors and panics into `on_err` and a last-error message, logged at warn
/// level (so that a failure of a `void` entry point, which returns nothing to check, is never
/// silent). Building and storing the message runs under `catch_unwind` too: a panic there (an
/// allocation failure, say) leaves the static [`UNRECORDED`] message instead, and never
/// unwinds into C.
fn guard<T>(on_err: T, f: impl FnOnce() -> Result<T, String>) -> T {
    let run = || {
        let msg = match catch_unwind(AssertUnwindSafe(f)) {
            Ok(Ok(v)) => return Some(v),
            Ok(Err(msg)) => msg,
            Err(panic) => format!(
                "internal error (caught at the C boundary): {}",
                panic_message(&*panic)
            ),
        };
        ensure_logging();
        tracing::warn!("{msg}");
        let c = CString::new(msg.replace('\0', " ")).unwrap_or_else(|_| UNRECORDED.into());
        set_error(Cow::Owned(c));
        None
    };
    match catch_unwind(AssertUnwindSafe(run)) {
        Ok(Some(v)) => v,
        Ok(None) => on_err,
        Err(payload) => {
            // Dropping a payload runs foreign code that may panic again: leak it instead.
            std::mem::forget(payload);
            set_error(Cow::Borrowed(UNRECORDED));
            on_err
        }
    }
}

/// 0 for success, or the error's message (for entry points that return 0 or -1).
fn status(r: crate::Result<()>) -> Result<c_int, String> {
    r.map(|()| 0).map_err(|e| e.to_string())
}

fn device_index(device: c_int) -> Result<usize, String> {
    usize::try_from(device).map_err(|_| format!("device {device} is not a device ordinal"))
}

enum Scope {
    Cuda(ProfileScope<'static, 'static, CudaDriver>),
    Sim(ProfileScope<'static, 'static, SimDriver>),
}

/// Run `$body` with `$d` bound to the device's `PerDevice`, whichever backend it is on.
macro_rules! on_device {
    ($device:expr, $d:ident => $body:expr) => {
        match $device {
            Device::Cuda($d) => $body,
            Device::Sim($d) => $body,
        }
    };
}

static SCOPES: OnceLock<Mutex<HashMap<usize, Scope>>> = OnceLock::new();

/// The device's state, from the registry the Rust API shares.
#[inline]
fn state(device: c_int) -> Result<&'static Device, String> {
    devices::device(device_index(device)?).map_err(|e| e.to_string())
}

/// # Safety
/// `p` is NULL or points to a NUL-terminated string that stays valid and unchanged for `'a`.
unsafe fn c_str<'a>(p: *const c_char, what: &str) -> Result<&'a str, String> {
    if p.is_null() {
        return Err(format!("{what} is NULL"));
    }
    // SAFETY: not NULL (checked above); NUL-terminated and live by this function's contract.
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
///
/// # Safety
/// On the CUDA backend `stream` is NULL (the legacy default stream) or a live `cudaStream_t` of
/// `device`'s primary context, which stays alive while memory allocated on it is in use: the
/// allocator hands it to the driver (capture queries, and events when the memory is freed).
/// The simulated backend only compares it.
#[no_mangle]
pub unsafe extern "C" fn vram_ledger_malloc(
    size: isize,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    guard(std::ptr::null_mut(), || {
        let size = u64::try_from(size).map_err(|_| format!("negative size {size}"))?;
        let r =
            on_device!(state(device)?, d => d.allocator().allocate(size, StreamId(stream as u64)));
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

extern "C-unwind" {
    /// Throws a C++ `std::runtime_error` (csrc/throw.cpp); never returns.
    fn vram_ledger_throw(out_of_memory: c_int, why: *const c_char) -> !;
}

/// [`vram_ledger_malloc`] for PyTorch's pluggable allocator, which does not check for NULL:
/// when there is nothing to return it throws a C++ exception instead, which PyTorch turns into
/// a Python `RuntimeError` whose message starts with "CUDA out of memory." (out of memory) and
/// carries the breakdown. The process keeps its CUDA context and can go on.
///
/// # Safety
/// As for [`vram_ledger_malloc`]; and the caller is C++ that lets exceptions pass (PyTorch).
#[no_mangle]
pub unsafe extern "C-unwind" fn vram_ledger_malloc_or_throw(
    size: isize,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    // SAFETY: this function's contract is vram_ledger_malloc's.
    let p = unsafe { vram_ledger_malloc(size, device, stream) };
    if p.is_null() && size != 0 {
        let why = vram_ledger_last_error();
        // SAFETY: the last error is NUL-terminated and lives until this thread's next failure.
        // Out-of-memory messages have their own beginning, so the success path keeps no flag.
        let oom = unsafe { CStr::from_ptr(why) }
            .to_bytes()
            .starts_with(crate::error::OUT_OF_MEMORY.as_bytes());
        // SAFETY: as above; the exception unwinds through no Rust frame that holds anything
        // to drop.
        unsafe { vram_ledger_throw(c_int::from(oom), why) }
    }
    p
}

/// `void free(void* ptr, ssize_t size, int device, cudaStream_t stream)`. `ptr` is looked up,
/// never dereferenced: NULL is ignored, and a pointer this library did not allocate is an error.
///
/// # Safety
/// `stream` is as for [`vram_ledger_malloc`]. Work that uses `ptr` is queued on `stream`, or on
/// a stream passed to [`vram_ledger_record_stream`] for it: the memory is reused once that work
/// completes, and the driver is handed those streams to find out when.
#[no_mangle]
pub unsafe extern "C" fn vram_ledger_free(
    ptr: *mut c_void,
    _size: isize,
    device: c_int,
    stream: *mut c_void,
) {
    guard((), || {
        let r = on_device!(state(device)?, d => d.allocator().free_on(ptr as u64, StreamId(stream as u64)));
        r.map_err(|e| format!("free of {ptr:?} on device {device} failed: {e}"))
    })
}

/// `void init(int device)`. PyTorch calls it for every device at start-up, also in processes
/// that use only one, so it creates nothing: a device's allocator and profiling baseline come
/// with its first use.
#[no_mangle]
pub extern "C" fn vram_ledger_init(device: c_int) {
    ensure_logging();
    guard((), || device_index(device).map(|_| ()));
}

/// `void reset(void)`: `torch.cuda.empty_cache()`.
#[no_mangle]
pub extern "C" fn vram_ledger_reset() {
    guard((), || {
        for s in devices::created() {
            on_device!(s, d => d.allocator().empty_cache()).map_err(|e| e.to_string())?;
        }
        Ok(())
    });
}

/// `void memory_fraction(double fraction, int device)`.
#[no_mangle]
pub extern "C" fn vram_ledger_memory_fraction(fraction: c_double, device: c_int) {
    guard((), || {
        let limit = Some(Limit::Fraction(fraction));
        on_device!(state(device)?, d => d.allocator().set_limit(limit)).map_err(|e| e.to_string())
    });
}

/// `void record_stream(void* ptr, cudaStream_t stream)`: `ptr`'s memory is not reused before
/// the work queued on `stream` so far completes. `ptr` is looked up, never dereferenced.
///
/// # Safety
/// On the CUDA backend `stream` is a live `cudaStream_t` of the context of the device that
/// `ptr` belongs to, alive until `ptr` is freed: the allocator records an event on it then.
#[no_mangle]
pub unsafe extern "C" fn vram_ledger_record_stream(ptr: *mut c_void, stream: *mut c_void) {
    guard((), || {
        let mut last = String::from("no device has been used");
        for s in devices::created() {
            match on_device!(s, d => d.allocator().record_stream(ptr as u64, StreamId(stream as u64)))
            {
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
///
/// # Safety
/// `mode` is NULL (an error) or a NUL-terminated string, readable for the length of the call.
#[no_mangle]
pub unsafe extern "C" fn vram_ledger_configure(mode: *const c_char) -> c_int {
    ensure_logging();
    guard(-1, || {
        // SAFETY: `mode` is NULL or NUL-terminated, by this function's contract.
        let mode: SegmentMode = unsafe { c_str(mode, "mode") }?
            .parse()
            .map_err(|e| format!("{e}"))?;
        devices::configure(Config {
            mode,
            ..Default::default()
        });
        Ok(0)
    })
}

/// Set this thread's tag (weights, activation, kv_cache or kv, untracked).
///
/// # Safety
/// `name` is NULL (an error) or a NUL-terminated string, readable for the length of the call.
#[no_mangle]
pub unsafe extern "C" fn vram_ledger_set_tag(name: *const c_char) -> c_int {
    guard(-1, || {
        // SAFETY: `name` is NULL or NUL-terminated, by this function's contract.
        let tag: Tag = unsafe { c_str(name, "tag name") }?
            .parse()
            .map_err(|e: crate::tag::UnknownTag| e.to_string())?;
        crate::tag::set_current(tag);
        Ok(0)
    })
}

/// Make `name` this thread's tag until the matching `vram_ledger_pop_tag`.
///
/// # Safety
/// `name` is NULL (an error) or a NUL-terminated string, readable for the length of the call.
#[no_mangle]
pub unsafe extern "C" fn vram_ledger_push_tag(name: *const c_char) -> c_int {
    guard(-1, || {
        // SAFETY: `name` is NULL or NUL-terminated, by this function's contract.
        let tag: Tag = unsafe { c_str(name, "tag name") }?
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
    let name = |t: Tag| match t {
        Tag::Weights => c"weights",
        Tag::Activation => c"activation",
        Tag::KvCache => c"kv_cache",
        Tag::Untracked => c"untracked",
    };
    guard(c"untracked".as_ptr(), || Ok(name(Tag::current()).as_ptr()))
}

/// The ledger snapshot as JSON (free with `vram_ledger_string_free`), or NULL.
#[no_mangle]
pub extern "C" fn vram_ledger_stats_json(device: c_int) -> *mut c_char {
    guard(std::ptr::null_mut(), || {
        let snap = on_device!(state(device)?, d => d.allocator().snapshot());
        Ok(into_c_string(
            serde_json::to_string(&snap).map_err(|e| e.to_string())?,
        ))
    })
}

/// Statistics under PyTorch's `memory_stats()` keys, plus per-tag keys, as JSON.
#[no_mangle]
pub extern "C" fn vram_ledger_memory_stats_json(device: c_int) -> *mut c_char {
    guard(std::ptr::null_mut(), || {
        let stats = on_device!(state(device)?, d => memory_stats(d.allocator()));
        Ok(into_c_string(
            serde_json::to_string(&stats).map_err(|e| e.to_string())?,
        ))
    })
}

/// Hold this process to `bytes` of device memory in all on `device` (the budget contract:
/// the allocator's bytes plus memory outside it, re-read before every growth); a negative
/// `bytes` lifts the cap. Profiling sets it to the requested memory by itself.
#[no_mangle]
pub extern "C" fn vram_ledger_set_cap(device: c_int, bytes: i64) -> c_int {
    guard(-1, || {
        let cap = u64::try_from(bytes).ok();
        on_device!(state(device)?, d => d.allocator().set_cap(cap));
        Ok(0)
    })
}

/// The budget contract of `device` in bytes, -1 when none is set, or -2 on error (with the
/// last error set).
#[no_mangle]
pub extern "C" fn vram_ledger_cap(device: c_int) -> i64 {
    guard(-2, || {
        let cap = on_device!(state(device)?, d => d.allocator().cap());
        Ok(cap.map_or(-1, |c| i64::try_from(c).unwrap_or(i64::MAX)))
    })
}

#[no_mangle]
pub extern "C" fn vram_ledger_reset_peaks(device: c_int) -> c_int {
    guard(-1, || {
        on_device!(state(device)?, d => d.allocator().ledger().reset_peaks());
        Ok(0)
    })
}

#[no_mangle]
pub extern "C" fn vram_ledger_empty_cache(device: c_int) -> c_int {
    guard(-1, || {
        status(on_device!(state(device)?, d => d.allocator().empty_cache()))
    })
}

/// Start (`enabled` non-zero; clearing what was recorded, keeping the newest `max_entries`
/// entries) or stop recording `device`'s allocation history.
#[no_mangle]
pub extern "C" fn vram_ledger_record_history(
    device: c_int,
    enabled: c_int,
    max_entries: i64,
) -> c_int {
    guard(-1, || {
        let max = usize::try_from(max_entries)
            .ok()
            .filter(|&m| m > 0)
            .ok_or_else(|| format!("max_entries must be positive, not {max_entries}"))?;
        status(on_device!(state(device)?, d => d.allocator().record_history(enabled != 0, max)))
    })
}

/// Write `device`'s snapshot (segments now, and the recorded history) to `path` as PyTorch's
/// snapshot pickle (`torch.cuda.memory._dump_snapshot`'s format).
///
/// # Safety
/// `path` is NULL (an error) or a NUL-terminated string, readable for the length of the call.
#[no_mangle]
pub unsafe extern "C" fn vram_ledger_dump_snapshot(device: c_int, path: *const c_char) -> c_int {
    guard(-1, || {
        // SAFETY: `path` is NULL or NUL-terminated, by this function's contract.
        let path = unsafe { c_str(path, "path") }?;
        let d = device_index(device)?;
        let bytes =
            on_device!(state(device)?, dev => crate::replay::snapshot::write(dev.allocator(), d));
        std::fs::write(path, bytes).map_err(|e| format!("cannot write {path}: {e}"))?;
        Ok(0)
    })
}

/// Every device in use, in Prometheus' text exposition format (see [`crate::metrics`] for the
/// names); the caller frees the string with `vram_ledger_string_free`.
#[no_mangle]
pub extern "C" fn vram_ledger_metrics() -> *mut c_char {
    guard(std::ptr::null_mut(), || {
        let devices: Vec<crate::metrics::DeviceMetrics> = devices::created_ordinals()
            .map(|(ordinal, s)| {
                on_device!(s, d => crate::metrics::DeviceMetrics {
                    device: ordinal,
                    snapshot: d.allocator().snapshot(),
                    cap: d.allocator().cap(),
                })
            })
            .collect();
        Ok(into_c_string(crate::metrics::prometheus(&devices)))
    })
}

// ---------------------------------------------------------------------------------------------
// CUDA graph pools (PyTorch's private pools, which its pluggable allocator does not forward:
// the Python package calls these around `torch.cuda.CUDAGraph`'s capture and release).

/// Route the capture running on `stream` to graph pool (`pool_a`, `pool_b`), PyTorch's
/// `MempoolId_t`: until `vram_ledger_graph_end`, allocations on streams of that capture come
/// from the pool, and nothing else gets its memory while a graph made from it lives. Counts
/// one reference to the pool. -1 when `stream` is not capturing.
///
/// # Safety
/// On the CUDA backend `stream` is a live `cudaStream_t` of `device`'s primary context.
#[no_mangle]
pub unsafe extern "C" fn vram_ledger_graph_begin(
    device: c_int,
    stream: *mut c_void,
    pool_a: u64,
    pool_b: u64,
) -> c_int {
    guard(-1, || {
        let pool = crate::GraphPool(pool_a, pool_b);
        status(
            on_device!(state(device)?, d => d.allocator().begin_graph_pool(pool, StreamId(stream as u64))),
        )
    })
}

/// Stop routing the capture that began on `stream` into the pool (after the capture has ended
/// and the graph is instantiated); measures what appeared outside the allocator meanwhile.
/// `stream` is only compared.
#[no_mangle]
pub extern "C" fn vram_ledger_graph_end(
    device: c_int,
    stream: *mut c_void,
    pool_a: u64,
    pool_b: u64,
) -> c_int {
    guard(-1, || {
        let pool = crate::GraphPool(pool_a, pool_b);
        status(
            on_device!(state(device)?, d => d.allocator().end_graph_pool(pool, StreamId(stream as u64))),
        )
    })
}

/// Drop one reference to the pool (a graph made from it was reset or destroyed); with the last
/// one its free memory goes back to the driver.
#[no_mangle]
pub extern "C" fn vram_ledger_graph_release(device: c_int, pool_a: u64, pool_b: u64) -> c_int {
    guard(-1, || {
        let pool = crate::GraphPool(pool_a, pool_b);
        status(on_device!(state(device)?, d => d.allocator().release_graph_pool(pool)))
    })
}

/// Open a profiling scope on `device` (its baseline was taken at the device's first use). A
/// negative `margin_bytes` means the default (`Margin::Auto`: none in native mode, a little
/// room for placement in the virtual-memory modes).
#[no_mangle]
pub extern "C" fn vram_ledger_profile_begin(
    device: c_int,
    utilization: c_double,
    margin_bytes: i64,
) -> c_int {
    guard(-1, || {
        let d = device_index(device)?;
        let margin = u64::try_from(margin_bytes).map_or(Margin::Auto, Margin::Bytes);
        let options = ProfileOptions {
            utilization,
            margin,
            ..Default::default()
        };
        let no_baseline = |e: &str| format!("device {d} has no profiling baseline: {e}");
        let scope = match state(device)? {
            Device::Cuda(dev) => Scope::Cuda(
                dev.profiler()
                    .map_err(no_baseline)?
                    .begin(options)
                    .map_err(|e| e.to_string())?,
            ),
            Device::Sim(dev) => Scope::Sim(
                dev.profiler()
                    .map_err(no_baseline)?
                    .begin(options)
                    .map_err(|e| e.to_string())?,
            ),
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

/// The message of the last failure on this thread ("" if none). Valid until the next failure
/// on this thread. Never NULL.
#[no_mangle]
pub extern "C" fn vram_ledger_last_error() -> *const c_char {
    LAST_ERROR
        .try_with(|e| e.try_borrow().map_or(UNRECORDED.as_ptr(), |e| e.as_ptr()))
        .unwrap_or(UNRECORDED.as_ptr())
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

/// The number of this process's devices: CUDA devices (0 without a driver or a device), or
/// with `VRAM_LEDGER_DRIVER=sim` simulated ones.
#[no_mangle]
pub extern "C" fn vram_ledger_device_count() -> c_int {
    guard(0, || {
        Ok(c_int::try_from(devices::count()).unwrap_or(c_int::MAX))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn last_error() -> String {
        // SAFETY: never NULL, and valid until the next failure on this thread.
        unsafe { CStr::from_ptr(vram_ledger_last_error()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn a_panic_becomes_the_error_value_and_a_readable_message() {
        assert_eq!(
            guard(-1, || -> Result<i32, String> { panic!("boom {}", 7) }),
            -1
        );
        assert_eq!(
            last_error(),
            "internal error (caught at the C boundary): boom 7"
        );
        let p = guard(std::ptr::null_mut::<c_char>(), || {
            std::panic::panic_any(42u8)
        });
        assert!(p.is_null());
        assert!(last_error().ends_with("unknown panic"), "{}", last_error());
    }

    #[test]
    fn an_error_message_with_a_nul_is_kept_readable() {
        assert_eq!(guard(-1, || Err("a\0b".to_string())), -1);
        assert_eq!(last_error(), "a b");
    }

    #[test]
    fn recording_while_the_message_is_borrowed_does_not_unwind() {
        assert_eq!(guard(-1, || Err("first".to_string())), -1);
        // A caller still holding the previous message: recording the next one must neither
        // panic across the boundary nor free the string being read.
        let r = LAST_ERROR.with(|e| {
            let held = e.borrow();
            let r = guard(-1, || Err("second".to_string()));
            assert_eq!(held.to_str().unwrap(), "first");
            r
        });
        assert_eq!(r, -1);
        assert_eq!(guard(-1, || Err("third".to_string())), -1);
        assert_eq!(last_error(), "third");
    }
}
