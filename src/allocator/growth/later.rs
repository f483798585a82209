//! Unmapping later ([`crate::Config::unmap_later`], remap mode): a piece moved out of the
//! growing stream's own free memory needs no wait on the host. The piece is mapped at its new
//! place at once (CUDA maps one handle at several addresses), and what the stream does there
//! runs after what it queued at the old place, in stream order. Only the old mapping must
//! outlive that earlier work: it is kept, as a retiring mapping, until an event recorded on the
//! stream at the move has completed, and unmapped then.
//!
//! Invariants:
//! - Every entry of `retiring` is a pooled mapping that the driver still holds at `va` and
//!   that the allocator's tables show unmapped (inside an `Unmapped` block of `seg`): nothing
//!   is handed out there, and nothing is mapped over it until the entry is finished.
//! - Its handle is spare or mapped at one place (it may have other retiring mappings too: moved
//!   and moved again); its bytes are counted once, there.
//! - Its event was recorded on `stream`, the stream that owns `seg`, after every free of memory
//!   in the range; once it completes no work that used `va` remains.
//! - Its piece is mapped again only for `stream` (whose later work runs after the earlier), or
//!   for another stream once the entry is finished: shards are shared by streams, and so is
//!   their spare list.
//! - `retiring` is in the order the entries' events were recorded.
//! - Before a handle is given back to the driver, before anything is mapped over a retiring
//!   range, and before another shard takes this shard's spare pieces, the entries concerned
//!   are finished, waiting for their events if need be; a reservation with one stays until it
//!   is. `empty_cache`, sleep and drop finish every entry. A graph pool's growth (perhaps in a
//!   capture) neither asks events nor maps a piece that has an entry.

use crate::allocator::core::Core;
use crate::allocator::planted::{self, Bug};
use crate::allocator::segment::Spare;
use crate::allocator::shard::Shard;
use crate::driver::{DevicePtr, Driver, DriverError, DriverResult, EventId, PhysHandle, StreamId};

/// A mapping the allocator has let go of, waiting for the work that may still use it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Retiring {
    pub(crate) seg: u32,
    pub(crate) stream: StreamId,
    pub(crate) va: DevicePtr,
    pub(crate) bytes: u64,
    pub(crate) handle: PhysHandle,
    pub(crate) event: EventId,
}

impl Retiring {
    /// Whether it lies in `seg` and overlaps `[lo, hi)`.
    pub(crate) fn overlaps(&self, seg: u32, lo: DevicePtr, hi: DevicePtr) -> bool {
        self.seg == seg && self.va < hi && lo < self.va + self.bytes
    }
}

impl Shard {
    /// Whether a retiring mapping lies in `seg`.
    pub(crate) fn retiring_in(&self, seg: u32) -> bool {
        self.retiring.iter().any(|r| r.seg == seg)
    }

    /// Let pooled mapping `va` of `seg` (owned by `stream`) go without unmapping it: its piece
    /// becomes spare now, and the mapping is unmapped once `event` (on `stream`) completes.
    pub(crate) fn retire(
        &mut self,
        seg: u32,
        stream: StreamId,
        va: DevicePtr,
        m: Spare,
        event: EventId,
    ) {
        self.retiring.push(Retiring {
            seg,
            stream,
            va,
            bytes: m.bytes,
            handle: m.handle,
            event,
        });
        self.spare.push(m);
    }

