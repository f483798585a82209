//! The KV cache, sized last: the entry points that reserve it, commit it to what the budget
//! contract leaves, resize it while serving and give it back (the region itself is in
//! `kvregion.rs`).
//!
//! The order engines use is weights, profile, KV cache, CUDA graphs, serve: a captured
//! attention kernel reads the KV cache at fixed addresses, so the cache exists before the
//! graphs, and the graphs' memory is not known when it is sized. Nothing is estimated:
//! [`Allocator::reserve_kv`] reserves the whole range and maps a prefix for warm-up and
//! capture; [`Allocator::commit_kv`], after the captures, maps the rest up to what the cap
//! leaves once everything else is measured at that moment. This holds in native mode too: only
//! eager work's memory is in plain segments.
//!
//! What the cap must leave room for besides the KV cache, when sizing it:
//! - eager work: what it holds now, after the cache is given back (weights, workspaces, graphs'
//!   static inputs), and on top of it the transient memory its passes take (`transient_to_keep`):
//!   profiling's pass, until serving has risen at least as far as that pass does in freshly cut
//!   memory; from then on, the largest rise serving made above what eager work held when the
//!   KV cache was last sized before it;
//! - graph pools, as held now;
//! - memory outside the allocator, as this process's usage shows it now (CUDA context,
//!   libraries, graph instantiation), and the margin profiling chose;
//! - the memory of tags asleep, which their wake takes back.
//!
//! An allocator limit ([`crate::Config::limit`]) bounds what the allocator reserves, the KV
//! cache included: where one is set, the KV cache gets no more than the limit less eager work
//! (held and transient), graph pools and tags asleep (memory outside the allocator is not
//! under it).
//!
//! Invariants: one KV cache per allocator; its lock is taken before any shard lock, never
//! while one is held; nothing here runs while a capture is routed to a graph pool (giving the
//! cache back and synchronising would spoil it). The marks of the ledger's reserved and
//! graph-pool bytes are set by every commit and resize of the KV cache (after any change to
//! it), and by nothing else; the KV cache changes only under its lock, so within a window its
//! mapped bytes are those recorded when the window opened. Not seen: memory other threads take
//! and give back while a commit or resize runs, and the serving of a KV cache released before
//! this one was reserved.

use std::sync::atomic::Ordering::Relaxed;

use super::dump::DumpState;
use super::front::Allocator;
use super::kvregion::KvRegion;
use crate::driver::{DevicePtr, Driver};
use crate::error::{Error, OomCause, Result};
use crate::tag::Tag;

/// The KV cache's shape and state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct KvCache {
    /// Where the reserved range starts: the engine's KV tensor spans the whole range from here.
    pub base: DevicePtr,
    /// The engine's block size.
    pub block_bytes: u64,
    /// Blocks the reserved range holds: the KV tensor's final shape.
    pub reserved_blocks: u64,
    /// Blocks the engine may use now (mapped).
    pub usable_blocks: u64,
    /// Address space reserved, and physical memory mapped into it.
    pub reserved_bytes: u64,
    pub mapped_bytes: u64,
}

/// What the budget contract leaves the KV cache, and why.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct KvRoom {
    /// The memory this process requested (the cap).
    pub cap: u64,
    /// What eager work holds now, and the transient memory kept for its passes on top of it.
    pub eager_now: u64,
    pub transient: u64,
    /// The largest rise of eager work's reserved bytes while serving, above their level when
    /// the KV cache was last sized before it (`None` until the cache has been sized once).
    pub served_rise: Option<u64>,
    /// Bytes held for CUDA graph pools now.
    pub graph_pools: u64,
    /// This process's memory outside the allocator now.
    pub outside: u64,
    /// The memory of tags asleep now, which their wake takes back within the cap.
    pub asleep: u64,
    pub margin: u64,
    /// The allocator's limit ([`crate::Config::limit`]), when one is set: it bounds what the
    /// allocator reserves, the KV cache included.
    pub limit: Option<u64>,
    /// What is left for the KV cache: cap − (eager now + transient + graph pools + outside +
    /// asleep + margin), and no more than limit − (eager now + transient + graph pools +
    /// asleep) where a limit is set (memory outside the allocator is not under the limit).
    pub room: u64,
}

