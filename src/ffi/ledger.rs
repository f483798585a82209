//! Configuration, tags, statistics, history and metrics. Functions returning int give 0 or -1.
//! The configuration (`vram_ledger_configure` and the settings beside it) is for allocators not
//! yet created: once any device is in use, a call that would change it is refused (-1), since
//! the allocators in use keep theirs.

use std::ffi::{c_char, c_int};

use super::boundary::*;
use crate::devices::{self, Device};
use crate::{SegmentMode, Tag};

/// Choose the segment mode ("native", "expandable", "compact" or "remap") of allocators not yet
/// created (refused once a device is in use, unless it is the mode set already). A device is
/// in use from the first call that names it, queries included (`vram_ledger_cap`,
/// `vram_ledger_stats_json`, …): configure first. `vram_ledger_init`, `vram_ledger_device_count`
/// and `vram_ledger_free` or `vram_ledger_record_stream` of NULL put none in use.
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
        devices::configure_with(|c| c.mode = mode)?;
        Ok(0)
    })
}

/// Remap mode: unmap a moved piece's old mapping once the stream's earlier work has finished,
/// instead of synchronising the stream before the move (`Config::unmap_later`), in allocators
/// not yet created. Other modes make no such moves and ignore it.
#[no_mangle]
pub extern "C" fn vram_ledger_unmap_later(enabled: c_int) -> c_int {
    guard(-1, || {
        devices::configure_with(|c| c.unmap_later = enabled != 0)?;
        Ok(0)
    })
}

/// Remap mode: the largest piece of physical memory one map call covers, in bytes, rounded up
/// to whole granules (`Config::remap_piece`), in allocators not yet created; 0 puts back the
/// default (68 MiB). Other modes ignore it.
#[no_mangle]
pub extern "C" fn vram_ledger_remap_piece(bytes: u64) -> c_int {
    guard(-1, || {
        devices::configure_with(|c| c.remap_piece = (bytes != 0).then_some(bytes))?;
        Ok(0)
    })
}

/// Compact and remap modes: before growing, also take the free memory other streams' shards
/// hold, after synchronising the device (`Config::move_across_streams`), in allocators not yet
/// created. Off by default; other modes ignore it.
#[no_mangle]
pub extern "C" fn vram_ledger_move_across_streams(enabled: c_int) -> c_int {
    guard(-1, || {
        devices::configure_with(|c| c.move_across_streams = enabled != 0)?;
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
        crate::tag::set_current(unsafe { tag_arg(name) }?);
        Ok(0)
    })
}

/// The tag a C caller named.
///
/// # Safety
/// `name` is NULL (an error) or a NUL-terminated string, readable for the length of the call.
unsafe fn tag_arg(name: *const c_char) -> Result<Tag, String> {
    // SAFETY: the caller's contract.
    unsafe { c_str(name, "tag name") }?
        .parse()
        .map_err(|e: crate::tag::UnknownTag| e.to_string())
}

/// Make `name` this thread's tag until the matching `vram_ledger_pop_tag`.
///
/// # Safety
/// `name` is NULL (an error) or a NUL-terminated string, readable for the length of the call.
#[no_mangle]
pub unsafe extern "C" fn vram_ledger_push_tag(name: *const c_char) -> c_int {
    guard(-1, || {
        // SAFETY: `name` is NULL or NUL-terminated, by this function's contract.
        let previous = crate::tag::set_current(unsafe { tag_arg(name) }?);
        TAG_STACK.with(|s| s.borrow_mut().push(previous));
        Ok(0)
    })
}

/// Give this thread back the tag it had before the matching `vram_ledger_push_tag`; -1 when
/// there is none.
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
        let stats = on_device!(state(device)?, d => d.memory_stats());
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

/// Start every peak figure of `device` over from its current value.
#[no_mangle]
pub extern "C" fn vram_ledger_reset_peaks(device: c_int) -> c_int {
    guard(-1, || {
        on_device!(state(device)?, d => d.allocator().ledger().reset_peaks());
        Ok(0)
    })
}

/// Count `device`'s accumulated statistics (the `allocated` and `freed` totals, retries,
/// out-of-memory failures, device allocations and frees) from now on, as
/// `torch.cuda.reset_accumulated_memory_stats` does; the ledger's own totals are kept.
#[no_mangle]
pub extern "C" fn vram_ledger_reset_accumulated(device: c_int) -> c_int {
    guard(-1, || {
        on_device!(state(device)?, d => d.reset_accumulated());
        Ok(0)
    })
}

/// Give `device`'s cached, unused memory back to the driver.
#[no_mangle]
pub extern "C" fn vram_ledger_empty_cache(device: c_int) -> c_int {
    guard(-1, || {
        status(on_device!(state(device)?, d => d.allocator().empty_cache()))
    })
}

/// Start (`enabled` non-zero; clearing what was recorded, keeping the newest `max_entries`
/// entries, which must be positive) or stop recording `device`'s allocation history
/// (`max_entries` is then not read).
#[no_mangle]
pub extern "C" fn vram_ledger_record_history(
    device: c_int,
    enabled: c_int,
    max_entries: i64,
) -> c_int {
    guard(-1, || {
        let max = match usize::try_from(max_entries).ok().filter(|&m| m > 0) {
            Some(m) => m,
            None if enabled == 0 => 1,
            None => return Err(format!("max_entries must be positive, not {max_entries}")),
        };
        status(on_device!(state(device)?, d => d.allocator().record_history(enabled != 0, max)))
    })
}

/// Attach `metadata` to `device`'s history entries from now on (NULL or "": none), as
/// PyTorch's `_set_memory_metadata` does; 0 on success, -1 on error.
///
/// # Safety
/// `metadata` is NULL or a NUL-terminated string, readable for the length of the call.
#[no_mangle]
pub unsafe extern "C" fn vram_ledger_set_history_metadata(
    device: c_int,
    metadata: *const c_char,
) -> c_int {
    guard(-1, || {
        let m = if metadata.is_null() {
            None
        } else {
            // SAFETY: non-NULL and NUL-terminated, by this function's contract.
            Some(unsafe { c_str(metadata, "metadata") }?)
        };
        on_device!(state(device)?, d => d.allocator().set_history_metadata(m));
        Ok(0)
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
