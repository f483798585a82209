//! Where a capture's allocations go: each shard's copy of the routes from running captures (and
//! from threads, PyTorch's `use_mem_pool`) to graph pools, and the allocator-wide registry of
//! pools (`graphs.rs` and `mempools.rs` act on both).
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
//! - Routing costs the cached path one length check while nothing is routed; while a capture
//!   is, every allocation asks the driver which capture its stream is in, as PyTorch's
//!   allocator does during a capture. The route registered last that matches wins, so pools
//!   used one inside another serve the inner one.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};

use parking_lot::Mutex;

use super::owner::{Owner, PoolKey};
use crate::driver::external::Source;
use crate::driver::{Capture, Driver, GraphPool, StreamId};

/// What is routed to a pool: a running capture (by the driver's capture id), or every
/// allocation a thread makes ([`this_thread`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Route {
    Capture(u64),
    Thread(u64),
}

/// What one shard knows of graph pools.
#[derive(Default, Debug)]
pub(crate) struct GraphRoutes {
    /// Each capture or thread routed to a pool, in the order they were routed.
    pub(crate) routes: Vec<(Route, PoolKey)>,
    /// Keys of the pools that graphs still reference.
    pub(crate) held: Vec<PoolKey>,
    /// The held pools whose segments come from an allocator of their own.
    pub(crate) sources: Vec<(PoolKey, Source)>,
    /// The held pools whose free blocks serve an allocation that would otherwise fail
    /// (PyTorch's `use_on_oom`), oldest first.
    pub(crate) on_oom: Vec<PoolKey>,
    /// The held pools whose blocks are never split (PyTorch's `no_split`).
    pub(crate) unsplit: Vec<PoolKey>,
}

impl GraphRoutes {
    /// Whose memory serves an allocation on `stream` by this thread: the pool its capture or
    /// this thread is routed to, or the stream's own.
    #[inline]
    pub(crate) fn owner<D: Driver>(&self, driver: &D, stream: StreamId) -> Owner {
        if self.routes.is_empty() {
            return Owner::of_stream(stream);
        }
        self.route(driver, stream)
    }

    #[cold]
    fn route<D: Driver>(&self, driver: &D, stream: StreamId) -> Owner {
        // Asked of the driver at most once, and only when a capture is routed.
        let mut capture = None;
        let mut in_capture = |c: u64| {
            *capture.get_or_insert_with(|| match driver.capture(stream) {
                Capture::Active(id) => Some(id),
                Capture::None | Capture::Unknown => None,
            }) == Some(c)
        };
        self.routes
            .iter()
            .rev()
            .find(|&&(r, _)| match r {
                Route::Thread(t) => t == this_thread(),
                Route::Capture(c) => in_capture(c),
            })
            .map_or(Owner::of_stream(stream), |&(_, key)| Owner::of_pool(key))
    }

    /// Whether a capture is routed to a pool now, anywhere (every shard holds every route):
    /// moves between shards synchronise the device, which would spoil it.
    #[inline]
    pub(crate) fn capturing(&self) -> bool {
        self.routes
            .iter()
            .any(|(r, _)| matches!(r, Route::Capture(_)))
    }

    /// The allocator of `owner`'s pool, when it has one of its own.
    pub(crate) fn source(&self, owner: Owner) -> Option<&Source> {
        let key = owner.pool()?;
        self.sources.iter().find(|(k, _)| *k == key).map(|(_, s)| s)
    }

    /// Whether `owner` is (a region of) a pool whose blocks are never split: each allocation
    /// takes a whole block, and a block a whole segment of its own.
    pub(crate) fn unsplit(&self, owner: Owner) -> bool {
        owner.pool().is_some_and(|key| self.unsplit.contains(&key))
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
    /// The threads routed to the pool now ([`this_thread`]; one entry per `use_mem_pool` in
    /// progress).
    pub(crate) threads: Vec<u64>,
    /// How the pool was made.
    pub(crate) options: PoolOptions,
}

/// How a pool is made (PyTorch's `MemPool(allocator, use_on_oom, no_split)`); a graph's pool
/// has the defaults.
#[derive(Clone, Debug, Default)]
pub struct PoolOptions {
    /// Where the pool's segments come from: an allocator of its own, or (None) the driver, as
    /// the allocator's mode says.
    pub source: Option<Source>,
    /// Whether the pool's free blocks may serve an allocation that nothing else can.
    pub use_on_oom: bool,
    /// Whether the pool's blocks are never split: an allocation takes a whole free block, or a
    /// new segment of its own (sized as PyTorch sizes segments), in every mode. Its segments
    /// are plain ones (`cuMemAlloc`, or the pool's own allocator) whatever the mode, so they
    /// stay awake while their tag sleeps, as a pool's own allocator's do.
    pub no_split: bool,
}

impl PoolEntry {
    /// Whether nothing holds the pool any more: no graph or pool object references it, and no
    /// capture or thread is routed to it.
    pub(crate) fn unreferenced(&self) -> bool {
        self.refs == 0 && self.captures.is_empty() && self.threads.is_empty()
    }
}

static NEXT_THREAD: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// This thread's name in thread routes: dealt out once per thread, never twice, so a route
    /// a thread left behind when it ended matches no other thread.
    static THREAD: u64 = NEXT_THREAD.fetch_add(1, Relaxed);
}

/// This thread's name in [`Route::Thread`].
pub(crate) fn this_thread() -> u64 {
    THREAD.with(|t| *t)
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
