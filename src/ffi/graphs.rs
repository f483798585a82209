//! CUDA graph pools (PyTorch's private pools, which its pluggable allocator does not forward:
//! the Python package calls these around `torch.cuda.CUDAGraph`'s capture and release).

use std::ffi::{c_char, c_int, c_void};

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

/// A block of a pool's checkpoint, as the JSON of the two functions below spells it.
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Block {
    addr: u64,
    size: u64,
    requested: u64,
    tag: String,
}

impl From<&crate::CheckpointBlock> for Block {
    fn from(b: &crate::CheckpointBlock) -> Block {
        Block {
            addr: b.addr,
            size: b.size,
            requested: b.requested,
            tag: b.tag.name().to_owned(),
        }
    }
}

#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Checkpoint {
    blocks: Vec<Block>,
}

/// What the pool (`pool_a`, `pool_b`) holds allocated now, as JSON: `blocks`, each with its
/// `addr`, `size`, `requested` bytes and `tag`, in address order (PyTorch's
/// `getCheckpointState`). NULL when the pool is unknown.
#[no_mangle]
pub extern "C" fn vram_ledger_pool_checkpoint(
    device: c_int,
    pool_a: u64,
    pool_b: u64,
) -> *mut c_char {
    guard(std::ptr::null_mut(), || {
        let pool = crate::GraphPool(pool_a, pool_b);
        let d = state(device)?;
        let cp =
            on_device!(d, d => d.allocator().checkpoint_pool(pool)).map_err(|e| e.to_string())?;
        let out = Checkpoint {
            blocks: cp.blocks.iter().map(Block::from).collect(),
        };
        Ok(into_c_string(
            serde_json::to_string(&out).map_err(|e| e.to_string())?,
        ))
    })
}

/// Put the pool back to `checkpoint` (the JSON `vram_ledger_pool_checkpoint` gave): every block
/// it holds allocated now is freed and the checkpoint's are allocated again at their addresses
/// (PyTorch's `setCheckpointPoolState`). Returns JSON: `freed`, the addresses freed, and
/// `made`, the blocks allocated (the caller owns them; an address may be in both). NULL, with
/// nothing changed, when the checkpoint is malformed or no longer fits the pool, or while a
/// capture runs.
///
/// # Safety
/// `checkpoint` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn vram_ledger_pool_restore(
    device: c_int,
    pool_a: u64,
    pool_b: u64,
    checkpoint: *const c_char,
) -> *mut c_char {
    guard(std::ptr::null_mut(), || {
        // SAFETY: the caller passes NULL or a NUL-terminated string.
        let text = unsafe { c_str(checkpoint, "checkpoint") }?;
        let parsed: Checkpoint =
            serde_json::from_str(text).map_err(|e| format!("malformed checkpoint: {e}"))?;
        let blocks = parsed
            .blocks
            .iter()
            .map(|b| {
                Ok(crate::CheckpointBlock {
                    addr: b.addr,
                    size: b.size,
                    requested: b.requested,
                    tag: b
                        .tag
                        .parse()
                        .map_err(|e: crate::tag::UnknownTag| e.to_string())?,
                })
            })
            .collect::<Result<Vec<_>, String>>()?;
        let cp = crate::PoolCheckpoint {
            pool: crate::GraphPool(pool_a, pool_b),
            blocks,
        };
        let d = state(device)?;
        let done =
            on_device!(d, d => d.allocator().restore_pool(&cp)).map_err(|e| e.to_string())?;
        let out = serde_json::json!({
            "freed": done.freed,
            "made": done.made.iter().map(Block::from).collect::<Vec<_>>(),
        });
        Ok(into_c_string(out.to_string()))
    })
}
