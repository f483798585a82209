//! The checked layer over the CUDA driver's raw results: a `CUresult` that is not
//! `CUDA_SUCCESS` becomes a typed [`DriverError`] that names the call, the kind and the driver's
//! own description.

use std::ffi::CStr;

use cudarc::driver::sys::{self, CUresult};

use super::{DriverCall, DriverError, DriverErrorKind, DriverResult};

pub(super) fn check(call: DriverCall, r: CUresult) -> DriverResult<()> {
    if r == CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    Err(error(call, r, describe(r)))
}

/// The typed error of a failed `CUresult` (not `CUDA_SUCCESS`).
pub(super) fn error(call: DriverCall, r: CUresult, detail: String) -> DriverError {
    let kind = match r {
        CUresult::CUDA_ERROR_OUT_OF_MEMORY => DriverErrorKind::OutOfMemory,
        CUresult::CUDA_ERROR_INVALID_VALUE | CUresult::CUDA_ERROR_INVALID_HANDLE => {
            DriverErrorKind::InvalidValue
        }
        CUresult::CUDA_ERROR_NO_DEVICE
        | CUresult::CUDA_ERROR_INVALID_DEVICE
        | CUresult::CUDA_ERROR_NOT_INITIALIZED => DriverErrorKind::NoDevice,
        other => DriverErrorKind::Other(other as i32),
    };
    DriverError::new(call, kind, detail)
}

/// The driver's name and description of `r` ("CUDA_ERROR_NO_DEVICE: no CUDA-capable device
/// is detected"), so that an error says why and not only which code.
pub(super) fn describe(r: CUresult) -> String {
    let (mut name, mut text): (*const std::ffi::c_char, *const std::ffi::c_char) =
        (std::ptr::null(), std::ptr::null());
    // SAFETY: both calls write a pointer to a static string, or leave it null.
    unsafe {
        let name = if sys::cuGetErrorName(r, &mut name) == CUresult::CUDA_SUCCESS && !name.is_null()
        {
            CStr::from_ptr(name).to_string_lossy().into_owned()
        } else {
            format!("CUresult {}", r as i32)
        };
        if sys::cuGetErrorString(r, &mut text) == CUresult::CUDA_SUCCESS && !text.is_null() {
            format!("{name}: {}", CStr::from_ptr(text).to_string_lossy())
        } else {
            name
        }
    }
}
