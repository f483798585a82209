//! Moving free memory between streams (the compact and remap policies, with
//! [`crate::Config::move_across_streams`]): when a stream's shard must grow and its own free
//! memory does not cover the request, free memory cached in other shards is unmapped there and
//! taken instead of new memory, so that what one stream cached can serve another.
//!
//! Invariants:
//! - The growing shard's lock is held; others are only tried (`try_lock`), never waited for, so
//!   two shards moving memory at once cannot deadlock: a busy shard is passed over.
//! - Only memory wholly inside free blocks is unmapped, never a graph pool's, and never while
//!   any capture is routed to a graph pool (the device synchronisation would spoil it) or the
//!   calling stream captures (the policies check before asking).
//! - Before unmapping another shard's memory the whole device is synchronised: its blocks
//!   were freed on that shard's streams, whose handles may have been destroyed since.
//! - Compact gives the unmapped memory back to the driver (the growth then commits new memory
//!   within the same total); remap hands the unmapped pieces over to the growing shard as
//!   spare (`take_spares`), so the physical memory itself moves.

use super::mapped::{note_move_failure, SyncFirst};
use crate::allocator::block::NIL;
use crate::allocator::core::Core;
use crate::allocator::shard::{Shard, Shards};
use crate::driver::Driver;

/// Take up to `want` bytes of free memory from the shards other than `sh` (with
/// `take_spares`, every spare piece they hold too, into `sh`'s).
#[cold]
pub(crate) fn from_other_shards<D: Driver>(
    core: &Core<D>,
    shards: &Shards,
    sh: &mut Shard,
    want: u64,
    take_spares: bool,
) {
    let mut left = want;
    for j in (0..shards.len()).filter(|&j| j != sh.id) {
        if left == 0 {
            break;
        }
        let Some(mut other) = shards[j].try_lock() else {
            continue;
        };
        let got = match other.release_for_growth(core, left, SyncFirst::Device, [NIL; 2]) {
            Ok(got) => Some(got),
            Err(e) => {
                note_move_failure(core, &e);
                None
            }
        };
        // A spare piece whose old mapping still waits for that shard's stream would be used
        // here, on another stream, before that work ends: finish them first (after the device
        // synchronisation a move makes, nothing waits), or take no spares.
        let settled = got.is_some()
            && other
                .finish_retiring(core, |_| true, true)
                .map_err(|e| note_move_failure(core, &e.into()))
                .is_ok();
        if let Some(got) = got {
            // What was unmapped there counts only where it comes here (compact gave it back to
            // the driver; remap takes it as spare only once settled).
            if settled || !take_spares {
                left = left.saturating_sub(got);
            }
        }
        if take_spares && settled {
            sh.spare.extend(other.spare.drain(..).rev());
        }
    }
}
