//! CUDA graph pools: the memory that allocations made during a capture get, kept apart from
//! every other allocation while a graph made from it may replay (PyTorch's private pools).
//!
//! A replayed graph writes to the addresses it was captured with, freed or not. So memory
//! freed during a capture must never be handed to code outside that graph (eager code on the
//! capture stream, or a second capture into another pool) while the graph lives: a replay
//! would overwrite it.
//!
//! How: between [`Allocator::begin_graph_pool`] and [`Allocator::end_graph_pool`], an
//! allocation on any stream that is part of the capture is served from the pool's own free
//! lists, and grows the pool, under the pool's key: a stream id that no real stream has (the
//! top bit set; CUDA stream handles are user-space pointers), standing where a stream would.
//! Blocks of a pool return to it when freed, whenever that happens, and only allocations
//! routed to the pool reuse them. Captures that share a pool (PyTorch's `pool=` argument, as
//! vLLM passes for its batch sizes) share its memory, as with PyTorch's allocator.
//!
//! Invariants:
//! - Every shard holds the same routes and the same held keys (they change under each shard's
//!   lock in turn, in index order).
//! - A pool is held while a graph references it: each begin counts one reference, each
//!   [`Allocator::release_graph_pool`] drops one. A held pool's memory is never released,
//!   moved or unmapped, by `empty_cache`, by an out-of-memory retry or by a move.
//! - Once the last reference goes and no capture runs anywhere (a synchronisation would spoil
//!   it), the pool's free memory is released after the device is synchronised (graphs replay on
//!   streams the allocator never sees; `cuMemFree` waits by itself; remap keeps its pieces as
//!   spare); what is still allocated stays in the pool and goes with the next `empty_cache`.
//! - Routing costs the cached path one length check while no capture is routed; while one is,
//!   every allocation asks the driver which capture its stream is in, as PyTorch's allocator
//!   does during a capture.

use std::sync::atomic::Ordering::Relaxed;

use parking_lot::Mutex;

use super::shard::Shard;
use super::Allocator;
use crate::driver::{Capture, Driver, StreamId};
use crate::error::{Error, Result};

/// A graph pool's identity, as PyTorch names its memory pools (`MempoolId_t`): two integers,
/// one of them non-zero.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GraphPool(pub u64, pub u64);

const KEY_BIT: u64 = 1 << 63;

/// Whether `stream` is a graph pool's key rather than a real stream.
#[inline]
pub(crate) fn is_pool_key(stream: StreamId) -> bool {
    stream.0 & KEY_BIT != 0
}

/// What one shard knows of graph pools.
#[derive(Default, Debug)]
pub(crate) struct GraphRoutes {
    /// (capture id, pool key) for each capture routed to a pool.
    routes: Vec<(u64, StreamId)>,
    /// Keys of the pools that graphs still reference.
    held: Vec<StreamId>,
}

impl GraphRoutes {
    /// Where an allocation on `stream` goes: the pool its capture is routed to, or the stream.
    #[inline]
    pub(crate) fn owner<D: Driver>(&self, driver: &D, stream: StreamId) -> StreamId {
        if self.routes.is_empty() {
            return stream;
        }
        self.route(driver, stream)
    }

    #[cold]
    fn route<D: Driver>(&self, driver: &D, stream: StreamId) -> StreamId {
        match driver.capture(stream) {
            Capture::Active(id) => self
                .routes
                .iter()
                .find(|&&(c, _)| c == id)
                .map_or(stream, |&(_, key)| key),
            Capture::None | Capture::Unknown => stream,
        }
    }

    /// Whether a capture is routed to a pool now, anywhere (every shard holds every route):
    /// moves between shards synchronise the device, which would spoil it.
    #[inline]
    pub(crate) fn capturing(&self) -> bool {
        !self.routes.is_empty()
    }

    /// Whether the memory of `owner` (a stream or a pool key) may be released or moved.
    #[inline]
    pub(crate) fn releasable(&self, owner: StreamId) -> bool {
        !self.held.contains(&owner)
    }
}

