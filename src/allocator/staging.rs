//! Sleep's copies between device memory and pageable host memory, through a small ring of
//! page-locked slots: the host memory that holds a tag while it sleeps is never pinned.
//!
//! Why: pinning is what a first sleep waited for. On the H200 machine, 16 GiB took 0.5 s to
//! fault in and 0.4 to 0.6 s to register (registration does not scale with threads), and
//! 0.3 s to unregister at wake. Through slots of 2 MiB, few enough to stay in the host's
//! last-level cache, each worker's device copy into one slot runs while it copies the other
//! out on the CPU: 16 GiB went out in 0.52 to 0.54 s and back in 0.39 to 0.40 s with 12 to 16
//! workers, every round alike (`scripts/host_staging_bench.cu`, docs/results.md §5). Larger
//! slots fall out of the cache and double the host's memory traffic (0.8 to 1.2 s with 16 to
//! 32 MiB slots).
//!
//! Invariants:
//! - Each worker owns two slots and one stream. A slot is read or written on the host only
//!   once the event recorded after its last device copy has been waited for.
//! - When a piece fails, every worker stops before its next piece and synchronises its stream
//!   before it returns: once [`run`] returns settled, no device copy uses a slot or the
//!   pageable memory. Unsettled (a synchronisation failed), the caller keeps both.

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

use crate::driver::{DevicePtr, Driver, DriverError, DriverResult, EventId, HostPtr, StreamId};
use crate::units::MIB;

/// Which way a copy goes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Direction {
    ToHost,
    ToDevice,
}

/// Bytes of one slot.
pub(crate) const SLOT: u64 = 2 * MIB;

/// Workers of a ring: three for every four cores, 2 to 16, or `VRAM_LEDGER_STAGING_WORKERS`
/// (1 to 64) where set. On the H200 machine's 16 cores, in the library under PyTorch, later
/// sleeps took 0.64 to 0.84 s with 12 workers and 0.69 to 0.86 s with 16 (alike, within the
/// spread between runs), and 0.86 to 1.15 s with 8; wakes 0.49 to 0.61 s with any of them.
/// Twelve leave the process cores for its own threads at no measured cost.
pub(crate) fn workers() -> usize {
    let set = std::env::var("VRAM_LEDGER_STAGING_WORKERS").ok();
    match set.as_deref().map(str::parse::<usize>) {
        Some(Ok(n)) if (1..=64).contains(&n) => n,
        Some(_) => {
            tracing::warn!(value = ?set, "VRAM_LEDGER_STAGING_WORKERS is not a number from 1 to 64; ignored");
            default_workers()
        }
        None => default_workers(),
    }
}

fn default_workers() -> usize {
    let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
    (cores * 3 / 4).clamp(2, 16)
}

/// Page-locked slots, two per worker (each a buffer of its own: a buffer is the unit a device
/// copy is known to be done with), and a stream per worker.
#[derive(Debug)]
pub(crate) struct Ring {
    slots: Vec<HostPtr>,
    streams: Vec<StreamId>,
}

impl Ring {
    /// A ring of `workers`; on failure, slots made that could not be freed go to `stale`.
    pub(crate) fn new<D: Driver>(
        d: &D,
        workers: usize,
        stale: &mut Vec<HostPtr>,
    ) -> DriverResult<Ring> {
        let mut ring = Ring {
            slots: Vec::with_capacity(2 * workers),
            streams: Vec::with_capacity(workers),
        };
        // On several threads: one at a time, a ring of 24 slots took 13 to 26 ms to make on
        // the H200 machine, each slot faulted in and registered on its own.
        let made = crate::threads::on_threads(&vec![(); 2 * workers], |()| d.host_alloc(SLOT));
        let mut first = None;
        for r in made {
            match r {
                Ok(p) => ring.slots.push(p),
                Err(e) => {
                    first.get_or_insert(e);
                }
            }
        }
        if let Some(e) = first {
            stale.extend(ring.release(d));
            return Err(e);
        }
        for _ in 0..workers {
            match d.create_stream() {
                Ok(s) => ring.streams.push(s),
                Err(e) => {
                    stale.extend(ring.release(d));
                    return Err(e);
                }
            }
        }
        Ok(ring)
    }

