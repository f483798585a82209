//! The C ABI entry points with arbitrary arguments, on the simulated backend: every call returns
//! (an error code, NULL, or a value), nothing panics or crashes, and the allocator keeps working.
//!
//! Safety of the `unsafe` entry points: the simulated backend hands streams to no driver, so
//! any stream value meets their contracts; pointers to free are only looked up; strings are
//! `CString`s alive for the call.
#![no_main]

use std::ffi::{c_void, CString};
use std::sync::Once;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use vram_ledger::ffi::*;

#[derive(Arbitrary, Debug)]
enum Call {
    Malloc { size: i64, device: i8, stream: u8 },
    Free { pick: u8, raw: u64, device: i8, use_raw: bool },
    SetTag(Vec<u8>),
    PushTag(Vec<u8>),
    PopTag,
    Fraction { f: f64, device: i8 },
    RecordStream { pick: u8, stream: u8 },
    Stats { device: i8, pytorch: bool },
    ResetPeaks(i8),
    EmptyCache(i8),
    ProfileBegin { device: i8, utilization: f64, margin: i64 },
    ProfileEnd(i8),
    Reset,
    Sleep { device: i8, offload: i32, discard: i32 },
    Wake { device: i8, mask: i32 },
}

fuzz_target!(|calls: Vec<Call>| {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        std::env::set_var("VRAM_LEDGER_DRIVER", "sim");
        std::env::set_var("VRAM_LEDGER_SIM_DEVICES", "2");
        // Every failure here is deliberate: keep the log they would each write quiet.
        std::env::set_var("VRAM_LEDGER_LOG", "off");
    });
    let mut live: Vec<(*mut c_void, i32)> = Vec::new();
    for c in calls.into_iter().take(100) {
        match c {
            Call::Malloc { size, device, stream } => {
                // SAFETY: a simulated device drives no stream.
                let p = unsafe { vram_ledger_malloc(size as isize % (1 << 34), i32::from(device % 3), stream as usize as *mut c_void) };
                if !p.is_null() {
                    live.push((p, i32::from(device % 3)));
                }
            }
            Call::Free { pick, raw, device, use_raw } => {
                if use_raw || live.is_empty() {
                    if !live.iter().any(|&(p, _)| p as u64 == raw) {
                        // SAFETY: the pointer is only looked up; a NULL stream is the default one.
                        unsafe { vram_ledger_free(raw as *mut c_void, 0, i32::from(device), std::ptr::null_mut()) };
                    }
                } else {
                    let (p, d) = live.swap_remove(pick as usize % live.len());
                    // SAFETY: as above.
                    unsafe { vram_ledger_free(p, 0, d, std::ptr::null_mut()) };
                }
            }
            Call::SetTag(b) | Call::PushTag(b) if b.contains(&0) => {
                let _ = b;
            }
            Call::SetTag(b) => {
                let s = CString::new(b).unwrap();
                // SAFETY: a NUL-terminated string alive for the call.
                unsafe { vram_ledger_set_tag(s.as_ptr()) };
            }
            Call::PushTag(b) => {
                let s = CString::new(b).unwrap();
                // SAFETY: a NUL-terminated string alive for the call.
                unsafe { vram_ledger_push_tag(s.as_ptr()) };
            }
            Call::PopTag => {
                vram_ledger_pop_tag();
            }
            Call::Fraction { f, device } => vram_ledger_memory_fraction(f, i32::from(device % 3)),
            Call::RecordStream { pick, stream } => {
                let p = live.get(pick as usize % live.len().max(1)).map_or(std::ptr::null_mut(), |&(p, _)| p);
                // SAFETY: the pointer is only looked up; a simulated device drives no stream.
                unsafe { vram_ledger_record_stream(p, stream as usize as *mut c_void) };
            }
            Call::Stats { device, pytorch } => {
                let s = if pytorch { vram_ledger_memory_stats_json(i32::from(device)) } else { vram_ledger_stats_json(i32::from(device)) };
                // SAFETY: NULL or a string from the library, freed once.
                unsafe { vram_ledger_string_free(s) };
            }
            Call::ResetPeaks(d) => {
                vram_ledger_reset_peaks(i32::from(d));
            }
            Call::EmptyCache(d) => {
                vram_ledger_empty_cache(i32::from(d));
            }
            Call::ProfileBegin { device, utilization, margin } => {
                vram_ledger_profile_begin(i32::from(device % 3), utilization, margin);
            }
            // SAFETY: NULL or a string from the library, freed once.
            Call::ProfileEnd(d) => unsafe { vram_ledger_string_free(vram_ledger_profile_end(i32::from(d % 3))) },
            Call::Reset => vram_ledger_reset(),
            // Native devices here: argument checks and the refusal, across the boundary.
            Call::Sleep { device, offload, discard } => unsafe {
                vram_ledger_string_free(vram_ledger_sleep(i32::from(device % 3), offload, discard))
            },
            Call::Wake { device, mask } => unsafe { vram_ledger_string_free(vram_ledger_wake(i32::from(device % 3), mask)) },
        }
        let _ = vram_ledger_last_error();
    }
    for (p, d) in live {
        // SAFETY: pointers from malloc, freed once; a NULL stream is the default one.
        unsafe { vram_ledger_free(p, 0, d, std::ptr::null_mut()) };
    }
    while vram_ledger_pop_tag() == 0 {}
    vram_ledger_memory_fraction(1.0, 0);
    vram_ledger_memory_fraction(1.0, 1);
    // Still working after whatever came before.
    // SAFETY: a NULL stream is the default one; `p` is freed once.
    let p = unsafe { vram_ledger_malloc(4096, 0, std::ptr::null_mut()) };
    assert!(!p.is_null());
    // SAFETY: as above.
    unsafe { vram_ledger_free(p, 4096, 0, std::ptr::null_mut()) };
});
