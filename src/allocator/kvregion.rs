//! The KV cache as the allocator holds it: one range of address space reserved whole at its
//! largest size, mapped from its base up to what the engine may use, in pieces of physical
//! memory of their own, in every mode (native mode's plain segments are eager work's; the KV
//! cache is one tensor the engine carves itself). The engine builds its KV tensor over the
//! whole range, so the tensor's shape and address never change, and CUDA graphs captured
//! against it stay valid while the mapped part grows and shrinks.
//!
//! Invariants:
//! - Pieces are mapped contiguously from `base`: piece `i` starts where piece `i - 1` ends, each
//!   one whole handle of a multiple of the granularity; `mapped` is their sum, at most
//!   `reserved`.
//! - `usable * unit <= mapped`: every block the engine may use is mapped.
//! - Mapped bytes are counted in the ledger's reserved bytes and committed against the limit and
//!   the cap exactly while the driver holds them, and in its KV figures; the KV cache counts as
//!   one allocation of the KV tag while anything is mapped.
//! - While the KV tag sleeps (`asleep` is the bytes it gave back), nothing is mapped, the
//!   ledger counts those bytes as sleeping and no block as usable, and `usable` keeps the
//!   engine's count for the wake, which maps that many bytes again at the same addresses.
//! - A growth or shrink either completes or leaves the region as it was: a growth that fails
//!   gives back what it mapped (a piece whose undo fails goes to the stranded list, counted as
//!   lost and not as the region's); a shrink gives its handles back first (a released handle
//!   stays mapped, and valid, until unmapped) and, if an unmap fails, maps fresh memory where
//!   pieces were already unmapped. Memory is unmapped only after the device is synchronised,
//!   except a failed growth's, which nothing has used.

use super::core::{Core, GrowError};
use super::dump::{BlockDump, DumpState, SegmentDump};
use super::growth::mapped::map_one;
use super::kv::Served;
use super::rules::PoolKind;
use crate::driver::{DevicePtr, Driver, PhysHandle};
use crate::error::{Error, Result};
use crate::tag::Tag;
use crate::units::MIB;

/// The largest piece one map call covers: a commit of tens of GiB costs hundreds of map calls,
/// not thousands, and a shrink gives memory back to within one piece.
pub(crate) const KV_PIECE: u64 = 32 * MIB;

/// One mapped piece.
#[derive(Clone, Copy, Debug)]
struct Piece {
    bytes: u64,
    handle: PhysHandle,
    /// Released to the driver but still mapped (a shrink whose unmap is yet to come).
    released: bool,
}

#[derive(Debug)]
pub(crate) struct KvRegion {
    pub(crate) base: DevicePtr,
    /// Address space reserved.
    pub(crate) reserved: u64,
    /// The engine's block size.
    pub(crate) unit: u64,
    /// Blocks the engine may use.
    pub(crate) usable: u64,
    mapped: u64,
    pieces: Vec<Piece>,
    /// How high eager work's memory rose while serving (read when the cache is sized again).
    pub(crate) served: Served,
    /// While the KV tag sleeps: the bytes mapped when it fell asleep.
    asleep: Option<u64>,
}

impl KvRegion {
    /// A range of `reserved` bytes of address space (a multiple of the granularity) for blocks
    /// of `unit` bytes, nothing mapped.
    pub(crate) fn reserve<D: Driver>(core: &Core<D>, reserved: u64, unit: u64) -> Result<KvRegion> {
        let base = core.driver.reserve_va(reserved)?;
        core.ledger.kv_reserved(reserved);
        Ok(KvRegion {
            base,
            reserved,
            unit,
            usable: 0,
            mapped: 0,
            pieces: Vec::new(),
            served: Served::default(),
            asleep: None,
        })
    }

    pub(crate) fn mapped(&self) -> u64 {
        self.mapped
    }

    /// Whether the KV tag sleeps with this region's memory given back.
    pub(crate) fn is_asleep(&self) -> bool {
        self.asleep.is_some()
    }

    /// Sleep with the KV tag (its contents discarded): give every piece back, keeping the
    /// address space and the engine's usable count. On an error the region is as it was.
    pub(crate) fn sleep<D: Driver>(&mut self, core: &Core<D>) -> Result<u64> {
        let bytes = self.mapped;
        self.shrink(core, 0)?;
        core.ledger.kv_usable(0);
        core.ledger.sleeping_add(Tag::KvCache, bytes);
        core.ledger.kv_asleep(bytes);
        self.asleep = Some(bytes);
        Ok(bytes)
    }

