//! Wake: the sleeping tags' memory mapped again at the same addresses, and their contents put
//! back (`sleep.rs` says how they went to sleep).
//!
//! Invariants:
//! - Tags are woken one at a time: every shard's lock is taken to map a tag and to mark it
//!   awake, and let go of across the copies back (the next tag's memory is mapped meanwhile).
//! - A wake that fails gives back what it mapped (or keeps it, counted, where that fails too);
//!   the tag stays asleep with its host copy, and wake can be retried.
//! - The KV cache of `reserve_kv` wakes first, under its own lock with no shard locked, after
//!   the same checks; if the rest of the KV tag then stays asleep, it is given back again.

use std::time::Instant;

use super::core::GrowError;
use super::front::Allocator;
use super::growth::sleep::TagMapping;
use super::growth::SyncFirst;
use super::host::{queue_copies, Direction, SleepState};
use super::phases::Phases;
use super::shard::Shard;
use super::sleep_report::WakeReport;
use super::spin::SpinGuard;
use super::staging;
use crate::driver::counting::Counting;
use crate::driver::{DevicePtr, Driver, DriverError, PhysHandle, StreamId};
use crate::error::{Error, Result};
use crate::tag::Tag;

/// A sleeping tag whose memory a wake mapped again, its contents not yet put back.
struct Mapped {
    tag: Tag,
    /// The tag's bytes asleep when the wake began (committed against the cap).
    gone: u64,
    /// What was mapped, by shard.
    made: Vec<Vec<(TagMapping, PhysHandle)>>,
    /// What to put back, by shard.
    work: Vec<Contents>,
}

/// What a wake puts back in one shard: offloaded mappings (address, bytes, host offset) and
/// discarded ones to fill with zeros (address, bytes).
struct Contents {
    offloaded: Vec<(DevicePtr, u64, u64)>,
    discarded: Vec<(DevicePtr, u64)>,
}

fn is_out_of_memory(e: &Error) -> bool {
    match e {
        Error::OutOfMemory(_) => true,
        Error::Driver(d) => d.is_out_of_memory(),
        _ => false,
    }
}

impl<D: Driver> Allocator<D> {
    /// Wake sleeping tags (all of them when `tags` is empty): fresh memory is mapped at their
    /// addresses and the offloaded contents are copied back. Tags are woken one at a time (the
    /// next one's memory is mapped while this one's contents are copied back); one
    /// that cannot be woken (the device lacks room, a driver call fails) stays asleep, with
    /// nothing lost, and the others are still tried. Waking a tag applies the frees deferred
    /// while it slept, which may make room for another: the tags left asleep are tried again
    /// as long as a round wakes any. The first error of the last round is returned; wake can be
    /// retried.
    pub fn wake(&self, tags: &[Tag]) -> Result<WakeReport> {
        let t0 = Instant::now();
        let mut st = self.sleep.lock();
        let mut phases = Phases::start();
        let mut report = WakeReport::default();
        let wanted = |t: Tag| tags.is_empty() || tags.contains(&t);
        // The KV cache of `reserve_kv` first, under its own lock (taken before the shards'):
        // the largest piece of the KV tag. If it cannot wake, the KV tag stays asleep; if the
        // rest of the tag cannot, it is given back again below.
        let (kv_woke, kv_failed) = if wanted(Tag::KvCache) {
            match self.wake_kv_region(&mut st, &mut report) {
                Ok(woke) => (woke, None),
                Err(
                    e @ (Error::Capturing(_)
                    | Error::SleepNeedsVirtualMemory(_)
                    | Error::SleepNeedsSeparateTags),
                ) => return Err(e),
                Err(e) => (false, Some(e)),
            }
        } else {
            (false, None)
        };
        let mut shards = self.lock_all()?;
        if let Err(e) = self.check_sleepable(&shards, "wake") {
            drop(shards);
            if kv_woke {
                self.kv_region_back_to_sleep();
            }
            return Err(e);
        }
        let mut left: Vec<Tag> = Tag::ALL
            .into_iter()
            .filter(|&t| wanted(t) && shards[0].tag_asleep(t))
            .filter(|&t| !(t == Tag::KvCache && kv_failed.is_some()))
            .collect();
        let failed = loop {
            let before = left.len();
            let mut first = None;
            let round = self.wake_round(&mut st, &mut shards, &left, &mut report, &mut phases);
            left.clear();
            for (t, r) in round {
                match r {
                    Ok(()) => report.tags.push(t),
                    Err(e) => {
                        first.get_or_insert(Error::Wake {
                            tag: t,
                            source: Box::new(e),
                        });
                        left.push(t);
                    }
                }
            }
            if left.is_empty() || left.len() == before || shards.is_empty() {
                break first;
            }
        };
        // Reported in tag order, whichever round woke each.
        report.tags.sort_by_key(|t| t.index());
        // Unpinning takes time too: the host memory of awake tags (this wake's, and any an
        // earlier one could not free) goes with no shard locked.
        let awake: Vec<Tag> = match shards.first() {
            Some(sh) => Tag::ALL
                .into_iter()
                .filter(|&t| !sh.tag_asleep(t))
                .collect(),
            None => Vec::new(),
        };
        drop(shards);
        if kv_woke && !awake.contains(&Tag::KvCache) {
            // The KV cache woke but the rest of its tag did not: asleep again, with its tag.
            self.kv_region_back_to_sleep();
        }
        phases.mark("marked awake");
        // Host memory an earlier sleep kept because its copies could not be waited for is
        // freed only once they can be.
        if !st.retain_host && st.settle(&self.core.driver) {
            for t in awake {
                st.host[t.index()].free_all(&self.core.driver);
            }
        }
        phases.mark("host memory freed");
        st.drop_ring(&self.core.driver);
        phases.mark("ring freed");
        phases.log("wake");
        let kv_failed = kv_failed.map(|e| Error::Wake {
            tag: Tag::KvCache,
            source: Box::new(e),
        });
        if let Some(e) = failed.or(kv_failed) {
            return Err(e);
        }
        report.host_bytes_after = st.host_bytes();
        report.seconds = t0.elapsed().as_secs_f64();
        Ok(report)
    }

