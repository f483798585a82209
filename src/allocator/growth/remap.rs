//! The remap policy: physical memory in pieces of at most [`Remap::piece`], each mapped whole.
//! Before growing the large pool, the shard unmaps pieces lying wholly inside its free blocks
//! (and, with `across_streams`, other shards'), keeping them as spare, and maps those same
//! pieces where the request needs them (`spare.rs`): few physical allocations, the least
//! fragmentation.
//!
//! Invariants:
//! - Moving memory before growth keeps the free blocks beside the range that growth is to
//!   map, as chosen before the move (growth extends them in place; it chooses again after the
//!   move, with the pieces moved, and may take another range).
//! - The small pool's mappings are pages of one granule, and it maps no larger spare piece (a
//!   large piece there would be pinned by small blocks). Its growth moves memory only when
//!   [`Remap::piece`] is one granule: then every piece is such a page.
//! - A large block is rounded up to whole granules when that adds at most
//!   1/[`rules::REMAP_ALIGN_WASTE`] of it, but never across `max_split_size`.

use super::mapped::{note_move_failure, Site, SyncFirst};
use super::spare::new_bytes_for;
use super::{may_move, moves, At, Grown, Request};
use crate::allocator::block::{BlockId, NIL};
use crate::allocator::config::{Config, DEFAULT_REMAP_PIECE};
use crate::allocator::core::{Core, GrowError};
use crate::allocator::owner::Owner;
use crate::allocator::rules::{self, PoolKind};
use crate::allocator::shard::Shard;
use crate::driver::{DevicePtr, Driver, StreamId};
use crate::error::OomCause;

/// Growth weighs at most this many unmapped ranges for where to map spare pieces.
const WEIGHED: usize = 32;

/// The largest piece kept (256 TiB, larger than any device): a caller's larger one, up to
/// `u64::MAX`, means the same (every piece as large as the growth needs), and sums of a piece
/// and a growth's bytes stay far from overflowing.
const LARGEST_PIECE: u64 = 1 << 48;

#[derive(Debug)]
pub(crate) struct Remap {
    /// The largest piece of the large pool mapped by one `cuMemMap` (whole granules).
    pub(crate) piece: u64,
    /// [`crate::Config::move_across_streams`].
    pub(crate) across_streams: bool,
    /// [`crate::Config::unmap_later`].
    unmap_later: bool,
    granularity: u64,
    max_split: u64,
}

impl Remap {
    pub(super) fn new(config: &Config, granularity: u64, max_split: u64) -> Remap {
        let piece = config
            .remap_piece
            .unwrap_or(DEFAULT_REMAP_PIECE)
            .clamp(1, LARGEST_PIECE);
        Remap {
            piece: piece.div_ceil(granularity) * granularity,
            across_streams: config.move_across_streams,
            unmap_later: config.unmap_later,
            granularity,
            max_split,
        }
    }

    /// The block size for a request of `size` bytes: PyTorch's rounding, and a large block up
    /// to a whole granule when that costs little ([`rules::remap_round`]), but never across
    /// `max_split_size` (a request under it must not become an oversize one, which may take a
    /// larger cached block whole).
    #[inline]
    pub(super) fn round(&self, size: u64) -> u64 {
        let rounded = rules::round_size(size);
        let up = rules::remap_round(rounded, self.granularity);
        if rounded < self.max_split && up >= self.max_split {
            rounded
        } else {
            up
        }
    }

    /// The largest new piece growth in `pool` creates (the small pool's pages are one granule).
    fn largest_piece(&self, pool: PoolKind) -> u64 {
        match pool {
            PoolKind::Small => self.granularity,
            PoolKind::Large => self.piece,
        }
    }

