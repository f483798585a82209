//! The C ABI entry points with arbitrary arguments, on the simulated backend: every call returns
//! (an error code, NULL, or a value), nothing panics or crashes, and the allocator keeps working.
//! The KV cache's calls and the cap among them: every result is NULL or JSON, and a release
//! leaves no KV cache.
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
    Malloc {
        size: i64,
        device: i8,
        stream: u8,
    },
    Free {
        pick: u8,
        raw: u64,
        device: i8,
        use_raw: bool,
    },
    SetTag(Vec<u8>),
    PushTag(Vec<u8>),
    PopTag,
    Fraction {
        f: f64,
        device: i8,
    },
    RecordStream {
        pick: u8,
        stream: u8,
    },
    Stats {
        device: i8,
        pytorch: bool,
    },
    ResetPeaks(i8),
    EmptyCache(i8),
    ProfileBegin {
        device: i8,
        utilization: f64,
        margin: i64,
    },
    ProfileEnd(i8),
    Reset,
    Sleep {
        device: i8,
        offload: i32,
        discard: i32,
    },
    Wake {
        device: i8,
        mask: i32,
    },
    PoolHold {
        device: i8,
        id: u8,
        own: bool,
        half: bool,
        flags: u8,
    },
    PoolBegin {
        device: i8,
        id: u8,
    },
    PoolEnd {
        device: i8,
        id: u8,
    },
    PoolRelease {
        device: i8,
        id: u8,
    },
    Reporter {
        on: bool,
        profiling: u8,
    },
    Checkpoint {
        device: i8,
        id: u8,
    },
    /// A checkpoint this input took (`text` None), or arbitrary bytes as one.
    Restore {
        device: i8,
        id: u8,
        pick: u8,
        text: Option<Vec<u8>>,
    },
    SetCap {
        device: i8,
        bytes: i64,
    },
    KvReserve {
        device: i8,
        block_bytes: u32,
        max_bytes: i64,
        initial: u16,
    },
    KvCommit(i8),
    KvResize {
        device: i8,
        blocks: u32,
        free_from: u32,
    },
    KvInfo(i8),
    KvRelease(i8),
    /// Settings for allocators not yet created (those of this process exist already).
    Settings {
        piece: u64,
        across: i32,
        later: i32,
    },
}

/// A KV cache result: NULL (refused, the reason in the last error) or JSON the library made,
/// freed here once.
fn kv_result(p: *mut std::ffi::c_char) {
    if !p.is_null() {
        // SAFETY: a string the library returned.
        let text = unsafe { std::ffi::CStr::from_ptr(p) }
            .to_str()
            .expect("UTF-8")
            .to_owned();
        serde_json::from_str::<serde_json::Value>(&text).expect("a KV result is JSON");
    }
    // SAFETY: NULL or a string from the library, freed once.
    unsafe { vram_ledger_string_free(p) };
}

/// The addresses in a restore's result: those it freed and those it made.
fn restored(json: &str) -> (Vec<u64>, Vec<u64>) {
    let v: serde_json::Value = serde_json::from_str(json).expect("a restore's result is JSON");
    let addrs = |key: &str, addr: fn(&serde_json::Value) -> Option<u64>| -> Vec<u64> {
        v[key]
            .as_array()
            .expect("a list")
            .iter()
            .map(|x| addr(x).expect("an address"))
            .collect()
    };
    (
        addrs("freed", |x| x.as_u64()),
        addrs("made", |x| x["addr"].as_u64()),
    )
}

/// A pool's own allocator for the fuzzer: host memory, refused above 64 MiB (the library sees
/// only addresses on the simulated backend).
unsafe extern "C" fn own_alloc(size: usize, _device: i32, _stream: *mut c_void) -> *mut c_void {
    match std::alloc::Layout::from_size_align(size, 512) {
        Ok(l) if size > 0 && size <= 64 << 20 => {
            OWN_HELD.fetch_add(size, std::sync::atomic::Ordering::Relaxed);
            unsafe { std::alloc::alloc(l).cast() }
        }
        _ => std::ptr::null_mut(),
    }
}

/// Bytes the pools' own allocator has given and not had back.
static OWN_HELD: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

unsafe extern "C" fn own_free(ptr: *mut c_void, size: usize, _device: i32, _stream: *mut c_void) {
    OWN_HELD.fetch_sub(size, std::sync::atomic::Ordering::Relaxed);
    let l = std::alloc::Layout::from_size_align(size, 512).unwrap();
    // SAFETY: `ptr` came from `own_alloc` with this size (the library gives back what it got).
    unsafe { std::alloc::dealloc(ptr.cast(), l) };
}

static PROFILING: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

unsafe extern "C" fn profiling() -> u8 {
    PROFILING.load(std::sync::atomic::Ordering::Relaxed)
}

