//! Memory events for PyTorch's profiler (`torch.profiler.profile(profile_memory=True)` and the
//! memory timeline built on it): PyTorch's caching allocator reports each allocation and free
//! to c10 (`c10::reportMemoryUsageToProfiler`) while a profiler that records memory is active;
//! a pluggable allocator reports nothing. The host names c10's two functions here, and every
//! allocation and free through the PyTorch hooks is reported as PyTorch's allocator reports it.
//!
//! Costs the hooks one load of the reporter's address while none is set, and one call of the
//! host's check while one is (c10's reads a thread-local).

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::devices::Device;

/// Whether a profiler that records memory is active on this thread (`c10::memoryProfilingEnabled`;
/// its `bool` read as one byte, 0 or 1).
pub type MemoryProfiling = unsafe extern "C" fn() -> u8;

/// A memory event (`c10::reportMemoryUsageToProfiler`): the pointer, the bytes allocated
/// (negative for a free), the bytes allocated and reserved on the device after it, and the
/// device as c10 passes a `c10::Device` by value (its type, CUDA = 1, in the low byte and its
/// index in the high byte).
pub type MemoryReport =
    unsafe extern "C" fn(ptr: *mut c_void, size: i64, allocated: u64, reserved: u64, device: u16);

/// The two functions' addresses (0: none), written only by the setter, the check before the
/// report (so a reader that sees a check also sees its report).
static PROFILING: AtomicUsize = AtomicUsize::new(0);
static REPORT: AtomicUsize = AtomicUsize::new(0);

/// Report allocations and frees through the PyTorch hooks to `report` while `profiling` says
/// so (both NULL: stop). Both run on the allocating or freeing thread with no lock of the
/// allocator held, and must not unwind.
#[no_mangle]
pub extern "C" fn vram_ledger_set_memory_reporter(
    profiling: Option<MemoryProfiling>,
    report: Option<MemoryReport>,
) {
    let (p, r) = match (profiling, report) {
        (Some(p), Some(r)) => (p as usize, r as usize),
        _ => (0, 0),
    };
    PROFILING.store(0, Ordering::Release);
    REPORT.store(r, Ordering::Release);
    PROFILING.store(p, Ordering::Release);
}

/// Report `size` bytes at `ptr` (negative: freed) on `device`, if a profiler records memory.
#[inline(always)]
pub(super) fn report(state: &Device, device: c_int, ptr: *mut c_void, size: i64) {
    let p = PROFILING.load(Ordering::Acquire);
    if p != 0 && !ptr.is_null() {
        report_slow(state, device, p, ptr, size);
    }
}

#[cold]
fn report_slow(state: &Device, device: c_int, p: usize, ptr: *mut c_void, size: i64) {
    // SAFETY: a non-zero value was stored from a `MemoryProfiling` by the setter.
    let profiling: MemoryProfiling = unsafe { std::mem::transmute::<usize, MemoryProfiling>(p) };
    // SAFETY: the host's function, called as the setter's contract says.
    if unsafe { profiling() } & 1 == 0 {
        return;
    }
    let r = REPORT.load(Ordering::Acquire);
    if r == 0 {
        return;
    }
    // SAFETY: stored from a `MemoryReport` before the check was (the setter's order).
    let report: MemoryReport = unsafe { std::mem::transmute::<usize, MemoryReport>(r) };
    let (allocated, reserved) = on_device!(state, d => {
        let l = d.allocator().ledger();
        (l.allocated(), l.reserved())
    });
    let cuda = 1u16 | (u16::from(device as u8) << 8);
    // SAFETY: the host's function, called as the setter's contract says.
    unsafe { report(ptr, size, allocated, reserved, cuda) };
}