impl KvRoom {
    /// What eager work keeps under the limit as under the cap: held now, transient, graph
    /// pools and tags asleep (saturating: a figure may be any byte count).
    fn eager(&self) -> u64 {
        [
            self.eager_now,
            self.transient,
            self.graph_pools,
            self.asleep,
        ]
        .into_iter()
        .fold(0u64, u64::saturating_add)
    }
}

impl std::fmt::Display for KvRoom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use crate::units::Bytes;
        write!(
            f,
            "{} requested, less {} held by eager work, {} kept for its passes, {} of graph pools, \
             {} outside the allocator, {} asleep and a margin of {}",
            Bytes(self.cap),
            Bytes(self.eager_now),
            Bytes(self.transient),
            Bytes(self.graph_pools),
            Bytes(self.outside),
            Bytes(self.asleep),
            Bytes(self.margin)
        )?;
        if let Some(limit) = self.limit {
            if self.eager().saturating_add(self.room) >= limit {
                write!(
                    f,
                    "; the allocator's limit of {} leaves no more",
                    Bytes(limit)
                )?;
            }
        }
        Ok(())
    }
}

/// What [`Allocator::commit_kv`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct KvCommit {
    pub kv: KvCache,
    pub room: KvRoom,
    /// Blocks usable before the commit.
    pub blocks_before: u64,
}

fn info(r: &KvRegion) -> KvCache {
    KvCache {
        base: r.base,
        block_bytes: r.unit,
        reserved_blocks: r.reserved_blocks(),
        // Asleep, no block may be used: the count comes back with the wake.
        usable_blocks: if r.is_asleep() { 0 } else { r.usable },
        reserved_bytes: r.reserved,
        mapped_bytes: r.mapped(),
    }
}

/// How far eager work's reserved memory rose while serving, measured between sizings of the KV
/// cache from the ledger's marks: while the KV cache does not change, reserved bytes above it
/// and the graph pools are eager work's.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Served {
    /// Eager work's reserved bytes when the current window opened (the KV cache was last
    /// committed or resized).
    since: Option<u64>,
    /// The largest rise of eager work's reserved bytes above their level when a window opened,
    /// over every window of this KV cache so far.
    rise: Option<u64>,
}

impl<D: Driver> Allocator<D> {
    /// Reserve the KV cache: address space for `max_bytes` (default: the device's memory) in
    /// blocks of `block_bytes`, with `initial_blocks` of them mapped for warm-up and capture.
    /// When that fails and the address space cannot be given back, it stays reserved (an empty
    /// KV cache) until [`Allocator::release_kv`] gives it back.
    pub fn reserve_kv(
        &self,
        block_bytes: u64,
        max_bytes: Option<u64>,
        initial_blocks: u64,
    ) -> Result<KvCache> {
        let mut kv = self.kv.lock();
        if kv.is_some() {
            return Err(Error::InvalidArgument(
                "a KV cache is reserved already on this device: release it first".into(),
            ));
        }
        self.check_kv_awake(None)?;
        if block_bytes == 0 || block_bytes >= super::rules::ABSURD_SIZE {
            return Err(Error::InvalidArgument(format!(
                "the KV cache's block size must be between 1 byte and 1 EiB, not {block_bytes}"
            )));
        }
        let g = self.core.granularity;
        let max = max_bytes.unwrap_or(self.core.device_total);
        if max < block_bytes || max >= super::rules::ABSURD_SIZE {
            return Err(Error::InvalidArgument(format!(
                "the KV cache's largest size ({max} bytes) must hold one block of {block_bytes} and be under 1 EiB"
            )));
        }
        let mut region = KvRegion::reserve(&self.core, max.div_ceil(g) * g, block_bytes)?;
        let refused = if initial_blocks > region.reserved_blocks() {
            Some(Error::InvalidArgument(format!(
                "{initial_blocks} initial blocks do not fit in the {} the KV cache may hold",
                region.reserved_blocks()
            )))
        } else {
            region.set_blocks(&self.core, initial_blocks).err()
        };
        if let Some(e) = refused {
            // A reservation that cannot be given back stays, held and counted, for
            // `release_kv` to try again; nothing is dropped while the driver holds it.
            if let Err(e2) = region.release(&self.core) {
                tracing::warn!(error = %e2, "could not give back the address space of a refused KV cache; it stays reserved until release_kv");
                *kv = Some(region);
            }
            return Err(e);
        }
        let out = info(&region);
        tracing::info!(
            base = out.base,
            reserved = out.reserved_bytes,
            usable = out.usable_blocks,
            "KV cache reserved: {} blocks of {} bytes, {} usable",
            out.reserved_blocks,
            block_bytes,
            out.usable_blocks
        );
        *kv = Some(region);
        Ok(out)
    }

