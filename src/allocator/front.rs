//! The allocator for one device: its entry points (allocate, free, `record_stream`,
//! `empty_cache`, figures), which shard's lock a call takes, when pending events are polled,
//! and what happens when a shard cannot grow (release every shard's cache, unless the calling
//! stream is capturing a graph; retry once; then report out of memory with the whole
//! breakdown). Graph pools (`graphs.rs`) and sleep (`sleep.rs`) add their entry points to the
//! same type; what a shard does with its blocks lives in `shard/`, how it grows in `growth/`.
//!
//! Invariants kept across the allocator (see `shard/mod.rs` for the per-shard ones):
//! - A stream's blocks live in exactly one shard (dealt by the stream table, `streams.rs`),
//!   so a cached allocation or free takes one lock and never allocates on the heap.
//! - Cross-shard work (releasing the cache, dumps, statistics) takes shard locks one at a
//!   time, in index order, never while holding another, so it cannot deadlock with allocation;
//!   the one exception, moves between shards (`growth/moves.rs`), only tries the other locks.
//! - Code holding a shard lock never takes the graph-pool registry's lock (the registry's
//!   holders take shard locks).
//! - A shard whose operation panicked is poisoned: every later call that needs it gets
//!   [`Error::Poisoned`], never its half-updated state.

use std::sync::atomic::Ordering::Relaxed;

use crossbeam::utils::CachePadded;

use super::config::{Config, Limit, SegmentMode};
use super::core::{Allocation, Core, GrowError, Profiled, NONE};
use super::dump::{PoolStats, StateDump};
use super::growth::{At, Grown, Growth, Request, SyncFirst};
use super::history::{Action, HistoryEntry};
use super::host::SleepState;
use super::kvregion::KvRegion;
use super::owner::Owner;
use super::places::Place;
use super::routes::GraphRegistry;
use super::rules;
use super::shard::{Shard, Shards, Taken};
use super::spin::{SpinGuard, SpinLock};
use super::streams::{StreamTable, SHARDS};
use crate::driver::counting::DriverCalls;
use crate::driver::{DevicePtr, Driver, StreamId};
use crate::error::{Error, OomCause, OomReport, Result};
use crate::ledger::{Ledger, PerTag, Snapshot};
use crate::tag::Tag;

#[cold]
fn poisoned(shard: usize) -> Error {
    Error::Poisoned { shard }
}

/// A caching allocator for one device.
pub struct Allocator<D: Driver> {
    pub(super) core: Core<D>,
    pub(super) growth: Growth,
    streams: StreamTable,
    pub(super) shards: Box<Shards>,
    pub(super) graphs: GraphRegistry,
    pub(super) sleep: parking_lot::Mutex<SleepState>,
    /// The KV cache in reserved address space, once reserved (`kv.rs`).
    pub(super) kv: parking_lot::Mutex<Option<KvRegion>>,
}

impl<D: Driver> Allocator<D> {
    /// An allocator over `driver`. Asks the driver once for the device's total memory (for a
    /// fractional limit and the virtual reservations).
    pub fn new(driver: D, config: Config) -> Result<Self> {
        let core = Core::new(driver, &config, Ledger::new(SHARDS))?;
        let a = Allocator {
            growth: Growth::new(&config, core.granularity, core.max_split),
            core,
            streams: StreamTable::default(),
            shards: (0..SHARDS)
                .map(|id| CachePadded::new(SpinLock::new(Shard::new(id))))
                .collect(),
            graphs: GraphRegistry::default(),
            sleep: Default::default(),
            kv: Default::default(),
        };
        a.set_limit(config.limit)?;
        Ok(a)
    }

    /// The driver the allocator was built on.
    pub fn driver(&self) -> &D {
        self.core.driver.inner()
    }

    pub fn ledger(&self) -> &Ledger {
        &self.core.ledger
    }

