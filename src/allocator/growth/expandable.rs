//! The expandable policy, PyTorch's `expandable_segments:True`: one reservation per (owner,
//! pool), grown at its lowest unmapped range by pages of 2 MiB (small pool) or 20 MiB (large
//! pool), each page its own handle; free pages are unmapped only by `empty_cache`.

use crate::allocator::block::BlockId;
use crate::allocator::core::{Core, GrowError};
use crate::allocator::owner::Owner;
use crate::allocator::rules;
use crate::allocator::shard::Shard;
use crate::driver::Driver;
use crate::error::OomCause;

pub(super) fn grow<D: Driver>(
    core: &Core<D>,
    sh: &mut Shard,
    owner: Owner,
    rounded: u64,
) -> Result<BlockId, GrowError> {
    let pool = rules::pool_for(rounded);
    let page = rules::expandable_page(pool, core.granularity);
    let seg = sh.reservation(core, owner, pool, page)?;
    let site = sh
        .lowest_site(seg, rounded, 0)
        .ok_or(GrowError::Memory(OomCause::AddressSpace))?;
    sh.grow_at(core, seg, site, rounded, |sh, start, bytes, _| {
        sh.map_new(core, seg, start, bytes, page)
    })
}