    /// The KV cache, if one is reserved.
    pub fn kv_cache(&self) -> Option<KvCache> {
        self.kv.lock().as_ref().map(info)
    }

    /// Map the KV cache up to what the budget contract leaves now (call it after the CUDA
    /// graphs are captured, instantiated and replayed once): the cache of eager work is given
    /// back first, then everything else is measured (see the module's notes). It never maps past
    /// the cap nor unmaps: when less is left than is mapped already, the KV cache stays as it is
    /// (and the result says so). Addresses do not change.
    ///
    /// Committing again once the engine has served sizes the cache from the largest rise
    /// serving made instead of from the profiled pass (see the module's notes): memory kept
    /// for cuts the serving mix did not make goes to the KV cache, and a serving mix that
    /// needed more than the profile is kept room for. Until serving has risen as far as the
    /// profiled pass does in fresh memory, the profiled figure stands.
    pub fn commit_kv(&self) -> Result<KvCommit> {
        let mut kv = self.kv.lock();
        let region = kv.as_mut().ok_or(Error::NoKvCache)?;
        self.check_not_capturing("commit the KV cache")?;
        self.check_kv_awake(Some(region))?;
        self.close_window(region);
        self.empty_cache()?;
        let before = region.usable;
        let room = self.kv_room(region)?;
        let g = self.core.granularity;
        let fits = ((room.room / g * g) / region.unit).min(region.reserved_blocks());
        let grown = if fits > before {
            region.set_blocks(&self.core, fits)
        } else {
            Ok(())
        };
        self.open_window(region);
        grown?;
        if fits < before {
            tracing::warn!(
                usable = before,
                fits,
                "the budget contract leaves the KV cache less than it holds already; it stays as it is"
            );
        }
        let out = KvCommit {
            kv: info(region),
            room,
            blocks_before: before,
        };
        tracing::info!(
            blocks = out.kv.usable_blocks,
            bytes = out.kv.mapped_bytes,
            "KV cache committed: {} blocks usable ({} mapped); graph pools {} bytes, outside the allocator {} bytes",
            out.kv.usable_blocks,
            out.kv.mapped_bytes,
            room.graph_pools,
            room.outside
        );
        Ok(out)
    }

