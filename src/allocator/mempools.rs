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
use super::graphs::known;
use super::owner::Owner;
use super::routes::{this_thread, PoolOptions, Route};
use super::shard::{Shard, Taken};
use crate::driver::{Driver, GraphPool, StreamId};
use crate::error::{Error, Result};
use crate::tag::Tag;

impl<D: Driver> Allocator<D> {
    /// Count one reference to `pool`, making it with `options` if it is new (a pool object was
    /// made, PyTorch's `createOrIncrefPool`). The pool keeps its memory until the last
    /// reference is dropped ([`Allocator::release_graph_pool`]). A pool that exists keeps how
    /// it was made: asking for another allocator of its own, or the other `no_split`, is an
    /// error that changes nothing.
    pub fn hold_pool(&self, pool: GraphPool, options: PoolOptions) -> Result<()> {
        let mut pools = self.graphs.pools.lock();
        let asked = options.source.clone();
        let no_split = options.no_split;
        let (p, made) = self.entry_made(&mut pools, pool, Some(options));
        if !made {
            if p.options.no_split != no_split {
                return Err(Error::InvalidArgument(format!(
                    "pool {pool:?} exists with no_split={}; it cannot be held with no_split={no_split}",
                    p.options.no_split
                )));
            }
            if let Some(asked) = &asked {
                let same = p
                    .options
                    .source
                    .as_ref()
                    .is_some_and(|s| s.key() == asked.key());
                if !same {
                    return Err(Error::InvalidArgument(format!(
                        "pool {pool:?} exists with {}; it cannot take another allocator",
                        p.options
                            .source
                            .as_ref()
                            .map_or("the library's memory".to_owned(), |s| format!("{s:?}"))
                    )));
                }
            }
        }
        p.refs += 1;
        self.route_to(p, None)
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
        // Under the registry's lock, as every change of routes: every shard sees them in the
        // same order.
        self.route_to(p, Some(Route::Thread(this_thread())))
    }

    /// Stop routing this thread's allocations to `pool` (the route its last
    /// [`Allocator::begin_thread_pool`] of that pool made). The reference that began it stays
    /// until [`Allocator::release_graph_pool`]; when every reference went while the route ran,
    /// the pool's free memory goes back now (unless a capture runs: then when it ends).
    pub fn end_thread_pool(&self, pool: GraphPool) -> Result<()> {
        let me = this_thread();
        let mut pools = self.graphs.pools.lock();
        let p = known(&mut pools, pool)?;
        let i = p
            .threads
            .iter()
            .rposition(|&t| t == me)
            .ok_or(Error::UnknownGraphPool(pool))?;
        p.threads.remove(i);
        let key = p.key;
        // The last references may have gone while the route ran: then the pool goes now.
        let gone = p.unreferenced() && pools.iter().all(|p| p.captures.is_empty());
        self.unroute(key, Route::Thread(me))?;
        drop(pools);
        if gone {
            self.retire_unreferenced()?;
        }
        Ok(())
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

    /// A free block of a `use_on_oom` pool for a request nothing else could serve (the cache
    /// released, the driver out of memory): the oldest such pool first, as PyTorch does. The
    /// pools' memory is only reused, never grown, for it; the block stays the pool's.
    pub(super) fn take_from_pools_on_oom(
        &self,
        sh: &mut Shard,
        stream: StreamId,
        rounded: u64,
        size: u64,
        tag: Tag,
    ) -> Option<(Owner, Taken)> {
        // A capture must not take a block whose pool no graph of it holds.
        if self.core.driver.is_capturing(stream) {
            return None;
        }
        let keys = sh.graphs.on_oom.clone();
        keys.into_iter().find_map(|key| {
            let owner = self.core.region(Owner::of_pool(key), tag);
            if sh.sleeps(owner) {
                return None;
            }
            sh.try_alloc(&self.core, owner, rounded, size, tag)
                .map(|t| (owner, t))
        })
    }
}
