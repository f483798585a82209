//! The kernels of `kernels/`, compiled at run time with NVRTC: fill a buffer with a pattern
//! derived from its addresses and a seed, verify it, or hold a stream busy.

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};

use crate::driver::DevicePtr;

const SOURCE: &str = include_str!("../kernels/pattern.cu");

/// Errors from compiling or launching the kernels.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("NVRTC could not compile kernels/pattern.cu: {0}")]
    Compile(String),
    #[error(transparent)]
    Driver(#[from] cudarc::driver::DriverError),
}

/// The pattern kernels, loaded into one context.
pub struct PatternKernels {
    _module: Arc<CudaModule>,
    fill: CudaFunction,
    verify: CudaFunction,
    hold: CudaFunction,
}

fn grid(words: u64) -> LaunchConfig {
    let blocks = words.div_ceil(256).clamp(1, 4096) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl PatternKernels {
    pub fn load(ctx: &Arc<CudaContext>) -> Result<Self, KernelError> {
        let ptx = cudarc::nvrtc::compile_ptx(SOURCE)
            .map_err(|e| KernelError::Compile(format!("{e:?}")))?;
        let module = ctx.load_module(ptx)?;
        Ok(PatternKernels {
            fill: module.load_function("fill_pattern")?,
            verify: module.load_function("verify_pattern")?,
            hold: module.load_function("hold")?,
            _module: module,
        })
    }

    /// Fill `bytes` (a multiple of 8) at `ptr` with the pattern of `seed`, on `stream`.
    pub fn fill(
        &self,
        stream: &Arc<CudaStream>,
        ptr: DevicePtr,
        bytes: u64,
        seed: u64,
    ) -> Result<(), KernelError> {
        let words = bytes / 8;
        let mut b = stream.launch_builder(&self.fill);
        b.arg(&ptr).arg(&words).arg(&seed);
        // SAFETY: the kernel writes `words` words from `ptr`, which the caller owns.
        unsafe { b.launch(grid(words)) }?;
        Ok(())
    }

    /// Count words at `ptr` that do not hold the pattern of `seed` (adds to `counter`).
    pub fn verify(
        &self,
        stream: &Arc<CudaStream>,
        ptr: DevicePtr,
        bytes: u64,
        seed: u64,
        counter: &mut CudaSlice<u64>,
    ) -> Result<(), KernelError> {
        let words = bytes / 8;
        let mut b = stream.launch_builder(&self.verify);
        b.arg(&ptr).arg(&words).arg(&seed).arg(counter);
        // SAFETY: the kernel reads `words` words from `ptr` and adds to one counter.
        unsafe { b.launch(grid(words)) }?;
        Ok(())
    }

    /// Keep `stream` busy for about `cycles` GPU clock ticks, then read the word at `ptr`.
    pub fn hold(
        &self,
        stream: &Arc<CudaStream>,
        ptr: DevicePtr,
        cycles: i64,
        sink: &mut CudaSlice<u64>,
    ) -> Result<(), KernelError> {
        let mut b = stream.launch_builder(&self.hold);
        b.arg(&ptr).arg(&cycles).arg(sink);
        // SAFETY: one thread reads one word at `ptr` and writes `sink`.
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (1, 1, 1),
                shared_mem_bytes: 0,
            })
        }?;
        Ok(())
    }
}
