//! The CUDA backend's host buffers: page-locked ones (`pinned.rs`), pageable ones, and pageable
//! ones whose pages are a file's (sleep's disk backend), each known by address with its size,
//! so that a free or a host copy is checked against what was handed out.
//!
//! Invariant: an address is in one table at most, from its allocation until its free succeeds;
//! a free that fails leaves it in its table, to be freed again.

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::path::Path;

use parking_lot::Mutex;

use super::pinned::{self, PinError};
use super::{DriverCall, DriverError, DriverErrorKind, DriverResult, HostPtr};

#[derive(Default)]
pub(super) struct HostBuffers {
    pinned: Mutex<BTreeMap<u64, usize>>,
    /// Pageable buffers: size, and whether a file's pages.
    pageable: Mutex<BTreeMap<u64, (usize, bool)>>,
}

impl HostBuffers {
    /// A page-locked buffer (the caller has made the context current).
    pub(super) fn alloc_pinned(&self, bytes: u64) -> DriverResult<HostPtr> {
        let (p, size) = pinned::alloc(bytes).map_err(|e| pin_error(DriverCall::HostAlloc, e))?;
        self.pinned.lock().insert(p as u64, size);
        Ok(HostPtr(p as u64))
    }

    /// A pageable buffer: anonymous memory, or the pages of a new file at `file`.
    pub(super) fn alloc_pageable(&self, bytes: u64, file: Option<&Path>) -> DriverResult<HostPtr> {
        let made = match file {
            None => pinned::alloc_pageable(bytes),
            Some(path) => pinned::alloc_file(path, bytes),
        };
        let (p, size) = made.map_err(|e| pin_error(DriverCall::HostAllocPageable, e))?;
        self.pageable
            .lock()
            .insert(p as u64, (size, file.is_some()));
        Ok(HostPtr(p as u64))
    }

    /// Free a buffer of either kind; `current` makes the context current, which only a
    /// page-locked buffer needs.
    pub(super) fn free(
        &self,
        ptr: HostPtr,
        current: impl FnOnce() -> DriverResult<()>,
    ) -> DriverResult<()> {
        const CALL: DriverCall = DriverCall::HostFree;
        let p = ptr.0 as *mut c_void;
        // Out of the table first, and the table's lock let go: freeing takes a while, and a
        // failure puts the buffer back.
        let found = self.pageable.lock().remove(&ptr.0);
        if let Some((size, file)) = found {
            return pinned::free_pageable(p, size, file).map_err(|e| {
                // Still mapped: kept, to be freed again.
                self.pageable.lock().insert(ptr.0, (size, file));
                pin_error(CALL, e)
            });
        }
        current()?;
        // Out of the table first, so that an address reused by a concurrent allocation is
        // never confused with this one; back in only if the buffer is still registered.
        let size = self.pinned.lock().remove(&ptr.0).ok_or_else(|| {
            DriverError::new(
                CALL,
                DriverErrorKind::InvalidValue,
                format!("{:#x} is not a host buffer", ptr.0),
            )
        })?;
        if let Err(e) = pinned::free(p, size) {
            if matches!(e, PinError::Driver(_)) {
                self.pinned.lock().insert(ptr.0, size);
            }
            return Err(pin_error(CALL, e));
        }
        Ok(())
    }

    /// Copy between two host buffers of this driver on the calling thread.
    pub(super) fn copy(&self, dst: HostPtr, src: HostPtr, bytes: u64) -> DriverResult<()> {
        let within = |p: HostPtr, b: u64, n: usize| {
            p.0 >= b && p.0.checked_add(bytes).is_some_and(|e| e <= b + n as u64)
        };
        let inside = |p: HostPtr| {
            let pinned = self.pinned.lock();
            let pageable = self.pageable.lock();
            pinned
                .range(..=p.0)
                .next_back()
                .is_some_and(|(&b, &n)| within(p, b, n))
                || pageable
                    .range(..=p.0)
                    .next_back()
                    .is_some_and(|(&b, &(n, _))| within(p, b, n))
        };
        if !inside(dst) || !inside(src) {
            return Err(DriverError::new(
                DriverCall::HostCopy,
                DriverErrorKind::InvalidValue,
                format!(
                    "a host copy of {bytes} bytes from {:#x} to {:#x} leaves its buffers",
                    src.0, dst.0
                ),
            ));
        }
        // SAFETY: both ranges lie inside live host buffers of this driver (checked above) and
        // no device copy uses them (the caller's contract); they may overlap (a memmove).
        unsafe { std::ptr::copy(src.0 as *const u8, dst.0 as *mut u8, bytes as usize) };
        Ok(())
    }
}

fn pin_error(call: DriverCall, e: PinError) -> DriverError {
    match e {
        PinError::Driver(r) => super::cuda_result::error(call, r, super::cuda_result::describe(r)),
        PinError::Os(e) => {
            let kind = if e.raw_os_error() == Some(libc::ENOMEM) {
                DriverErrorKind::OutOfMemory
            } else {
                DriverErrorKind::Other(e.raw_os_error().unwrap_or(-1))
            };
            DriverError::new(call, kind, format!("host memory: {e}"))
        }
        PinError::File { path, error } => {
            let kind = if error.raw_os_error() == Some(libc::ENOSPC) {
                DriverErrorKind::OutOfMemory
            } else {
                DriverErrorKind::Other(error.raw_os_error().unwrap_or(-1))
            };
            DriverError::new(
                call,
                kind,
                format!("sleep file {}: {error}", path.display()),
            )
        }
        PinError::Exhausted {
            wanted,
            room,
            pinned,
        } => DriverError::new(
            call,
            DriverErrorKind::OutOfMemory,
            format!(
                "host memory exhausted: {} {} needs more than the {} this host can spare",
                if pinned { "pinning" } else { "keeping" },
                crate::units::Bytes(wanted),
                crate::units::Bytes(room)
            ),
        ),
    }
}
