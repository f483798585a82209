//! Sleep's state beside the shards: the copy stream, the staging ring, and each tag's host
//! memory, with the copies between device memory and page-locked host memory. Needs only the
//! driver: the allocator's sleep and wake (`sleep.rs`) decide what is copied where.
//!
//! Invariants:
//! - A tag's host memory is pageable (anonymous, or a sleep file's pages; reached through the
//!   staging ring) or, when host memory is retained from the start and no sleep file is set,
//!   page-locked chunks. An arena holds one kind only and keeps it while it holds anything: a
//!   retained arena is reused, growing by another buffer of its kind, until a wake frees it
//!   (host memory no longer retained). Memory that cannot be freed is kept (and freed by a
//!   later wake), never forgotten.
//! - No host memory is freed, and neither the copy stream nor the ring is destroyed, while a
//!   copy queued on them may still run: their streams are synchronised first, and if that
//!   fails all of them are kept.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::mpsc;

pub(crate) use super::staging::Direction;
use super::staging::{self, Ring};
use crate::driver::{DevicePtr, Driver, DriverError, DriverResult, HostPtr, StreamId};
use crate::tag::Tag;
use crate::units::MIB;

/// Page-locked host memory is pinned in pieces of this size: pinning starts sooner and a
/// piece is reused whole.
const CHUNK: u64 = 256 * MIB;

/// Host memory of one tag: chunks that together hold its offloaded contents.
#[derive(Default, Debug)]
pub(crate) struct HostArena {
    chunks: Vec<(HostPtr, u64)>,
    /// The chunks are pageable: copies go through the staging ring.
    pageable: bool,
}

impl HostArena {
    pub(crate) fn capacity(&self) -> u64 {
        self.chunks.iter().map(|c| c.1).sum()
    }

    pub(crate) fn is_pageable(&self) -> bool {
        self.pageable
    }

    /// Grow to `need` bytes with one pageable buffer (none when the arena holds enough), the
    /// pages of a new file at `file` if given. Page-locked chunks are never mixed in.
    pub(crate) fn grow_pageable<D: Driver>(
        &mut self,
        d: &D,
        need: u64,
        file: Option<&Path>,
    ) -> DriverResult<()> {
        debug_assert!(self.pageable || self.chunks.is_empty());
        let have = self.capacity();
        if have < need {
            let p = d.host_alloc_pageable(need - have, file)?;
            self.chunks.push((p, need - have));
            self.pageable = true;
        }
        Ok(())
    }

    /// Pin chunks until `need` bytes fit, on several threads (pinning is the kernel faulting in
    /// and locking pages: it scales with threads), calling `ready` on this thread
    /// each time the chunks pinned in order reach further (at once if they already hold
    /// `need`): the caller queues the copies that fit while the rest is still being pinned, so
    /// a first sleep waits for about the longer of pinning and copying, not their sum. After
    /// `ready` or a pin fails, no more chunks are started; what was pinned stays.
    pub(crate) fn grow_streaming<D: Driver>(
        &mut self,
        d: &D,
        need: u64,
        mut ready: impl FnMut(&HostArena) -> DriverResult<()>,
    ) -> DriverResult<()> {
        debug_assert!(
            !self.pageable,
            "page-locked chunks are not mixed with pageable ones"
        );
        let mut sizes = Vec::new();
        let mut have = self.capacity();
        while have < need {
            let n = (need - have).min(CHUNK);
            sizes.push(n);
            have += n;
        }
        if sizes.is_empty() {
            return ready(self);
        }
        let next = AtomicUsize::new(0);
        let (tx, rx) = mpsc::channel();
        let pin = |tx: mpsc::Sender<(usize, DriverResult<(HostPtr, u64)>)>| loop {
            let i = next.fetch_add(1, Relaxed);
            if i >= sizes.len()
                || tx
                    .send((i, d.host_alloc(sizes[i]).map(|p| (p, sizes[i]))))
                    .is_err()
            {
                break;
            }
        };
        std::thread::scope(|s| {
            let workers = (0..crate::threads::THREADS.min(sizes.len()))
                .filter(|_| {
                    let tx = tx.clone();
                    std::thread::Builder::new()
                        .spawn_scoped(s, || pin(tx))
                        .is_ok()
                })
                .count();
            if workers == 0 {
                // No thread could be started: this one pins, in order, before the copies.
                pin(tx.clone());
            }
            drop(tx);
            let mut slots: Vec<Option<(HostPtr, u64)>> = vec![None; sizes.len()];
            let (mut in_order, mut first) = (0, None);
            for (i, r) in rx {
                match r {
                    Ok(c) => slots[i] = Some(c),
                    Err(e) => {
                        first.get_or_insert(e);
                    }
                }
                let before = in_order;
                while in_order < slots.len() && slots[in_order].is_some() {
                    self.chunks.push(slots[in_order].take().expect("checked"));
                    in_order += 1;
                }
                if first.is_none() && in_order > before {
                    if let Err(e) = ready(self) {
                        first = Some(e);
                    }
                }
                if first.is_some() {
                    // Start no more; those being pinned are received and kept.
                    next.store(sizes.len(), Relaxed);
                }
            }
            // Pinned past a gap that a failure left: kept, to be freed with the rest.
            self.chunks.extend(slots.into_iter().flatten());
            first.map_or(Ok(()), Err)
        })
    }

