//! Shared set-up of the GPU tests: they run on a real device when one is there; with no driver
//! library or no device they print "skipped: <why>" and pass; with a driver that loads and
//! fails they fail, so that a broken install never reads as "no GPU here".

#![allow(dead_code)]

#[macro_use]
pub mod sim;

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use vram_ledger::driver::cuda::{self, CudaDriver};
use vram_ledger::kernels::PatternKernels;
use vram_ledger::{Allocator, Config, SegmentMode};

pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub kernels: PatternKernels,
}

/// The GPU, or `None` after printing why the test is skipped. Panics on a broken driver.
pub fn gpu(test: &str) -> Option<Gpu> {
    match cuda::probe().skip_reason() {
        Ok(None) => {}
        Ok(Some(why)) => {
            println!("{test}: skipped: {why}");
            return None;
        }
        Err(e) => panic!("{test}: the CUDA driver loads but fails: {e}"),
    }
    let ctx = CudaContext::new(0).expect("a CUDA context on device 0");
    let stream = ctx.default_stream();
    let kernels = PatternKernels::load(&ctx).expect("kernels compile with NVRTC");
    Some(Gpu {
        ctx,
        stream,
        kernels,
    })
}

pub fn allocator(mode: SegmentMode) -> Arc<Allocator<CudaDriver>> {
    Arc::new(
        Allocator::new(
            CudaDriver::new(0).expect("device 0"),
            Config {
                mode,
                ..Default::default()
            },
        )
        .unwrap(),
    )
}

impl Gpu {
    pub fn counter(&self) -> CudaSlice<u64> {
        self.stream.alloc_zeros::<u64>(1).unwrap()
    }

    pub fn read(&self, c: &CudaSlice<u64>) -> u64 {
        self.stream.clone_dtoh(c).unwrap()[0]
    }
}
