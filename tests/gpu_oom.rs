//! On a real GPU: allocate until the device is full, get a clean out-of-memory error with the
//! breakdown, then free and go on.

mod common;

use common::{allocator, gpu};
use vram_ledger::devices::stream_id;
use vram_ledger::driver::Driver;
use vram_ledger::{Error, SegmentMode, Tag};

#[test]
fn gpu_allocate_until_oom_then_recover() {
    let Some(g) = gpu("gpu_oom") else { return };
    for mode in [SegmentMode::Native, SegmentMode::Remap] {
        let a = allocator(mode);
        let s = stream_id(&g.stream);
        let free = a.driver().mem_info().unwrap().free;
        let mut held = Vec::new();
        let err = loop {
            match a.allocate_tagged(4 << 30, s, Tag::KvCache) {
                Ok(x) => held.push(x),
                Err(e) => break e,
            }
        };
        let Error::OutOfMemory(r) = &err else {
            panic!("{mode:?}: expected OOM, got {err}")
        };
        println!("{mode:?}: OOM after {} x 4 GiB: {err}", held.len());
        // Every whole 4 GiB the device had free at the start, but the last one (a segment
        // costs the driver a little besides its bytes).
        assert!(
            held.len() as u64 + 1 >= free / (4 << 30),
            "{mode:?}: {} x 4 GiB of {free} bytes free at the start",
            held.len()
        );
        assert_eq!(r.requested, 4 << 30);
        assert_eq!(r.allocated, held.len() as u64 * (4 << 30));
        assert_eq!(r.per_tag[Tag::KvCache], r.allocated);
        assert!(
            r.device_total > r.allocated && r.device_free < 4 << 30,
            "{r:?}"
        );
        assert_eq!(a.snapshot().ooms, 1);
        // Free one and the same request succeeds.
        a.free_on(held.pop().unwrap().ptr, s).unwrap();
        held.push(a.allocate_tagged(4 << 30, s, Tag::KvCache).unwrap());
        for x in held {
            a.free_on(x.ptr, s).unwrap();
        }
        a.empty_cache().unwrap();
        assert_eq!(a.snapshot().reserved_bytes.current, 0);
    }
}

/// Pinning more host memory than the host can spare is an error that says so, before any page
/// is touched (faulting them in would wake the OOM killer instead); a size that fits pins.
#[test]
fn gpu_pinning_past_the_host_is_refused_as_host_memory_exhausted() {
    use vram_ledger::driver::DriverErrorKind;
    let Some(_g) = gpu("gpu_oom") else { return };
    let d = vram_ledger::driver::cuda::CudaDriver::new(0).unwrap();
    let e = d.host_alloc(1 << 50).unwrap_err();
    assert_eq!(e.kind, DriverErrorKind::OutOfMemory, "{e}");
    assert!(e.to_string().contains("host memory exhausted"), "{e}");
    println!("1 PiB of pinned host memory: {e}");
    let p = d.host_alloc(64 << 20).unwrap();
    d.host_free(p).unwrap();
}
