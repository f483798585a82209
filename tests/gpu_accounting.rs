//! On a real GPU: what the driver reports agrees with the ledger, in every mode. `empty_cache`
//! gives memory back (cuMemGetInfo and NVML agree within one granule), and memory allocated
//! behind the allocator's back shows up as non-allocator memory. NVML must list this process
//! (the per-process usage is what the budget contract rests on): a reading it does not give
//! fails the test, as a missing reading is never taken as agreement. Set
//! `VRAM_LEDGER_TEST_WITHOUT_NVML=1` where NVML cannot see the process (some containers) to
//! run only the cuMemGetInfo checks.

mod common;

use common::{allocator, gpu};
use vram_ledger::devices::stream_id;
use vram_ledger::driver::Driver;
use vram_ledger::SegmentMode;

#[test]
fn gpu_driver_and_nvml_agree_with_the_ledger() {
    let Some(g) = gpu("gpu_accounting") else {
        return;
    };
    let nvml_optional = std::env::var_os("VRAM_LEDGER_TEST_WITHOUT_NVML").is_some();
    for mode in [
        SegmentMode::Native,
        SegmentMode::Expandable,
        SegmentMode::Compact,
        SegmentMode::Remap,
    ] {
        let a = allocator(mode);
        let d = a.driver();
        let granule = d.granularity();
        let s = stream_id(&g.stream);
        let mem_free = || d.mem_info().unwrap().free;
        let read = || d.process_usage().unwrap();
        let u0 = read();
        if u0.is_none() {
            assert!(
                nvml_optional,
                "{mode:?}: NVML does not list this process ({:?}); VRAM_LEDGER_TEST_WITHOUT_NVML=1 runs the other checks",
                d.nvml_error()
            );
            println!(
                "gpu_accounting({mode:?}): NVML checks not run (VRAM_LEDGER_TEST_WITHOUT_NVML): NVML does not list this process ({:?})",
                d.nvml_error()
            );
        }
        // Once NVML has listed this process, every later reading must be there too.
        let listed = u0.is_some();
        let usage = || {
            let u = read();
            assert!(
                !listed || u.is_some(),
                "{mode:?}: NVML stopped listing this process"
            );
            u
        };
        let f0 = mem_free();
        let xs: Vec<_> = [3u64 << 30, 700 << 20, 5 << 20, 300 << 10]
            .iter()
            .map(|&n| a.allocate(n, s).unwrap())
            .collect();
        let reserved = a.snapshot().reserved_bytes.current;
        let (u1, f1) = (usage(), mem_free());
        println!(
            "{mode:?}: reserved {reserved}, cuMemGetInfo free fell {}",
            f0 - f1
        );
        assert!(
            (f0 - f1).abs_diff(reserved) <= granule,
            "{mode:?}: free {f0} -> {f1} for {reserved} reserved"
        );
        if let (Some(u0), Some(u1)) = (u0, u1) {
            println!("{mode:?}: NVML grew {}", u1 - u0);
            assert!(
                u1.abs_diff(u0 + reserved) <= granule,
                "{mode:?}: NVML {u0} -> {u1} for {reserved} reserved"
            );
        }

        // 256 MiB behind the allocator's back: non-allocator memory = usage - reserved.
        let mut raw = 0;
        // SAFETY: a plain driver allocation, freed below.
        unsafe {
            cudarc::driver::sys::cuMemAlloc_v2(&mut raw, 256 << 20)
                .result()
                .unwrap()
        };
        let fell = f1 - mem_free();
        println!("{mode:?}: 256 MiB by cuMemAlloc lowers free memory by {fell}");
        assert!(fell.abs_diff(256 << 20) <= granule);
        if let Some(u1) = u1 {
            let non_alloc = |u: u64| u - a.snapshot().reserved_bytes.current;
            let grown = non_alloc(usage().unwrap()) - non_alloc(u1);
            println!(
                "{mode:?}: 256 MiB by cuMemAlloc shows as {grown} bytes of non-allocator memory"
            );
            assert!(grown.abs_diff(256 << 20) <= granule);
        }
        // SAFETY: freeing the allocation made above.
        unsafe { cudarc::driver::sys::cuMemFree_v2(raw).result().unwrap() };

        for x in xs {
            a.free_on(x.ptr, s).unwrap();
        }
        a.empty_cache().unwrap();
        let f2 = mem_free();
        println!("{mode:?}: after empty_cache free {f1} -> {f2}");
        assert_eq!(a.snapshot().reserved_bytes.current, 0);
        assert!(
            f2.abs_diff(f0) <= granule,
            "{mode:?}: free back to {f0}? {f2}"
        );
        if let (Some(u0), Some(u2)) = (u0, usage()) {
            println!("{mode:?}: after empty_cache NVML -> {u2}");
            assert!(
                u2.abs_diff(u0) <= granule,
                "{mode:?}: NVML back to {u0}? {u2}"
            );
        }
    }
}
