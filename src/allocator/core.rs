//! What every shard shares: the (counted) driver, the ledger, the settings every policy
//! reads, and the commitment of bytes against the limit; the value an allocation hands out,
//! and why growing failed.
//!
//! Invariant: `committed` ≥ reserved bytes at every instant, and equals it at quiescence:
//! growth first commits against the limit and the cap, then calls the driver, then uncommits
//! what it did not get; giving memory back uncommits it after the driver call succeeded.
//!
//! The cap is the budget contract: what this process as a whole may use on the device (the
//! allocator's bytes plus memory outside it: context, libraries, graphs, NCCL). Growth re-reads
//! the process's usage from the driver before it commits, so memory that appeared outside the
//! allocator since profiling counts. Only growth pays for that read (a driver call on a path
//! that is about to make one); the cached path never sees the cap.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use super::config::Config;
use super::history::History;
use super::owner::Owner;
use super::places::Places;
use super::planted::{self, Bug};
use super::stranded::Stranded;
use crate::driver::counting::Counting;
use crate::driver::{DevicePtr, Driver, DriverError, DriverResult, StreamId};
use crate::error::OomCause;
use crate::ledger::Ledger;
use crate::tag::Tag;

/// One live allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Allocation {
    /// Device address; 0 for a zero-byte request.
    pub ptr: DevicePtr,
    /// Bytes reserved for it (the rounded size, plus any unsplit tail).
    pub size: u64,
    /// Bytes asked for.
    pub requested: u64,
    pub stream: StreamId,
    pub tag: Tag,
}

/// Why growing failed: memory (worth releasing the cache and retrying) or anything else.
#[derive(Debug)]
pub(crate) enum GrowError {
    Memory(OomCause),
    Driver(DriverError),
}

impl From<DriverError> for GrowError {
    fn from(e: DriverError) -> Self {
        if e.is_out_of_memory() {
            GrowError::Memory(OomCause::Device(e))
        } else {
            GrowError::Driver(e)
        }
    }
}

pub(crate) struct Core<D> {
    pub(crate) driver: Counting<D>,
    pub(crate) ledger: Ledger,
    pub(crate) max_split: u64,
    pub(crate) granularity: u64,
    pub(crate) device_total: u64,
    pub(crate) limit: AtomicU64,
    /// The budget contract in bytes for the whole process; `NONE` when not set.
    pub(crate) cap: AtomicU64,
    /// Memory outside the allocator assumed when the driver cannot report this process's usage.
    pub(crate) outside_floor: AtomicU64,
    /// Bytes a wake has mapped (and committed) that are not yet counted as reserved: the
    /// driver reports them in this process's usage while the tag's contents are put back, and
    /// they are not memory outside the allocator.
    pub(crate) waking: AtomicU64,
    /// What profiling measured, for sizing the KV cache against the cap later
    /// ([`super::Allocator::commit_kv`]).
    pub(crate) measured: Measured,
    /// Mappings whose undo failed, their memory counted as lost until an undo succeeds.
    pub(crate) stranded: Stranded,
    /// The allocation history, when recording (`history.rs`).
    pub(crate) history: History,
    /// [`Config::separate_tags`].
    pub(crate) separate_tags: bool,
    /// [`Config::exact_best_fit`].
    pub(crate) exact_fit: bool,
    /// Which shard holds each segment's addresses.
    pub(crate) places: Places,
    committed: AtomicU64,
}

/// What the last profiling measured, besides the cap (see [`Profiled`]).
#[derive(Debug, Default)]
pub(crate) struct Measured {
    pub(crate) eager_peak: AtomicU64,
    pub(crate) held: AtomicU64,
    pub(crate) kept: AtomicU64,
    pub(crate) margin: AtomicU64,
}

/// What profiling measured of eager work (not the KV cache, not graph pools).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Profiled {
    /// The pass's reserved peak, the bytes still allocated at its end, and the bytes still
    /// reserved once its cache was given back (`held` where it was not given back).
    pub(crate) eager_peak: u64,
    pub(crate) held: u64,
    pub(crate) kept: u64,
    pub(crate) margin: u64,
}

/// "No limit" and "no cap".
pub(crate) const NONE: u64 = u64::MAX;

impl<D: Driver> Core<D> {
    pub(crate) fn new(driver: D, config: &Config, ledger: Ledger) -> crate::error::Result<Self> {
        let driver = Counting::new(driver);
        let device_total = driver.mem_info()?.total;
        let granularity = driver.granularity();
        Ok(Core {
            granularity,
            driver,
            ledger,
            max_split: config.max_split_size.unwrap_or(u64::MAX),
            device_total,
            limit: AtomicU64::new(NONE),
            cap: AtomicU64::new(NONE),
            outside_floor: AtomicU64::new(0),
            waking: AtomicU64::new(0),
            measured: Measured::default(),
            stranded: Stranded::default(),
            history: Default::default(),
            separate_tags: config.separate_tags,
            exact_fit: config.exact_best_fit,
            places: Places::default(),
            committed: AtomicU64::new(0),
        })
    }