    /// Map the asleep KV cache of `reserve_kv` again at its addresses and fill it with zeros
    /// (unless told to leave discarded memory as it comes); on an error it is given back
    /// again and stays asleep.
    fn wake_kv_region(&self, st: &mut SleepState, report: &mut WakeReport) -> Result<bool> {
        let mut kv = self.kv.lock();
        let Some(region) = kv.as_mut().filter(|r| r.is_asleep()) else {
            return Ok(false);
        };
        // Nothing is mapped or filled during a capture (the fill's synchronisation would spoil
        // it), nor where the allocator cannot sleep.
        self.check_sleepable(&self.lock_all()?, "wake")?;
        let bytes = region.wake(&self.core)?;
        if bytes > 0 && !st.leave_discarded {
            let d = &self.core.driver;
            let zeroed = st
                .stream(d)
                .and_then(|s| d.fill_zero(region.base, bytes, s).map(|()| s))
                .and_then(|s| d.sync_stream(s));
            if let Err(e) = zeroed {
                if let Err(e2) = region.sleep(&self.core) {
                    tracing::warn!(error = %e2, "the KV cache could not be given back after its wake failed; it stays mapped, not zeroed");
                }
                return Err(e.into());
            }
            report.zeroed_bytes += bytes;
        }
        report.mapped_bytes += bytes;
        Ok(true)
    }

    /// Give the KV cache of `reserve_kv` back again after its tag failed to wake (with no
    /// shard locked: the cache's lock comes first).
    fn kv_region_back_to_sleep(&self) {
        let mut kv = self.kv.lock();
        if let Some(region) = kv.as_mut().filter(|r| !r.is_asleep()) {
            if let Err(e) = region.sleep(&self.core) {
                tracing::warn!(error = %e, "the KV cache woke but its tag did not, and it could not be given back; it stays mapped, its tag asleep");
            }
        }
    }

