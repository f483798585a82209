//! Memory a failed map could not give back: a mapping whose undo failed part-way leaves the
//! driver holding physical memory for this process (a handle not released, or an address
//! range still mapped) that no allocation uses and no segment records.
//!
//! Invariants:
//! - Every byte the driver holds for this allocator is reserved (the ledger) or lost (here):
//!   a stranded mapping is counted in the ledger's lost bytes from the moment its undo fails
//!   until a later undo succeeds, and never in reserved.
//! - A stranded range's addresses stay unmapped in its segment's records, so no allocation
//!   is handed them while the driver may still map them (a growth there fails at the driver,
//!   and is retried after [`Stranded::retry`]).
//! - The undo is retried whenever the cache is given back and when the allocator is dropped.

use parking_lot::Mutex;
use std::sync::atomic::Ordering::Relaxed;

use crate::driver::{DevicePtr, Driver, PhysHandle};
use crate::ledger::Ledger;

/// One mapping whose undo failed: what may still be mapped, and the handle if it was not
/// released.
#[derive(Clone, Copy, Debug)]
struct Mapping {
    va: DevicePtr,
    bytes: u64,
    mapped: bool,
    handle: Option<PhysHandle>,
}

/// The mappings whose undo failed, kept for another try.
#[derive(Debug, Default)]
pub(crate) struct Stranded {
    left: Mutex<Vec<Mapping>>,
}

impl Stranded {
    /// Record `bytes` at `va` as lost: still `mapped`, and/or its `handle` not released.
    pub(crate) fn strand(
        &self,
        ledger: &Ledger,
        va: DevicePtr,
        bytes: u64,
        mapped: bool,
        handle: Option<PhysHandle>,
    ) {
        ledger.lost.fetch_add(bytes, Relaxed);
        tracing::warn!(
            va,
            bytes,
            mapped,
            released = handle.is_none(),
            "a failed map could not be undone: its memory is counted as lost (never handed out) and the undo is tried again when the cache is given back"
        );
        self.left.lock().push(Mapping {
            va,
            bytes,
            mapped,
            handle,
        });
    }

    /// Before mapping: a stranded mapping may lie where the new one goes, so undo what is
    /// stranded first if the driver lets us (nothing to do, and no lock taken, when none is).
    pub(crate) fn undo_first<D: Driver>(&self, driver: &D, ledger: &Ledger) {
        if ledger.lost.load(Relaxed) > 0 {
            self.retry(driver, ledger);
        }
    }

    /// Undo what is left of each stranded mapping (unmap, then release); what succeeds stops
    /// being lost. Returns the bytes still lost.
    pub(crate) fn retry<D: Driver>(&self, driver: &D, ledger: &Ledger) -> u64 {
        let mut left = self.left.lock();
        left.retain_mut(|m| {
            if m.mapped && driver.unmap(m.va, m.bytes).is_ok() {
                m.mapped = false;
            }
            if let Some(h) = m.handle {
                if driver.release_physical(h).is_ok() {
                    m.handle = None;
                }
            }
            let done = !m.mapped && m.handle.is_none();
            if done {
                ledger.lost.fetch_sub(m.bytes, Relaxed);
            }
            !done
        });
        left.iter().map(|m| m.bytes).sum()
    }
}