    /// Every driver call the allocator has made, by name.
    pub fn driver_calls(&self) -> DriverCalls {
        self.core.driver.calls()
    }

    /// Every counter, now.
    pub fn snapshot(&self) -> Snapshot {
        self.core
            .ledger
            .snapshot(self.driver_calls(), self.core.driver.time())
    }

    pub fn mode(&self) -> SegmentMode {
        self.growth.mode()
    }

    /// The device's total memory, as the driver reported it at creation.
    pub fn device_total(&self) -> u64 {
        self.core.device_total
    }

    /// Set or clear the limit on reserved bytes. A limit below what is held now is allowed:
    /// growth fails (after releasing the cache) until enough is freed. `u64::MAX` bytes is no
    /// limit ([`Allocator::limit`] then says `None`): nothing can reserve that much.
    pub fn set_limit(&self, limit: Option<Limit>) -> Result<()> {
        let bytes = match limit {
            None => NONE,
            Some(Limit::Bytes(b)) => b,
            // Rounded, not truncated: a fraction computed as bytes / total comes back as those
            // bytes, where truncating the product can lose one. 0 is PyTorch's too: no memory.
            Some(Limit::Fraction(f)) if (0.0..=1.0).contains(&f) => {
                (self.core.device_total as f64 * f).round() as u64
            }
            Some(Limit::Fraction(f)) => {
                return Err(Error::InvalidLimit(format!(
                    "fraction {f} is not in [0, 1]"
                )))
            }
        };
        self.core.limit.store(bytes, Relaxed);
        Ok(())
    }

    /// The limit in bytes, if any.
    pub fn limit(&self) -> Option<u64> {
        Some(self.core.limit.load(Relaxed)).filter(|&l| l != NONE)
    }

    /// Hold this process to `cap` bytes of device memory in all, or lift the cap: the budget
    /// contract. Before every growth the allocator re-reads this process's usage (so memory
    /// that appears outside it later counts), and growth that would pass the cap fails like
    /// any other out-of-memory: the cache is released and the request retried once, then
    /// [`Error::OutOfMemory`] says the cap was the limit. Profiling sets it to the requested
    /// memory unless told not to. When the driver cannot see this process's usage, growth
    /// assumes the memory outside the allocator that profiling measured (0 if it never ran):
    /// without per-process figures, nothing outside can be measured again. A cap of `u64::MAX`
    /// is no cap ([`Allocator::cap`] then says `None`).
    pub fn set_cap(&self, cap: Option<u64>) {
        let floor = match cap {
            Some(_) => self.core.outside_now(),
            None => 0,
        };
        self.arm_cap(cap, floor);
    }

    /// [`Allocator::set_cap`], with the memory outside the allocator to assume while the
    /// driver cannot report this process's usage.
    pub(crate) fn arm_cap(&self, cap: Option<u64>, outside_floor: u64) {
        self.core.outside_floor.store(outside_floor, Relaxed);
        self.core.cap.store(cap.unwrap_or(NONE), Relaxed);
        match cap {
            Some(c) => tracing::info!(
                cap = c,
                "budget contract set: this process may use {}",
                crate::units::Bytes(c)
            ),
            None => tracing::info!("budget contract lifted"),
        }
    }

    /// Keep what profiling measured, for sizing the KV cache against the cap later.
    pub(crate) fn note_profile(&self, p: Profiled) {
        let m = &self.core.measured;
        m.eager_peak.store(p.eager_peak, Relaxed);
        m.held.store(p.held, Relaxed);
        m.kept.store(p.kept, Relaxed);
        m.margin.store(p.margin, Relaxed);
    }

    /// The budget contract in bytes, if one is set.
    pub fn cap(&self) -> Option<u64> {
        Some(self.core.cap.load(Relaxed)).filter(|&c| c != NONE)
    }

