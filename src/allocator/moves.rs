//! Moving free memory between streams (compact and remap modes, with
//! [`super::Config::move_across_streams`]): when a stream's shard must grow and its own free
//! memory does not cover the request (remap: in the large pool; the small pool moves nothing),
//! free memory cached in other shards is unmapped there and taken instead of new memory, so
//! that what one stream cached can serve another. Remap asks a second time when the first ask
//! brought pieces: growth then chooses its site again, with the pieces moved in, and may lack
//! more there than at the site it chose first.
//!
//! Invariants:
//! - The growing shard's lock is held; others are only tried (`try_lock`), never waited for, so
//!   two shards moving memory at once cannot deadlock: a busy shard is passed over.
//! - Only memory wholly inside free blocks is unmapped, never a graph pool's, and never while
//!   any capture is routed to a graph pool (the device synchronisation would spoil it) or the
//!   calling stream captures (the caller checks; `room_wanted` is 0 then).
//! - Before unmapping another shard's memory the whole device is synchronised: its blocks
//!   were freed on that shard's streams, whose handles may have been destroyed since.
//! - Compact mode gives the unmapped memory back to the driver (the growth then commits new
//!   memory within the same total); remap mode hands the unmapped pieces over to the growing
//!   shard as spare, so the physical memory itself moves.

use super::block::NIL;
use super::shard::{note_move_failure, Shard, SyncFirst};
use super::{Allocator, SegmentMode};
use crate::driver::Driver;

impl<D: Driver> Allocator<D> {
    /// Take up to `want` bytes of free memory from shards other than `sh`'s (remap: and every
    /// spare piece they hold).
    #[cold]
    pub(super) fn room_from_other_shards(&self, sh: &mut Shard, want: u64) {
        let mut left = want;
        for j in (0..self.shards.len()).filter(|&j| j != sh.id) {
            if left == 0 {
                break;
            }
            let Some(mut other) = self.shards[j].try_lock() else {
                continue;
            };
            match other.release_for_growth(&self.core, left, SyncFirst::Device, [NIL; 2]) {
                Ok(got) => left = left.saturating_sub(got),
                Err(e) => note_move_failure(&self.core, &e),
            }
            if self.core.mode == SegmentMode::Remap {
                while let Some(p) = other.spare.pop() {
                    sh.spare.push(p);
                }
            }
        }
    }
}