    pub(super) fn grow<D: Driver>(&self, at: At<'_, D>, sh: &mut Shard, r: Request) -> Grown {
        let (core, shards, owner, rounded) = (at.core, at.shards, r.owner, r.rounded);
        let pool = rules::pool_for(rounded);
        // A small-pool page is one granule. With larger pieces, moving memory for it would map
        // a whole free piece of the large pool (CUDA maps whole handles), where small blocks
        // that live long would pin all of it; new pages cost a map each, as the small pool's
        // always do. With pieces of one granule every piece is such a page, and the two pools
        // trade free pages: a workload whose small blocks come and go in waves (a serving
        // loop's) would otherwise keep the pages of its last wave as well as the large pool's.
        // So a pool moves memory when it may map every piece a move frees.
        let pool_moves = self.piece <= self.largest_piece(pool);
        // Asked once: it is a driver call.
        let moving = may_move(core, owner, r.stream);
        if moving && !sh.retiring.is_empty() {
            // Old mappings whose work has finished go now, so that their ranges can be mapped
            // again without a wait (failures are logged and tried again). Not for a graph
            // pool's growth, which may be inside a capture, where events are not asked.
            let _ = sh.finish_retiring(core, |_| true, false);
        }
        if pool_moves && moving {
            let left = self.make_room(core, sh, owner, r.stream, rounded);
            if left > 0 && self.across_streams && !sh.graphs.capturing() {
                // With the pieces moved in, growth chooses its site again and may need more
                // than the site chosen first lacked (a piece too wide for a hole goes to a range
                // that needs more of it): ask the other shards once more, if they had anything
                // to give.
                let spare = sh.spare_bytes();
                moves::from_other_shards(core, shards, sh, left, true);
                if sh.spare_bytes() > spare {
                    let more = self.room_wanted(core, sh, owner, rounded).0;
                    if more > 0 {
                        moves::from_other_shards(core, shards, sh, more, true);
                    }
                }
            }
        }
        let seg = sh.reservation(core, owner, pool, self.granularity)?;
        let site = self
            .site(sh, seg, rounded)
            .ok_or(GrowError::Memory(OomCause::AddressSpace))?;
        let piece = self.largest_piece(pool);
        if let Site::Map { range, bytes } = site {
            let (lo, hi) = reach(sh, range, bytes, piece);
            sh.clear_for_map(core, seg, lo, hi)?;
        }
        sh.grow_at(core, seg, site, rounded, |sh, start, bytes, room| {
            sh.map_spare(core, seg, start, bytes, room, piece)
        })
    }

    /// Before growing a pool that moves memory (the large pool; both pools when pieces are one
    /// granule): unmap free pieces of this shard, so that reserved bytes follow live bytes
    /// (their pieces become spare, to be mapped here), except the free blocks beside the range
    /// that growth will map: growth uses them where they are, and moving them would only map
    /// their pieces back (one unmap, map and set-access each, for nothing). Returns the bytes
    /// still wanted. A failure only means that less is moved.
    fn make_room<D: Driver>(
        &self,
        core: &Core<D>,
        sh: &mut Shard,
        owner: Owner,
        stream: StreamId,
        rounded: u64,
    ) -> u64 {
        let (want, site) = self.room_wanted(core, sh, owner, rounded);
        if want == 0 {
            return 0;
        }
        let keep = site.map_or([NIL; 2], |u| [sh.blocks[u].prev, sh.blocks[u].next]);
        let sync = if self.unmap_later {
            SyncFirst::Later(stream)
        } else {
            SyncFirst::Owner
        };
        match sh.release_for_growth(core, want, sync, keep) {
            Ok(got) => want.saturating_sub(got),
            Err(e) => {
                note_move_failure(core, &e);
                want
            }
        }
    }