    /// The shard that serves `stream` (assigned on first use). Peaks are kept per shard and
    /// summed (see [`crate::ledger`]), so this tells which streams' peaks add up exactly.
    pub fn shard_of(&self, stream: StreamId) -> usize {
        self.streams.shard(stream)
    }

    #[inline]
    pub(super) fn lock(&self, shard: usize) -> Result<SpinGuard<'_, Shard>> {
        match self.shards[shard].lock() {
            Ok(sh) => Ok(sh),
            Err(_) => Err(poisoned(shard)),
        }
    }

    /// Allocate `size` bytes for use on `stream`, tagged with this thread's current tag.
    #[inline]
    pub fn allocate(&self, size: u64, stream: StreamId) -> Result<Allocation> {
        self.allocate_tagged(size, stream, Tag::current())
    }

    /// Allocate `size` bytes for use on `stream` with an explicit tag.
    ///
    /// A zero-byte request returns an [`Allocation`] whose pointer is 0 and counts nothing;
    /// freeing pointer 0 does nothing (PyTorch's allocator behaves the same way). Requests of
    /// 2^60 bytes or more are refused with [`Error::SizeTooLarge`]. When neither the cache nor
    /// the driver can serve the request, every shard's cache is released and the request is
    /// retried once before [`Error::OutOfMemory`] is returned.
    #[inline]
    pub fn allocate_tagged(&self, size: u64, stream: StreamId, tag: Tag) -> Result<Allocation> {
        if size == 0 {
            return Ok(Allocation {
                ptr: 0,
                size: 0,
                requested: 0,
                stream,
                tag,
            });
        }
        if size >= rules::ABSURD_SIZE {
            return Err(Error::SizeTooLarge(size));
        }
        let rounded = self.growth.round(size);
        let i = self.streams.shard(stream);
        // What growth lacked, when it lacked memory (worth releasing the cache and retrying).
        let mut short = None;
        let served = self.shards[i].with(|sh| -> Result<Option<Allocation>> {
            // Completed events are polled here, except while the stream captures a graph
            // (querying an event would invalidate the capture).
            if !sh.pending.is_empty() && !self.core.driver.is_capturing(stream) {
                sh.process_pending(&self.core, false)?;
            }
            let owner = self.owner(sh, stream, tag);
            let taken = match sh.try_alloc(&self.core, owner, rounded, size, tag) {
                Some(t) => t,
                None => match self.grow_and_take(sh, owner, stream, rounded, size, tag)? {
                    Ok(t) => t,
                    Err(cause) => {
                        short = Some(cause);
                        return Ok(None);
                    }
                },
            };
            Ok(Some(self.hand_out(
                sh,
                owner,
                taken.allocation(size, stream, tag),
            )))
        });
        match served {
            Ok(Ok(Some(a))) => Ok(a),
            Ok(Ok(None)) => {
                let cause = short.expect("growth said what it lacked");
                self.retry_after_release(stream, rounded, size, tag, cause)
            }
            Ok(Err(e)) => Err(e),
            Err(_) => Err(poisoned(i)),
        }
    }

    /// Whose memory serves `tag` on `stream`: the stream's own, or the graph pool its capture
    /// is routed to (their region of the tag when tags are kept apart).
    #[inline]
    fn owner(&self, sh: &Shard, stream: StreamId, tag: Tag) -> Owner {
        self.core
            .region(sh.graphs.owner(&self.core.driver, stream), tag)
    }

    /// Serve a request the cache could not serve from new memory for `owner` (the calling
    /// stream's, or the graph pool its capture is routed to). `Ok(Err(cause))` when the memory
    /// is not there (worth releasing the cache and retrying).
    /// Out of line: the cached path above stays small.
    #[inline(never)]
    fn grow_and_take(
        &self,
        sh: &mut Shard,
        owner: Owner,
        stream: StreamId,
        rounded: u64,
        size: u64,
        tag: Tag,
    ) -> Result<std::result::Result<Taken, OomCause>> {
        if sh.sleeps(owner) {
            return Err(Error::Asleep(tag));
        }
        let grown = match sh.graphs.source(owner).cloned() {
            Some(source) => sh.grow_external(&self.core, owner, stream, rounded, &source),
            // A mode's growth may hand back part of a larger free block, which would be split.
            None if sh.graphs.unsplit(owner) => sh.grow_plain(&self.core, owner, stream, rounded),
            None => self.grow(sh, owner, stream, rounded),
        };
        match grown {
            Ok(id) => Ok(Ok(sh.take(&self.core, id, rounded, size, tag))),
            Err(GrowError::Memory(cause)) => Ok(Err(cause)),
            Err(GrowError::Driver(e)) => Err(e.into()),
        }
    }

    /// The mode's growth for `owner`.
    fn grow(&self, sh: &mut Shard, owner: Owner, stream: StreamId, rounded: u64) -> Grown {
        let at = At {
            core: &self.core,
            shards: &self.shards,
        };
        self.growth.grow(
            at,
            sh,
            Request {
                owner,
                stream,
                rounded,
            },
        )
    }

    /// The slow end of an allocation: release every shard's cache, try once more, and report
    /// out of memory with the cause of the last attempt (the one made with the cache
    /// released, which is what the caller can act on).
    #[cold]
    fn retry_after_release(
        &self,
        stream: StreamId,
        rounded: u64,
        size: u64,
        tag: Tag,
        first: OomCause,
    ) -> Result<Allocation> {
        self.core.ledger.retries.fetch_add(1, Relaxed);
        tracing::debug!(size, cause = %first, "allocation missed the cache and the driver; releasing the cache and retrying");
        // Releasing the cache waits for events and unmaps: not while this stream captures a
        // graph (that would spoil the capture). The retry then sees what the others freed.
        if !self.core.driver.is_capturing(stream) {
            if let Err(e) = self.empty_cache() {
                tracing::warn!(error = %e, "releasing the cache before a retry failed");
            }
        }
        let mut sh = self.lock(self.streams.shard(stream))?;
        let owner = self.owner(&sh, stream, tag);
        let served = match sh.try_alloc(&self.core, owner, rounded, size, tag) {
            Some(t) => Ok(t),
            None => match self.grow_and_take(&mut sh, owner, stream, rounded, size, tag) {
                Ok(served) => served,
                Err(e) => {
                    drop(sh);
                    self.give_back_after_failure(stream);
                    return Err(e);
                }
            },
        };
        let cause = match served {
            Ok(t) => return Ok(self.hand_out(&mut sh, owner, t.allocation(size, stream, tag))),
            Err(cause) => cause,
        };
        if let Some((pool, t)) = self.take_from_pools_on_oom(&mut sh, stream, rounded, size, tag) {
            return Ok(self.hand_out(&mut sh, pool, t.allocation(size, stream, tag)));
        }
        drop(sh);
        self.give_back_after_failure(stream);
        self.core.ledger.ooms.fetch_add(1, Relaxed);
        // Returned, not logged: the caller has the report (the C boundary logs what it does not
        // hand over itself).
        let report = self.oom_report(size, rounded, cause);
        Err(Error::OutOfMemory(Box::new(report)))
    }

    /// Growth that failed part-way keeps what it mapped before the failure (`mapped.rs`), and
    /// the retry mapped afresh what the release gave back: free blocks now, which would leave
    /// this process holding memory it could not use, where other processes on the device need
    /// it (PyTorch's expandable segments undo a failed map too). Given back, so that a failed
    /// request leaves the process holding what it held before, and the report reads what is
    /// left. Not while `stream` captures a graph (a release would spoil the capture).
    fn give_back_after_failure(&self, stream: StreamId) {
        if !self.core.driver.is_capturing(stream) {
            if let Err(e) = self.empty_cache() {
                tracing::warn!(error = %e, "giving back what a failed allocation mapped failed; it stays cached");
            }
        }
    }

    pub(super) fn oom_report(&self, requested: u64, rounded: u64, cause: OomCause) -> OomReport {
        let info = self.core.driver.mem_info().unwrap_or_default();
        let usage = self.core.driver.process_usage().ok().flatten();
        let snap = self.snapshot();
        let reserved = snap.reserved_bytes.current;
        let needed = self.growth.needed(rounded, self.core.granularity);
        let per_tag = PerTag(snap.per_tag.0.map(|t| t.allocated_bytes.current));
        // An asleep tag's allocations hold no device memory: the figures set beside this
        // process's usage are the awake tags'.
        let allocated = Tag::ALL
            .iter()
            .filter(|&&t| snap.sleeping_bytes[t] == 0)
            .map(|&t| per_tag[t])
            .sum::<u64>();
        OomReport {
            requested,
            needed,
            device_total: info.total,
            device_free: info.free,
            process_usage: usage,
            allocated,
            reserved,
            cached: reserved.saturating_sub(allocated),
            non_allocator: usage.map(|u| u.saturating_sub(reserved)),
            per_tag,
            asleep: snap.sleeping_bytes,
            limit: self.limit(),
            cap: self.cap(),
            mode: self.mode().name(),
            cause,
        }
    }

    /// The allocation, recorded in the history when that is on.
    #[inline]
    fn hand_out(&self, sh: &mut Shard, owner: Owner, a: Allocation) -> Allocation {
        if sh.recording {
            self.record_alloc(&a);
        }
        if owner.is_pool() {
            self.pool_block_in_use(sh, &a);
        }
        a
    }

    #[cold]
    fn record_alloc(&self, a: &Allocation) {
        // The size asked for, as PyTorch's traces record it (the rounding is the allocator's).
        self.core
            .history
            .record(Action::Alloc, a.ptr, a.requested, a.stream, a.tag);
    }

    /// Start recording the allocation history (clearing what was recorded before), keeping the
    /// newest `max_entries` entries, or stop recording (what was recorded stays readable).
    /// While it is off, the cached path costs what it costs without it.
    pub fn record_history(&self, enabled: bool, max_entries: usize) -> Result<()> {
        self.core.history.set(enabled, max_entries);
        let mut first = None;
        for i in 0..self.shards.len() {
            match self.lock(i) {
                Ok(mut sh) => sh.recording = enabled,
                Err(e) => {
                    first.get_or_insert(e);
                }
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// The recorded history, oldest first, and how many older entries the bound dropped.
    pub fn history(&self) -> (Vec<HistoryEntry>, u64) {
        self.core.history.entries()
    }

    /// Attach `metadata` to the history's entries from now on (None or "": none), as PyTorch's
    /// `_set_memory_metadata` does; the snapshot shows it as their `user_metadata`.
    pub fn set_history_metadata(&self, metadata: Option<&str>) {
        self.core.history.set_metadata(metadata);
    }

    /// The history metadata in force, if any.
    pub fn history_metadata(&self) -> Option<String> {
        self.core.history.metadata()
    }

    /// The metadata strings entries name (`HistoryEntry::metadata` − 1).
    pub fn history_metadata_table(&self) -> Vec<String> {
        self.core.history.metadata_table()
    }

    /// The host's context of each live allocation made with one while recording
    /// ([`crate::allocator::history::with_context`]), by address.
    pub fn live_contexts(&self) -> std::collections::HashMap<u64, u64> {
        self.core.history.live_contexts()
    }

    /// Free an allocation. The address tables name the shard that holds the pointer (a few
    /// loads); only where they cannot (segments of two shards in one granule) are the shards
    /// searched in turn. [`Allocator::free_on`] takes the stream's shard directly. Pointer 0 is
    /// a no-op.
    pub fn free(&self, ptr: DevicePtr) -> Result<()> {
        if ptr == 0 {
            return Ok(());
        }
        self.in_owning_shard(ptr, |sh| sh.free(&self.core, ptr))
    }

    /// Run `op` on the shard that holds `ptr`: the one the address table names, or else each
    /// in turn until one knows it. `op` must change nothing and return `UnknownPointer` when
    /// its shard does not hold the pointer. A poisoned shard is passed over in the search: if
    /// the pointer is nowhere else, the error says which shard was poisoned.
    fn in_owning_shard(
        &self,
        ptr: DevicePtr,
        mut op: impl FnMut(&mut Shard) -> Result<()>,
    ) -> Result<()> {
        match self.core.places.find(ptr) {
            Place::Shard(i) => return op(&mut *self.lock(i)?),
            Place::Nowhere => return Err(Error::UnknownPointer(ptr)),
            Place::Search => {}
        }
        let mut poisoned = None;
        for i in 0..self.shards.len() {
            let r = match self.lock(i) {
                Ok(mut sh) => op(&mut sh),
                Err(e) => {
                    poisoned.get_or_insert(e);
                    continue;
                }
            };
            match r {
                Err(Error::UnknownPointer(_)) => continue,
                done => return done,
            }
        }
        Err(poisoned.unwrap_or(Error::UnknownPointer(ptr)))
    }

    /// Free an allocation made on `stream`: one lock, that stream's shard. A pointer that
    /// shard does not hold is then looked up as [`Allocator::free`] does, so a wrong stream
    /// costs a second lookup, not an error. Pointer 0 is a no-op.
    #[inline]
    pub fn free_on(&self, ptr: DevicePtr, stream: StreamId) -> Result<()> {
        if ptr == 0 {
            return Ok(());
        }
        // An unknown pointer changes nothing in the shard, so trying it there first is safe.
        // The lock must be given back before the fallback locks every shard, this one included.
        let i = self.streams.shard(stream);
        let mut failed = None;
        let here = self.shards[i].with(|sh| match sh.free(&self.core, ptr) {
            Ok(()) => true,
            Err(Error::UnknownPointer(_)) => false,
            Err(e) => {
                failed = Some(e);
                true
            }
        });
        match here {
            Ok(true) => failed.map_or(Ok(()), Err),
            Ok(false) => self.free(ptr),
            Err(_) => Err(poisoned(i)),
        }
    }

    /// Record that `stream` uses the allocation at `ptr`: when it is freed, its memory is not
    /// reused until the work queued on `stream` by then has completed. Pointer 0 (a zero-byte
    /// allocation, which has no memory) is a no-op, as in PyTorch.
    pub fn record_stream(&self, ptr: DevicePtr, stream: StreamId) -> Result<()> {
        if ptr == 0 {
            return Ok(());
        }
        self.in_owning_shard(ptr, |sh| sh.record_stream(ptr, stream))
    }

    /// Give every cached byte back to the driver (waiting first for the streams that still use
    /// freed blocks). Every shard is attempted; the first error is returned and what could not
    /// be released stays cached and accounted.
    pub fn empty_cache(&self) -> Result<()> {
        self.release_all(SyncFirst::Owner)
    }

    pub(super) fn release_all(&self, sync: SyncFirst) -> Result<()> {
        self.core
            .stranded
            .retry(&self.core.driver, &self.core.ledger);
        let mut first = None;
        for i in 0..self.shards.len() {
            if let Err(e) = self
                .lock(i)
                .and_then(|mut sh| sh.release_cached(&self.core, sync))
            {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Live allocations, over all streams (poisoned shards are not counted).
    pub fn live_allocations(&self) -> usize {
        (0..self.shards.len())
            .filter_map(|i| self.lock(i).ok().map(|sh| sh.live_count()))
            .sum()
    }

    /// Per-pool figures (small, large) now, as `memory_stats` reports them. Walks every
    /// block, one shard at a time; not for the hot path.
    pub fn pool_stats(&self) -> [PoolStats; 2] {
        let mut pools = [PoolStats::default(); 2];
        for i in 0..self.shards.len() {
            if let Ok(sh) = self.lock(i) {
                sh.pool_stats(&mut pools);
            }
        }
        pools
    }

    /// A copy of the allocator's whole state, for the invariant checker.
    pub fn dump(&self) -> StateDump {
        let mut dump = StateDump::default();
        // Read before any shard is locked: the pools' lock is never taken under a shard's.
        let mut pools: Vec<_> = self
            .graphs
            .pools
            .lock()
            .iter()
            .map(|p| (p.key, p.id))
            .collect();
        pools.extend(self.graphs.retired.lock().iter().copied());
        for i in 0..self.shards.len() {
            let sh = match self.lock(i) {
                Ok(sh) => sh,
                Err(e) => {
                    dump.problems.push(e.to_string());
                    continue;
                }
            };
            if sh.id != i {
                dump.problems
                    .push(format!("shard {i} writes the counters of shard {}", sh.id));
            }
            sh.self_check(&mut dump.problems);
            sh.dump_into(&mut dump);
        }
        for seg in &mut dump.segments {
            seg.graph_pool = seg.pool_key.map(|key| {
                pools
                    .iter()
                    .find(|(k, _)| *k == key)
                    .map_or((0, 0), |(_, id)| (id.0, id.1))
            });
        }
        if let Some(r) = self.kv.lock().as_ref() {
            dump.segments.push(r.dump());
        }
        dump.ledger = self.snapshot();
        dump.committed = self.core.committed();
        dump
    }
}

impl<D: Driver> Drop for Allocator<D> {
    /// Cached device memory, the copy stream and the host memory kept for the next sleep go
    /// with the allocator: one dropped in the middle of a process (an engine restarted, a test)
    /// must not hold them for the rest of it. What stays held is warned about: live
    /// allocations (their pointers may still be in use, and nothing can free them any more),
    /// graph pools a graph may still replay into, asleep tags' memory, a poisoned shard's.
    ///
    /// A copy of a sleep or wake left queued by a failed synchronisation is waited for first;
    /// if that fails, nothing is freed. Then the whole device is synchronised once, not each
    /// segment's stream (streams the allocator saw may have been destroyed by now); if that
    /// fails, the device memory is kept. No device memory is released while the thread
    /// unwinds from a panic (a second panic there would abort the process).
    fn drop(&mut self) {
        if !self.sleep.get_mut().settle(&self.core.driver) {
            return;
        }
        if !std::thread::panicking() {
            self.release_at_drop();
        }
        self.sleep.get_mut().release(&self.core.driver);
    }
}

impl<D: Driver> Allocator<D> {
    fn release_at_drop(&self) {
        if let Err(e) = self.core.driver.sync_device() {
            tracing::error!(error = %e, "could not synchronise the device when the allocator was dropped; its device memory is kept");
            return;
        }
        if let Some(r) = self.kv.lock().as_mut() {
            if let Err(e) = r.release(&self.core) {
                tracing::error!(error = %e, "could not give the KV cache back when the allocator was dropped");
            }
        }
        if let Err(e) = self.release_all(SyncFirst::Done) {
            tracing::error!(error = %e, "could not give the cache back when the allocator was dropped");
        }
        let lost = self.core.ledger.lost.load(Relaxed);
        if lost > 0 {
            tracing::warn!(
                lost,
                "allocator dropped with mappings whose undo kept failing: their memory stays held for the rest of the process"
            );
        }
        let reserved = self.core.ledger.reserved();
        if reserved > 0 {
            let live = self.live_allocations();
            tracing::warn!(
                reserved,
                live,
                "allocator dropped holding memory (live allocations, graph pools, asleep tags or a poisoned shard): it stays held for the rest of the process"
            );
        }
    }
}
