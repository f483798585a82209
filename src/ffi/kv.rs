//! The KV cache sized last (see `Allocator::reserve_kv`): reserve it, commit it to what the
//! budget contract leaves after the CUDA graphs are captured, resize it while serving, give it
//! back. Results are JSON (free them with `vram_ledger_string_free`), NULL on error with the
//! reason in `vram_ledger_last_error`.

use std::ffi::{c_char, c_int};

use super::boundary::*;
use crate::devices::Device;

fn json<T: serde::Serialize>(r: crate::Result<T>) -> Result<*mut c_char, String> {
    let v = r.map_err(|e| e.to_string())?;
    Ok(into_c_string(
        serde_json::to_string(&v).map_err(|e| e.to_string())?,
    ))
}

/// Reserve the KV cache on `device`: address space for `max_bytes` (negative: the device's
/// memory) in blocks of `block_bytes`, `initial_blocks` of them usable now. Returns the KV
/// cache as JSON (`base`, `block_bytes`, `reserved_blocks`, `usable_blocks`, `reserved_bytes`,
/// `mapped_bytes`).
#[no_mangle]
pub extern "C" fn vram_ledger_kv_reserve(
    device: c_int,
    block_bytes: u64,
    max_bytes: i64,
    initial_blocks: u64,
) -> *mut c_char {
    guard(std::ptr::null_mut(), || {
        let max = u64::try_from(max_bytes).ok();
        let d = state(device)?;
        json(on_device!(d, d => d.allocator().reserve_kv(block_bytes, max, initial_blocks)))
    })
}

/// Map the KV cache up to what the budget contract leaves now (again after serving: sized from
/// what serving reserved at most); returns the KV cache and what was measured (`kv`, `room`,
/// `blocks_before`) as JSON.
#[no_mangle]
pub extern "C" fn vram_ledger_kv_commit(device: c_int) -> *mut c_char {
    guard(std::ptr::null_mut(), || {
        let d = state(device)?;
        json(on_device!(d, d => d.allocator().commit_kv()))
    })
}

/// Make `blocks` usable; returns the KV cache as JSON. Shrinking needs every block from
/// `free_from` on free (the engine says so; a `free_from` at or above the usable blocks says
/// nothing is); growing past the memory the cache keeps mapped needs the budget contract
/// (profiling, or `vram_ledger_set_cap`), whose room it may not pass. On an error the KV cache
/// is as it was.
#[no_mangle]
pub extern "C" fn vram_ledger_kv_resize(device: c_int, blocks: u64, free_from: u64) -> *mut c_char {
    guard(std::ptr::null_mut(), || {
        let d = state(device)?;
        json(on_device!(d, d => d.allocator().resize_kv(blocks, free_from)))
    })
}

/// The KV cache as JSON, or `null` when none is reserved.
#[no_mangle]
pub extern "C" fn vram_ledger_kv_info(device: c_int) -> *mut c_char {
    guard(std::ptr::null_mut(), || {
        let d = state(device)?;
        json(Ok(on_device!(d, d => d.allocator().kv_cache())))
    })
}

/// Give the KV cache back: 0, or -1 on error.
#[no_mangle]
pub extern "C" fn vram_ledger_kv_release(device: c_int) -> c_int {
    guard(-1, || {
        let d = state(device)?;
        status(on_device!(d, d => d.allocator().release_kv()))
    })
}
