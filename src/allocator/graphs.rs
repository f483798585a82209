//! CUDA graph pools, the entry points: routing a capture's allocations to a pool, and
//! giving a pool's memory back once no graph references it (PyTorch's private pools; the
//! routing itself, and why, is in `routes.rs`).
//!
//! Invariants:
//! - A pool is held while a graph references it: each begin counts one reference, each
//!   [`Allocator::release_graph_pool`] drops one. A held pool's memory is never released,
//!   moved or unmapped, by `empty_cache`, by an out-of-memory retry or by a move; only sleep
//!   gives a tag's region of it back, and wake maps it again at the same addresses.
//! - Once the last reference goes and no capture runs anywhere (a synchronisation would spoil
//!   it), the pool's free memory is released after the device is synchronised (graphs replay on
//!   streams the allocator never sees; `cuMemFree` waits by itself; remap keeps its pieces as
//!   spare); what is still allocated stays in the pool and goes with the next `empty_cache`.
//! - Blocks of a pool return to it when freed, whenever that happens, and only allocations
//!   routed to the pool reuse them. Captures that share a pool (PyTorch's `pool=` argument, as
//!   vLLM passes for its batch sizes) share its memory, as with PyTorch's allocator.

use std::sync::atomic::Ordering::Relaxed;

use super::front::Allocator;
use super::owner::PoolKey;
use super::routes::{GraphRoutes, PoolEntry, PoolOptions, Route};
use crate::driver::{Capture, Driver, GraphPool, StreamId};
use crate::error::{Error, Result};

/// How many retired pools' names the registry keeps for the dump.
const RETIRED_KEPT: usize = 1 << 16;

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
        let p = self.entry(&mut pools, pool);
        p.refs += 1;
        p.captures.push((capture, stream, outside));
        // Under the registry's lock, as every change of routes: every shard sees them in the
        // same order.
        self.route_to(p, Some(Route::Capture(capture)))
    }

    /// The registry's entry for `pool`, made (unreferenced) if there is none.
    pub(super) fn entry<'a>(
        &self,
        pools: &'a mut Vec<PoolEntry>,
        pool: GraphPool,
    ) -> &'a mut PoolEntry {
        self.entry_made(pools, pool, None).0
    }

    /// As [`Allocator::entry`]; a new entry is made with `options` (the defaults when None),
    /// and the flag says whether it was made now. Only a new entry takes options: its key is
    /// new too, so no shard holds it yet, and [`Allocator::route_to`] gives every shard the
    /// options with the key.
    pub(super) fn entry_made<'a>(
        &self,
        pools: &'a mut Vec<PoolEntry>,
        pool: GraphPool,
        options: Option<PoolOptions>,
    ) -> (&'a mut PoolEntry, bool) {
        let mut made = false;
        let i = match pools.iter().position(|p| p.id == pool) {
            Some(i) => i,
            None => {
                made = true;
                let n = self.graphs.last_key.fetch_add(1, Relaxed) + 1;
                pools.push(PoolEntry {
                    id: pool,
                    key: PoolKey(n),
                    refs: 0,
                    captures: Vec::new(),
                    threads: Vec::new(),
                    options: options.unwrap_or_default(),
                });
                pools.len() - 1
            }
        };
        (&mut pools[i], made)
    }

    /// Hold `key` in every shard (its memory is then never released or moved, and how it was
    /// made is known there) and, with a route, send what the route matches to it.
    pub(super) fn route_to(&self, p: &PoolEntry, route: Option<Route>) -> Result<()> {
        let key = p.key;
        self.each_shard(|r| {
            r.routes.extend(route.map(|route| (route, key)));
            if !r.held.contains(&key) {
                r.held.push(key);
                if let Some(source) = &p.options.source {
                    r.sources.push((key, source.clone()));
                }
                if p.options.use_on_oom {
                    r.on_oom.push(key);
                }
                if p.options.no_split {
                    r.unsplit.push(key);
                }
            }
        })
    }

    /// Remove the route registered last from `route` to `key`, in every shard.
    pub(super) fn unroute(&self, key: PoolKey, route: Route) -> Result<()> {
        self.each_shard(|r| {
            if let Some(i) = r.routes.iter().rposition(|&x| x == (route, key)) {
                r.routes.remove(i);
            }
        })
    }

    /// Stop routing to `pool` the capture that began on `stream` (call it once the capture has
    /// ended and the graph is instantiated). Adds to the ledger's graph figure what appeared
    /// outside the allocator meanwhile (graph instantiation, mostly), when the driver reports
    /// this process's usage. Pools released while captures ran are given back once none runs.
    pub fn end_graph_pool(&self, pool: GraphPool, stream: StreamId) -> Result<()> {
        let mut pools = self.graphs.pools.lock();
        let p = known(&mut pools, pool)?;
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
        self.unroute(key, Route::Capture(capture))?;
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

    /// Give back the pools that nothing references (none captures, by the callers' check).
    pub(super) fn retire_unreferenced(&self) -> Result<()> {
        let mut pools = self.graphs.pools.lock();
        let mut keys = Vec::new();
        let mut retired = self.graphs.retired.lock();
        pools.retain(|p| {
            let gone = p.unreferenced();
            if gone {
                keys.push(p.key);
                retired.push((p.key, p.id));
            }
            !gone
        });
        // A program that makes and drops graphs without end would grow this without end; the
        // newest names are the ones live blocks may still need.
        let excess = retired.len().saturating_sub(RETIRED_KEPT);
        retired.drain(..excess);
        drop(retired);
        if keys.is_empty() {
            return Ok(());
        }
        self.each_shard(|r| {
            r.held.retain(|k| !keys.contains(k));
            // Segments keep their own source until they are given back to it.
            r.sources.retain(|(k, _)| !keys.contains(k));
            r.on_oom.retain(|k| !keys.contains(k));
            r.unsplit.retain(|k| !keys.contains(k));
        })?;
        drop(pools);
        let mut first = None;
        for i in 0..self.shards.len() {
            for &key in &keys {
                if let Err(e) = self
                    .lock(i)
                    .and_then(|mut sh| sh.release_pool(&self.core, key))
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

/// The registry's entry for `pool`, which must be there.
pub(super) fn known(pools: &mut [PoolEntry], pool: GraphPool) -> Result<&mut PoolEntry> {
    pools
        .iter_mut()
        .find(|p| p.id == pool)
        .ok_or(Error::UnknownGraphPool(pool))
}
