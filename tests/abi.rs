//! The C ABI under abuse, on simulated devices (VRAM_LEDGER_DRIVER=sim): every bad call gets an
//! error code or NULL and a readable last error, and the allocator keeps working. Each test uses
//! its own device, so that parallel tests do not share a ledger.
//!
//! The simulated backend hands streams to no driver, so any stream value (NULL here) meets the
//! entry points' safety contracts; strings are Rust `CString`s or NUL-terminated literals.

use std::ffi::{c_char, c_void, CStr, CString};
use std::ptr::null_mut;
use std::sync::Once;

use vram_ledger::ffi::*;

fn setup() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        std::env::set_var("VRAM_LEDGER_DRIVER", "sim");
        std::env::set_var("VRAM_LEDGER_SIM_DEVICES", "9");
        // Every failure here is deliberate: keep the log they would each write quiet.
        std::env::set_var("VRAM_LEDGER_LOG", "off");
    });
}

fn last_error() -> String {
    unsafe { CStr::from_ptr(vram_ledger_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn json(p: *mut c_char) -> serde_json::Value {
    assert!(!p.is_null(), "{}", last_error());
    let v = serde_json::from_str(&unsafe { CStr::from_ptr(p) }.to_string_lossy()).unwrap();
    unsafe { vram_ledger_string_free(p) };
    v
}

fn allocated(device: i32) -> u64 {
    json(vram_ledger_stats_json(device))["all"]["allocated_bytes"]["current"]
        .as_u64()
        .unwrap()
}

const S: *mut c_void = null_mut();

fn malloc(size: isize, device: i32) -> *mut c_void {
    // SAFETY: a NULL stream is the default stream, and a simulated device drives no stream.
    unsafe { vram_ledger_malloc(size, device, S) }
}

fn free(p: *mut c_void, size: isize, device: i32) {
    // SAFETY: as for `malloc`; `p` is only looked up.
    unsafe { vram_ledger_free(p, size, device, S) }
}

fn push_tag(name: &str) -> i32 {
    let name = CString::new(name).unwrap();
    // SAFETY: a NUL-terminated string that outlives the call.
    unsafe { vram_ledger_push_tag(name.as_ptr()) }
}

#[test]
fn abi_allocate_and_free_round_trip() {
    setup();
    assert!(vram_ledger_device_count() == 9);
    let p = malloc(1000, 0);
    assert!(!p.is_null(), "{}", last_error());
    assert_eq!(allocated(0), 1024);
    free(p, 1000, 0);
    assert_eq!(allocated(0), 0);
    // Size 0 is NULL without being an error.
    assert!(malloc(0, 0).is_null());
    let stats = json(vram_ledger_memory_stats_json(0));
    assert_eq!(stats["allocation.all.allocated"], 1);
}

#[test]
fn abi_free_of_unknown_pointers_and_double_free() {
    setup();
    let before = json(vram_ledger_stats_json(1));
    free(0xdead_b000 as *mut c_void, 512, 1);
    assert!(
        last_error().contains("not allocated by this allocator"),
        "{}",
        last_error()
    );
    assert_eq!(json(vram_ledger_stats_json(1)), before, "nothing changed");
    let p = malloc(4096, 1);
    free(p, 4096, 1);
    free(p, 4096, 1);
    assert!(last_error().contains("already freed"), "{}", last_error());
    // NULL is a no-op, as PyTorch frees NULL for zero-sized tensors.
    free(null_mut(), 0, 1);
    let q = malloc(4096, 1);
    assert_eq!(q, p, "the allocator keeps working, and reuses the block");
    free(q, 4096, 1);
}

#[test]
fn abi_negative_and_absurd_sizes() {
    setup();
    assert!(malloc(-1, 2).is_null());
    assert!(
        last_error().contains("negative size -1"),
        "{}",
        last_error()
    );
    assert!(malloc(isize::MAX, 2).is_null());
    assert!(
        last_error().starts_with("Tried to allocate more than 1EB memory"),
        "{}",
        last_error()
    );
    assert!(
        malloc(1 << 50, 2).is_null(),
        "1 PiB does not fit a simulated 80 GiB device"
    );
    assert!(
        last_error().starts_with("Tried to allocate ")
            && last_error().contains(". GPU 2 has a total capacity of 80.00 GiB of which "),
        "worded as PyTorch words it: {}",
        last_error()
    );
    assert_eq!(allocated(2), 0);
    let p = malloc(1 << 20, 2);
    assert!(!p.is_null());
    free(p, 1 << 20, 2);
}

#[test]
fn abi_wrong_device_ordinals() {
    setup();
    assert!(malloc(512, 9).is_null());
    assert!(
        last_error().contains("no device with ordinal 9: 9 device(s) available"),
        "{}",
        last_error()
    );
    assert!(malloc(512, -1).is_null());
    assert!(
        last_error().contains("not a device ordinal"),
        "{}",
        last_error()
    );
    assert!(vram_ledger_stats_json(99).is_null());
    assert_eq!(vram_ledger_reset_peaks(-3), -1);
    assert_eq!(vram_ledger_empty_cache(42), -1);
}

#[test]
fn abi_tags_by_name() {
    setup();
    let name = |s: &str| CString::new(s).unwrap();
    let current = || {
        unsafe { CStr::from_ptr(vram_ledger_current_tag()) }
            .to_str()
            .unwrap()
            .to_owned()
    };
    // SAFETY (all three calls): NULL, or NUL-terminated strings that outlive the call.
    assert_eq!(unsafe { vram_ledger_set_tag(name("weight").as_ptr()) }, -1);
    assert!(
        last_error().contains("unknown tag \"weight\""),
        "{}",
        last_error()
    );
    assert_eq!(unsafe { vram_ledger_set_tag(null_mut()) }, -1);
    assert!(last_error().contains("NULL"));
    assert_eq!(push_tag("kv"), 0);
    let p = malloc(3000, 3);
    assert_eq!(current(), "kv_cache");
    assert_eq!(vram_ledger_pop_tag(), 0);
    assert_eq!(current(), "untracked");
    assert_eq!(vram_ledger_pop_tag(), -1, "more pops than pushes");
    let s = json(vram_ledger_stats_json(3));
    assert_eq!(s["per_tag"]["kv_cache"]["allocated_bytes"]["current"], 3072);
    let bad = [0xffu8, 0];
    // SAFETY: NUL-terminated, and alive for the call.
    assert_eq!(
        unsafe { vram_ledger_set_tag(bad.as_ptr() as *const c_char) },
        -1
    );
    assert!(last_error().contains("UTF-8"));
    free(p, 3000, 3);
}

#[test]
fn abi_memory_fraction_and_configure() {
    setup();
    vram_ledger_memory_fraction(0.0001, 4);
    assert!(malloc(100 << 20, 4).is_null());
    assert!(last_error().contains("limit"), "{}", last_error());
    vram_ledger_memory_fraction(2.0, 4);
    assert!(
        last_error().contains("invalid memory limit"),
        "{}",
        last_error()
    );
    vram_ledger_memory_fraction(1.0, 4);
    let p = malloc(100 << 20, 4);
    assert!(!p.is_null(), "{}", last_error());
    free(p, 100 << 20, 4);
    let warp = CString::new("warp").unwrap();
    // SAFETY: a NUL-terminated string that outlives the call, then NULL.
    assert_eq!(unsafe { vram_ledger_configure(warp.as_ptr()) }, -1);
    assert!(last_error().contains("unknown segment mode"));
    assert_eq!(unsafe { vram_ledger_configure(null_mut()) }, -1);
    // SAFETY: a simulated device drives no stream; the pointer is only looked up.
    unsafe { vram_ledger_record_stream(0x1234 as *mut c_void, S) };
    assert!(
        last_error().contains("not allocated by this allocator"),
        "{}",
        last_error()
    );
    vram_ledger_reset();
}

#[test]
fn abi_profiling_scope() {
    setup();
    assert!(vram_ledger_profile_end(5).is_null());
    assert!(last_error().contains("no profiling scope is open"));
    // Past the 9 devices, the device is what is missing.
    assert!(vram_ledger_profile_end(12).is_null());
    assert!(
        last_error().contains("no device with ordinal 12: 9 device(s) available"),
        "{}",
        last_error()
    );
    assert_eq!(vram_ledger_profile_begin(5, 1.5, 0), -1);
    assert!(last_error().contains("utilization"));
    assert_eq!(push_tag("weights"), 0);
    let w = malloc(1 << 30, 5);
    vram_ledger_pop_tag();
    assert_eq!(vram_ledger_profile_begin(5, 0.5, -1), 0, "{}", last_error());
    push_tag("activation");
    let a = malloc(2 << 30, 5);
    free(a, 2 << 30, 5);
    vram_ledger_pop_tag();
    let r = json(vram_ledger_profile_end(5));
    assert_eq!(r["weights"], 1u64 << 30);
    assert_eq!(r["activation_peak"], 2u64 << 30);
    assert!(r["kv_budget"].as_u64().unwrap() > 30 << 30);
    assert!(r["report"][2]
        .as_str()
        .unwrap()
        .starts_with("Available KV cache memory"));
    free(w, 1 << 30, 5);
}

#[test]
fn abi_contract_cap() {
    setup();
    // Device 6: profiling arms the budget contract at the requested memory.
    assert_eq!(vram_ledger_cap(6), -1, "{}", last_error());
    assert_eq!(
        vram_ledger_profile_begin(6, 0.25, -1),
        0,
        "{}",
        last_error()
    );
    let r = json(vram_ledger_profile_end(6));
    let requested = r["requested"].as_u64().unwrap();
    assert_eq!(vram_ledger_cap(6), requested as i64);
    // Past it, allocation fails with the contract named, though the device has room.
    let p = malloc(requested as isize, 6);
    assert!(p.is_null());
    assert!(last_error().contains("budget contract"), "{}", last_error());
    // Lifted, the same request succeeds; set again explicitly, it holds.
    assert_eq!(vram_ledger_set_cap(6, -1), 0);
    assert_eq!(vram_ledger_cap(6), -1);
    let p = malloc(requested as isize, 6);
    assert!(!p.is_null(), "{}", last_error());
    free(p, requested as isize, 6);
    // The cap bounds growth; what is cached already may still serve.
    assert_eq!(vram_ledger_empty_cache(6), 0);
    assert_eq!(vram_ledger_set_cap(6, 1 << 30), 0);
    assert_eq!(vram_ledger_cap(6), 1 << 30);
    assert!(malloc(2 << 30, 6).is_null());
    assert_eq!(vram_ledger_set_cap(6, -1), 0);
    // A wrong device is an error, not "no cap".
    assert_eq!(vram_ledger_cap(99), -2);
    assert!(last_error().contains("no device"), "{}", last_error());
}

#[test]
fn abi_and_the_rust_api_share_one_allocator_per_device() {
    setup();
    // A device of its own: the cap test uses device 6 and would race with the counts here.
    assert_eq!(vram_ledger::devices::count(), 9);
    let p = malloc(5000, 8);
    assert!(!p.is_null(), "{}", last_error());
    let a = vram_ledger::devices::sim_allocator(8).unwrap();
    assert_eq!(
        a.snapshot().all.allocated_bytes.current,
        allocated(8),
        "the Rust API sees what the C ABI allocated"
    );
    a.free(p as u64).unwrap();
    assert_eq!(allocated(8), 0, "and the C ABI sees what it freed");
    free(p, 5000, 8);
    assert!(last_error().contains("already freed"), "{}", last_error());
    assert!(matches!(
        vram_ledger::devices::allocator(8),
        Err(vram_ledger::Error::WrongBackend { .. })
    ));
}

unsafe extern "C" fn pool_alloc(_size: usize, _device: i32, _stream: *mut c_void) -> *mut c_void {
    null_mut()
}

#[test]
fn abi_memory_pools_refuse_half_an_allocator_and_unknown_routes() {
    setup();
    assert_eq!(
        vram_ledger_pool_hold(5, 0, 9, Some(pool_alloc), None, 0),
        -1
    );
    assert!(last_error().contains("both"), "{}", last_error());
    // Flags: 1 and 2 are known, any other bit is refused before anything is made.
    for flags in [4, -1, 1 << 30] {
        assert_eq!(vram_ledger_pool_hold(5, 0, 9, None, None, flags), -1);
        assert!(last_error().contains("flags"), "{}", last_error());
    }
    assert_eq!(vram_ledger_pool_end(5, 0, 9), -1);
    assert!(last_error().contains("graph pool"), "{}", last_error());
    // A pool whose allocator returns NULL: out of memory, and the device keeps working.
    unsafe extern "C" fn pool_free(_p: *mut c_void, _size: usize, _device: i32, _s: *mut c_void) {}
    assert_eq!(
        vram_ledger_pool_hold(5, 0, 9, Some(pool_alloc), Some(pool_free), 0),
        0
    );
    // Held again with the same functions: the same allocator; with others: refused.
    assert_eq!(
        vram_ledger_pool_hold(5, 0, 9, Some(pool_alloc), Some(pool_free), 0),
        0,
        "{}",
        last_error()
    );
    // A body of its own: identical functions may be folded into one address.
    static OTHER_FREES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    unsafe extern "C" fn other_free(_p: *mut c_void, _n: usize, _d: i32, _s: *mut c_void) {
        OTHER_FREES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    assert_eq!(
        vram_ledger_pool_hold(5, 0, 9, Some(pool_alloc), Some(other_free), 0),
        -1
    );
    assert!(
        last_error().contains("another allocator"),
        "{}",
        last_error()
    );
    assert_eq!(vram_ledger_pool_begin(5, 0, 9), 0);
    assert!(malloc(4096, 5).is_null());
    assert!(last_error().contains("NULL"), "{}", last_error());
    assert_eq!(vram_ledger_pool_end(5, 0, 9), 0);
    for _ in 0..3 {
        assert_eq!(vram_ledger_graph_release(5, 0, 9), 0);
    }
    let p = malloc(4096, 5);
    assert!(!p.is_null(), "{}", last_error());
    free(p, 4096, 5);
}

static PROFILING: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);
type Event = (usize, i64, u64, u64, u16);
static EVENTS: std::sync::Mutex<Vec<Event>> = std::sync::Mutex::new(Vec::new());

unsafe extern "C" fn profiling() -> u8 {
    PROFILING.load(std::sync::atomic::Ordering::Relaxed)
}

unsafe extern "C" fn report(ptr: *mut c_void, size: i64, allocated: u64, reserved: u64, d: u16) {
    EVENTS
        .lock()
        .unwrap()
        .push((ptr as usize, size, allocated, reserved, d));
}

#[test]
fn abi_allocations_and_frees_are_reported_to_a_profiler_that_records_memory() {
    setup();
    vram_ledger_set_memory_reporter(Some(profiling), Some(report));
    let mine = |e: &&Event| e.4 == (6 << 8) | 1;
    let quiet = malloc(4096, 6);
    free(quiet, 4096, 6);
    PROFILING.store(1, std::sync::atomic::Ordering::Relaxed);
    let p = malloc(3000, 6);
    free(p, 3000, 6);
    PROFILING.store(0, std::sync::atomic::Ordering::Relaxed);
    vram_ledger_set_memory_reporter(None, None);
    let events: Vec<Event> = EVENTS
        .lock()
        .unwrap()
        .iter()
        .filter(mine)
        .copied()
        .collect();
    assert_eq!(
        events.len(),
        2,
        "only while the profiler records: {events:?}"
    );
    let (ptr, size, allocated, reserved, _) = events[0];
    assert_eq!((ptr, size), (p as usize, 3000));
    assert!(allocated >= 3000 && reserved >= allocated, "{events:?}");
    assert_eq!((events[1].0, events[1].1), (p as usize, -3000));
    assert_eq!(
        events[1].2,
        allocated - 3072,
        "the block (3000 rounded to 512) went back"
    );
}

static MISALIGNED_FREES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

unsafe extern "C" fn misaligned_alloc(_size: usize, _d: i32, _s: *mut c_void) -> *mut c_void {
    0x7000_0010 as *mut c_void
}

unsafe extern "C" fn misaligned_free(p: *mut c_void, _size: usize, _d: i32, _s: *mut c_void) {
    assert_eq!(p as usize, 0x7000_0010);
    MISALIGNED_FREES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

#[test]
fn abi_a_pools_allocator_that_returns_misaligned_memory_gets_it_back_and_an_error() {
    setup();
    assert_eq!(
        vram_ledger_pool_hold(7, 0, 3, Some(misaligned_alloc), Some(misaligned_free), 0),
        0
    );
    assert_eq!(vram_ledger_pool_begin(7, 0, 3), 0);
    assert!(malloc(4096, 7).is_null());
    assert!(
        last_error().contains("not aligned to 512 bytes"),
        "{}",
        last_error()
    );
    assert_eq!(vram_ledger_pool_end(7, 0, 3), 0);
    assert!(MISALIGNED_FREES.load(std::sync::atomic::Ordering::Relaxed) >= 1);
    assert_eq!(vram_ledger_graph_release(7, 0, 3), 0);
    assert_eq!(vram_ledger_graph_release(7, 0, 3), 0);
}

static SMALL_ALLOCS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
static SMALL_FREES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

unsafe extern "C" fn small_alloc(size: usize, _d: i32, _s: *mut c_void) -> *mut c_void {
    let k = SMALL_ALLOCS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    assert!(size <= 64 << 20, "{size}");
    (0x5000_0000_0000usize + k * (64 << 20)) as *mut c_void
}

unsafe extern "C" fn small_free(_p: *mut c_void, _size: usize, _d: i32, _s: *mut c_void) {
    SMALL_FREES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

#[test]
fn abi_a_pool_dropped_while_its_tensor_lives_frees_its_segment_only_after_the_tensor() {
    // PyTorch's test_tensor_delete_after_allocator_delete, as use_mem_pool drives the C ABI:
    // hold, begin, a 16-byte allocation, end and release (the block's end), the pool's own
    // release (del pool); the segment goes back to its allocator only once the tensor is freed
    // and the cache emptied.
    setup();
    use std::sync::atomic::Ordering::Relaxed;
    assert_eq!(
        vram_ledger_pool_hold(4, 0, 21, Some(small_alloc), Some(small_free), 0),
        0
    );
    assert_eq!(vram_ledger_pool_begin(4, 0, 21), 0);
    let p = malloc(16, 4);
    assert!(!p.is_null(), "{}", last_error());
    assert_eq!(vram_ledger_pool_end(4, 0, 21), 0);
    assert_eq!(vram_ledger_graph_release(4, 0, 21), 0, "{}", last_error());
    assert_eq!(SMALL_ALLOCS.load(Relaxed), 1);
    assert_eq!(
        SMALL_FREES.load(Relaxed),
        0,
        "the block's end frees nothing"
    );
    assert_eq!(vram_ledger_graph_release(4, 0, 21), 0, "{}", last_error());
    assert_eq!(
        SMALL_FREES.load(Relaxed),
        0,
        "the pool's release frees nothing in use"
    );
    free(p, 16, 4);
    assert_eq!(vram_ledger_empty_cache(4), 0);
    assert_eq!(
        SMALL_FREES.load(Relaxed),
        1,
        "the segment went back once the tensor did"
    );
}