    pub(crate) fn workers(&self) -> usize {
        self.streams.len()
    }

    pub(crate) fn streams(&self) -> &[StreamId] {
        &self.streams
    }

    /// Page-locked bytes the ring holds.
    pub(crate) fn bytes(&self) -> u64 {
        SLOT * self.slots.len() as u64
    }

    fn slot(&self, worker: usize, k: usize) -> HostPtr {
        self.slots[2 * worker + k]
    }

    /// Wait for every stream of the ring; false when one cannot be waited for (then the ring
    /// must be kept).
    pub(crate) fn settle<D: Driver>(&self, d: &D) -> bool {
        self.streams.iter().fold(true, |ok, &s| match d.sync_stream(s) {
            Ok(()) => ok,
            Err(e) => {
                tracing::warn!(error = %e, "could not wait for a staging stream; its ring is kept");
                false
            }
        })
    }

    /// Destroy the streams and free the slots (after [`Ring::settle`]); returns the slots that
    /// could not be freed, for the caller to keep (a stream that cannot be destroyed is
    /// logged: it holds no memory of ours).
    pub(crate) fn release<D: Driver>(self, d: &D) -> Vec<HostPtr> {
        for s in self.streams {
            if let Err(e) = d.destroy_stream(s) {
                tracing::warn!(error = %e, "could not destroy a staging stream");
            }
        }
        free_slots(d, self.slots)
    }
}

/// Free page-locked slots; returns those that could not be freed (logged).
pub(crate) fn free_slots<D: Driver>(d: &D, slots: Vec<HostPtr>) -> Vec<HostPtr> {
    slots
        .into_iter()
        .filter(|&p| match d.host_free(p) {
            Ok(()) => false,
            Err(e) => {
                tracing::warn!(error = %e, "could not free a staging slot's page-locked memory; kept for later");
                true
            }
        })
        .collect()
}

/// One slot's worth of a copy: device bytes at `dev`, host bytes at `host`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Piece {
    pub(crate) dev: DevicePtr,
    pub(crate) host: HostPtr,
    pub(crate) bytes: u64,
}

/// Cut copies of `(device, host, bytes)` into pieces of at most a slot.
pub(crate) fn pieces(copies: impl IntoIterator<Item = (DevicePtr, HostPtr, u64)>) -> Vec<Piece> {
    let mut out = Vec::new();
    for (dev, host, bytes) in copies {
        let mut off = 0;
        while off < bytes {
            let n = (bytes - off).min(SLOT);
            out.push(Piece {
                dev: dev + off,
                host: HostPtr(host.0 + off),
                bytes: n,
            });
            off += n;
        }
    }
    out
}

/// Move every piece in `dir` through the ring, worker `w` taking pieces `w`, `w + W`, ….
/// Returns the first error, and whether every stream was waited for afterwards.
pub(crate) fn run<D: Driver>(
    d: &D,
    ring: &Ring,
    pieces: &[Piece],
    dir: Direction,
) -> Result<(), (DriverError, bool)> {
    let workers = ring.streams.len().min(pieces.len());
    let stop = AtomicBool::new(false);
    // A worker's first error, and its stream's synchronisation's.
    let work = |w: usize| {
        let r = match dir {
            Direction::ToHost => out(d, ring, w, workers, pieces, &stop),
            Direction::ToDevice => back(d, ring, w, workers, pieces, &stop),
        };
        if r.is_err() {
            stop.store(true, Relaxed);
        }
        (r.err(), d.sync_stream(ring.streams[w]).err())
    };
    let results: Vec<(Option<DriverError>, Option<DriverError>)> = std::thread::scope(|s| {
        let started: Vec<_> = (1..workers)
            .map(|w| {
                std::thread::Builder::new()
                    .spawn_scoped(s, move || work(w))
                    .map_err(|_| w)
            })
            .collect();
        let mut results = Vec::with_capacity(workers);
        if workers > 0 {
            results.push(work(0));
        }
        for h in started {
            // A worker that could not be started does its part here, after the others.
            results.push(match h {
                Ok(h) => h.join().expect("a staging worker panicked"),
                Err(w) => work(w),
            });
        }
        results
    });
    let settled = results.iter().all(|r| r.1.is_none());
    let mut errors = results
        .into_iter()
        .flat_map(|(e, sync)| e.into_iter().chain(sync));
    match errors.next() {
        Some(e) => Err((e, settled)),
        None => Ok(()),
    }
}