    /// Make `blocks` of the KV cache usable while serving: shrinking gives back the tail (every
    /// block from `free_from` on must be free, and `blocks` may not be below it); growing maps
    /// more within the reservation and what the budget contract leaves (see
    /// [`Allocator::commit_kv`]). On an error the KV cache is as it was.
    pub fn resize_kv(&self, blocks: u64, free_from: u64) -> Result<KvCache> {
        let mut kv = self.kv.lock();
        let region = kv.as_mut().ok_or(Error::NoKvCache)?;
        self.check_not_capturing("resize the KV cache")?;
        self.check_kv_awake(Some(region))?;
        if blocks > region.reserved_blocks() {
            return Err(Error::InvalidArgument(format!(
                "{blocks} blocks do not fit in the {} the KV cache's reservation holds",
                region.reserved_blocks()
            )));
        }
        if blocks < region.usable && blocks < free_from.min(region.usable) {
            return Err(Error::InvalidArgument(format!(
                "cannot shrink the KV cache to {blocks} blocks: blocks below {} are in use",
                free_from.min(region.usable)
            )));
        }
        self.close_window(region);
        let g = self.core.granularity;
        let want = (blocks * region.unit).div_ceil(g) * g;
        // Blocks within memory the cache keeps mapped (a shrink keeps a partly used piece)
        // need nothing new, and so no budget.
        if blocks > region.usable && want > region.mapped() {
            self.empty_cache()?;
            let room = self.kv_room(region)?;
            if want > room.room {
                return Err(Error::KvShort(Box::new(OomCause::KvRoom {
                    to: want,
                    wanted: want - region.mapped(),
                    room: Box::new(room),
                })));
            }
        }
        let set = region.set_blocks(&self.core, blocks);
        self.open_window(region);
        set?;
        Ok(info(region))
    }

    /// Give the KV cache back (the device is synchronised first; the engine's tensors over it
    /// must not be used again).
    pub fn release_kv(&self) -> Result<()> {
        let mut kv = self.kv.lock();
        let region = kv.as_mut().ok_or(Error::NoKvCache)?;
        region.release(&self.core)?;
        *kv = None;
        Ok(())
    }

    /// Fold the window since the KV cache was last sized into the largest rise serving made.
    /// The KV cache's mapped bytes have not changed since (they change only here, under its
    /// lock); graph pools may have, so their lowest level in the window is taken off: eager
    /// work's peak is read high, never low.
    fn close_window(&self, region: &mut KvRegion) {
        let Some(eager) = region.served.since else {
            return;
        };
        let l = &self.core.ledger;
        let peak = l
            .reserved
            .since_mark()
            .saturating_sub(region.mapped() + l.graph_reserved.low_since_mark());
        let rise = peak.saturating_sub(eager);
        region.served.rise = Some(region.served.rise.map_or(rise, |r| r.max(rise)));
    }

    /// Start a new window: the KV cache was just sized.
    fn open_window(&self, region: &mut KvRegion) {
        let l = &self.core.ledger;
        l.reserved.set_mark();
        l.graph_reserved.set_mark();
        let eager = l
            .reserved
            .get()
            .saturating_sub(region.mapped() + l.graph_reserved.get());
        region.served.since = Some(eager);
    }

    /// Refuse to map KV cache memory while the KV tag sleeps: its wake maps what it had.
    fn check_kv_awake(&self, region: Option<&KvRegion>) -> Result<()> {
        if region.is_some_and(KvRegion::is_asleep) || self.asleep_tags().contains(&Tag::KvCache) {
            return Err(Error::Asleep(Tag::KvCache));
        }
        Ok(())
    }

    /// What the budget contract leaves the KV cache now.
    fn kv_room(&self, region: &KvRegion) -> Result<KvRoom> {
        let cap = self.cap().ok_or_else(|| {
            Error::InvalidArgument(
                "sizing the KV cache needs a budget contract: profile first, or set a cap".into(),
            )
        })?;
        let outside = self.core.outside_now();
        let reserved = self.core.ledger.reserved();
        let graph_pools = self.core.ledger.graph_reserved.get();
        let eager_now = reserved.saturating_sub(region.mapped() + graph_pools);
        let served_rise = region.served.rise;
        let transient = self.transient_to_keep(served_rise);
        let margin = self.core.measured.margin.load(Relaxed);
        let asleep = Tag::ALL
            .iter()
            .map(|&t| self.core.ledger.sleeping(t))
            .sum::<u64>();
        let mut r = KvRoom {
            cap,
            eager_now,
            transient,
            served_rise,
            graph_pools,
            outside,
            asleep,
            margin,
            limit: self.limit(),
            room: 0,
        };
        // Saturating: a margin may be any byte count (profiling with the KV cache's size given
        // does not check it against the request), and then nothing is left.
        let eager = r.eager();
        r.room = cap.saturating_sub(eager.saturating_add(outside).saturating_add(margin));
        if let Some(limit) = r.limit {
            r.room = r.room.min(limit.saturating_sub(eager));
        }
        Ok(r)
    }

