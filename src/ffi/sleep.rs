//! Sleep and wake by tag (see `Allocator::sleep`). Tags are given as bit masks: bit `i` is
//! `Tag::ALL[i]` (1 weights, 2 activation, 4 kv_cache, 8 untracked; `vram_ledger_abi_json` gives
//! them to hosts). A negative device means every device in use, one after the other; for the
//! settings (`set_retain_host`, `set_sleep_file`, `set_zero_discarded`), also every device used
//! later.

use std::ffi::{c_char, c_int};

use super::boundary::*;
use crate::devices::{self, Device};
use crate::driver::Driver;
use crate::Tag;

/// The bit of `tag` in the masks of sleep and wake.
pub(super) const fn tag_bit(tag: Tag) -> c_int {
    1 << tag.index()
}

pub(super) fn tags(mask: c_int, what: &str) -> Result<Vec<Tag>, String> {
    if !(0..1 << Tag::COUNT).contains(&mask) {
        return Err(format!(
            "{what} {mask} is not a mask of tags (0 to {})",
            (1 << Tag::COUNT) - 1
        ));
    }
    Ok(Tag::ALL
        .into_iter()
        .filter(|&t| mask & tag_bit(t) != 0)
        .collect())
}

/// `device`, or every device in use when it is negative, with its ordinal.
fn devices_of(device: c_int) -> Result<Vec<(usize, &'static Device)>, String> {
    if device < 0 {
        Ok(devices::created_ordinals().collect())
    } else {
        Ok(vec![(device_index(device)?, state(device)?)])
    }
}

/// `f`'s report for each of `devices_of(device)`, as one JSON object keyed by ordinal.
fn reports<R: serde::Serialize>(
    device: c_int,
    mut f: impl FnMut(&'static Device) -> Result<R, String>,
) -> Result<*mut c_char, String> {
    let mut out = serde_json::Map::new();
    for (ordinal, d) in devices_of(device)? {
        let r = f(d).map_err(|e| format!("device {ordinal}: {e}"))?;
        out.insert(
            ordinal.to_string(),
            serde_json::to_value(r).map_err(|e| e.to_string())?,
        );
    }
    Ok(into_c_string(serde_json::Value::Object(out).to_string()))
}

/// Keep each tag's memory apart (`Config::separate_tags`), which sleep needs, in allocators
/// created from now on (before the first use of any device: refused after, as
/// `vram_ledger_configure`).
#[no_mangle]
pub extern "C" fn vram_ledger_separate_tags(enabled: c_int) -> c_int {
    guard(-1, || {
        devices::configure_with(|c| c.separate_tags = enabled != 0)?;
        Ok(0)
    })
}

/// Put the `offload` tags (copied to host memory) and the `discard` tags to sleep.
/// Returns a JSON report per device (free it with `vram_ledger_string_free`), NULL on error.
/// On an error, every tag this call put to sleep is woken again, on every device, so that an
/// error means nothing was left asleep by it (a discarded tag comes back as fresh memory),
/// unless the message says which tags could not be woken again.
#[no_mangle]
pub extern "C" fn vram_ledger_sleep(device: c_int, offload: c_int, discard: c_int) -> *mut c_char {
    guard(std::ptr::null_mut(), || {
        let (offload, discard) = (tags(offload, "offload")?, tags(discard, "discard")?);
        let mut slept: Vec<(&'static Device, Vec<Tag>)> = Vec::new();
        let r = reports(device, |d| {
            // Discarded tags are given back while the copies run: a failed copy leaves them
            // asleep on this device too, and they are woken with the rest below.
            let (r, left) = on_device!(d, d => d.allocator().sleep_noting(&offload, &discard));
            slept.push((d, left));
            r.map_err(|e| e.to_string())
        });
        let Err(mut message) = r else { return r };
        // What could not be woken again is part of the error: the caller must know that
        // memory is still asleep (and which), or it would use it.
        for (d, tags) in slept.into_iter().filter(|(_, t)| !t.is_empty()) {
            if let Err(e) = on_device!(d, d => d.allocator().wake(&tags)) {
                tracing::warn!(error = %e, "waking a device after another failed to sleep also failed");
                let names: Vec<&str> = tags.iter().map(|t| t.name()).collect();
                message.push_str(&format!(
                    "; waking device {} again also failed, its tags {} may still be asleep: {e}",
                    on_device!(d, d => d.allocator().driver().ordinal()),
                    names.join(", ")
                ));
            }
        }
        Err(message)
    })
}

/// Wake the tags of `mask` (0: every sleeping tag). Returns a JSON report per device, NULL on
/// error (the tag that failed stays asleep; wake can be retried).
#[no_mangle]
pub extern "C" fn vram_ledger_wake(device: c_int, mask: c_int) -> *mut c_char {
    guard(std::ptr::null_mut(), || {
        let wake = tags(mask, "mask")?;
        reports(device, |d| {
            on_device!(d, d => d.allocator().wake(&wake)).map_err(|e| e.to_string())
        })
    })
}

/// Keep (non-zero, page-locked) or free (0, the default) offloaded tags' host memory at wake.
#[no_mangle]
pub extern "C" fn vram_ledger_set_retain_host(device: c_int, retain: c_int) -> c_int {
    guard(-1, || {
        if device < 0 {
            devices::set_sleep_defaults(
                |s| s.retain_host = Some(retain != 0),
                |d| on_device!(d, d => d.allocator().set_retain_host(retain != 0)),
            );
            return Ok(0);
        }
        for (_, d) in devices_of(device)? {
            on_device!(d, d => d.allocator().set_retain_host(retain != 0));
        }
        Ok(0)
    })
}

/// Offload to disk: each offloaded tag goes to a new file `PATH.dev<N>.<tag>` (which must not
/// exist; created at sleep and removed at once, its blocks reserved first); NULL (the default):
/// host memory. Takes effect at the next sleep of a tag whose host memory is not retained.
///
/// # Safety
/// `path` is NULL or a NUL-terminated string, readable for the length of the call.
#[no_mangle]
pub unsafe extern "C" fn vram_ledger_set_sleep_file(device: c_int, path: *const c_char) -> c_int {
    guard(-1, || {
        let path = if path.is_null() {
            None
        } else {
            // SAFETY: non-NULL and NUL-terminated, by this function's contract.
            let p = unsafe { c_str(path, "the sleep file's path") }?;
            if p.is_empty() {
                return Err(
                    "the sleep file's path is empty (NULL turns the disk backend off)".into(),
                );
            }
            Some(std::path::PathBuf::from(p))
        };
        if device < 0 {
            devices::set_sleep_defaults(
                |s| s.file = Some(path.clone()),
                |d| on_device!(d, d => d.allocator().set_sleep_file(path.clone())),
            );
            return Ok(0);
        }
        for (_, d) in devices_of(device)? {
            on_device!(d, d => d.allocator().set_sleep_file(path.clone()));
        }
        Ok(0)
    })
}

/// Fill discarded tags' memory with zeros at wake (non-zero, the default), or leave it as fresh
/// memory comes (0: stale data of this process).
#[no_mangle]
pub extern "C" fn vram_ledger_set_zero_discarded(device: c_int, zero: c_int) -> c_int {
    guard(-1, || {
        if device < 0 {
            devices::set_sleep_defaults(
                |s| s.zero_discarded = Some(zero != 0),
                |d| on_device!(d, d => d.allocator().set_zero_discarded(zero != 0)),
            );
            return Ok(0);
        }
        for (_, d) in devices_of(device)? {
            on_device!(d, d => d.allocator().set_zero_discarded(zero != 0));
        }
        Ok(0)
    })
}
