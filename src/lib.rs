//! vram-ledger: a caching GPU device-memory allocator that knows what every byte is for.
//!
//! ```
//! use vram_ledger::{Allocator, Config, Tag, StreamId, tag};
//! use vram_ledger::driver::sim::SimDriver;
//!
//! let alloc = Allocator::new(SimDriver::new(), Config::default())?;
//! let weights = {
//!     let _scope = tag::scope(Tag::Weights);
//!     alloc.allocate(300 << 20, StreamId::DEFAULT)?
//! };
//! let act = alloc.allocate_tagged(8 << 20, StreamId::DEFAULT, Tag::Activation)?;
//! alloc.free(act.ptr)?;
//!
//! let s = alloc.snapshot();
//! assert_eq!(s.per_tag[Tag::Weights].allocated_bytes.current, 300 << 20);
//! assert_eq!(s.per_tag[Tag::Activation].allocated_bytes.peak, 8 << 20);
//! assert!(s.cached_bytes > 0); // the activation's segment stays cached
//! alloc.free(weights.ptr)?;
//! alloc.empty_cache()?;
//! assert_eq!(alloc.snapshot().reserved_bytes.current, 0);
//! # Ok::<(), vram_ledger::Error>(())
//! ```

pub mod allocator;
pub mod devices;
pub mod driver;
pub mod error;
pub mod ffi;
pub mod invariants;
pub mod kernels;
pub mod ledger;
pub mod metrics;
pub mod profile;
pub mod replay;
pub mod report;
pub mod stats;
pub mod tag;
mod threads;
pub mod units;

pub use allocator::{
    Allocation, Allocator, CheckpointBlock, Config, GraphMemory, KvCache, KvCommit, KvRoom, Limit,
    PoolCheckpoint, PoolOptions, PoolRestore, PoolStats, SegmentMode, SleepReport, WakeReport,
};
pub use driver::{Capture, DevicePtr, Driver, GraphPool, StreamId};
pub use error::{Error, OomCause, OomReport, Result};
pub use ledger::{Counter, KvBytes, PerTag, Snapshot, TagStats};
pub use profile::{Margin, ProfileError, ProfileOptions, ProfileResult, Profiler};
pub use tag::Tag;
