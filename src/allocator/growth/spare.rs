//! The remap policy's spare pieces: physical memory held but not mapped, waiting to be mapped
//! where a request needs it.
//!
//! Invariants:
//! - A piece is one `cuMemCreate` handle, mapped whole or not at all (CUDA maps no partial
//!   handle); it is either in `spare` or the handle of exactly one pooled mapping. It may also
//!   have old mappings waiting to be unmapped (`later.rs`), which the tables no longer show.
//! - A graph pool's growth (perhaps inside a capture) maps no piece with such an old mapping:
//!   it would have to wait for an event first.
//! - Spare bytes count as reserved: they were reserved when created and are unreserved only
//!   when released to the driver.

use crate::allocator::core::{Core, GrowError};
use crate::allocator::history::Action;
use crate::allocator::planted::{self, Bug};
use crate::allocator::segment::{Mapping, Spare};
use crate::allocator::shard::Shard;
use crate::driver::{DevicePtr, Driver, DriverError, PhysHandle};
use crate::error::Result;

impl Shard {
    /// Map at least `bytes` (at most `room`) from `start`, one whole handle per map call:
    /// spare pieces of at most `piece` bytes first (the smallest that covers what is left,
    /// else the largest that fits), then new pieces of at most `piece` bytes. Returns the bytes
    /// mapped (a prefix) and the error that stopped it; a piece that could not be mapped stays
    /// spare.
    pub(crate) fn map_spare<D: Driver>(
        &mut self,
        core: &Core<D>,
        seg: u32,
        start: DevicePtr,
        bytes: u64,
        room: u64,
        piece: u64,
    ) -> (u64, Option<GrowError>) {
        let g = core.granularity;
        let mut done = 0;
        let stream = self.segments.get(seg).owner.stream();
        while done < bytes {
            // A piece with an old mapping still waiting is passed over by a graph pool's growth
            // (a size no range fits).
            let sizes = self.spare.iter().map(|p| {
                if stream.is_none() && self.retires(p.handle) {
                    u64::MAX
                } else {
                    p.bytes
                }
            });
            let p = match next_piece(sizes, bytes - done, room - done, piece, g) {
                Next::Spare(i) => {
                    let p = self.spare.swap_remove(i);
                    if let Err(e) = self.clear_for_stream(core, p.handle, stream) {
                        self.spare.push(p);
                        return (done, Some(e.into()));
                    }
                    p
                }
                Next::New(size) => match self.create_or_trade(core, size, piece) {
                    Ok(p) => p,
                    Err(e) => return (done, Some(e)),
                },
            };
            let va = start + done;
            if let Err((e, still_mapped)) = map_piece(core, va, p.bytes, p.handle) {
                if still_mapped {
                    // Not spare: the piece may not be mapped anywhere else while its failed
                    // mapping stands. It is lost until an undo succeeds, which gives it back
                    // to the driver: an old mapping of it must be gone by then.
                    if let Err(e) = self.clear_handle(core, p.handle) {
                        super::later::note_late_failure(core, &e, "a stranded piece's old mapping could not be unmapped; it stays retiring and is tried again later");
                    }
                    core.ledger.on_unreserve(p.bytes, false);
                    core.uncommit(p.bytes);
                    core.stranded
                        .strand(&core.ledger, va, p.bytes, true, Some(p.handle));
                } else {
                    self.spare.push(p);
                }
                return (done, Some(e.into()));
            }
            let m = Mapping::new(p.bytes, p.handle, true);
            self.segments.get_mut(seg).virt_mut().mappings.insert(va, m);
            self.record_map(core, seg, Action::SegmentMap, va, p.bytes);
            done += p.bytes;
        }
        (done, None)
    }

    /// The sizes of the spare pieces of at most `piece` bytes, for [`new_bytes_for`].
    pub(crate) fn spare_sizes(&self, piece: u64) -> Vec<u64> {
        self.spare
            .iter()
            .map(|p| p.bytes)
            .filter(|&b| b <= piece)
            .collect()
    }

    /// Give the spare pieces back to the driver.
    pub(crate) fn release_spare<D: Driver>(&mut self, core: &Core<D>) -> Result<()> {
        let keep = usize::from(planted::active(Bug::RemapSpare));
        while self.spare.len() > keep {
            let p = self.spare.pop().expect("more than `keep` pieces");
            self.release_piece(core, p)?;
        }
        Ok(())
    }

    /// A new piece of `size` bytes. When memory runs out (the limit, the cap or the device)
    /// while spare pieces larger than `piece` are held, pieces this growth may not map, they
    /// are given back one at a time, smallest first, and the piece created again: an unmapped
    /// piece needs no synchronisation to go, so this works during a capture too, where the
    /// cache is not released before a retry.
    fn create_or_trade<D: Driver>(
        &mut self,
        core: &Core<D>,
        size: u64,
        piece: u64,
    ) -> std::result::Result<Spare, GrowError> {
        loop {
            match create_piece(core, size) {
                Err(GrowError::Memory(cause)) => {
                    let Some(i) = (0..self.spare.len())
                        .filter(|&i| self.spare[i].bytes > piece)
                        // Not one whose old mapping still waits: giving it back would wait.
                        .filter(|&i| !self.retires(self.spare[i].handle))
                        .min_by_key(|&i| self.spare[i].bytes)
                    else {
                        return Err(GrowError::Memory(cause));
                    };
                    let p = self.spare.swap_remove(i);
                    self.release_piece(core, p)?;
                }
                created => return created,
            }
        }
    }