    /// How much memory large-pool growth for `owner` should move before it adds any, and the
    /// unmapped range it will map ([`Remap::site`], with the spare pieces on hand now).
    fn room_wanted<D: Driver>(
        &self,
        core: &Core<D>,
        sh: &Shard,
        owner: Owner,
        rounded: u64,
    ) -> (u64, Option<BlockId>) {
        let g = core.granularity;
        let seg = sh.reservation_of(owner, rules::pool_for(rounded));
        let (bytes, site) = match seg.and_then(|seg| self.site(sh, seg, rounded)) {
            Some(Site::Free(_)) => return (0, None),
            Some(Site::Map { range, bytes }) => (bytes, Some(range)),
            None => (rounded.div_ceil(g) * g, None),
        };
        (bytes.saturating_sub(sh.spare_bytes()), site)
    }

    /// Where in `seg` growth for a request of `rounded` bytes goes: a free block that holds it
    /// already (the cache passed it over only because it is at least max_split_size; growth
    /// serves from it, as PyTorch's expandable segments do), or an unmapped range that, with the
    /// free blocks on either side, holds it, and the bytes to map at its front.
    ///
    /// The lowest such range; except that with spare pieces on hand it weighs the lowest
    /// [`WEIGHED`] ranges and takes the one that needs the fewest new bytes, the lowest of those:
    /// a range too narrow for the pieces would leave them unused and create new memory. Only
    /// [`WEIGHED`] ranges: each costs a pass over the spare pieces per piece mapped, and a
    /// reservation riddled with holes must not make growth slow.
    ///
    /// A range where a moved piece's old mapping still waits (`later.rs`) is passed over while
    /// another will do: mapping there would first wait for the stream.
    fn site(&self, sh: &Shard, seg: u32, rounded: u64) -> Option<Site> {
        if sh.retiring_in(seg) {
            if let Some(site) = self.site_avoiding(sh, seg, rounded, true) {
                return Some(site);
            }
        }
        self.site_avoiding(sh, seg, rounded, false)
    }

    fn site_avoiding(&self, sh: &Shard, seg: u32, rounded: u64, avoid: bool) -> Option<Site> {
        let s = sh.segments.get(seg);
        let piece = self.largest_piece(s.pool);
        // The large pool grows by at least a large segment's worth, as PyTorch's segments do:
        // small requests then do not each cost a map.
        let floor = match s.pool {
            PoolKind::Large => rules::LARGE_BUFFER,
            PoolKind::Small => 0,
        };
        // Whether mapping at the front of range `u` would cover a retiring mapping.
        let waits = |u: BlockId, bytes: u64| {
            let (lo, hi) = reach(sh, u, bytes, piece);
            avoid && sh.retiring.iter().any(|r| r.overlaps(seg, lo, hi))
        };
        // Only the pieces this pool may map weigh (`next_piece` passes over larger ones).
        let sizes = sh.spare_sizes(piece);
        if sizes.is_empty() && !avoid {
            return sh.lowest_site(seg, rounded, floor);
        }
        let (mut best, mut best_new, mut weighed) = (None, u64::MAX, 0);
        for &(_, u) in &s.virt().unmapped {
            let bytes = match sh.site_at(seg, u, rounded, floor) {
                None => continue,
                Some(Site::Map { bytes, .. }) => bytes,
                free => return free,
            };
            if waits(u, bytes) {
                continue;
            }
            if sizes.is_empty() {
                // The lowest range, as `lowest_site` takes it.
                return Some(Site::Map { range: u, bytes });
            }
            let room = sh.blocks[u].size;
            let new = new_bytes_for(sizes.clone(), bytes, room, piece, self.granularity);
            if new < best_new {
                (best, best_new) = (Some(Site::Map { range: u, bytes }), new);
            }
            weighed += 1;
            if new == 0 || weighed == WEIGHED {
                break;
            }
        }
        best
    }
}

/// What `map_spare` may map to put `bytes` at the front of unmapped range `u`: those bytes and
/// at most a piece more, within the range.
fn reach(sh: &Shard, u: BlockId, bytes: u64, piece: u64) -> (DevicePtr, DevicePtr) {
    let (lo, room) = (sh.blocks[u].addr, sh.blocks[u].size);
    (lo, lo + (bytes + piece).min(room))
}
