//! This process's memory on a GPU, as NVML accounts it: a small binding loaded at run time
//! (`libnvidia-ml.so.1`), so the crate builds and runs where there is no NVIDIA driver.
//!
//! Invariants: the device is found by UUID, not by index (CUDA and NVML number devices
//! differently under `CUDA_VISIBLE_DEVICES`); a process NVML does not list (PID namespaces in
//! containers) is reported as unknown (`None`), never as zero.

use std::ffi::{c_char, c_int, c_uint, c_void, CString};

use libloading::{Library, Symbol};

type Ret = c_int;
const NVML_SUCCESS: Ret = 0;
const NVML_ERROR_INSUFFICIENT_SIZE: Ret = 7;

/// `nvmlProcessInfo_t` (the v2/v3 layout used by `nvmlDeviceGetComputeRunningProcesses_v3`).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct ProcessInfo {
    pid: c_uint,
    used_gpu_memory: u64,
    gpu_instance_id: c_uint,
    compute_instance_id: c_uint,
}

type GetProcesses = unsafe extern "C" fn(*mut c_void, *mut c_uint, *mut ProcessInfo) -> Ret;

/// An initialised NVML and one device's handle.
pub struct Nvml {
    // Kept alive: the function pointers below point into it.
    _lib: Library,
    device: *mut c_void,
    get_processes: GetProcesses,
    shutdown: unsafe extern "C" fn() -> Ret,
}

// SAFETY: NVML is thread-safe; the handle is an opaque pointer NVML owns for its lifetime.
unsafe impl Send for Nvml {}
unsafe impl Sync for Nvml {}

impl Nvml {
    /// Open NVML for the device with this UUID (`GPU-xxxxxxxx-...`). Errors say why not.
    pub fn open(uuid: &str) -> Result<Nvml, String> {
        // SAFETY: loading the system's NVML library; its initialisers are NVIDIA's.
        let lib = unsafe { Library::new("libnvidia-ml.so.1") }
            .map_err(|e| format!("NVML is not available: {e}"))?;
        // SAFETY: symbol types follow nvml.h.
        unsafe {
            let init: Symbol<unsafe extern "C" fn() -> Ret> =
                lib.get(b"nvmlInit_v2\0").map_err(|e| e.to_string())?;
            let by_uuid: Symbol<unsafe extern "C" fn(*const c_char, *mut *mut c_void) -> Ret> = lib
                .get(b"nvmlDeviceGetHandleByUUID\0")
                .map_err(|e| e.to_string())?;
            let get_processes: Symbol<GetProcesses> = lib
                .get(b"nvmlDeviceGetComputeRunningProcesses_v3\0")
                .map_err(|e| e.to_string())?;
            let shutdown: Symbol<unsafe extern "C" fn() -> Ret> =
                lib.get(b"nvmlShutdown\0").map_err(|e| e.to_string())?;
            let r = init();
            if r != NVML_SUCCESS {
                return Err(format!("nvmlInit failed ({r})"));
            }
            let mut device = std::ptr::null_mut();
            let c = CString::new(uuid).map_err(|e| e.to_string())?;
            let r = by_uuid(c.as_ptr(), &mut device);
            if r != NVML_SUCCESS {
                shutdown();
                return Err(format!("NVML does not know device {uuid} ({r})"));
            }
            let (get_processes, shutdown) = (*get_processes, *shutdown);
            Ok(Nvml {
                _lib: lib,
                device,
                get_processes,
                shutdown,
            })
        }
    }

    /// Memory NVML charges to `pid` on the device; `None` if NVML does not list the process.
    pub fn process_usage(&self, pid: u32) -> Result<Option<u64>, String> {
        let mut infos = vec![ProcessInfo::default(); 64];
        loop {
            let mut count = infos.len() as c_uint;
            // SAFETY: `infos` holds `count` entries.
            let r = unsafe { (self.get_processes)(self.device, &mut count, infos.as_mut_ptr()) };
            match r {
                NVML_SUCCESS => {
                    return Ok(infos[..count as usize]
                        .iter()
                        .find(|p| p.pid == pid)
                        .map(|p| p.used_gpu_memory));
                }
                NVML_ERROR_INSUFFICIENT_SIZE => {
                    infos.resize(count as usize + 16, ProcessInfo::default())
                }
                other => {
                    return Err(format!(
                        "nvmlDeviceGetComputeRunningProcesses failed ({other})"
                    ))
                }
            }
        }
    }
}

impl Drop for Nvml {
    fn drop(&mut self) {
        // SAFETY: balanced with the successful nvmlInit in `open`.
        unsafe {
            (self.shutdown)();
        }
    }
}
