//! PyTorch's pluggable-allocator entry points and hooks.

use std::ffi::{c_char, c_double, c_int, c_void, CStr};
use std::sync::atomic::{AtomicUsize, Ordering};

use super::boundary::*;
use crate::allocator::history;
use crate::devices::{self, Device};
use crate::driver::StreamId;
use crate::{Error, Limit};

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
    guard(std::ptr::null_mut(), || malloc(size, device, stream))
}

fn malloc(size: isize, device: c_int, stream: *mut c_void) -> Result<*mut c_void, String> {
    let size = u64::try_from(size).map_err(|_| format!("negative size {size}"))?;
    let state = state(device)?;
    let r = match context(CONTEXT_OF_ALLOCATION) {
        0 => allocate_on(state, size, stream),
        c => history::with_context(c, || allocate_on(state, size, stream)),
    };
    r.map(|x| {
        super::profiler::report(state, device, x.ptr as *mut c_void, x.requested as i64);
        x.ptr as *mut c_void
    })
    .map_err(|e| match e {
        Error::OutOfMemory(report) => {
            notify_oom(device, &report);
            // Worded as PyTorch words it, for the tools that read PyTorch's message.
            report.torch_message(device)
        }
        e => e.to_string(),
    })
}

// Inlined into both paths of each hook (with a context and without): a call here would cost
// the pair through the C ABI some 55 instructions.
#[inline(always)]
fn allocate_on(state: &Device, size: u64, stream: *mut c_void) -> crate::Result<crate::Allocation> {
    on_device!(state, d => d.allocator().allocate(size, StreamId(stream as u64)))
}

#[inline(always)]
fn free_on(state: &Device, ptr: *mut c_void, stream: *mut c_void) -> crate::Result<()> {
    on_device!(state, d => d.allocator().free_on(ptr as u64, StreamId(stream as u64)))
}

/// A host function naming the context of an allocation (`kind` 0) or a free (`kind` 1) this
/// thread is about to make: an identifier the host resolves later
/// (the Python package's stack frames), or 0 for none. The history's entry for the operation
/// carries it.
pub type ContextSource = unsafe extern "C" fn(kind: c_int) -> u64;

const CONTEXT_OF_ALLOCATION: c_int = 0;
const CONTEXT_OF_FREE: c_int = 1;

/// The context source, as an address (0: none), and the kinds it is asked for (bit `kind`).
/// Read once per allocation and free through this ABI (the kinds only when there is a
/// source), written only by the setter (a line no one else writes).
static CONTEXT_SOURCE: AtomicUsize = AtomicUsize::new(0);
static CONTEXT_KINDS: AtomicUsize = AtomicUsize::new(0);

/// Name a context for allocations (`kinds` bit 0) and frees (bit 1) through this ABI (NULL:
/// none, the default; other bits of `kinds` are ignored). The source runs on the allocating
/// or freeing thread before the allocator takes any lock, so it may wait on the host's own
/// locks (such as Python's) and call the library; it must not unwind.
#[no_mangle]
pub extern "C" fn vram_ledger_set_context_source(source: Option<ContextSource>, kinds: c_int) {
    CONTEXT_KINDS.store(kinds as usize & 0b11, Ordering::Release);
    CONTEXT_SOURCE.store(source.map_or(0, |f| f as usize), Ordering::Release);
}

fn context(kind: c_int) -> u64 {
    match CONTEXT_SOURCE.load(Ordering::Acquire) {
        0 => 0,
        _ if CONTEXT_KINDS.load(Ordering::Acquire) & (1 << kind) == 0 => 0,
        f => {
            // SAFETY: a non-zero value was stored from a `ContextSource` by the setter above.
            let f: ContextSource = unsafe { std::mem::transmute::<usize, ContextSource>(f) };
            // SAFETY: the host's source, called as its contract says.
            unsafe { f(kind) }
        }
    }
}

/// An observer of out-of-memory failures, as PyTorch's caching allocator calls its own
/// (`torch._C._cuda_attach_out_of_memory_observer`): the device, the bytes asked for, the
/// bytes this allocator has handed out on that device, and the device's free bytes.
pub type OomObserver =
    unsafe extern "C" fn(device: c_int, size: i64, allocated: i64, device_free: i64);

/// The observer, as an address (0: none).
static OOM_OBSERVER: AtomicUsize = AtomicUsize::new(0);

/// Call `observer` on every out of memory of an allocation through this ABI (NULL: no one),
/// before the allocation's error is returned or thrown. It runs on the failing thread with no
/// lock of the allocator held, so it may call the library (read statistics, give the cache
/// back), and must not unwind.
#[no_mangle]
pub extern "C" fn vram_ledger_set_oom_observer(observer: Option<OomObserver>) {
    OOM_OBSERVER.store(observer.map_or(0, |f| f as usize), Ordering::Release);
}

fn notify_oom(device: c_int, r: &crate::error::OomReport) {
    let f = OOM_OBSERVER.load(Ordering::Acquire);
    if f != 0 {
        let n = |b: u64| i64::try_from(b).unwrap_or(i64::MAX);
        // SAFETY: a non-zero value was stored from an `OomObserver` by the setter above.
        let f: OomObserver = unsafe { std::mem::transmute::<usize, OomObserver>(f) };
        // Every tag's allocations, asleep ones included: what `memory_allocated()` says.
        let allocated = r.per_tag.0.iter().fold(0u64, |a, &b| a.saturating_add(b));
        // SAFETY: the host's observer, called as its contract says.
        unsafe { f(device, n(r.requested), n(allocated), n(r.device_free)) };
    }
}

