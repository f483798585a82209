//! Pools a thread allocates into (PyTorch's `torch.cuda.MemPool` and `use_mem_pool`): the
//! entry points. They share graph pools' registry, keys and routing (`routes.rs`): a pool is
//! one kind of memory kept apart, whether captures or threads fill it.
//!
//! Invariants:
//! - A pool is held while anything references it: each [`Allocator::hold_pool`] (a pool object
//!   made) and each [`Allocator::begin_thread_pool`] counts one reference, each
//!   [`Allocator::release_graph_pool`] drops one, as PyTorch's `createOrIncrefPool`,
//!   `beginAllocateToPool` and `releasePool` do. While held, its memory is never released or
//!   moved (`empty_cache` inside `use_mem_pool` keeps it, as PyTorch's does).
//! - A thread's route serves that thread's allocations on every stream. Outside a capture, a
//!   block handed out from a pool is marked as used by the stream it was allocated on
//!   (`Allocator::pool_block_in_use`): when freed it is reused only once that stream has
//!   reached the free, whichever stream asks for it next (a pool has no stream of its own).

use super::core::Allocation;
use super::front::Allocator;
use super::routes::{this_thread, Route};
use super::shard::Shard;
use crate::driver::{Driver, GraphPool};
use crate::error::{Error, Result};

impl<D: Driver> Allocator<D> {
    /// Count one reference to `pool`, making it if it is new (a pool object was made). The
    /// pool keeps its memory until the last reference is dropped
    /// ([`Allocator::release_graph_pool`]).
    pub fn hold_pool(&self, pool: GraphPool) -> Result<()> {
        let mut pools = self.graphs.pools.lock();
        let p = self.entry(&mut pools, pool);
        p.refs += 1;
        let key = p.key;
        self.route_to(key, None)
    }

    /// Route every allocation this thread makes to `pool`, on any stream, until
    /// [`Allocator::end_thread_pool`] (the innermost route wins when pools are used one inside
    /// another). Counts one reference to the pool, as PyTorch's `beginAllocateToPool` does;
    /// [`Allocator::release_graph_pool`] drops it.
    pub fn begin_thread_pool(&self, pool: GraphPool) -> Result<()> {
        let mut pools = self.graphs.pools.lock();
        let p = self.entry(&mut pools, pool);
        p.refs += 1;
        p.threads.push(this_thread());
        let key = p.key;
        // Under the registry's lock, as every change of routes: every shard sees them in the
        // same order.
        self.route_to(key, Some(Route::Thread(this_thread())))
    }

    /// Stop routing this thread's allocations to `pool` (the route its last
    /// [`Allocator::begin_thread_pool`] of that pool made). The reference that began it stays
    /// until [`Allocator::release_graph_pool`].
    pub fn end_thread_pool(&self, pool: GraphPool) -> Result<()> {
        let me = this_thread();
        let mut pools = self.graphs.pools.lock();
        let p = pools
            .iter_mut()
            .find(|p| p.id == pool)
            .ok_or(Error::UnknownGraphPool(pool))?;
        let i = p
            .threads
            .iter()
            .rposition(|&t| t == me)
            .ok_or(Error::UnknownGraphPool(pool))?;
        p.threads.remove(i);
        let key = p.key;
        self.unroute(key, Route::Thread(me))
    }

    /// A block of a pool was handed out for `a.stream`: outside a capture, mark it used by
    /// that stream, so that once freed it waits for the stream before any other allocation
    /// reuses it. (A capture's blocks are reused inside the graph, in its order; an event
    /// recorded on a capturing stream would become part of the graph.)
    #[cold]
    pub(super) fn pool_block_in_use(&self, sh: &mut Shard, a: &Allocation) {
        if !self.core.driver.is_capturing(a.stream) {
            let marked = sh.record_stream(a.ptr, a.stream);
            debug_assert!(marked.is_ok(), "the block was just handed out");
        }
    }
}