#[derive(Debug)]
struct PoolEntry {
    id: GraphPool,
    key: StreamId,
    refs: u32,
    /// Captures in progress: (capture id, the stream it began on, memory outside the
    /// allocator when it began).
    captures: Vec<(u64, StreamId, Option<u64>)>,
}

/// The allocator's graph pools; its lock is taken only by the calls of this file.
#[derive(Default, Debug)]
pub(crate) struct GraphRegistry {
    pools: Mutex<Vec<PoolEntry>>,
    next: std::sync::atomic::AtomicU64,
}

/// A pool's memory now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct GraphMemory {
    /// Pools that graphs still reference.
    pub pools: usize,
    /// Bytes the allocator holds from the driver for graph pools.
    pub reserved: u64,
    /// Bytes of graph pools handed out and not freed (a graph's inputs and outputs, mostly).
    pub allocated: u64,
}

impl<D: Driver> Allocator<D> {
    /// Route the capture running on `stream` to `pool`: until [`Allocator::end_graph_pool`],
    /// every allocation on a stream that is part of that capture is served from the pool, and
    /// what the pool holds serves nothing else. Counts one reference to the pool (a graph made
    /// from the capture). Also notes this process's memory outside the allocator, so that
    /// what the capture and its instantiation add there is measured at the end.
    pub fn begin_graph_pool(&self, pool: GraphPool, stream: StreamId) -> Result<()> {
        let capture = match self.core.driver.capture(stream) {
            Capture::Active(id) => id,
            Capture::None | Capture::Unknown => return Err(Error::NotCapturing(stream)),
        };
        let outside = self.outside_measured();
        let mut pools = self.graphs.pools.lock();
        let i = match pools.iter().position(|p| p.id == pool) {
            Some(i) => i,
            None => {
                let n = self.graphs.next.fetch_add(1, Relaxed) + 1;
                pools.push(PoolEntry {
                    id: pool,
                    key: StreamId(KEY_BIT | n),
                    refs: 0,
                    captures: Vec::new(),
                });
                pools.len() - 1
            }
        };
        let p = &mut pools[i];
        p.refs += 1;
        p.captures.push((capture, stream, outside));
        let key = p.key;
        self.each_shard(|r| {
            r.routes.push((capture, key));
            if !r.held.contains(&key) {
                r.held.push(key);
            }
        })
    }

    /// Stop routing to `pool` the capture that began on `stream` (call it once the capture has
    /// ended and the graph is instantiated). Adds to the ledger's graph figure what appeared
    /// outside the allocator meanwhile (graph instantiation, mostly), when the driver reports
    /// this process's usage. Pools released while captures ran are given back once none runs.
    pub fn end_graph_pool(&self, pool: GraphPool, stream: StreamId) -> Result<()> {
        let mut pools = self.graphs.pools.lock();
        let p = pools
            .iter_mut()
            .find(|p| p.id == pool)
            .ok_or(Error::UnknownGraphPool(pool))?;
        let i = p
            .captures
            .iter()
            .rposition(|c| c.1 == stream)
            .ok_or(Error::UnknownGraphPool(pool))?;
        let (capture, _, before) = p.captures.remove(i);
        let key = p.key;
        let idle = pools.iter().all(|p| p.captures.is_empty());
        drop(pools);
        if let (Some(before), Some(after)) = (before, self.outside_measured()) {
            self.core
                .ledger
                .graph_outside
                .fetch_add(after.saturating_sub(before), Relaxed);
        }
        self.each_shard(|r| {
            if let Some(i) = r.routes.iter().position(|&x| x == (capture, key)) {
                r.routes.swap_remove(i);
            }
        })?;
        if idle {
            self.retire_unreferenced()?;
        }
        Ok(())
    }

