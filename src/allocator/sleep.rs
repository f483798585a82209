//! Sleep and wake by tag: give a tag's device memory back and restore it later at the same
//! addresses, so that every pointer the engine holds and every CUDA graph it captured stays
//! valid. Needs a virtual-memory mode and [`super::Config::separate_tags`] (each tag's memory
//! in segments of its own).
//!
//! This file holds sleep; `wake.rs` holds wake and the rollback both share. Sleep
//! synchronises the device, gives back every shard's cache (all tags), copies the offloaded
//! tags' mappings to host memory while the discarded tags' memory is released and unmapped,
//! then releases and unmaps the offloaded tags' memory. The host
//! memory is pageable (anonymous, or a sleep file's pages), reached through a small
//! page-locked ring on several threads (`staging.rs`), and freed at wake; when it is retained
//! from the start and no sleep file is set, it is page-locked instead, copied on a stream of
//! its own (each copy queued as soon as the memory it goes to is pinned). Retained memory of
//! either kind is kept for the next sleep. When the allocator is dropped, the copy streams are
//! synchronised before anything is freed, then destroyed with the host memory.
//!
//! Invariants:
//! - A tag is wholly asleep or wholly awake, in every shard at once: sleep and wake take every
//!   shard's lock to mark it, to give its memory back and to map it again, and let go of them
//!   across the pinning and the copies (other tags' allocations go on), while its mappings
//!   cannot change (its allocations are refused, its frees deferred).
//! - A sleep that fails before its memory is given back (the copies, the host memory) leaves
//!   its offloaded tags awake with their contents; its discarded tags, whose contents the
//!   caller gave up, are given back while the copies run, and stay asleep. Once the copies are
//!   complete an offloaded tag is asleep; a release or unmap that fails then leaves that
//!   mapping's memory held (reported, counted in reserved), never lost.
//! - A wake that fails gives back what it mapped (or keeps it, counted, where that fails
//!   too); the tag stays asleep with its host copy, and wake can be retried.

use std::time::Instant;

use super::front::Allocator;
use super::growth::sleep::TagMapping;
use super::growth::SyncFirst;
use super::host::{queue_copies, Direction, SleepState};
use super::phases::Phases;
use super::segment::DISCARDED;
use super::shard::Shard;
use super::sleep_report::{GivenBack, SleepReport};
use super::spin::SpinGuard;
use super::staging;
use crate::driver::Driver;
use crate::error::{Error, Result};
use crate::tag::Tag;