unsafe extern "C" fn report(_p: *mut c_void, _size: i64, _allocated: u64, _reserved: u64, _d: u16) {
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
    // References this input took (holds and routes), dropped at its end: inputs share the
    // library's state.
    let (mut refs, mut routes): (Vec<(i32, u64)>, Vec<(i32, u64)>) = (Vec::new(), Vec::new());
    let mut checkpoints: Vec<CString> = Vec::new();
    for c in calls.into_iter().take(100) {
        match c {
            Call::Malloc {
                size,
                device,
                stream,
            } => {
                // SAFETY: a simulated device drives no stream.
                let p = unsafe {
                    vram_ledger_malloc(
                        size as isize % (1 << 34),
                        i32::from(device % 3),
                        stream as usize as *mut c_void,
                    )
                };
                if !p.is_null() {
                    live.push((p, i32::from(device % 3)));
                }
            }
            Call::Free {
                pick,
                raw,
                device,
                use_raw,
            } => {
                if use_raw || live.is_empty() {
                    if !live.iter().any(|&(p, _)| p as u64 == raw) {
                        // SAFETY: the pointer is only looked up; a NULL stream is the default one.
                        unsafe {
                            vram_ledger_free(
                                raw as *mut c_void,
                                0,
                                i32::from(device),
                                std::ptr::null_mut(),
                            )
                        };
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
                let p = live
                    .get(pick as usize % live.len().max(1))
                    .map_or(std::ptr::null_mut(), |&(p, _)| p);
                // SAFETY: the pointer is only looked up; a simulated device drives no stream.
                unsafe { vram_ledger_record_stream(p, stream as usize as *mut c_void) };
            }
            Call::Stats { device, pytorch } => {
                let s = if pytorch {
                    vram_ledger_memory_stats_json(i32::from(device))
                } else {
                    vram_ledger_stats_json(i32::from(device))
                };
                // SAFETY: NULL or a string from the library, freed once.
                unsafe { vram_ledger_string_free(s) };
            }
            Call::ResetPeaks(d) => {
                vram_ledger_reset_peaks(i32::from(d));
            }
            Call::EmptyCache(d) => {
                vram_ledger_empty_cache(i32::from(d));
            }
            Call::ProfileBegin {
                device,
                utilization,
                margin,
            } => {
                vram_ledger_profile_begin(i32::from(device % 3), utilization, margin);
            }
            // SAFETY: NULL or a string from the library, freed once.
            Call::ProfileEnd(d) => unsafe {
                vram_ledger_string_free(vram_ledger_profile_end(i32::from(d % 3)))
            },
            Call::Reset => vram_ledger_reset(),
            Call::Settings {
                piece,
                across,
                later,
            } => {
                // Accepted, or refused because a device is in use with its configuration.
                let settled = |rc: i32| {
                    // SAFETY: the library's message for this thread, read before the next call.
                    rc == 0
                        || unsafe { std::ffi::CStr::from_ptr(vram_ledger_last_error()) }
                            .to_string_lossy()
                            .contains("in use already")
                };
                assert!(settled(vram_ledger_remap_piece(piece)));
                assert!(settled(vram_ledger_move_across_streams(across)));
                assert!(settled(vram_ledger_unmap_later(later)));
            }
            // Native devices here: argument checks and the refusal, across the boundary.
            Call::Sleep {
                device,
                offload,
                discard,
            } => unsafe {
                vram_ledger_string_free(vram_ledger_sleep(i32::from(device % 3), offload, discard))
            },
            Call::Wake { device, mask } => unsafe {
                vram_ledger_string_free(vram_ledger_wake(i32::from(device % 3), mask))
            },
            Call::PoolHold {
                device,
                id,
                own,
                half,
                flags,
            } => {
                let d = i32::from(device % 3);
                let (alloc, free): (Option<PoolAlloc>, Option<PoolFree>) = match (own, half) {
                    (true, false) => (Some(own_alloc), Some(own_free)),
                    (true, true) => (Some(own_alloc), None),
                    (false, _) => (None, None),
                };
                if vram_ledger_pool_hold(d, 0, u64::from(id % 8), alloc, free, i32::from(flags % 8))
                    == 0
                {
                    refs.push((d, u64::from(id % 8)));
                }
            }
            Call::PoolBegin { device, id } => {
                let d = i32::from(device % 3);
                if vram_ledger_pool_begin(d, 0, u64::from(id % 8)) == 0 {
                    refs.push((d, u64::from(id % 8)));
                    routes.push((d, u64::from(id % 8)));
                }
            }
            Call::PoolEnd { device, id } => {
                let d = i32::from(device % 3);
                if vram_ledger_pool_end(d, 0, u64::from(id % 8)) == 0 {
                    if let Some(i) = routes.iter().rposition(|&r| r == (d, u64::from(id % 8))) {
                        routes.remove(i);
                    }
                }
            }
            Call::PoolRelease { device, id } => {
                let d = i32::from(device % 3);
                if let Some(i) = refs.iter().rposition(|&r| r == (d, u64::from(id % 8))) {
                    refs.remove(i);
                    vram_ledger_graph_release(d, 0, u64::from(id % 8));
                }
            }
            Call::Checkpoint { device, id } => {
                let p = vram_ledger_pool_checkpoint(i32::from(device % 3), 0, u64::from(id % 8));
                if !p.is_null() && checkpoints.len() < 4 {
                    // SAFETY: a string the library returned, freed once below.
                    checkpoints.push(unsafe { std::ffi::CStr::from_ptr(p) }.to_owned());
                }
                unsafe { vram_ledger_string_free(p) };
            }
            Call::Restore {
                device,
                id,
                pick,
                text,
            } => {
                let d = i32::from(device % 3);
                let text = match text {
                    Some(t) => match CString::new(t) {
                        Ok(t) => t,
                        Err(_) => continue,
                    },
                    None if checkpoints.is_empty() => continue,
                    None => checkpoints[pick as usize % checkpoints.len()].clone(),
                };
                // SAFETY: `text` is a CString alive for the call.
                let p = unsafe { vram_ledger_pool_restore(d, 0, u64::from(id % 8), text.as_ptr()) };
                if !p.is_null() {
                    // SAFETY: a string the library returned.
                    let json = unsafe { std::ffi::CStr::from_ptr(p) }
                        .to_str()
                        .unwrap()
                        .to_owned();
                    unsafe { vram_ledger_string_free(p) };
                    // What the pool freed is no longer this input's to free; what it made is.
                    let (freed, made) = restored(&json);
                    live.retain(|&(q, qd)| qd != d || !freed.contains(&(q as u64)));
                    live.extend(made.into_iter().map(|a| (a as *mut c_void, d)));
                }
            }
            // Caps from a few bytes to past the device, so that growths are refused, and
            // raised again, as a co-tenant's leaving would.
            Call::SetCap { device, bytes } => {
                vram_ledger_set_cap(i32::from(device % 3), bytes % (1 << 36));
            }
            Call::KvReserve {
                device,
                block_bytes,
                max_bytes,
                initial,
            } => {
                // Blocks of up to 16 MiB (0 and other odd sizes refused), ranges up to 64 GiB.
                let block = u64::from(block_bytes % (16 << 20));
                kv_result(vram_ledger_kv_reserve(
                    i32::from(device % 3),
                    block,
                    max_bytes % (1 << 36),
                    u64::from(initial),
                ));
            }
            Call::KvCommit(d) => kv_result(vram_ledger_kv_commit(i32::from(d % 3))),
            Call::KvResize {
                device,
                blocks,
                free_from,
            } => {
                kv_result(vram_ledger_kv_resize(
                    i32::from(device % 3),
                    u64::from(blocks % 4096),
                    u64::from(free_from % 4096),
                ));
            }
            Call::KvInfo(d) => kv_result(vram_ledger_kv_info(i32::from(d % 3))),
            Call::KvRelease(d) => {
                vram_ledger_kv_release(i32::from(d % 3));
            }
            Call::Reporter { on, profiling: p } => {
                PROFILING.store(p, std::sync::atomic::Ordering::Relaxed);
                if on {
                    vram_ledger_set_memory_reporter(Some(profiling), Some(report));
                } else {
                    vram_ledger_set_memory_reporter(None, None);
                }
            }
        }
        let _ = vram_ledger_last_error();
    }
    for (p, d) in live {
        // SAFETY: pointers from malloc, freed once; a NULL stream is the default one.
        unsafe { vram_ledger_free(p, 0, d, std::ptr::null_mut()) };
    }
    for (d, id) in routes.into_iter().rev() {
        assert_eq!(
            vram_ledger_pool_end(d, 0, id),
            0,
            "a route this input began ends"
        );
    }
    for (d, id) in refs {
        assert_eq!(
            vram_ledger_graph_release(d, 0, id),
            0,
            "a pool this input holds is known"
        );
    }
    vram_ledger_set_memory_reporter(None, None);
    // The KV cache and the cap this input left go with it (release fails only where none is).
    for d in 0..2 {
        vram_ledger_kv_release(d);
        assert_eq!(vram_ledger_set_cap(d, -1), 0, "the cap lifts");
        let info = vram_ledger_kv_info(d);
        // SAFETY: a string the library returned.
        let text = unsafe { std::ffi::CStr::from_ptr(info) }
            .to_str()
            .unwrap()
            .to_owned();
        unsafe { vram_ledger_string_free(info) };
        assert_eq!(text, "null", "device {d}: no KV cache after its release");
    }
    // A pool that went while its memory was allocated keeps that memory cached until an
    // empty_cache, as PyTorch's does: given back here, so inputs do not pile it up.
    vram_ledger_empty_cache(0);
    vram_ledger_empty_cache(1);
    assert_eq!(
        OWN_HELD.load(std::sync::atomic::Ordering::Relaxed),
        0,
        "every pool this input made went, and its memory back to its allocator"
    );
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
