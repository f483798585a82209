//! Where a capture's allocations go: each shard's copy of the routes from running captures to
//! graph pools, and the allocator-wide registry of pools (`graphs.rs` acts on both).
//!
//! A replayed graph writes to the addresses it was captured with, freed or not. So memory
//! freed during a capture must never be handed to code outside that graph while the graph
//! lives: allocations on a stream that is part of a routed capture are filed under the pool's
//! [`Owner::of_pool`] key (its region of their tag, when tags are kept apart), and only
//! allocations routed to the same pool reuse its blocks.
//!
//! Invariants:
//! - Every shard holds the same routes and the same held keys (they change under each shard's
//!   lock in turn, in index order).
//! - A held pool's memory is never released, moved or unmapped (`releasable`).
//! - Routing costs the cached path one length check while no capture is routed; while one is,
//!   every allocation asks the driver which capture its stream is in, as PyTorch's allocator
//!   does during a capture.

use std::sync::atomic::AtomicU32;

use parking_lot::Mutex;

use super::owner::{Owner, PoolKey};
use crate::driver::{Capture, Driver, GraphPool, StreamId};

/// What one shard knows of graph pools.
#[derive(Default, Debug)]
pub(crate) struct GraphRoutes {
    /// (capture id, pool key) for each capture routed to a pool.
    pub(crate) routes: Vec<(u64, PoolKey)>,
    /// Keys of the pools that graphs still reference.
    pub(crate) held: Vec<PoolKey>,
}

impl GraphRoutes {
    /// Whose memory serves an allocation on `stream`: the pool its capture is routed to, or
    /// the stream's own.
    #[inline]
    pub(crate) fn owner<D: Driver>(&self, driver: &D, stream: StreamId) -> Owner {
        if self.routes.is_empty() {
            return Owner::of_stream(stream);
        }
        self.route(driver, stream)
    }

    #[cold]
    fn route<D: Driver>(&self, driver: &D, stream: StreamId) -> Owner {
        match driver.capture(stream) {
            Capture::Active(id) => self
                .routes
                .iter()
                .find(|&&(c, _)| c == id)
                .map_or(Owner::of_stream(stream), |&(_, key)| Owner::of_pool(key)),
            Capture::None | Capture::Unknown => Owner::of_stream(stream),
        }
    }

    /// Whether a capture is routed to a pool now, anywhere (every shard holds every route):
    /// moves between shards synchronise the device, which would spoil it.
    #[inline]
    pub(crate) fn capturing(&self) -> bool {
        !self.routes.is_empty()
    }

    /// Whether the memory of `owner` may be released or moved.
    #[inline]
    pub(crate) fn releasable(&self, owner: Owner) -> bool {
        owner.pool().is_none_or(|key| !self.held.contains(&key))
    }
}

/// One graph pool of the registry.
#[derive(Debug)]
pub(crate) struct PoolEntry {
    pub(crate) id: GraphPool,
    pub(crate) key: PoolKey,
    /// Graphs made from the pool's captures and not released.
    pub(crate) refs: u32,
    /// Captures in progress: (capture id, the stream it began on, memory outside the
    /// allocator when it began).
    pub(crate) captures: Vec<(u64, StreamId, Option<u64>)>,
}

/// The allocator's graph pools. Its lock is never taken while a shard lock is held (its
/// holders take shard locks).
#[derive(Default, Debug)]
pub(crate) struct GraphRegistry {
    pub(crate) pools: Mutex<Vec<PoolEntry>>,
    /// The host's names of the pools no graph references any more, by key (keys are never
    /// dealt out twice): their allocated blocks keep segments that still name the pool.
    pub(crate) retired: Mutex<Vec<(PoolKey, GraphPool)>>,
    /// The last key dealt out.
    pub(crate) last_key: AtomicU32,
}
