//! Page-locked host memory for the CUDA backend, made fast to pin. `cuMemHostAlloc` faults in
//! and locks fresh 4 KiB pages one at a time: about 2.3 GB/s on an H200 host (16 GiB took 7 s),
//! whatever the number of calling threads. Here the memory is anonymous, asks for transparent
//! huge pages, is faulted in by several threads at once, and is then registered with the
//! driver (`cuMemHostRegister`), which pins pages that are already there.
//!
//! Pageable buffers (`alloc_pageable`) are the same anonymous huge-page memory, neither faulted
//! in nor registered: their pages come as the CPU first writes them.
//!
//! Invariant: every buffer handed out by `alloc` is registered and mapped until `free`
//! unregisters and unmaps it, with the size it was made with; every one from `alloc_pageable`
//! is mapped until `free_pageable` unmaps it.

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::sys;

const HUGE: usize = 2 << 20;
const THREADS: usize = 8;

/// A registered buffer of at least `bytes`; `Err` carries the failed call's result or errno.
pub(super) fn alloc(bytes: u64) -> Result<(*mut c_void, usize), PinError> {
    // Faulting in pages the host does not have would not fail: it would wake the OOM killer.
    // Buffers being faulted in on other threads count against the room too: the host's
    // figure does not show them yet (or only in part, which errs on the safe side).
    let others = PINNING.fetch_add(bytes, Ordering::Relaxed);
    let r = check_room(others, bytes, true).and_then(|()| alloc_unchecked(bytes));
    PINNING.fetch_sub(bytes, Ordering::Relaxed);
    r
}

/// A pageable buffer of at least `bytes`, refused when the host cannot spare that much now:
/// its pages are faulted in later, by the copies into it, when a shortfall could no longer be
/// reported.
pub(super) fn alloc_pageable(bytes: u64) -> Result<(*mut c_void, usize), PinError> {
    check_room(0, bytes, false)?;
    let size = (bytes as usize).div_ceil(HUGE) * HUGE;
    Ok((map_huge(size)?, size))
}

/// Unmap a buffer from [`alloc_pageable`].
pub(super) fn free_pageable(p: *mut c_void, size: usize) -> Result<(), PinError> {
    // SAFETY: the mapping of `size` bytes made by `alloc_pageable`, used by no one any more
    // (the caller's contract).
    if unsafe { libc::munmap(p, size) } != 0 {
        return Err(PinError::Os(std::io::Error::last_os_error()));
    }
    Ok(())
}

/// Bytes of buffers being made now, by every thread.
static PINNING: AtomicU64 = AtomicU64::new(0);

fn check_room(others: u64, bytes: u64, pinned: bool) -> Result<(), PinError> {
    match super::host_room::pinnable_now() {
        Some(room) if others.saturating_add(bytes) > room => Err(PinError::Exhausted {
            wanted: bytes,
            room: room.saturating_sub(others),
            pinned,
        }),
        _ => Ok(()),
    }
}

fn alloc_unchecked(bytes: u64) -> Result<(*mut c_void, usize), PinError> {
    let size = (bytes as usize).div_ceil(HUGE) * HUGE;
    let start = map_huge(size)? as usize;
    // Fault the pages in on several threads: the kernel zero-fills them in parallel.
    let per = size.div_ceil(THREADS).next_multiple_of(HUGE);
    let touch = move |lo: usize, hi: usize| {
        let mut off = lo;
        while off < hi {
            // SAFETY: inside the mapping, which no one else uses yet.
            unsafe { std::ptr::write_volatile((start + off) as *mut u8, 0) };
            off += 4096;
        }
    };
    let ranges: Vec<(usize, usize)> = (0..THREADS)
        .map(|k| (k * per, ((k + 1) * per).min(size)))
        .filter(|(lo, hi)| lo < hi)
        .collect();
    crate::threads::on_threads(&ranges, |&(lo, hi)| touch(lo, hi));
    let p = start as *mut c_void;
    // SAFETY: a mapped, writable range of `size` bytes.
    let r = unsafe { sys::cuMemHostRegister_v2(p, size, sys::CU_MEMHOSTREGISTER_PORTABLE) };
    if r != sys::CUresult::CUDA_SUCCESS {
        // SAFETY: the mapping made above, not registered.
        unsafe { libc::munmap(p, size) };
        return Err(PinError::Driver(r));
    }
    Ok((p, size))
}

/// `size` bytes (a multiple of a huge page) of anonymous memory on a huge-page boundary, with
/// transparent huge pages asked for; nothing faulted in.
fn map_huge(size: usize) -> Result<*mut c_void, PinError> {
    // Over-map by a huge page so that the buffer can start on a huge-page boundary.
    let span = size + HUGE;
    // SAFETY: an anonymous private mapping; no file, no fixed address.
    let raw = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            span,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        return Err(PinError::Os(std::io::Error::last_os_error()));
    }
    let start = (raw as usize).next_multiple_of(HUGE);
    let (head, tail) = (start - raw as usize, raw as usize + span - (start + size));
    // SAFETY: the trimmed pieces lie inside the mapping just made and are not used.
    unsafe {
        if head > 0 {
            libc::munmap(raw, head);
        }
        if tail > 0 {
            libc::munmap((start + size) as *mut c_void, tail);
        }
        // Advice only: without transparent huge pages the memory is still correct.
        libc::madvise(start as *mut c_void, size, libc::MADV_HUGEPAGE);
    }
    Ok(start as *mut c_void)
}

/// Unregister and unmap a buffer from [`alloc`].
pub(super) fn free(p: *mut c_void, size: usize) -> Result<(), PinError> {
    // SAFETY: a buffer registered by `alloc`, with no copy pending on it (the caller's
    // contract).
    let r = unsafe { sys::cuMemHostUnregister(p) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(PinError::Driver(r));
    }
    // SAFETY: the mapping of `size` bytes made by `alloc`, no longer registered.
    if unsafe { libc::munmap(p, size) } != 0 {
        return Err(PinError::Os(std::io::Error::last_os_error()));
    }
    Ok(())
}

#[derive(Debug)]
pub(super) enum PinError {
    Driver(sys::CUresult),
    Os(std::io::Error),
    /// More than the host (and this process's memory cgroup) can spare now.
    Exhausted {
        wanted: u64,
        room: u64,
        /// Page-locked (else pageable) memory was asked for.
        pinned: bool,
    },
}