impl<D: Driver> Allocator<D> {
    /// Every shard, locked, in index order (the order every cross-shard operation uses).
    pub(super) fn lock_all(&self) -> Result<Vec<SpinGuard<'_, Shard>>> {
        (0..self.shards.len()).map(|i| self.lock(i)).collect()
    }

    pub(super) fn check_sleepable(
        &self,
        shards: &[SpinGuard<'_, Shard>],
        what: &'static str,
    ) -> Result<()> {
        if !self.growth.is_virtual() {
            return Err(Error::SleepNeedsVirtualMemory(self.mode().name()));
        }
        if !self.core.separate_tags {
            return Err(Error::SleepNeedsSeparateTags);
        }
        if shards.iter().any(|s| s.graphs.capturing()) {
            return Err(Error::Capturing(what));
        }
        Ok(())
    }

    /// Tags asleep now.
    pub fn asleep_tags(&self) -> Vec<Tag> {
        let Ok(sh) = self.lock(0) else {
            return Vec::new();
        };
        Tag::ALL.into_iter().filter(|&t| sh.tag_asleep(t)).collect()
    }

    /// Keep the host memory of offloaded tags after they wake, for the next sleep (default:
    /// freed at wake). Memory retained from the start of a tag's sleep, with no sleep file set,
    /// is page-locked: later sleeps and wakes copy at the copy engine's full speed and pin
    /// nothing. Without it, a sleep copies through a small page-locked ring into pageable
    /// memory, freed at wake. Memory kept keeps its kind (page-locked, pageable or a file's)
    /// until a wake frees it.
    pub fn set_retain_host(&self, retain: bool) {
        self.sleep.lock().retain_host = retain;
    }

    /// Offload to disk: each offloaded tag's contents go to a new file `PATH.dev<N>.<tag>`
    /// (through the page cache, which the host writes back and drops when it needs the memory),
    /// created at sleep and removed at once, its blocks reserved first; `None` (the default):
    /// host memory. The file must not exist; its directory must. A tag whose host memory is
    /// retained keeps that memory's kind until a wake frees it.
    pub fn set_sleep_file(&self, path: Option<std::path::PathBuf>) {
        self.sleep.lock().file = path;
    }

    /// Whether wake fills discarded tags' memory with zeros (the default), or leaves it as
    /// fresh memory comes: stale data of this process, one device memset cheaper.
    pub fn set_zero_discarded(&self, zero: bool) {
        self.sleep.lock().leave_discarded = !zero;
    }

    /// Put tags to sleep: the `offload` tags' contents are copied to host memory,
    /// the `discard` tags' are dropped (they read as zeros after wake, unless
    /// [`Allocator::set_zero_discarded`] says otherwise); then their
    /// device memory is given back, keeping its addresses. The cache of every tag is given back
    /// first. Allocating a sleeping tag's memory fails with [`Error::Asleep`] until it wakes;
    /// freeing it is deferred to the wake. Tags already asleep are left as they are. When the
    /// copies fail, the error is returned with the offloaded tags awake and the discarded ones
    /// asleep ([`Allocator::asleep_tags`]).
    pub fn sleep(&self, offload: &[Tag], discard: &[Tag]) -> Result<SleepReport> {
        self.sleep_noting(offload, discard).0
    }

    /// [`Allocator::sleep`], and the tags this call left asleep: on success the report's
    /// tags, on an error those it put to sleep before failing (the discarded ones, when the
    /// copies fail). Read under the lock that orders sleeps and wakes, so a caller undoing a
    /// failed sleep wakes what this call did and never a tag another thread put to sleep.
    pub fn sleep_noting(
        &self,
        offload: &[Tag],
        discard: &[Tag],
    ) -> (Result<SleepReport>, Vec<Tag>) {
        let mut st = self.sleep.lock();
        let before = self.asleep_tags();
        let r = self.sleep_locked(&mut st, offload, discard);
        let left = match &r {
            Ok(report) => report.tags.clone(),
            Err(_) => self
                .asleep_tags()
                .into_iter()
                .filter(|t| !before.contains(t))
                .collect(),
        };
        (r, left)
    }

    fn sleep_locked(
        &self,
        st: &mut SleepState,
        offload: &[Tag],
        discard: &[Tag],
    ) -> Result<SleepReport> {
        let t0 = Instant::now();
        if let Some(t) = offload.iter().find(|t| discard.contains(t)) {
            return Err(Error::InvalidArgument(format!(
                "tag {t} cannot be both offloaded and discarded"
            )));
        }
        let d = &self.core.driver;
        let mut phases = Phases::start();
        let (plan, maps, kv_given) = {
            // The KV cache's lock before the shards', as everywhere.
            let mut kv = self.kv.lock();
            let mut shards = self.lock_all()?;
            self.check_sleepable(&shards, "sleep")?;
            d.sync_device()?;
            for sh in shards.iter_mut() {
                sh.release_cached(&self.core, SyncFirst::Done)?;
            }
            // A block freed during a capture the allocator was not told of is still held: it
            // would come back to a sleeping tag's free list.
            if shards.iter().any(|sh| sh.holds_for_capture()) {
                return Err(Error::Capturing("sleep"));
            }
            let mut plan: Vec<(Tag, bool)> = Vec::new();
            for &t in offload.iter().chain(discard) {
                if !shards[0].tag_asleep(t) && !plan.iter().any(|&(p, _)| p == t) {
                    plan.push((t, offload.contains(&t)));
                }
            }
            // The KV cache of `reserve_kv` sleeps with the KV tag: discarded, its pieces are
            // given back here, before anything is marked, so that a failure leaves every tag
            // awake. Its contents are never copied: an engine's KV cache is rebuilt, not kept.
            let kv_given = match (kv.as_mut(), plan.iter().find(|&&(t, _)| t == Tag::KvCache)) {
                (Some(r), Some(&(_, true))) if r.mapped() > 0 => {
                    return Err(Error::InvalidArgument(
                        "the KV cache reserved with reserve_kv cannot be offloaded: discard it \
                         (its blocks read as zeros after wake)"
                            .into(),
                    ))
                }
                (Some(r), Some(&(_, false))) if !r.is_asleep() => r.sleep(&self.core)?,
                _ => 0,
            };
            let maps: Vec<Vec<Vec<TagMapping>>> = plan
                .iter()
                .map(|&(t, _)| shards.iter().map(|sh| sh.tag_mappings(t)).collect())
                .collect();
            for &(t, _) in &plan {
                shards.iter_mut().for_each(|sh| sh.mark_asleep(t));
            }
            (plan, maps, kv_given)
        };
        // The pinning and the copies take no shard lock: other tags' allocations and frees go
        // on, except while the discarded tags' memory is given back, on a thread of its own
        // with every shard locked (as for any give-back): their contents are given up whatever
        // the copies do, and the driver's unmaps do not wait for the copies. The sleeping
        // tags' mappings cannot change meanwhile (their allocations are refused, their frees
        // deferred, their cache given back above).
        // The copies are all queued and waited for once: until they are complete none of the
        // offloaded tags' memory is given back, and a failure wakes those tags again.
        let mut report = SleepReport {
            discarded_bytes: kv_given,
            given_back_bytes: kv_given,
            ..SleepReport::default()
        };
        phases.mark("cache given back");
        let t_copy = Instant::now();
        let discards = plan.iter().any(|&(_, keep)| !keep);
        let (copied, discarded) = std::thread::scope(|s| {
            let giving = discards.then(|| {
                std::thread::Builder::new()
                    .spawn_scoped(s, || self.give_back_slept(&plan, &maps, None))
                    .ok()
            });
            let copied = self.offload(st, &plan, &maps, &mut report);
            let discarded = match giving {
                None => None,
                Some(Some(h)) => Some(h.join().expect("sleep's give-back thread panicked")),
                // No thread could be started: the discarded tags are given back here.
                Some(None) => Some(self.give_back_slept(&plan, &maps, None)),
            };
            (copied, discarded)
        });
        report.copy_seconds = t_copy.elapsed().as_secs_f64();
        phases.mark("copied");
        // The ring serves one sleep or wake: host memory held while asleep is the tags' own.
        st.drop_ring(d);
        phases.mark("ring freed");
        let hosts = match copied {
            Ok(h) => h,
            Err((e, settled)) => {
                let mut shards = self.lock_all()?;
                for &(t, _) in plan.iter().filter(|&&(_, keep)| keep) {
                    shards.iter_mut().for_each(|sh| sh.awake(&self.core, t, 0));
                }
                drop(shards);
                // Host memory is freed only once no copy can still be writing into it; if
                // that is unknown (the stream could not be synchronised) it is kept, and the
                // next wake or sleep frees it.
                if settled && !st.retain_host {
                    for &(t, _) in &plan {
                        st.host[t.index()].free_all(d);
                    }
                }
                return Err(e);
            }
        };
        if let Some(done) = discarded {
            report.add(&done?);
        }
        report.add(&self.give_back_slept(&plan, &maps, Some(&hosts))?);
        report.tags = plan.iter().map(|&(t, _)| t).collect();
        report.host_bytes = st.host_bytes();
        report.seconds = t0.elapsed().as_secs_f64();
        phases.mark("memory given back");
        phases.log("sleep");
        if report.held_bytes > 0 {
            tracing::warn!(
                held = report.held_bytes,
                "sleep could not give back all of the sleeping tags' memory"
            );
        }
        Ok(report)
    }

    /// Give back the memory of the sleeping tags of `plan`: the discarded ones when `hosts` is
    /// `None`, else the offloaded ones, whose copies `hosts` places (by plan entry, shard,
    /// mapping). Every shard is locked for it.
    fn give_back_slept(
        &self,
        plan: &[(Tag, bool)],
        maps: &[Vec<Vec<TagMapping>>],
        hosts: Option<&[Vec<Vec<u64>>]>,
    ) -> Result<GivenBack> {
        let mut shards = self.lock_all()?;
        let mut done = GivenBack::default();
        for (k, &(t, keep)) in plan.iter().enumerate() {
            if keep != hosts.is_some() {
                continue;
            }
            for (i, sh) in shards.iter_mut().enumerate() {
                let discarded;
                let host = match hosts {
                    Some(h) => &h[k][i][..],
                    None => {
                        discarded = vec![DISCARDED; maps[k][i].len()];
                        &discarded[..]
                    }
                };
                let (gone, held) = sh.put_to_sleep(&self.core, t, &maps[k][i], host);
                done.gone += gone;
                done.held += held;
                if !keep {
                    done.discarded += maps[k][i].iter().map(|m| m.bytes).sum::<u64>();
                }
            }
        }
        Ok(done)
    }

    /// Copy the offloaded tags of `plan` to host memory; returns each mapping's host offset
    /// (by plan entry, shard, mapping), [`DISCARDED`] for discarded tags. A tag whose host
    /// memory is pageable goes through the staging ring (all such tags at once, after the
    /// others are queued); one whose memory is retained is copied to page-locked memory, its
    /// copies queued as that memory is pinned (`HostArena::grow_streaming`). On failure,
    /// whether no copy can still be running (host memory may then be freed).
    #[allow(clippy::type_complexity)]
    fn offload(
        &self,
        st: &mut SleepState,
        plan: &[(Tag, bool)],
        maps: &[Vec<Vec<TagMapping>>],
        report: &mut SleepReport,
    ) -> std::result::Result<Vec<Vec<Vec<u64>>>, (Error, bool)> {
        let d = &self.core.driver;
        let stream = st.stream(d).map_err(|e| (e.into(), true))?;
        let mut hosts = Vec::with_capacity(plan.len());
        let mut staged = Vec::new();
        for (k, &(t, keep)) in plan.iter().enumerate() {
            if !keep {
                hosts.push(maps[k].iter().map(|m| vec![DISCARDED; m.len()]).collect());
                continue;
            }
            // Every mapping's place in the tag's host memory, in order.
            let mut off = 0;
            let per_shard: Vec<Vec<u64>> = maps[k]
                .iter()
                .map(|shard_maps| {
                    shard_maps
                        .iter()
                        .map(|m| {
                            off += m.bytes;
                            off - m.bytes
                        })
                        .collect()
                })
                .collect();
            let need = off;
            let mut todo = maps[k]
                .iter()
                .zip(&per_shard)
                .flat_map(|(ms, offs)| ms.iter().zip(offs))
                .peekable();
            let file = st.file_for(d.ordinal(), t);
            let arena = &mut st.host[t.index()];
            if arena.is_pageable() || (arena.capacity() == 0 && (!st.retain_host || file.is_some()))
            {
                if let Err(e) = arena.grow_pageable(d, need, file.as_deref()) {
                    return Err((e.into(), d.sync_stream(stream).is_ok()));
                }
                let copies = todo.flat_map(|(m, &off)| arena.spans(m.va, off, m.bytes));
                staged.extend(staging::pieces(copies));
                report.offloaded_bytes += need;
                hosts.push(per_shard);
                continue;
            }
            let copied = arena.grow_streaming(d, need, |arena| {
                while let Some((m, &off)) =
                    todo.next_if(|(m, &off)| off + m.bytes <= arena.capacity())
                {
                    queue_copies(d, arena, off, m.va, m.bytes, stream, Direction::ToHost)?;
                }
                Ok(())
            });
            if let Err(e) = copied {
                // Queued copies still write into the host memory: wait for them before it can
                // be freed.
                return Err((e.into(), d.sync_stream(stream).is_ok()));
            }
            if todo.peek().is_some() {
                // Not reachable while the arena grows to `need`; if it were, memory would be
                // given back without its copy: refuse the sleep instead.
                let e = Error::InvalidArgument(format!(
                    "sleep of {t}: host memory short of its contents"
                ));
                return Err((e, d.sync_stream(stream).is_ok()));
            }
            report.offloaded_bytes += need;
            hosts.push(per_shard);
        }
        match st.stage(d, &staged, Direction::ToHost) {
            Ok(workers) => report.copy_workers = workers,
            Err((e, settled)) => return Err((e.into(), settled && d.sync_stream(stream).is_ok())),
        }
        d.sync_stream(stream).map_err(|e| (e.into(), false))?;
        Ok(hosts)
    }
}
