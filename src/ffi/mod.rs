//! The C ABI of `libvram_ledger.so`: PyTorch's pluggable-allocator entry points and hooks,
//! tags, statistics and profiling.
//!
//! Invariants:
//! - No panic crosses the boundary: every entry point runs under `catch_unwind`, and so does
//!   recording its error message (a panic there leaves a static message instead). The one
//!   exception that does cross is deliberate: `vram_ledger_malloc_or_throw` throws a C++
//!   exception (csrc/throw.cpp) for PyTorch to turn into a Python exception.
//! - Entry points that read or trust a caller's pointer (a C string, a stream) are `unsafe`,
//!   with what the caller guarantees under `# Safety`; those taking only numbers are safe.
//! - Device state comes from [`crate::devices`], the registry the Rust API uses too: a device
//!   used from Rust and from C has one allocator and one ledger.
//! - Every failure is a return value (NULL, -1, or nothing for `void` functions) plus a
//!   readable message from `vram_ledger_last_error()` on the failing thread, and a warning:
//!   to the host's callback (`vram_ledger_set_log_callback`), else in the log (stderr unless
//!   the host installed its own `tracing` subscriber; `VRAM_LEDGER_LOG` sets the level); the
//!   allocator keeps working.
//! - Strings returned to the caller are owned by it and given back with
//!   `vram_ledger_string_free`; the last-error string stays valid until the next call that
//!   fails on the same thread.
//!
//! Hosts that bind the library at run time read its tags, modes and entry-point signatures from
//! `vram_ledger_abi_json()` rather than keeping their own copy.
//!
//! Out of memory: `vram_ledger_malloc` returns NULL after releasing the cache and retrying,
//! and prints the full breakdown to stderr (and the log). PyTorch's pluggable allocator does not
//! check for NULL (the first kernel touching a tensor at address 0 ends the CUDA context), so
//! `install()` hands it `vram_ledger_malloc_or_throw`, whose "CUDA out of memory." exception
//! reaches Python as torch.OutOfMemoryError (PyTorch's own c10 type, when PyTorch is loaded). A `torch.cuda.MemPool` backed by this library checks for
//! NULL itself and raises `torch.OutOfMemoryError`.

/// Run `$body` with `$d` bound to the device's `PerDevice`, whichever backend it is on.
macro_rules! on_device {
    ($device:expr, $d:ident => $body:expr) => {
        match $device {
            Device::Cuda($d) => $body,
            Device::Sim($d) => $body,
        }
    };
}

mod abi;
mod boundary;
#[cfg(test)]
mod declarations;
mod graphs;
#[cfg(test)]
mod header;
mod kv;
mod ledger;
mod pools;
mod profile;
mod profiler;
mod pytorch;
mod sleep;

pub use self::abi::vram_ledger_abi_json;
pub use self::boundary::{
    vram_ledger_device_count, vram_ledger_last_error, vram_ledger_string_free,
};
pub use self::graphs::*;
pub use self::kv::*;
pub use self::ledger::*;
pub use self::pools::*;
pub use self::profile::*;
pub use self::profiler::*;
pub use self::pytorch::*;
pub use self::sleep::*;