    /// Wake `tags` in order, each one's outcome in the same order. Each tag is mapped with every
    /// shard locked; its contents are put back with none locked, while the next tag is mapped
    /// on another thread (mapping 32 GiB took 0.035 s on the H200, 0.14 to 0.19 s in 2 MiB
    /// pages, and copies do not wait for it); then every shard is locked again to mark it awake
    /// or, on a failure, to give back what was mapped. `shards` are locked again at the end
    /// (left empty only if a shard is poisoned).
    fn wake_round<'a>(
        &'a self,
        st: &mut SleepState,
        shards: &mut Vec<SpinGuard<'a, Shard>>,
        tags: &[Tag],
        report: &mut WakeReport,
        phases: &mut Phases,
    ) -> Vec<(Tag, Result<()>)> {
        let mut out = Vec::with_capacity(tags.len());
        let Some(&first) = tags.first() else {
            return out;
        };
        let zero = !st.leave_discarded;
        let mut next = Some(self.map_retrying(shards, first, zero));
        phases.mark("mapped");
        for (i, &t) in tags.iter().enumerate() {
            let after = tags.get(i + 1).copied();
            let mapped = match next.take() {
                Some(Ok(m)) => m,
                Some(Err(e)) => {
                    out.push((t, Err(e)));
                    next = after.map(|u| self.map_retrying(shards, u, zero));
                    phases.mark("mapped");
                    continue;
                }
                None => unreachable!("every tag is mapped before its turn"),
            };
            shards.clear();
            let (put_back, upcoming) = std::thread::scope(|s| {
                // No retry there: this tag's deferred frees are not applied yet, so the cache
                // it would release is not all there is. A tag that found no room ahead is
                // mapped again once this one is awake.
                let ahead = after.and_then(|u| {
                    std::thread::Builder::new()
                        .spawn_scoped(s, move || {
                            let mut sh = self.lock_all()?;
                            self.map_tag(&mut sh, u, zero)
                        })
                        .ok()
                });
                let t_copy = Instant::now();
                let put_back = self.restore(st, t, &mapped.work);
                report.copy_seconds += t_copy.elapsed().as_secs_f64();
                let upcoming = ahead.map(|h| h.join().expect("a wake's mapping thread panicked"));
                (put_back, upcoming)
            });
            phases.mark("copied");
            match self.lock_all() {
                Ok(g) => *shards = g,
                Err(e) => {
                    // Only a panic elsewhere poisons a shard. What this wake mapped for this
                    // tag and the next stays mapped, and no tag left is tried.
                    if let Some(Ok(m)) = &upcoming {
                        tracing::error!(tag = %m.tag, "a shard is poisoned: memory mapped to wake this tag stays mapped");
                    }
                    tracing::error!(tag = %t, "a shard is poisoned: memory mapped to wake this tag stays mapped");
                    let shard = match e {
                        Error::Poisoned { shard } => shard,
                        _ => 0,
                    };
                    out.push((t, Err(e)));
                    for &u in &tags[i + 1..] {
                        out.push((u, Err(Error::Poisoned { shard })));
                    }
                    return out;
                }
            }
            out.push((t, self.finish_tag(shards, mapped, put_back, report)));
            // A mapping thread that could not be started, or that found no room, leaves the
            // next tag to this one, now that this one is awake.
            next = match upcoming {
                Some(Err(e)) if is_out_of_memory(&e) => None,
                other => other,
            };
            if next.is_none() {
                next = after.map(|u| self.map_retrying(shards, u, zero));
            }
            phases.mark("marked awake");
        }
        out
    }

    /// [`Allocator::map_tag`], and once more after giving the cache back when the device lacked
    /// room: what the awake tags cached since the sleep may be what is missing, as for an
    /// allocation.
    fn map_retrying<'a>(
        &'a self,
        shards: &mut [SpinGuard<'a, Shard>],
        t: Tag,
        zero: bool,
    ) -> Result<Mapped> {
        let mapped = self.map_tag(shards, t, zero);
        if !mapped.as_ref().is_err_and(is_out_of_memory) {
            return mapped;
        }
        for sh in shards.iter_mut() {
            if let Err(e) = sh.release_cached(&self.core, SyncFirst::Owner) {
                tracing::warn!(error = %e, "releasing the cache before retrying a wake failed");
            }
        }
        self.map_tag(shards, t, zero)
    }

    /// Map fresh memory under `tag`'s mappings, with every shard locked, and list what to put
    /// back (discarded memory to fill with zeros only if `zero`); on a failure, what was mapped
    /// is given back and the tag stays asleep.
    fn map_tag(&self, shards: &mut [SpinGuard<'_, Shard>], tag: Tag, zero: bool) -> Result<Mapped> {
        let gone = self.core.ledger.sleeping(tag);
        match self.core.commit(gone) {
            Ok(()) => {}
            Err(GrowError::Memory(cause)) => {
                return Err(Error::OutOfMemory(Box::new(
                    self.oom_report(gone, gone, cause),
                )))
            }
            Err(GrowError::Driver(e)) => return Err(e.into()),
        }
        let mut mapped = Mapped {
            tag,
            gone,
            made: vec![Vec::new(); shards.len()],
            work: Vec::new(),
        };
        for (i, sh) in shards.iter_mut().enumerate() {
            if let Err(e) = sh.remake(&self.core, tag, &mut mapped.made[i]) {
                self.unmap_tag(shards, &mapped);
                return Err(e.into());
            }
        }
        mapped.work = shards
            .iter()
            .map(|sh| Contents {
                offloaded: sh.offloaded(tag),
                discarded: if zero { sh.discarded(tag) } else { Vec::new() },
            })
            .collect();
        Ok(mapped)
    }

    /// Give back what a wake mapped for a tag that stays asleep; what cannot be given back
    /// stays held and counted.
    fn unmap_tag(&self, shards: &mut [SpinGuard<'_, Shard>], mapped: &Mapped) {
        let mut held = 0;
        for (i, sh) in shards.iter_mut().enumerate() {
            for (m, _) in &mapped.made[i] {
                if !sh.unmake(&self.core, mapped.tag, m) {
                    held += m.bytes;
                }
            }
        }
        self.core.uncommit(mapped.gone - held);
    }

    /// With every shard locked again after the contents were put back: the tag is awake, or, if
    /// `put_back` failed, given back what was mapped and left asleep.
    fn finish_tag(
        &self,
        shards: &mut [SpinGuard<'_, Shard>],
        mapped: Mapped,
        put_back: Result<(u64, u64)>,
        report: &mut WakeReport,
    ) -> Result<()> {
        let (restored, zeroed) = match put_back {
            Ok(n) => n,
            Err(e) => {
                self.unmap_tag(shards, &mapped);
                return Err(e);
            }
        };
        report.restored_bytes += restored;
        report.zeroed_bytes += zeroed;
        for (i, sh) in shards.iter_mut().enumerate() {
            let remade: u64 = mapped.made[i].iter().map(|(m, _)| m.bytes).sum();
            report.mapped_bytes += remade;
            sh.awake(&self.core, mapped.tag, remade);
        }
        // Memory still held from a failed give-back was committed when it was mapped first.
        let remade_all: u64 = mapped.made.iter().flatten().map(|(m, _)| m.bytes).sum();
        self.core.uncommit(mapped.gone - remade_all);
        Ok(())
    }

    /// Put `tag`'s contents back: offloaded ones copied from host memory (through the staging
    /// ring when it is pageable), discarded ones filled with zeros (unless told to leave
    /// them), one synchronisation; returns the bytes copied and the bytes zeroed.
    fn restore(&self, st: &mut SleepState, tag: Tag, work: &[Contents]) -> Result<(u64, u64)> {
        let (mut restored, mut zeroed) = (0, 0);
        let d = &self.core.driver;
        let stream = st.stream(d)?;
        for w in work {
            for &(va, bytes) in &w.discarded {
                if let Err(e) = d.fill_zero(va, bytes, stream) {
                    return Err(Self::abandon(d, stream, e));
                }
                zeroed += bytes;
            }
        }
        let arena = &st.host[tag.index()];
        if arena.is_pageable() {
            let copies = work
                .iter()
                .flat_map(|w| &w.offloaded)
                .flat_map(|&(va, bytes, off)| arena.spans(va, off, bytes));
            let pieces = staging::pieces(copies);
            restored = pieces.iter().map(|p| p.bytes).sum();
            if let Err((e, settled)) = st.stage(d, &pieces, Direction::ToDevice) {
                // The caller gives back what this wake mapped: a copy into it must be done.
                if !settled {
                    if let Err(e2) = d.sync_device() {
                        tracing::warn!(error = %e2, "could not wait for the staging copies of a failed wake");
                    }
                }
                return Err(Self::abandon(d, stream, e));
            }
        } else {
            for &(va, bytes, off) in work.iter().flat_map(|w| &w.offloaded) {
                let queued = queue_copies(d, arena, off, va, bytes, stream, Direction::ToDevice);
                if let Err(e) = queued {
                    return Err(Self::abandon(d, stream, e));
                }
                restored += bytes;
            }
        }
        d.sync_stream(stream)?;
        Ok((restored, zeroed))
    }

    /// A restore that failed with `e`: what it queued still reads host memory, so it finishes
    /// before that memory can go.
    fn abandon(d: &Counting<D>, stream: StreamId, e: DriverError) -> Error {
        if let Err(e2) = d.sync_stream(stream) {
            tracing::warn!(error = %e2, "could not wait for the copies of a failed wake; the host copy is kept");
        }
        e.into()
    }
}
