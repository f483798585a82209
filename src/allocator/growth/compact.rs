//! The compact policy: like expandable, but each growth maps one piece of new physical memory
//! sized to the request (whole granules), and before growing the shard unmaps free memory of
//! its own (and, with `across_streams`, of other shards), giving it back to the driver: reserved
//! bytes follow live bytes, at the price of a synchronisation and an unmap per move.

use super::mapped::{note_move_failure, SyncFirst};
use super::{may_move, moves, At, Grown, Request};
use crate::allocator::block::NIL;
use crate::allocator::core::GrowError;
use crate::allocator::rules;
use crate::allocator::shard::Shard;
use crate::driver::Driver;
use crate::error::OomCause;

#[derive(Debug)]
pub(crate) struct Compact {
    /// [`crate::Config::move_across_streams`].
    pub(crate) across_streams: bool,
}

impl Compact {
    pub(super) fn grow<D: Driver>(&self, at: At<'_, D>, sh: &mut Shard, r: Request) -> Grown {
        let (core, rounded) = (at.core, r.rounded);
        if may_move(core, r.owner, r.stream) {
            let left = match sh.release_for_growth(core, rounded, SyncFirst::Owner, [NIL; 2]) {
                Ok(got) => rounded.saturating_sub(got),
                Err(e) => {
                    note_move_failure(core, &e);
                    rounded
                }
            };
            if left > 0 && self.across_streams && !sh.graphs.capturing() {
                moves::from_other_shards(core, at.shards, sh, left, false);
            }
        }
        let pool = rules::pool_for(rounded);
        let seg = sh.reservation(core, r.owner, pool, core.granularity)?;
        let site = sh
            .lowest_site(seg, rounded, 0)
            .ok_or(GrowError::Memory(OomCause::AddressSpace))?;
        sh.grow_at(core, seg, site, rounded, |sh, start, bytes, _| {
            sh.map_new(core, seg, start, bytes, bytes)
        })
    }
}
