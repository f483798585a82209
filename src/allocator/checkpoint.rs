//! Checkpoints of a graph pool, the entry points: what a pool holds allocated now, and putting
//! a pool back to what a checkpoint recorded (PyTorch's `getCheckpointState` and
//! `setCheckpointPoolState`, which inductor's CUDA-graph trees call between the graphs they
//! record into one pool; the shard's half is `shard/restore.rs`).
//!
//! A checkpoint is what a pool had allocated: each block's address, size, request and tag.
//! Free memory needs no record: restoring frees everything the pool holds allocated and cuts
//! the recorded blocks back out at their addresses, so the pool's allocated blocks are then
//! exactly the checkpoint's (and free memory between them is merged as any free memory is).
//!
//! Invariants:
//! - Every shard is locked, in index order (as every cross-shard operation), from the first
//!   check to the last change: a restore is refused whole (nothing changed) or done whole.
//! - A restore is refused while a capture is routed to a pool or a stream that used one of the
//!   pool's blocks captures, while the pool's memory is asleep, and when a recorded block is no
//!   longer mapped memory of the pool (its segment given back since).

use super::front::Allocator;
use super::graphs::known;
use super::owner::PoolKey;
pub use super::shard::CheckpointBlock;
use crate::driver::{DevicePtr, Driver, GraphPool};
use crate::error::{Error, Result};

/// What a graph pool had allocated at one moment, in address order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolCheckpoint {
    pub pool: GraphPool,
    pub blocks: Vec<CheckpointBlock>,
}

/// What a restore changed: the allocations it freed and those it made (the checkpoint's).
/// An address may be in both, when a block live at the checkpoint still was.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolRestore {
    pub freed: Vec<DevicePtr>,
    pub made: Vec<CheckpointBlock>,
}

impl<D: Driver> Allocator<D> {
    fn pool_key(&self, pool: GraphPool) -> Result<PoolKey> {
        let mut pools = self.graphs.pools.lock();
        Ok(known(&mut pools, pool)?.key)
    }

    /// What `pool` holds allocated now, in address order. The pool must be known (a graph or
    /// a pool object still references it).
    pub fn checkpoint_pool(&self, pool: GraphPool) -> Result<PoolCheckpoint> {
        let key = self.pool_key(pool)?;
        let shards = self.lock_all()?;
        let mut blocks = Vec::new();
        for sh in &shards {
            sh.pool_allocations(key, &mut blocks);
        }
        drop(shards);
        blocks.sort_unstable_by_key(|b| b.addr);
        Ok(PoolCheckpoint { pool, blocks })
    }

    /// The addresses `pool` holds allocated now (PyTorch's `checkPoolLiveAllocations` compares
    /// them with the tensors it expects to be alive).
    pub fn pool_live(&self, pool: GraphPool) -> Result<Vec<DevicePtr>> {
        Ok(self
            .checkpoint_pool(pool)?
            .blocks
            .iter()
            .map(|b| b.addr)
            .collect())
    }

    /// Put `checkpoint.pool` back to what the checkpoint recorded: every block it holds
    /// allocated now is freed and the recorded ones are allocated again, at the same addresses,
    /// with the same sizes, requests and tags. Whoever still holds a freed address must no
    /// longer use or free it; the caller owns the blocks made. Refused (nothing changed) while
    /// a capture is routed to a pool, while the pool's memory is asleep, or when a recorded
    /// block is no longer mapped memory of the pool.
    pub fn restore_pool(&self, checkpoint: &PoolCheckpoint) -> Result<PoolRestore> {
        let key = self.pool_key(checkpoint.pool)?;
        let mut plan = checkpoint.blocks.clone();
        plan.sort_unstable_by_key(|b| b.addr);
        for w in plan.windows(2) {
            if w[0].addr.saturating_add(w[0].size) > w[1].addr {
                return Err(Error::StaleCheckpoint(format!(
                    "its blocks at {:#x} and {:#x} overlap",
                    w[0].addr, w[1].addr
                )));
            }
        }
        if let Some(b) = plan.iter().find(|b| b.size == 0 || b.requested > b.size) {
            return Err(Error::StaleCheckpoint(format!(
                "its block at {:#x} asks for {} bytes of {}",
                b.addr, b.requested, b.size
            )));
        }
        let mut shards = self.lock_all()?;
        for sh in shards.iter_mut() {
            sh.restore_sync(&self.core, key)?;
        }
        // Which shard holds each recorded block (a pool's segments may be in several).
        let mut split: Vec<Vec<CheckpointBlock>> = vec![Vec::new(); shards.len()];
        for b in &plan {
            let i = shards
                .iter()
                .position(|sh| sh.pool_segment_of(key, b).is_some())
                .ok_or_else(|| {
                    Error::StaleCheckpoint(format!(
                        "no segment of the pool holds the block at {:#x} any more",
                        b.addr
                    ))
                })?;
            split[i].push(*b);
        }
        for (sh, part) in shards.iter().zip(&split) {
            sh.restore_check(key, part)?;
        }
        let mut done = PoolRestore::default();
        for (sh, part) in shards.iter_mut().zip(&split) {
            sh.restore_apply(&self.core, key, part, &mut done.freed);
        }
        drop(shards);
        done.made = plan;
        Ok(done)
    }
}