    /// Free every chunk (on several threads, as pinning); one that cannot be freed is kept
    /// (logged).
    pub(crate) fn free_all<D: Driver>(&mut self, d: &D) {
        let chunks = std::mem::take(&mut self.chunks);
        let results = crate::threads::on_threads(&chunks, |&(p, _)| d.host_free(p));
        for (c, r) in chunks.into_iter().zip(results) {
            if let Err(e) = r {
                tracing::warn!(error = %e, "could not free a tag's host memory; kept for later");
                self.chunks.push(c);
            }
        }
        self.pageable &= !self.chunks.is_empty();
    }

    /// The `len` device bytes at `va` against `[off, off + len)` of the arena, chunk by
    /// chunk: (device address, host address, bytes).
    pub(crate) fn spans(
        &self,
        mut va: DevicePtr,
        mut off: u64,
        mut len: u64,
    ) -> Vec<(DevicePtr, HostPtr, u64)> {
        let mut out = Vec::new();
        for &(p, size) in &self.chunks {
            if len == 0 {
                break;
            }
            if off >= size {
                off -= size;
                continue;
            }
            let n = (size - off).min(len);
            out.push((va, HostPtr(p.0 + off), n));
            va += n;
            off = 0;
            len -= n;
        }
        assert_eq!(len, 0, "the arena was sized for every offloaded byte");
        out
    }
}

/// Queue the copies between the `bytes` at device address `va` and the arena from `off`, piece
/// by piece (a mapping may span host chunks).
pub(crate) fn queue_copies<D: Driver>(
    d: &D,
    arena: &HostArena,
    off: u64,
    va: DevicePtr,
    bytes: u64,
    stream: StreamId,
    dir: Direction,
) -> DriverResult<()> {
    for (dev, h, n) in arena.spans(va, off, bytes) {
        match dir {
            Direction::ToHost => d.copy_to_host(h, dev, n, stream)?,
            Direction::ToDevice => d.copy_to_device(dev, h, n, stream)?,
        }
    }
    Ok(())
}

/// Sleep's state beside the shards: the copy stream, the staging ring (made for a sleep or a
/// wake, and freed after it) and each tag's host memory.
#[derive(Default, Debug)]
pub(crate) struct SleepState {
    pub(crate) stream: Option<StreamId>,
    ring: Option<Ring>,
    /// Staging slots that could not be freed, freed again with the next ring.
    stale_slots: Vec<HostPtr>,
    pub(crate) host: [HostArena; Tag::COUNT],
    pub(crate) retain_host: bool,
    /// Wake leaves discarded memory as fresh memory comes (stale data), instead of zeros.
    pub(crate) leave_discarded: bool,
    /// Offloaded tags go to files named from this path instead of memory (the disk backend).
    pub(crate) file: Option<PathBuf>,
}

impl SleepState {
    pub(crate) fn stream<D: Driver>(&mut self, d: &D) -> DriverResult<StreamId> {
        if let Some(s) = self.stream {
            return Ok(s);
        }
        let s = d.create_stream()?;
        self.stream = Some(s);
        Ok(s)
    }