    /// Unmap the retiring mappings for which `which` holds and whose events have completed
    /// (with `wait`, after waiting for them). Without `wait` a failure is logged and the entry
    /// tried again later; with it every entry is still tried and the first failure returned,
    /// the entries not finished kept.
    pub(crate) fn finish_retiring<D: Driver>(
        &mut self,
        core: &Core<D>,
        which: impl Fn(&Retiring) -> bool,
        wait: bool,
    ) -> DriverResult<()> {
        // Each event is asked (or waited for) once per pass, however many mappings it holds;
        // and entries are kept in the order their events were recorded, so once one event of a
        // stream has not completed, the stream's later ones have not either (a stream's work
        // completes in order) and are not asked.
        let mut done: Vec<(EventId, StreamId, bool)> = Vec::new();
        let mut first_err = None;
        let mut i = 0;
        while i < self.retiring.len() {
            let r = self.retiring[i];
            let behind = done
                .iter()
                .any(|&(e, s, finished)| !finished && s == r.stream && e != r.event);
            if !which(&r) || (!wait && behind) {
                i += 1;
                continue;
            }
            match finish_one(core, &r, wait, &mut done) {
                Ok(true) => {}
                Ok(false) => {
                    i += 1;
                    continue;
                }
                Err(e) if wait => {
                    first_err.get_or_insert(e);
                    i += 1;
                    continue;
                }
                Err(e) => {
                    note_late_failure(core, &e, "a moved piece's old mapping could not be unmapped yet; it stays mapped there (nothing is mapped over it) and is tried again later");
                    i += 1;
                    continue;
                }
            }
            self.retiring.remove(i);
            self.drop_event_if_unused(core, r.event);
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Destroy `event` once no retiring mapping waits for it.
    pub(crate) fn drop_event_if_unused<D: Driver>(&self, core: &Core<D>, event: EventId) {
        if !self.retiring.iter().any(|r| r.event == event) {
            if let Err(e) = core.driver.destroy_event(event) {
                tracing::warn!(error = %e, "an event of a move could not be destroyed; it is leaked");
            }
        }
    }

    /// Whether piece `handle` has an old mapping still retiring.
    pub(crate) fn retires(&self, handle: PhysHandle) -> bool {
        self.retiring.iter().any(|r| r.handle == handle)
    }

    /// Finish the retiring mappings of `seg` that overlap `[lo, hi)`, waiting for them: memory
    /// is about to be mapped there.
    pub(crate) fn clear_for_map<D: Driver>(
        &mut self,
        core: &Core<D>,
        seg: u32,
        lo: DevicePtr,
        hi: DevicePtr,
    ) -> DriverResult<()> {
        self.finish_retiring(core, |r| r.overlaps(seg, lo, hi), true)
    }

    /// Finish the retiring mapping of `handle`, if there is one, waiting for it: the handle is
    /// about to go back to the driver, which frees its memory only once no mapping is left.
    pub(crate) fn clear_handle<D: Driver>(
        &mut self,
        core: &Core<D>,
        handle: PhysHandle,
    ) -> DriverResult<()> {
        self.finish_retiring(core, |r| r.handle == handle, true)
    }

    /// Before spare piece `handle` is mapped for `stream`: finish its retiring mapping if that
    /// waits for another stream's work (waiting for it), which would otherwise still run when
    /// `stream` uses the memory.
    pub(crate) fn clear_for_stream<D: Driver>(
        &mut self,
        core: &Core<D>,
        handle: PhysHandle,
        stream: Option<StreamId>,
    ) -> DriverResult<()> {
        self.finish_retiring(
            core,
            |r| r.handle == handle && Some(r.stream) != stream,
            true,
        )
    }
}

/// A failure on the way of a move without a wait: counted with the failed moves
/// ([`crate::Snapshot::move_failures`]) and logged with what was kept safe.
pub(crate) fn note_late_failure<D: Driver>(core: &Core<D>, e: &DriverError, kept: &str) {
    core.ledger
        .move_failures
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    tracing::warn!(error = %e, "{kept}");
}

/// Unmap `r` if its event has completed (with `wait`, once it has); whether it was unmapped.
/// The event is asked first: a wait, even for work long done, stalls the host. `done` holds
/// the events asked this pass, their streams, and whether they had completed (an event whose
/// query or wait failed counts as not completed, and is not asked again).
fn finish_one<D: Driver>(
    core: &Core<D>,
    r: &Retiring,
    wait: bool,
    done: &mut Vec<(EventId, StreamId, bool)>,
) -> DriverResult<bool> {
    let finished = match done.iter().find(|(e, _, _)| *e == r.event) {
        Some(&(_, _, finished)) => finished,
        None => {
            done.push((r.event, r.stream, false));
            let mut finished =
                planted::active(Bug::RetireEarly) || core.driver.query_event(r.event)?;
            if !finished && wait {
                core.driver.wait_event(r.event)?;
                finished = true;
            }
            done.last_mut().expect("just pushed").2 = finished;
            finished
        }
    };
    if !finished {
        return Ok(false);
    }
    core.driver.unmap(r.va, r.bytes)?;
    Ok(true)
}