    /// Give spare piece `p` (out of `spare`) back to the driver; it stays spare if that fails.
    /// An old mapping of it still retiring is unmapped first: until then the driver would keep
    /// its memory though the ledger had let it go.
    fn release_piece<D: Driver>(
        &mut self,
        core: &Core<D>,
        p: Spare,
    ) -> std::result::Result<(), DriverError> {
        if let Err(e) = self.clear_handle(core, p.handle) {
            self.spare.push(p);
            return Err(e);
        }
        if let Err(e) = core.driver.release_physical(p.handle) {
            self.spare.push(p);
            return Err(e);
        }
        core.ledger.on_unreserve(p.bytes, false);
        core.uncommit(p.bytes);
        Ok(())
    }
}

/// What [`Shard::map_spare`] maps next.
enum Next {
    /// The spare piece at this index.
    Spare(usize),
    /// A new piece of this many bytes.
    New(u64),
}

/// The next piece to map, with `left` bytes still to map in a range of `fits` bytes: of the
/// spare pieces (of these sizes) of at most `piece` bytes, the smallest that covers what is
/// left, else the largest that fits; else a new piece of what is left (granularity `g`), at
/// most `piece` bytes. `left` and `fits` are multiples of `g` with `left <= fits`, so every
/// choice fits the range.
///
/// Larger spare pieces are passed over: the small pool's growth (pages of one granule) leaves
/// the large pool's pieces for the large pool, where they were cut to size.
fn next_piece(
    sizes: impl Iterator<Item = u64> + Clone,
    left: u64,
    fits: u64,
    piece: u64,
    g: u64,
) -> Next {
    let covering = sizes
        .clone()
        .enumerate()
        .filter(|&(_, b)| b >= left && b <= fits.min(piece))
        .min_by_key(|&(_, b)| b);
    let largest = || {
        sizes
            .enumerate()
            .filter(|&(_, b)| b <= fits.min(piece))
            .max_by_key(|&(_, b)| b)
    };
    match covering.or_else(largest) {
        Some((i, _)) => Next::Spare(i),
        None => Next::New(piece.min(left.div_ceil(g) * g)),
    }
}

/// The bytes of new pieces that [`Shard::map_spare`] would create to map `bytes` into a range
/// of `room` bytes with spare pieces of `sizes` on hand (the same choices, none made).
pub(crate) fn new_bytes_for(mut sizes: Vec<u64>, bytes: u64, room: u64, piece: u64, g: u64) -> u64 {
    let (mut done, mut new) = (0, 0);
    while done < bytes {
        done += match next_piece(sizes.iter().copied(), bytes - done, room - done, piece, g) {
            Next::Spare(i) => sizes.swap_remove(i),
            Next::New(n) => {
                new += n;
                n
            }
        };
    }
    new
}

/// A new piece of `size` bytes, committed against the limit and reserved.
fn create_piece<D: Driver>(core: &Core<D>, size: u64) -> std::result::Result<Spare, GrowError> {
    let handle = core.obtain(size, false, || core.driver.create_physical(size))?;
    Ok(Spare {
        handle,
        bytes: size,
    })
}

/// Map an existing handle of `bytes` at `va` and enable it; on failure undo the mapping. The
/// error says whether the mapping still stands (its undo failed too).
fn map_piece<D: Driver>(
    core: &Core<D>,
    va: DevicePtr,
    bytes: u64,
    handle: PhysHandle,
) -> std::result::Result<(), (DriverError, bool)> {
    let driver = &core.driver;
    core.stranded.undo_first(driver, &core.ledger);
    driver.map(va, bytes, handle).map_err(|e| (e, false))?;
    if let Err(e) = driver.set_access(va, bytes) {
        return Err((e, driver.unmap(va, bytes).is_err()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::units::MIB;

    fn chosen(sizes: &[u64], left: u64, fits: u64, piece: u64) -> Result<u64, u64> {
        match next_piece(sizes.iter().copied(), left, fits, piece, 2 * MIB) {
            Next::Spare(i) => Ok(sizes[i]),
            Next::New(n) => Err(n),
        }
    }

    #[test]
    fn the_small_pool_leaves_large_spare_pieces_alone() {
        // The small pool (pieces of one granule) needs a page: a spare 40 MiB piece would be
        // mapped whole under it; a new page is made instead.
        assert_eq!(chosen(&[40 * MIB], 2 * MIB, 1 << 40, 2 * MIB), Err(2 * MIB));
        assert_eq!(
            chosen(&[40 * MIB, 2 * MIB], 2 * MIB, 1 << 40, 2 * MIB),
            Ok(2 * MIB)
        );
        // The large pool takes the smallest piece that covers what is left, else the largest
        // that fits, else a new one.
        let big = 88 * MIB;
        assert_eq!(
            chosen(&[40 * MIB, 20 * MIB], 10 * MIB, 1 << 40, big),
            Ok(20 * MIB)
        );
        assert_eq!(
            chosen(&[40 * MIB, 20 * MIB], 60 * MIB, 1 << 40, big),
            Ok(40 * MIB)
        );
        assert_eq!(chosen(&[40 * MIB], 30 * MIB, 36 * MIB, big), Err(30 * MIB));
    }
}
