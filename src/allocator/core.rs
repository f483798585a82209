//! What every shard shares: the (counted) driver, the ledger, the settings, and the
//! commitment of bytes against the limit; and the value an allocation hands out.
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

use super::config::{Config, SegmentMode, DEFAULT_REMAP_PIECE};
use super::rules;
use super::shard::GrowError;
use crate::driver::counting::Counting;
use crate::driver::{DevicePtr, Driver, StreamId};
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

pub(crate) struct Core<D> {
    pub(crate) driver: Counting<D>,
    pub(crate) ledger: Ledger,
    pub(crate) mode: SegmentMode,
    /// Remap mode: the largest piece of the large pool mapped by one `cuMemMap`.
    pub(crate) remap_piece: u64,
    pub(crate) max_split: u64,
    /// [`super::Config::move_across_streams`].
    pub(crate) across_streams: bool,
    pub(crate) granularity: u64,
    pub(crate) device_total: u64,
    pub(crate) limit: AtomicU64,
    /// The budget contract in bytes for the whole process; `NONE` when not set.
    pub(crate) cap: AtomicU64,
    /// Memory outside the allocator assumed when the driver cannot report this process's usage.
    pub(crate) outside_floor: AtomicU64,
    /// The allocation history, when recording (`history.rs`).
    pub(crate) history: super::history::History,
    /// [`Config::separate_tags`].
    pub(crate) separate_tags: bool,
    committed: AtomicU64,
}

/// "No limit" and "no cap".
pub(crate) const NONE: u64 = u64::MAX;

impl<D: Driver> Core<D> {
    pub(crate) fn new(driver: D, config: &Config, ledger: Ledger) -> crate::Result<Self> {
        let driver = Counting::new(driver);
        let device_total = driver.mem_info()?.total;
        let granularity = driver.granularity();
        Ok(Core {
            remap_piece: config
                .remap_piece
                .unwrap_or(DEFAULT_REMAP_PIECE)
                .max(1)
                .div_ceil(granularity)
                * granularity,
            granularity,
            driver,
            ledger,
            mode: config.mode,
            max_split: config.max_split_size.unwrap_or(u64::MAX),
            across_streams: config.move_across_streams,
            device_total,
            limit: AtomicU64::new(NONE),
            cap: AtomicU64::new(NONE),
            outside_floor: AtomicU64::new(0),
            history: Default::default(),
            separate_tags: config.separate_tags,
            committed: AtomicU64::new(0),
        })
    }

    /// Count `bytes` against the limit and the cap before asking the driver for them.
    pub(crate) fn commit(&self, bytes: u64) -> Result<(), GrowError> {
        let limit = self.limit.load(Relaxed);
        let cap = self.cap.load(Relaxed);
        let outside = if cap == NONE { 0 } else { self.outside_now() };
        let before = self.committed.fetch_add(bytes, Relaxed);
        let cause = if before + bytes > limit {
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

    /// This process's memory outside the allocator, now: its usage as the driver reports it,
    /// less what the allocator holds. Reserved bytes are read before and after the usage and
    /// the smaller is subtracted, so that growth or release finishing in another shard between
    /// the reads makes the figure high, never low: the cap errs on the safe side. When the
    /// driver cannot tell, the figure given when the cap was set stands in.
    pub(crate) fn outside_now(&self) -> u64 {
        let before = self.ledger.reserved();
        let usage = self.driver.process_usage();
        let reserved = before.min(self.ledger.reserved());
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
    pub(crate) fn sync_owner(&self, owner: StreamId) -> crate::driver::DriverResult<()> {
        if super::graphs::is_pool_key(owner) {
            self.driver.sync_device()
        } else {
            self.driver.sync_stream(super::regions::stream_of(owner))
        }
    }

    /// Count `bytes` more (or, with `gone`, fewer) of graph-pool memory when `owner` is a pool.
    pub(crate) fn graph_bytes(&self, owner: StreamId, bytes: u64, gone: bool) {
        if super::graphs::is_pool_key(owner) {
            if gone {
                self.ledger.graph_reserved.sub(bytes);
            } else {
                self.ledger.graph_reserved.add(bytes);
            }
        }
    }

    /// The owner of `tag`'s memory for `owner` (a stream or a graph pool): the stream's region
    /// of the tag when tags are kept apart.
    #[inline]
    pub(crate) fn region(&self, owner: StreamId, tag: Tag) -> StreamId {
        if self.separate_tags {
            super::regions::with_region(owner, tag)
        } else {
            owner
        }
    }

    pub(crate) fn uncommit(&self, bytes: u64) {
        self.committed.fetch_sub(bytes, Relaxed);
    }

    pub(crate) fn committed(&self) -> u64 {
        self.committed.load(Relaxed)
    }

    /// The block size for a request of `size` bytes: PyTorch's rounding, and in remap mode a
    /// large block up to a whole granule when that costs little ([`rules::remap_round`]), but
    /// never across `max_split_size` (a request under it must not become an oversize one, which
    /// may take a larger cached block whole).
    #[inline]
    pub(crate) fn round(&self, size: u64) -> u64 {
        let rounded = rules::round_size(size);
        if self.mode != SegmentMode::Remap {
            return rounded;
        }
        let up = rules::remap_round(rounded, self.granularity);
        if rounded < self.max_split && up >= self.max_split {
            rounded
        } else {
            up
        }
    }

    /// Whether segments are virtual reservations with physical memory mapped on demand.
    pub(crate) fn is_virtual(&self) -> bool {
        self.mode.is_virtual()
    }
}