    /// Count `bytes` against the limit and the cap before asking the driver for them.
    pub(crate) fn commit(&self, bytes: u64) -> Result<(), GrowError> {
        let limit = self.limit.load(Relaxed);
        let cap = self.cap.load(Relaxed);
        let outside = if cap == NONE { 0 } else { self.outside_now() };
        let before = self.committed.fetch_add(bytes, Relaxed);
        let cause = if before + bytes > limit && !planted::active(Bug::LimitIgnored) {
            OomCause::Limit {
                wanted: bytes,
                held: before,
                limit,
            }
        } else if cap != NONE && before + bytes + outside > cap {
            OomCause::Cap {
                wanted: bytes,
                held: before,
                outside,
                cap,
            }
        } else {
            return Ok(());
        };
        self.committed.fetch_sub(bytes, Relaxed);
        Err(GrowError::Memory(cause))
    }

    /// Obtain `bytes` of device memory by `get` (one driver call that allocates them):
    /// committed against the limit and the cap first, given back to the commitment if the call
    /// fails, counted as reserved (a new segment when `segment`) if it succeeds.
    pub(crate) fn obtain<T>(
        &self,
        bytes: u64,
        segment: bool,
        get: impl FnOnce() -> DriverResult<T>,
    ) -> Result<T, GrowError> {
        self.commit(bytes)?;
        match get() {
            Ok(got) => {
                self.ledger.on_reserve(bytes, segment);
                Ok(got)
            }
            Err(e) => {
                self.uncommit(bytes);
                Err(e.into())
            }
        }
    }

    /// This process's memory outside the allocator, now: its usage as the driver reports it,
    /// less what the allocator holds. Reserved bytes are read before and after the usage and
    /// the smaller is subtracted, so that growth or release finishing in another shard between
    /// the reads makes the figure high, never low: the cap errs on the safe side. When the
    /// driver cannot tell, the figure given when the cap was set stands in.
    pub(crate) fn outside_now(&self) -> u64 {
        // A wake moves its bytes from `waking` to reserved, in that order, so the sum read here
        // is never more than the memory held (the figure errs high).
        let held = || self.ledger.reserved() + self.waking.load(Relaxed);
        let before = held();
        let usage = self.driver.process_usage();
        let reserved = before.min(held());
        match usage {
            Ok(Some(usage)) => usage.saturating_sub(reserved),
            Ok(None) => self.outside_floor.load(Relaxed),
            Err(e) => {
                self.ledger.usage_read_failures.fetch_add(1, Relaxed);
                tracing::warn!(error = %e, "could not read this process's usage; assuming the figure measured at profiling");
                self.outside_floor.load(Relaxed)
            }
        }
    }

    /// Wait for the work that may use memory of `owner`: its stream's, or, for a graph pool,
    /// all of the device's (graphs replay on streams the allocator never sees).
    pub(crate) fn sync_owner(&self, owner: Owner) -> DriverResult<()> {
        match owner.stream() {
            Some(s) => self.driver.sync_stream(s),
            None => self.driver.sync_device(),
        }
    }

    /// Count `bytes` more (or, with `gone`, fewer) of graph-pool memory when `owner` is a pool.
    pub(crate) fn graph_bytes(&self, owner: Owner, bytes: u64, gone: bool) {
        if owner.is_pool() {
            if gone {
                self.ledger.graph_reserved.sub(bytes);
            } else {
                self.ledger.graph_reserved.add(bytes);
            }
        }
    }

    /// The owner of `tag`'s memory for `owner` (a stream or a graph pool): its region of the
    /// tag when tags are kept apart.
    #[inline]
    pub(crate) fn region(&self, owner: Owner, tag: Tag) -> Owner {
        if self.separate_tags {
            owner.in_region(tag)
        } else {
            owner
        }
    }

    /// Record a segment event in the history (when it is on): a segment or mapping of
    /// `owner`'s made or given back.
    pub(crate) fn record_segment(
        &self,
        action: super::history::Action,
        addr: DevicePtr,
        bytes: u64,
        owner: Owner,
    ) {
        if self.history.on() {
            let stream = owner.stream().unwrap_or(StreamId::DEFAULT);
            self.history
                .record(action, addr, bytes, stream, Tag::Untracked);
        }
    }

    pub(crate) fn uncommit(&self, bytes: u64) {
        self.committed.fetch_sub(bytes, Relaxed);
    }

    pub(crate) fn committed(&self) -> u64 {
        self.committed.load(Relaxed)
    }
}