extern "C-unwind" {
    /// Throws PyTorch's `c10::OutOfMemoryError` for out of memory when PyTorch's libraries are
    /// loaded, else a `std::runtime_error` (csrc/throw.cpp); never returns.
    fn vram_ledger_throw(out_of_memory: c_int, why: *const c_char) -> !;
}

/// [`vram_ledger_malloc`] for PyTorch's pluggable allocator, which does not check for NULL:
/// when there is nothing to return it throws a C++ exception instead, which PyTorch turns into
/// `torch.OutOfMemoryError` (out of memory, worded as PyTorch's own message, then the
/// breakdown) or a `RuntimeError` (anything else). The process keeps its CUDA context and can
/// go on.
///
/// # Safety
/// As for [`vram_ledger_malloc`]; and the caller is C++ that lets exceptions pass (PyTorch).
#[no_mangle]
pub unsafe extern "C-unwind" fn vram_ledger_malloc_or_throw(
    size: isize,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    // The exception carries the message to the caller: one message per failure, not also a
    // log line.
    let p = guard_unlogged(std::ptr::null_mut(), || malloc(size, device, stream));
    if p.is_null() && size != 0 {
        let why = vram_ledger_last_error();
        // SAFETY: the last error is NUL-terminated and lives until this thread's next failure.
        // Out-of-memory messages have their own beginning, so the success path keeps no flag.
        let oom = unsafe { CStr::from_ptr(why) }
            .to_bytes()
            .starts_with(crate::error::TORCH_OUT_OF_MEMORY.as_bytes());
        // SAFETY: as above; the exception unwinds through no Rust frame that holds anything
        // to drop.
        unsafe { vram_ledger_throw(c_int::from(oom), why) }
    }
    p
}

/// `void free(void* ptr, ssize_t size, int device, cudaStream_t stream)`. `ptr` is looked up,
/// never dereferenced: NULL is ignored (nothing else is looked at, and no device is put in
/// use), and a pointer this library did not allocate is an error. `size` is what was asked for
/// it, told to the memory reporter as a negative allocation; a negative `size` is an error
/// (after the free: the memory is freed, the reporter told nothing).
///
/// # Safety
/// `stream` is as for [`vram_ledger_malloc`]. Work that uses `ptr` is queued on `stream`, or on
/// a stream passed to [`vram_ledger_record_stream`] for it: the memory is reused once that work
/// completes, and the driver is handed those streams to find out when.
#[no_mangle]
pub unsafe extern "C" fn vram_ledger_free(
    ptr: *mut c_void,
    size: isize,
    device: c_int,
    stream: *mut c_void,
) {
    guard((), || {
        if ptr.is_null() {
            return Ok(());
        }
        let state = state(device)?;
        let r = match context(CONTEXT_OF_FREE) {
            0 => free_on(state, ptr, stream),
            c => history::with_context(c, || free_on(state, ptr, stream)),
        };
        r.map_err(|e| format!("free of {ptr:?} on device {device} failed: {e}"))?;
        // The size PyTorch passes is the one it asked for, as the allocation reported: negated,
        // the free. A negative one would be reported as an allocation.
        if size < 0 {
            return Err(format!(
                "free of {ptr:?} on device {device}: size {size} is negative (the memory is freed; the memory reporter was not told)"
            ));
        }
        super::profiler::report(state, device, ptr, -(size as i64));
        Ok(())
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

/// `void memory_fraction(double fraction, int device)`: limit what `device`'s allocator reserves
/// to `fraction` (in [0, 1]) of the device's total memory, as PyTorch's
/// `set_per_process_memory_fraction`; 1.0 reserves up to the whole device. Growth past the
/// limit fails as an out-of-memory that names it. A limit on the allocator's own memory,
/// apart from the budget contract (`vram_ledger_set_cap`, the process's whole usage); a
/// fraction outside [0, 1] is an error (logged: the function returns nothing).
#[no_mangle]
pub extern "C" fn vram_ledger_memory_fraction(fraction: c_double, device: c_int) {
    guard((), || {
        let limit = Some(Limit::Fraction(fraction));
        on_device!(state(device)?, d => d.allocator().set_limit(limit)).map_err(|e| e.to_string())
    });
}

/// `void record_stream(void* ptr, cudaStream_t stream)`: `ptr`'s memory is not reused before
/// the work queued on `stream` so far completes. `ptr` is looked up, never dereferenced; NULL
/// (a zero-byte allocation's) is ignored.
///
/// # Safety
/// On the CUDA backend `stream` is a live `cudaStream_t` of the context of the device that
/// `ptr` belongs to, alive until `ptr` is freed: the allocator records an event on it then.
#[no_mangle]
pub unsafe extern "C" fn vram_ledger_record_stream(ptr: *mut c_void, stream: *mut c_void) {
    guard((), || {
        if ptr.is_null() {
            return Ok(());
        }
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
