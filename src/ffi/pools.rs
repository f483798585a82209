//! Memory pools (PyTorch's `torch.cuda.MemPool` and `use_mem_pool`, which its pluggable
//! allocator does not forward: the Python package calls these for its MemPool), and the
//! allocators of their own that pools may have.

use std::ffi::{c_int, c_void};
use std::fmt;
use std::sync::Arc;

use super::boundary::*;
use crate::devices::Device;
use crate::driver::external::SegmentSource;
use crate::driver::{DevicePtr, DriverCall, DriverError, DriverErrorKind, DriverResult, StreamId};
use crate::PoolOptions;

/// A pool's own allocation function, as PyTorch's pluggable allocator takes it: `size` bytes
/// on `device` for use on `stream`, or NULL.
pub type PoolAlloc =
    unsafe extern "C" fn(size: usize, device: c_int, stream: *mut c_void) -> *mut c_void;

/// A pool's own free function: give back what its allocation function returned.
pub type PoolFree =
    unsafe extern "C" fn(ptr: *mut c_void, size: usize, device: c_int, stream: *mut c_void);

/// [`vram_ledger_pool_hold`]'s flag for PyTorch's `use_on_oom`.
const POOL_USE_ON_OOM: c_int = 1;
/// [`vram_ledger_pool_hold`]'s flag for PyTorch's `no_split`.
const POOL_NO_SPLIT: c_int = 2;

/// Make pool (`pool_a`, `pool_b`) if it is new, and count one reference to it (PyTorch's
/// `createOrIncrefPool`, as a `torch.cuda.MemPool` is made); `vram_ledger_graph_release` drops
/// it. With `alloc` and `free` (both or neither), the pool's segments come from them, in every
/// mode: they must behave as PyTorch's pluggable-allocator functions, may be called from any
/// thread until the pool's last segment is given back, and must not unwind. They run with the
/// allocator's lock held, as PyTorch calls them under its own: they must not call this
/// library, nor take a lock that a thread calling it may hold (the call would wait forever).
/// `flags` is a sum
/// of: 1 (PyTorch's `use_on_oom`), the pool's free blocks serve an allocation that would
/// otherwise run out of memory; 2 (`no_split`), the pool's blocks are never split, so each
/// allocation has a segment of its own (or reuses a whole free block). Other bits are refused
/// (-1). A pool that exists keeps how it was made (another allocator or `no_split` is refused,
/// -1).
#[no_mangle]
pub extern "C" fn vram_ledger_pool_hold(
    device: c_int,
    pool_a: u64,
    pool_b: u64,
    alloc: Option<PoolAlloc>,
    free: Option<PoolFree>,
    flags: c_int,
) -> c_int {
    guard(-1, || {
        if flags & !(POOL_USE_ON_OOM | POOL_NO_SPLIT) != 0 {
            return Err(format!(
                "pool flags {flags:#x}: only 1 (use_on_oom) and 2 (no_split) are known"
            ));
        }
        let pool = crate::GraphPool(pool_a, pool_b);
        let source = match (alloc, free) {
            (Some(alloc), Some(free)) => Some(Arc::new(HostAllocator {
                alloc,
                free,
                device,
            }) as crate::driver::external::Source),
            (None, None) => None,
            _ => {
                return Err("a pool's allocator needs both its alloc and its free function".into())
            }
        };
        let options = PoolOptions {
            source,
            use_on_oom: flags & POOL_USE_ON_OOM != 0,
            no_split: flags & POOL_NO_SPLIT != 0,
        };
        status(on_device!(state(device)?, d => d.allocator().hold_pool(pool, options)))
    })
}

/// Route every allocation the calling thread makes on `device` to the pool, on any stream,
/// until `vram_ledger_pool_end` (PyTorch's `beginAllocateToPool` with a filter for the current
/// thread, as `use_mem_pool` begins). Counts one reference, which `vram_ledger_graph_release`
/// drops.
#[no_mangle]
pub extern "C" fn vram_ledger_pool_begin(device: c_int, pool_a: u64, pool_b: u64) -> c_int {
    guard(-1, || {
        let pool = crate::GraphPool(pool_a, pool_b);
        status(on_device!(state(device)?, d => d.allocator().begin_thread_pool(pool)))
    })
}

/// End the calling thread's last route to the pool (`use_mem_pool`'s end). -1 when the thread
/// has none.
#[no_mangle]
pub extern "C" fn vram_ledger_pool_end(device: c_int, pool_a: u64, pool_b: u64) -> c_int {
    guard(-1, || {
        let pool = crate::GraphPool(pool_a, pool_b);
        status(on_device!(state(device)?, d => d.allocator().end_thread_pool(pool)))
    })
}

/// A pool's own allocator: the host's C functions, for one device.
struct HostAllocator {
    alloc: PoolAlloc,
    free: PoolFree,
    device: c_int,
}

impl fmt::Debug for HostAllocator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the pool's own allocator ({:p}, {:p})",
            self.alloc as *const (), self.free as *const ()
        )
    }
}

impl SegmentSource for HostAllocator {
    fn alloc(&self, bytes: u64, stream: StreamId) -> DriverResult<DevicePtr> {
        let n = usize::try_from(bytes).map_err(|_| {
            DriverError::new(
                DriverCall::AllocSegment,
                DriverErrorKind::InvalidValue,
                "size",
            )
        })?;
        // SAFETY: the functions' contract, as vram_ledger_pool_hold states it.
        let p = unsafe { (self.alloc)(n, self.device, stream.0 as *mut c_void) };
        if p.is_null() {
            return Err(DriverError::new(
                DriverCall::AllocSegment,
                DriverErrorKind::OutOfMemory,
                format!("the pool's own allocator returned NULL for {bytes} bytes"),
            ));
        }
        // Blocks are cut at 512-byte steps from the segment's start, and kernels expect the
        // alignment cudaMalloc gives: a misaligned segment goes back at once.
        if !(p as usize).is_multiple_of(512) {
            self.free(p as DevicePtr, bytes, stream)?;
            return Err(DriverError::new(
                DriverCall::AllocSegment,
                DriverErrorKind::InvalidValue,
                format!("the pool's own allocator returned {p:?}, not aligned to 512 bytes"),
            ));
        }
        Ok(p as DevicePtr)
    }

    fn key(&self) -> [usize; 3] {
        [
            self.alloc as usize,
            self.free as usize,
            self.device as usize,
        ]
    }

    fn free(&self, ptr: DevicePtr, bytes: u64, stream: StreamId) -> DriverResult<()> {
        // SAFETY: as above; `ptr` and `bytes` are what `alloc` gave.
        unsafe {
            (self.free)(
                ptr as *mut c_void,
                bytes as usize,
                self.device,
                stream.0 as *mut c_void,
            )
        };
        Ok(())
    }
}
