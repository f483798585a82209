//! Profiling scopes: open one on a device, end it with the budget and report as JSON.

use std::ffi::{c_char, c_double, c_int};

use super::boundary::*;
use crate::devices::Device;
use crate::profile::{Margin, ProfileOptions};
use std::collections::HashMap;
use std::sync::OnceLock;

use parking_lot::Mutex;

use crate::driver::cuda::CudaDriver;
use crate::driver::sim::SimDriver;
use crate::profile::ProfileScope;

enum Scope {
    Cuda(ProfileScope<'static, 'static, CudaDriver>),
    Sim(ProfileScope<'static, 'static, SimDriver>),
}

static SCOPES: OnceLock<Mutex<HashMap<usize, Scope>>> = OnceLock::new();

/// Open a profiling scope on `device` (its baseline was taken at the device's first use). A
/// negative `margin_bytes` means the default (`Margin::Auto`: 0.25% of the requested memory, in
/// every mode, as room for serving's other placement).
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
        // Held across the begin: two scopes of one device never both begin.
        let mut scopes = SCOPES.get_or_init(Default::default).lock();
        if scopes.contains_key(&d) {
            return Err(format!(
                "a profiling scope is open already on device {d}: end it first (scopes do not nest)"
            ));
        }
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
        scopes.insert(d, scope);
        Ok(0)
    })
}

/// Close the profiling scope of `device`: the result as JSON (free with
/// `vram_ledger_string_free`), or NULL.
#[no_mangle]
pub extern "C" fn vram_ledger_profile_end(device: c_int) -> *mut c_char {
    guard(std::ptr::null_mut(), || {
        let d = device_index(device)?;
        let scope = SCOPES.get_or_init(Default::default).lock().remove(&d);
        let scope = match scope {
            Some(s) => s,
            // A device past the count has no scope because it is no device: say that.
            None => match crate::devices::try_count() {
                Ok(n) if d >= n => {
                    return Err(format!(
                        "no device with ordinal {d}: {n} device(s) available"
                    ))
                }
                _ => return Err("no profiling scope is open on this device".into()),
            },
        };
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
