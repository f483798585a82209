//! Sleep and wake in one shard: a tag's regions (its segments, with `Config::separate_tags`:
//! those of every stream and of every CUDA graph pool) lose their physical memory and keep
//! their addresses; waking maps fresh memory at the same addresses, where captured graphs
//! replay as before. The allocator (`allocator/sleep.rs`) holds the shards' locks and does the
//! copies; this file keeps the shard's tables true.
//!
//! Invariants:
//! - A tag is asleep in a shard exactly when its bit is set in `asleep`; then its regions'
//!   free lists are marked asleep (nothing is served from them), its regions' segments are
//!   neither grown, released nor moved, and every mapping of them has `sleep` set.
//! - An asleep mapping with `gone` has no memory behind its range (released and unmapped,
//!   counted in the ledger's sleeping bytes, not in reserved); without `gone` it still holds
//!   its memory (a release or unmap failed), mapped as before and counted in reserved.
//! - A free of asleep memory is deferred (`deferred`) and applied once the tag wakes: nothing
//!   is put back into an asleep free list while it sleeps.

use super::mapped::map_one;
use crate::allocator::core::Core;
use crate::allocator::history::Action;
use crate::allocator::segment::{Mapping, Slept, DISCARDED};
use crate::allocator::shard::{tag_bit, Shard};
use crate::driver::{DevicePtr, Driver, DriverError, PhysHandle};
use crate::tag::Tag;
use std::sync::atomic::Ordering::Relaxed;

/// One mapping of an asleep tag: its segment, address and size.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TagMapping {
    pub seg: u32,
    pub va: DevicePtr,
    pub bytes: u64,
}

impl Shard {
    /// Every mapping of `tag`'s regions in this shard, in segment and address order.
    pub(crate) fn tag_mappings(&self, tag: Tag) -> Vec<TagMapping> {
        let mut out = Vec::new();
        for (seg, s) in self.segments.iter() {
            if s.owner.region() != Some(tag) || !s.is_virtual() {
                continue;
            }
            for (&va, m) in &s.virt().mappings {
                out.push(TagMapping {
                    seg,
                    va,
                    bytes: m.bytes,
                });
            }
        }
        out
    }

    /// `tag` is asleep here from now: its allocations are refused and its frees deferred, so
    /// its mappings stay as they are while its contents are copied with no shard locked.
    pub(crate) fn mark_asleep(&mut self, tag: Tag) {
        self.asleep |= tag_bit(tag);
        for l in &mut self.lists {
            if l.owner.region() == Some(tag) {
                l.asleep = true;
            }
        }
    }

    /// Give asleep `tag`'s memory back here: each of its mappings is marked with where its
    /// contents wait (`hosts`, in [`Shard::tag_mappings`] order), then released and unmapped.
    /// Returns (bytes given back, bytes still held because a release or unmap failed; those
    /// stay mapped with their contents).
    pub(crate) fn put_to_sleep<D: Driver>(
        &mut self,
        core: &Core<D>,
        tag: Tag,
        maps: &[TagMapping],
        hosts: &[u64],
    ) -> (u64, u64) {
        debug_assert!(self.tag_asleep(tag), "marked asleep first");
        let (mut gone, mut held) = (0, 0);
        for (m, &host) in maps.iter().zip(hosts) {
            let ok = self.give_back(core, m);
            let map = self.mapping_mut(m);
            map.sleep = Some(Slept { host, gone: ok });
            if ok {
                core.history
                    .record_sleep(Action::SegmentUnmap, m.va, m.bytes, tag);
                gone += m.bytes;
                core.ledger.on_unreserve(m.bytes, false);
                core.ledger.sleeping_add(tag, m.bytes);
                core.graph_bytes(self.segments.get(m.seg).owner, m.bytes, true);
                core.uncommit(m.bytes);
            } else {
                held += m.bytes;
            }
        }
        (gone, held)
    }

    /// Release and unmap one mapping; false (logged) when either fails: it then keeps its
    /// memory and its contents.
    fn give_back<D: Driver>(&mut self, core: &Core<D>, m: &TagMapping) -> bool {
        let map = self.mapping_mut(m);
        // Release first: a released handle stays alive while mapped, so a failed unmap after
        // it leaves a consistent (mapped, released) mapping.
        if !map.released {
            if let Err(e) = core.driver.release_physical(map.handle) {
                tracing::warn!(error = %e, va = m.va, "sleep could not release a mapping's memory; it stays held");
                return false;
            }
            map.released = true;
            // A released handle cannot serve as a spare piece (remap mode) when unmapped.
            map.pooled = false;
        }
        if let Err(e) = core.driver.unmap(m.va, m.bytes) {
            tracing::warn!(error = %e, va = m.va, "sleep could not unmap a mapping; its memory stays held");
            return false;
        }
        true
    }

    fn mapping_mut(&mut self, m: &TagMapping) -> &mut Mapping {
        self.segments
            .get_mut(m.seg)
            .virt_mut()
            .mappings
            .get_mut(&m.va)
            .expect("an asleep tag's mapping stays in its segment")
    }