/// Wait for a slot's last device copy, if it has one.
fn drain<D: Driver>(d: &D, ev: &mut Option<EventId>) -> DriverResult<()> {
    if let Some(e) = ev.take() {
        let waited = d.wait_event(e);
        if let Err(e2) = d.destroy_event(e) {
            tracing::warn!(error = %e2, "could not destroy a staging event");
        }
        waited?;
    }
    Ok(())
}

/// Device to host: the copy into one slot runs while the other slot is copied out.
fn out<D: Driver>(
    d: &D,
    ring: &Ring,
    w: usize,
    workers: usize,
    pieces: &[Piece],
    stop: &AtomicBool,
) -> DriverResult<()> {
    let s = ring.streams[w];
    let mine: Vec<&Piece> = pieces.iter().skip(w).step_by(workers).collect();
    let mut ev: [Option<EventId>; 2] = [None, None];
    let issue = |i: usize, ev: &mut [Option<EventId>; 2]| -> DriverResult<()> {
        let p = mine[i];
        d.copy_to_host(ring.slot(w, i & 1), p.dev, p.bytes, s)?;
        ev[i & 1] = Some(d.record_event(s)?);
        Ok(())
    };
    let result = (|| {
        if !mine.is_empty() {
            issue(0, &mut ev)?;
        }
        for i in 0..mine.len() {
            if stop.load(Relaxed) {
                break;
            }
            if i + 1 < mine.len() {
                issue(i + 1, &mut ev)?;
            }
            drain(d, &mut ev[i & 1])?;
            d.host_copy(mine[i].host, ring.slot(w, i & 1), mine[i].bytes)?;
        }
        Ok(())
    })();
    forget(d, &mut ev);
    result
}

/// Host to device: one slot is filled on the CPU while the other's device copy runs.
fn back<D: Driver>(
    d: &D,
    ring: &Ring,
    w: usize,
    workers: usize,
    pieces: &[Piece],
    stop: &AtomicBool,
) -> DriverResult<()> {
    let s = ring.streams[w];
    let mut ev: [Option<EventId>; 2] = [None, None];
    let result = (|| {
        for (i, p) in pieces.iter().skip(w).step_by(workers).enumerate() {
            if stop.load(Relaxed) {
                break;
            }
            drain(d, &mut ev[i & 1])?;
            let slot = ring.slot(w, i & 1);
            d.host_copy(slot, p.host, p.bytes)?;
            d.copy_to_device(p.dev, slot, p.bytes, s)?;
            ev[i & 1] = Some(d.record_event(s)?);
        }
        Ok(())
    })();
    forget(d, &mut ev);
    result
}

/// Events still held at a worker's end: destroyed (the stream is synchronised after).
fn forget<D: Driver>(d: &D, ev: &mut [Option<EventId>; 2]) {
    for e in ev.iter_mut().filter_map(Option::take) {
        if let Err(e2) = d.destroy_event(e) {
            tracing::warn!(error = %e2, "could not destroy a staging event");
        }
    }
}