    /// Wake with the KV tag: map what it gave back at the same addresses (committed against
    /// the limit and the cap), its contents left to the caller. On an error it stays asleep.
    pub(crate) fn wake<D: Driver>(&mut self, core: &Core<D>) -> Result<u64> {
        let Some(bytes) = self.asleep else {
            return Ok(0);
        };
        if bytes > 0 {
            self.grow(core, bytes)?;
        }
        core.ledger.kv_asleep(0);
        core.ledger.sleeping_sub(Tag::KvCache, bytes);
        core.ledger.kv_usable(self.usable * self.unit);
        self.asleep = None;
        Ok(bytes)
    }

    /// Blocks the reservation holds.
    pub(crate) fn reserved_blocks(&self) -> u64 {
        self.reserved / self.unit
    }

    /// Make `blocks` usable, mapping (or unmapping) to the granule that holds them. Growth is
    /// committed against the limit and the cap; shrinking synchronises the device first. On an
    /// error the region is as it was.
    pub(crate) fn set_blocks<D: Driver>(&mut self, core: &Core<D>, blocks: u64) -> Result<()> {
        let g = core.granularity;
        let want = (blocks * self.unit).div_ceil(g) * g;
        debug_assert!(
            want <= self.reserved,
            "callers bound the blocks by the reservation"
        );
        if want > self.mapped {
            self.grow(core, want)?;
        } else if want < self.mapped {
            self.shrink(core, want)?;
        }
        self.usable = blocks;
        core.ledger.kv_usable(blocks * self.unit);
        Ok(())
    }

    /// Map from the current end up to `want` bytes, in pieces of at most [`KV_PIECE`] (or one
    /// granule, if larger).
    fn grow<D: Driver>(&mut self, core: &Core<D>, want: u64) -> Result<()> {
        let more = want - self.mapped;
        commit(core, more)?;
        let (before, start) = (self.pieces.len(), self.mapped);
        let mut done = 0;
        while done < more {
            // A granularity above the piece (none on today's GPUs) makes each piece a granule.
            let bytes = (more - done).min(KV_PIECE.max(core.granularity));
            match map_one(core, self.base + start + done, bytes) {
                Ok(handle) => {
                    self.pieces.push(Piece {
                        bytes,
                        handle,
                        released: false,
                    });
                    done += bytes;
                }
                Err(e) => {
                    // Give back what this growth mapped (what cannot be is stranded).
                    self.undo_growth(core, before, start);
                    core.uncommit(more);
                    return Err(e.into());
                }
            }
        }
        self.account_mapped(core, more, true);
        Ok(())
    }

    /// Give back the pieces from `from` on (mapped from `start`). A piece whose release or unmap
    /// fails is handed to the stranded list (counted as lost, never reserved, its undo retried
    /// when the cache is given back), so that the region stays the prefix it was.
    fn undo_growth<D: Driver>(&mut self, core: &Core<D>, from: usize, start: u64) {
        let mut off = start;
        let made: Vec<Piece> = self.pieces.drain(from..).collect();
        for p in made {
            let va = self.base + off;
            // Release then unmap, each tried even when the other fails: the memory goes with
            // the mapping, and what is left to undo is as small as it can be.
            let released = core.driver.release_physical(p.handle).is_ok();
            let unmapped = core.driver.unmap(va, p.bytes).is_ok();
            if !(released && unmapped) {
                core.stranded.strand(
                    &core.ledger,
                    va,
                    p.bytes,
                    !unmapped,
                    (!released).then_some(p.handle),
                );
            }
            off += p.bytes;
        }
    }

    /// Give back the whole pieces above `want` bytes (the device synchronised first).
    fn shrink<D: Driver>(&mut self, core: &Core<D>, want: u64) -> Result<()> {
        // The pieces to go: those starting at or above `want`.
        let mut keep = self.pieces.len();
        let mut end = self.mapped;
        while keep > 0 && end - self.pieces[keep - 1].bytes >= want {
            keep -= 1;
            end -= self.pieces[keep].bytes;
        }
        if keep == self.pieces.len() {
            return Ok(());
        }
        core.driver.sync_device()?;
        for p in &mut self.pieces[keep..] {
            if !p.released {
                core.driver.release_physical(p.handle)?;
                p.released = true;
            }
        }
        // Unmap from the top, so that what stays mapped is always a prefix.
        let mut top = self.mapped;
        let mut i = self.pieces.len();
        while i > keep {
            let p = self.pieces[i - 1];
            let va = self.base + top - p.bytes;
            if let Err(e) = core.driver.unmap(va, p.bytes) {
                self.remap_above(core, i, top);
                return Err(e.into());
            }
            top -= p.bytes;
            i -= 1;
        }
        let gone: u64 = self.pieces.drain(keep..).map(|p| p.bytes).sum();
        self.account_mapped(core, gone, false);
        core.uncommit(gone);
        Ok(())
    }