    /// Map fresh memory under every given-back mapping of asleep `tag`, pushing each one made
    /// onto `made` (for [`Shard::unmake`] if the wake fails later). The bytes were committed
    /// by the caller.
    pub(crate) fn remake<D: Driver>(
        &mut self,
        core: &Core<D>,
        tag: Tag,
        made: &mut Vec<(TagMapping, PhysHandle)>,
    ) -> std::result::Result<(), DriverError> {
        for m in self.tag_mappings(tag) {
            let map = self.mapping_mut(&m);
            if !map.sleep.is_some_and(|s| s.gone) {
                continue;
            }
            let h = map_one(core, m.va, m.bytes)?;
            core.waking.fetch_add(m.bytes, Relaxed);
            core.history
                .record_sleep(Action::SegmentMap, m.va, m.bytes, tag);
            // A graph pool's region counts as graph memory again as soon as it is mapped (its
            // reserved bytes are counted once the whole wake holds, `Shard::awake`).
            core.graph_bytes(self.segments.get(m.seg).owner, m.bytes, false);
            let map = self.mapping_mut(&m);
            map.handle = h;
            map.released = false;
            map.pooled = false;
            map.sleep = Some(Slept {
                gone: false,
                ..map.sleep.expect("checked above")
            });
            made.push((m, h));
        }
        Ok(())
    }

    /// Undo one mapping a failed wake made: give its memory back again; if that fails too it
    /// stays mapped (and held, counted in reserved). Returns whether it was given back.
    pub(crate) fn unmake<D: Driver>(&mut self, core: &Core<D>, tag: Tag, m: &TagMapping) -> bool {
        let ok = self.give_back(core, m);
        core.waking.fetch_sub(m.bytes, Relaxed);
        if ok {
            core.history
                .record_sleep(Action::SegmentUnmap, m.va, m.bytes, tag);
            core.graph_bytes(self.segments.get(m.seg).owner, m.bytes, true);
        }
        let map = self.mapping_mut(m);
        let s = map.sleep.expect("a mapping made by wake is asleep");
        map.sleep = Some(Slept { gone: ok, ..s });
        if !ok {
            // It holds memory now, as any mapping does.
            core.ledger.on_reserve(m.bytes, false);
            core.ledger.sleeping_sub(tag, m.bytes);
        }
        ok
    }

    /// The offloaded mappings of asleep `tag`: (address, bytes, host offset).
    pub(crate) fn offloaded(&self, tag: Tag) -> Vec<(DevicePtr, u64, u64)> {
        self.tag_mappings(tag)
            .into_iter()
            .filter_map(|m| {
                let s = self.segments.get(m.seg).virt().mappings[&m.va].sleep?;
                (s.host != DISCARDED).then_some((m.va, m.bytes, s.host))
            })
            .collect()
    }

    /// The discarded mappings of asleep `tag`: (address, bytes).
    pub(crate) fn discarded(&self, tag: Tag) -> Vec<(DevicePtr, u64)> {
        self.tag_mappings(tag)
            .into_iter()
            .filter(|m| {
                let s = self.segments.get(m.seg).virt().mappings[&m.va].sleep;
                s.is_some_and(|s| s.host == DISCARDED)
            })
            .map(|m| (m.va, m.bytes))
            .collect()
    }

    /// `tag` is awake again here: its mappings are marked awake (those remade counted in
    /// reserved, no longer sleeping), its free lists rejoin the index, and the frees deferred
    /// while it slept are applied (failures logged).
    pub(crate) fn awake<D: Driver>(&mut self, core: &Core<D>, tag: Tag, remade: u64) {
        for m in self.tag_mappings(tag) {
            self.mapping_mut(&m).sleep = None;
        }
        // Out of `waking` before into reserved: a reader in between sees less memory held,
        // never more (`Core::outside_now`).
        core.waking.fetch_sub(remade, Relaxed);
        core.ledger.on_reserve(remade, false);
        core.ledger.sleeping_sub(tag, remade);
        self.asleep &= !tag_bit(tag);
        for l in &mut self.lists {
            if l.owner.region() == Some(tag) {
                l.asleep = false;
            }
        }
        let deferred = std::mem::take(&mut self.deferred);
        for ptr in deferred {
            let Some(id) = self.live_block(ptr) else {
                tracing::warn!(
                    ptr,
                    "a free deferred while its memory slept names no allocation"
                );
                continue;
            };
            if self.sleeps(self.owner_of(id)) {
                self.deferred.push(ptr);
                continue;
            }
            // No stream can still be using it: sleep synchronised the device, and nothing
            // touched the memory while it slept. So the free needs no events and cannot fail.
            self.blocks[id].used_streams.clear();
            if let Err(e) = self.free(core, ptr) {
                tracing::warn!(error = %e, ptr, "a free deferred while its memory slept failed");
            }
        }
    }
}