    /// Where `tag`'s offloaded contents go on device `ordinal` when the disk backend is on:
    /// `PATH.dev<ordinal>.<tag>`.
    pub(crate) fn file_for(&self, ordinal: usize, tag: Tag) -> Option<PathBuf> {
        let base = self.file.as_ref()?;
        let mut name = base.as_os_str().to_owned();
        name.push(format!(".dev{ordinal}.{tag}"));
        Some(PathBuf::from(name))
    }

    pub(crate) fn host_bytes(&self) -> u64 {
        self.host.iter().map(HostArena::capacity).sum::<u64>()
            + self.ring.as_ref().map_or(0, Ring::bytes)
            + staging::SLOT * self.stale_slots.len() as u64
    }

    /// The staging ring, made if there is none. A ring kept because its streams could not be
    /// waited for is waited for first: a copy it queued then may still use a slot.
    pub(crate) fn ring<D: Driver>(&mut self, d: &D) -> DriverResult<&Ring> {
        if let Some(r) = &self.ring {
            for &s in r.streams() {
                d.sync_stream(s)?;
            }
        }
        if self.ring.is_none() {
            let t0 = std::time::Instant::now();
            self.ring = Some(Ring::new(d, staging::workers(), &mut self.stale_slots)?);
            tracing::debug!(seconds = t0.elapsed().as_secs_f64(), "staging ring made");
        }
        Ok(self.ring.as_ref().expect("made above"))
    }

    /// Move `pieces` through the staging ring in `dir` (no ring is made for none); returns the
    /// workers that moved them, or the error and whether every copy was waited for.
    pub(crate) fn stage<D: Driver>(
        &mut self,
        d: &D,
        pieces: &[staging::Piece],
        dir: Direction,
    ) -> Result<usize, (DriverError, bool)> {
        if pieces.is_empty() {
            return Ok(0);
        }
        let ring = self.ring(d).map_err(|e| (e, true))?;
        staging::run(d, ring, pieces, dir)?;
        Ok(ring.workers().min(pieces.len()))
    }

    /// Free the staging ring once nothing queued on it can still run (else it is kept, for a
    /// later try).
    pub(crate) fn drop_ring<D: Driver>(&mut self, d: &D) {
        if self.ring.as_ref().is_some_and(|r| r.settle(d)) {
            let kept = self.ring.take().expect("checked").release(d);
            self.stale_slots.extend(kept);
        }
        if self.ring.is_none() {
            // No copy uses them: they held one only while their ring was settled.
            self.stale_slots = staging::free_slots(d, std::mem::take(&mut self.stale_slots));
        }
    }

    /// At the allocator's drop (and before a wake frees host memory), first: wait for the copy
    /// stream and the ring's streams. A sleep or wake whose
    /// synchronisation failed may have left copies queued between device memory and the host
    /// memory kept for the next sleep; false when even this fails (then neither may be freed).
    pub(crate) fn settle<D: Driver>(&self, d: &D) -> bool {
        if self.ring.as_ref().is_some_and(|r| !r.settle(d)) {
            return false;
        }
        let Some(s) = self.stream else {
            return true;
        };
        match d.sync_stream(s) {
            Ok(()) => true,
            Err(e) => {
                tracing::error!(error = %e, "could not synchronise the copy stream; its device and host memory are kept");
                false
            }
        }
    }

    /// At the allocator's drop, last: the copy stream and the host memory kept for the next
    /// sleep go.
    pub(crate) fn release<D: Driver>(&mut self, d: &D) {
        if let Some(r) = self.ring.take() {
            self.stale_slots.extend(r.release(d));
        }
        let kept = staging::free_slots(d, std::mem::take(&mut self.stale_slots));
        if !kept.is_empty() {
            tracing::error!(
                slots = kept.len(),
                "staging slots could not be freed at the end"
            );
        }
        if let Some(s) = self.stream.take() {
            if let Err(e) = d.destroy_stream(s) {
                tracing::error!(error = %e, "could not destroy the copy stream");
            }
        }
        for arena in &mut self.host {
            arena.free_all(d);
        }
    }
}
