//! The caching allocator: PyTorch's size classes and best fit, per-stream shards, growth
//! policies for plain and virtual memory, and an exact tagged ledger.
//!
//! Where things live, from the bottom up (each file imports only files listed before it):
//! - vocabulary: `planted.rs` (bugs planted for the property tests), `owner.rs` (who owns a
//!   block), `config.rs` (settings, the segment mode), `rules.rs` (PyTorch's sizing rules),
//!   `history.rs` (the trace vocabulary and the ring), `dump.rs` (copies of the state for
//!   readers), `block.rs`, `free_index.rs`, `live.rs`, `segment.rs`, `places.rs` (which shard
//!   holds an address), `spin.rs`, `streams.rs`;
//! - `core.rs`: what every shard shares (driver, ledger, limit, cap);
//! - `routes.rs`: graph-pool routing; `host.rs`: sleep's host memory; `kvregion.rs`: the KV
//!   cache's reserved range;
//! - `shard/`: one shard's tables and the cached path;
//! - `growth/`: how a shard obtains and gives back memory, one policy per file;
//! - `front.rs`: the [`Allocator`] and its entry points; `graphs.rs`, `checkpoint.rs`, `sleep.rs`
//!   and `kv.rs` add the graph-pool, pool-checkpoint, sleep and KV-cache entry points to it.

pub(crate) mod block;
mod checkpoint;
mod config;
mod core;
pub mod dump;
pub(crate) mod free_index;
mod front;
mod graphs;
mod growth;
pub mod history;
mod host;
mod kv;
mod kvregion;
mod live;
mod mempools;
mod owner;
mod phases;
mod places;
mod planted;
mod routes;
pub mod rules;
mod segment;
mod shard;
mod sleep;
mod sleep_report;
mod spin;
mod staging;
mod stranded;
mod streams;
mod wake;

pub use self::checkpoint::{CheckpointBlock, PoolCheckpoint, PoolRestore};
pub use self::config::{Config, Limit, SegmentMode, UnknownMode, DEFAULT_REMAP_PIECE};
pub use self::core::Allocation;
pub(crate) use self::core::Profiled;
pub use self::dump::PoolStats;
pub use self::front::Allocator;
pub use self::graphs::GraphMemory;
pub use self::history::{Action, HistoryEntry};
pub use self::kv::{KvCache, KvCommit, KvRoom};
pub use self::routes::PoolOptions;
pub use self::sleep_report::{SleepReport, WakeReport};
pub use crate::driver::GraphPool;