    /// After an unmap failed at piece `i - 1`: map fresh memory in place of pieces `i..`, which
    /// were unmapped from `top` up, so that the region is whole again (their blocks were free;
    /// what they held does not matter).
    fn remap_above<D: Driver>(&mut self, core: &Core<D>, i: usize, top: u64) {
        let mut off = top;
        for k in i..self.pieces.len() {
            let bytes = self.pieces[k].bytes;
            match map_one(core, self.base + off, bytes) {
                Ok(handle) => {
                    self.pieces[k] = Piece {
                        bytes,
                        handle,
                        released: false,
                    }
                }
                Err(e) => {
                    // Nothing is mapped from here up: the region ends at the last piece mapped.
                    tracing::warn!(error = %e, "could not map the KV cache back after a failed shrink; it ends lower");
                    let lost: u64 = self.pieces.drain(k..).map(|p| p.bytes).sum();
                    self.account_mapped(core, lost, false);
                    core.uncommit(lost);
                    self.usable = self.usable.min(self.mapped / self.unit);
                    core.ledger.kv_usable(self.usable * self.unit);
                    return;
                }
            }
            off += bytes;
        }
    }

    fn account_mapped<D: Driver>(&mut self, core: &Core<D>, bytes: u64, up: bool) {
        if bytes == 0 {
            return;
        }
        if up {
            self.mapped += bytes;
            core.ledger.on_reserve(bytes, false);
            core.ledger.kv_mapped.add(bytes);
        } else {
            self.mapped -= bytes;
            core.ledger.on_unreserve(bytes, false);
            core.ledger.kv_mapped.sub(bytes);
        }
    }

    /// Give everything back: unmap and release every piece and the address space, after the
    /// device is synchronised. On an error what is left stays, whole and counted, and releasing
    /// can be tried again.
    pub(crate) fn release<D: Driver>(&mut self, core: &Core<D>) -> Result<()> {
        core.driver.sync_device()?;
        self.shrink(core, 0)?;
        // Nothing is mapped from here on, so no block is usable, whether or not the address
        // space can be given back; memory asleep is given up.
        self.usable = 0;
        core.ledger.kv_usable(0);
        if let Some(bytes) = self.asleep.take() {
            core.ledger.kv_asleep(0);
            core.ledger.sleeping_sub(Tag::KvCache, bytes);
        }
        core.driver.release_va(self.base, self.reserved)?;
        core.ledger.kv_reserved(0);
        Ok(())
    }

    /// The region as a segment of the state dump: one block of the KV tag over what is mapped.
    pub(crate) fn dump(&self) -> SegmentDump {
        let mut blocks = Vec::new();
        // Asleep, the cache is still one allocation, over the range it gave back.
        let held = self.asleep.unwrap_or(self.mapped);
        if held > 0 {
            blocks.push(BlockDump {
                addr: self.base,
                size: held,
                requested: held,
                state: DumpState::Allocated,
                tag: Tag::KvCache,
            });
        }
        if held < self.reserved {
            blocks.push(BlockDump {
                addr: self.base + held,
                size: self.reserved - held,
                requested: 0,
                state: DumpState::Unmapped,
                tag: Tag::Untracked,
            });
        }
        SegmentDump {
            base: self.base,
            pool: PoolKind::Large,
            // No stream's free lists: the engine hands out its blocks.
            stream: None,
            region: None,
            size: self.reserved,
            expandable: true,
            external: false,
            mapped: if self.mapped > 0 {
                vec![(self.base, self.mapped)]
            } else {
                Vec::new()
            },
            asleep: match self.asleep {
                Some(bytes) if bytes > 0 => vec![(self.base, bytes)],
                _ => Vec::new(),
            },
            blocks,
            graph_pool: None,
            pool_key: None,
        }
    }
}

/// Commit `bytes` against the limit and the cap, as an error the caller can return.
fn commit<D: Driver>(core: &Core<D>, bytes: u64) -> Result<()> {
    core.commit(bytes).map_err(short)
}

/// A growth's failure as the KV cache reports it: memory it lacked, or a driver error.
fn short(e: GrowError) -> Error {
    match e {
        GrowError::Memory(cause) => Error::KvShort(Box::new(cause)),
        GrowError::Driver(d) => Error::Driver(d),
    }
}
