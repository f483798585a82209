//! Page-locked host memory for the CUDA backend, made fast to pin. `cuMemHostAlloc` faults in
//! and locks fresh 4 KiB pages one at a time: about 2.3 GB/s on an H200 host (16 GiB took 7 s),
//! whatever the number of calling threads. Here the memory is anonymous, asks for transparent
//! huge pages, is faulted in by several threads at once, and is then registered with the
//! driver (`cuMemHostRegister`), which pins pages that are already there.
//!
//! Pageable buffers (`alloc_pageable`) are the same anonymous huge-page memory, neither faulted
//! in nor registered: their pages come as the CPU first writes them. A file's buffer
//! (`alloc_file`) is a shared mapping of a new file whose blocks are reserved at once: its pages
//! are the kernel's page cache, written back to the disk and dropped when the host needs the
//! memory.
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
    // Buffers handed out count against the room until freed: the host's figure shows only
    // what has been written into them so far (counted twice once written, on the safe side).
    let size = huge_multiple(bytes);
    let pinning = PINNING.load(Ordering::Relaxed);
    let out = PAGEABLE.fetch_add(size as u64, Ordering::Relaxed);
    let made = check_room(pinning.saturating_add(out), bytes, false).and_then(|()| map_huge(size));
    if made.is_err() {
        PAGEABLE.fetch_sub(size as u64, Ordering::Relaxed);
    }
    Ok((made?, size))
}

/// Bytes of anonymous pageable buffers handed out and not yet freed.
static PAGEABLE: AtomicU64 = AtomicU64::new(0);

/// A buffer of at least `bytes` whose pages are those of a new file at `path`, which must not
/// exist. The file is removed at once (its space stays in use until the buffer is unmapped,
/// and nothing is left behind if the process ends), and its blocks are reserved first: a
/// write into a hole that the disk cannot fill would end the process (SIGBUS).
pub(super) fn alloc_file(
    path: &std::path::Path,
    bytes: u64,
) -> Result<(*mut c_void, usize), PinError> {
    use std::os::fd::AsRawFd;
    let size = huge_multiple(bytes);
    let file_error = |error| PinError::File {
        path: path.to_path_buf(),
        error,
    };
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(file_error)?;
    std::fs::remove_file(path).map_err(file_error)?;
    // SAFETY: a file descriptor of this process, open for writing.
    let r = unsafe { libc::posix_fallocate(f.as_raw_fd(), 0, size as libc::off_t) };
    if r != 0 {
        return Err(file_error(std::io::Error::from_raw_os_error(r)));
    }
    // SAFETY: a shared mapping of the whole file just sized; it keeps the file after `f` closes.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(file_error(std::io::Error::last_os_error()));
    }
    Ok((p, size))
}

/// Unmap a buffer from [`alloc_pageable`] (`file` false) or [`alloc_file`].
pub(super) fn free_pageable(p: *mut c_void, size: usize, file: bool) -> Result<(), PinError> {
    if !file {
        drop_pages(p as usize, size);
    }
    // SAFETY: the mapping of `size` bytes made by `alloc_pageable` or `alloc_file`, used by no
    // one any more (the caller's contract).
    if unsafe { libc::munmap(p, size) } != 0 {
        return Err(PinError::Os(std::io::Error::last_os_error()));
    }
    if !file {
        PAGEABLE.fetch_sub(size as u64, Ordering::Relaxed);
    }
    Ok(())
}

/// Give the pages of an anonymous buffer back to the host on several threads before it is
/// unmapped. `munmap` frees them on one thread under the process's address-space lock: 16 GiB
/// took 0.04 to 0.08 s on the H200 machine, and wake waits for it; `MADV_DONTNEED` frees pages
/// under the lock's shared side, so threads share the work (0.011 s on 16 threads in the
/// benchmark, 0.011 to 0.013 s on these 8 in the library).
fn drop_pages(start: usize, size: usize) {
    const PART: usize = 256 << 20;
    if size <= PART {
        return;
    }
    let per = size
        .div_ceil(crate::threads::THREADS)
        .max(PART)
        .next_multiple_of(HUGE);
    let ranges: Vec<(usize, usize)> = (0..size.div_ceil(per))
        .map(|k| (k * per, ((k + 1) * per).min(size)))
        .collect();
    crate::threads::on_threads(&ranges, |&(lo, hi)| {
        // SAFETY: inside the caller's mapping, which no one uses any more. Advice only: what it
        // leaves, the munmap that follows frees.
        unsafe { libc::madvise((start + lo) as *mut c_void, hi - lo, libc::MADV_DONTNEED) };
    });
}

/// `bytes` rounded up to whole huge pages: the size of every buffer made here.
fn huge_multiple(bytes: u64) -> usize {
    (bytes as usize).div_ceil(HUGE) * HUGE
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
    let size = huge_multiple(bytes);
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
    /// A sleep file could not be made, sized or mapped.
    File {
        path: std::path::PathBuf,
        error: std::io::Error,
    },
    /// More than the host (and this process's memory cgroup) can spare now.
    Exhausted {
        wanted: u64,
        room: u64,
        /// Page-locked (else pageable) memory was asked for.
        pinned: bool,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pageable_buffers_count_against_the_room_until_freed() {
        // Two buffers of 60% of what the host can spare: each fits alone, not both (nothing is
        // written into the first, so the host's own figure does not show it).
        let Some(room) = super::super::host_room::pinnable_now() else {
            eprintln!("skipped: this host says nothing of its memory");
            return;
        };
        let bytes = (room / 10 * 6).max(HUGE as u64);
        let (p, size) = alloc_pageable(bytes).unwrap();
        let Err(PinError::Exhausted { pinned: false, .. }) = alloc_pageable(bytes) else {
            panic!("a second buffer of {bytes} bytes was handed out beside the first");
        };
        free_pageable(p, size, false).unwrap();
        let (p, size) = alloc_pageable(bytes).unwrap();
        free_pageable(p, size, false).unwrap();
    }

    #[test]
    fn a_file_buffer_holds_what_is_written_is_removed_at_once_and_refuses_an_existing_name() {
        let dir = std::env::temp_dir().join(format!("vram-ledger-pinned-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("weights");
        let (p, size) = alloc_file(&path, 5 << 20).unwrap();
        assert_eq!(size, 6 << 20, "a multiple of a huge page");
        assert!(!path.exists(), "removed at once");
        // SAFETY: the mapping just made, of `size` bytes.
        let bytes = unsafe { std::slice::from_raw_parts_mut(p as *mut u8, size) };
        bytes.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
        assert!(bytes.iter().enumerate().all(|(i, &b)| b == i as u8));
        free_pageable(p, size, true).unwrap();
        std::fs::write(&path, b"the user's").unwrap();
        let Err(PinError::File { error, .. }) = alloc_file(&path, 1 << 20) else {
            panic!("an existing file is not taken over");
        };
        assert_eq!(error.kind(), std::io::ErrorKind::AlreadyExists);
        assert_eq!(std::fs::read(&path).unwrap(), b"the user's");
        let Err(PinError::File { .. }) = alloc_file(&dir.join("no/such/dir"), 1 << 20) else {
            panic!("a missing directory is an error");
        };
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