    /// Drop one reference to `pool` (a graph made from it was destroyed). When none remain,
    /// the pool's free memory is given back to the driver (after a device synchronisation in
    /// the virtual-memory modes; `cuMemFree` waits by itself), at once, or, while any capture
    /// runs (a synchronisation would spoil it), when the last one ends. Blocks still allocated
    /// stay in the pool and go with the next `empty_cache` once freed.
    pub fn release_graph_pool(&self, pool: GraphPool) -> Result<()> {
        let mut pools = self.graphs.pools.lock();
        let i = pools
            .iter()
            .position(|p| p.id == pool)
            .ok_or(Error::UnknownGraphPool(pool))?;
        pools[i].refs = pools[i].refs.saturating_sub(1);
        let idle = pools.iter().all(|p| p.captures.is_empty());
        drop(pools);
        if idle {
            self.retire_unreferenced()?;
        }
        Ok(())
    }

    /// Give back the pools that no graph references (none captures, by the callers' check).
    fn retire_unreferenced(&self) -> Result<()> {
        let mut pools = self.graphs.pools.lock();
        let mut keys = Vec::new();
        pools.retain(|p| {
            let gone = p.refs == 0 && p.captures.is_empty();
            if gone {
                keys.push(p.key);
            }
            !gone
        });
        if keys.is_empty() {
            return Ok(());
        }
        self.each_shard(|r| r.held.retain(|k| !keys.contains(k)))?;
        drop(pools);
        let mut first = None;
        for i in 0..self.shards.len() {
            for &key in &keys {
                if let Err(e) = self
                    .lock(i)
                    .and_then(|mut sh| sh.release_owner(&self.core, key))
                {
                    first.get_or_insert(e);
                }
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// What graph pools hold now. Walks every block, one shard at a time; not for the hot path.
    pub fn graph_memory(&self) -> GraphMemory {
        let mut m = GraphMemory {
            pools: self.graphs.pools.lock().len(),
            ..GraphMemory::default()
        };
        for i in 0..self.shards.len() {
            if let Ok(sh) = self.lock(i) {
                let (reserved, allocated) = sh.graph_bytes();
                m.reserved += reserved;
                m.allocated += allocated;
            }
        }
        m
    }

    /// This process's memory outside the allocator, when the driver reports its usage.
    fn outside_measured(&self) -> Option<u64> {
        let reserved = self.core.ledger.reserved();
        let usage = self.core.driver.process_usage().ok().flatten()?;
        Some(usage.saturating_sub(reserved))
    }

    /// Apply `f` to every shard's routes, one lock at a time, in index order.
    fn each_shard(&self, mut f: impl FnMut(&mut GraphRoutes)) -> Result<()> {
        let mut first = None;
        for i in 0..self.shards.len() {
            match self.lock(i) {
                Ok(mut sh) => f(&mut sh.graphs),
                Err(e) => {
                    first.get_or_insert(e);
                }
            }
        }
        first.map_or(Ok(()), Err)
    }
}

impl Shard {
    /// Bytes held for graph pools in this shard, and bytes of them handed out.
    fn graph_bytes(&self) -> (u64, u64) {
        let (mut reserved, mut allocated) = (0, 0);
        for (_, s) in self.segments.iter().filter(|(_, s)| is_pool_key(s.stream)) {
            reserved += match &s.kind {
                super::shard::SegmentKind::Plain => s.size,
                super::shard::SegmentKind::Virtual(v) => v.mappings.values().map(|m| m.bytes).sum(),
            };
            let mut id = s.first;
            while id != super::block::NIL {
                let b = &self.blocks[id];
                if b.state == super::block::BlockState::Allocated {
                    allocated += b.size;
                }
                id = b.next;
            }
        }
        (reserved, allocated)
    }

    /// Release the free memory of `owner` (a pool no graph references any more).
    pub(crate) fn release_owner<D: Driver>(
        &mut self,
        core: &super::core::Core<D>,
        owner: StreamId,
    ) -> Result<()> {
        let segs: Vec<u32> = self
            .segments
            .iter()
            .filter(|(_, s)| s.stream == owner)
            .map(|(id, _)| id)
            .collect();
        for seg in segs {
            self.release_segment(core, seg, super::shard::SyncFirst::Owner)?;
        }
        Ok(())
    }
}
