//! What every shard shares: the (counted) driver, the ledger, the settings, and the
//! commitment of bytes against the limit; and the value an allocation hands out.
//!
//! Invariant: `committed` ≥ reserved bytes at every instant, and equals it at quiescence:
//! growth first commits against the limit, then calls the driver, then uncommits what it did
//! not get; giving memory back uncommits it after the driver call succeeded.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use super::config::{Config, SegmentMode, DEFAULT_REMAP_PIECE};
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
    pub(crate) granularity: u64,
    pub(crate) device_total: u64,
    pub(crate) limit: AtomicU64,
    committed: AtomicU64,
}

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
            device_total,
            limit: AtomicU64::new(u64::MAX),
            committed: AtomicU64::new(0),
        })
    }

    /// Count `bytes` against the limit before asking the driver for them.
    pub(crate) fn commit(&self, bytes: u64) -> Result<(), GrowError> {
        let limit = self.limit.load(Relaxed);
        let before = self.committed.fetch_add(bytes, Relaxed);
        if before + bytes > limit {
            self.committed.fetch_sub(bytes, Relaxed);
            return Err(GrowError::Memory(OomCause::Limit {
                wanted: bytes,
                held: before,
                limit,
            }));
        }
        Ok(())
    }

    pub(crate) fn uncommit(&self, bytes: u64) {
        self.committed.fetch_sub(bytes, Relaxed);
    }

    pub(crate) fn committed(&self) -> u64 {
        self.committed.load(Relaxed)
    }

    /// Whether segments are virtual reservations with physical memory mapped on demand.
    pub(crate) fn is_virtual(&self) -> bool {
        self.mode.is_virtual()
    }
}
