//! CUDA graph pools (PyTorch's private pools, which its pluggable allocator does not forward:
//! the Python package calls these around `torch.cuda.CUDAGraph`'s capture and release).

use std::ffi::{c_int, c_void};

use super::boundary::*;
use crate::devices::Device;
use crate::driver::StreamId;

/// Route the capture running on `stream` to graph pool (`pool_a`, `pool_b`), PyTorch's
/// `MempoolId_t`: until `vram_ledger_graph_end`, allocations on streams of that capture come
/// from the pool, and nothing else gets its memory while a graph made from it lives. Counts
/// one reference to the pool. -1 when `stream` is not capturing.
///
/// # Safety
/// On the CUDA backend `stream` is a live `cudaStream_t` of `device`'s primary context.
#[no_mangle]
pub unsafe extern "C" fn vram_ledger_graph_begin(
    device: c_int,
    stream: *mut c_void,
    pool_a: u64,
    pool_b: u64,
) -> c_int {
    guard(-1, || {
        let pool = crate::GraphPool(pool_a, pool_b);
        status(
            on_device!(state(device)?, d => d.allocator().begin_graph_pool(pool, StreamId(stream as u64))),
        )
    })
}

/// Stop routing the capture that began on `stream` into the pool (after the capture has ended
/// and the graph is instantiated); measures what appeared outside the allocator meanwhile.
/// `stream` is only compared.
#[no_mangle]
pub extern "C" fn vram_ledger_graph_end(
    device: c_int,
    stream: *mut c_void,
    pool_a: u64,
    pool_b: u64,
) -> c_int {
    guard(-1, || {
        let pool = crate::GraphPool(pool_a, pool_b);
        status(
            on_device!(state(device)?, d => d.allocator().end_graph_pool(pool, StreamId(stream as u64))),
        )
    })
}

/// Drop one reference to the pool (a graph made from it was reset or destroyed); with the last
/// one its free memory goes back to the driver.
#[no_mangle]
pub extern "C" fn vram_ledger_graph_release(device: c_int, pool_a: u64, pool_b: u64) -> c_int {
    guard(-1, || {
        let pool = crate::GraphPool(pool_a, pool_b);
        status(on_device!(state(device)?, d => d.allocator().release_graph_pool(pool)))
    })
}