    /// What eager work's next pass may take on top of what it holds now.
    ///
    /// The profiled pass's rise above what it held at its end, until serving has shown more.
    /// In native mode the rise above the bytes still allocated: everything reserved now comes
    /// on top, free memory in segments still in use included, as a plain segment keeps the
    /// cuts of the requests it served and a pass of another shape may find its free blocks of
    /// no use (a serving mix on the H200 needed up to all of it: docs/results.md §3). The
    /// virtual-memory modes map new memory per request, page or piece and unmap what is wholly
    /// free before growing under the cap: the next pass takes what the profiled one took, so
    /// the rise is above what eager work still reserved once its cache was given back, and what
    /// survived (free memory pinned beside live blocks) is counted once, in what it holds now.
    ///
    /// Once serving has risen at least as far as that second figure (`fresh`: the profiled
    /// pass's rise in freshly cut memory), it has run a pass as large as the profiled one, and
    /// its largest rise is kept instead: in native mode the serving mix shows which cuts it
    /// makes, which one profiled shape cannot. Until then (nothing served since the commit, or
    /// only small batches) the profiled figure stands.
    fn transient_to_keep(&self, served_rise: Option<u64>) -> u64 {
        let m = &self.core.measured;
        let peak = m.eager_peak.load(Relaxed);
        let rise = peak.saturating_sub(m.held.load(Relaxed));
        let fresh = rise.min(peak.saturating_sub(m.kept.load(Relaxed)));
        match served_rise {
            Some(served) if served >= fresh => served,
            _ if self.growth.is_virtual() => fresh,
            _ => rise,
        }
    }

    /// Eager work's reserved bytes once its cache is given back, when no capture runs (giving
    /// the cache back would spoil it); `None` otherwise. The virtual-memory modes give it back
    /// now. Native mode keeps its cache, as PyTorch's allocator does after a pass, and reads
    /// what giving it back would free from its segments: those outside any pool whose blocks
    /// are all free, or freed and waiting for their streams (counted as freed: the pass's rise
    /// above the rest comes out higher, not lower).
    pub(crate) fn eager_kept(&self) -> Result<Option<u64>> {
        if self.check_not_capturing("").is_err() {
            return Ok(None);
        }
        let releasable = if self.growth.is_virtual() {
            self.empty_cache()?;
            0
        } else {
            self.dump()
                .segments
                .iter()
                .filter(|s| s.pool_key.is_none() && !s.blocks.is_empty())
                .filter(|s| {
                    s.blocks
                        .iter()
                        .all(|b| matches!(b.state, DumpState::Free | DumpState::Pending))
                })
                .map(|s| s.size)
                .sum()
        };
        let kv_mapped = self.kv.lock().as_ref().map_or(0, |r| r.mapped());
        let graph_pools = self.core.ledger.graph_reserved.get();
        let reserved = self.core.ledger.reserved();
        Ok(Some(
            reserved.saturating_sub(kv_mapped + graph_pools + releasable),
        ))
    }

    fn check_not_capturing(&self, what: &'static str) -> Result<()> {
        if self.lock(0)?.graphs.capturing() {
            return Err(Error::Capturing(what));
        }
        Ok(())
    }
}
