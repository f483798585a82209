//! Frees whose events must wait for the end of a capture. CUDA never lets an event recorded
//! into a stream capture be queried or waited for: during the capture, asking spoils it; after
//! it, the event belongs to the graph, not to the stream's work. PyTorch's allocator defers
//! these frees alike. A block freed while a stream that used it captures, or while any capture
//! is routed to a pool, is held instead: `Pending(1)` with one entry in `pending` that has no
//! event (not reusable, counted as pending), and its events are recorded by the first poll that
//! finds no capture running. The entry costs the cached path nothing: allocations poll when
//! `pending` is not empty, as before.
//!
//! Invariant: a held block has exactly one entry, without an event, and keeps the streams that
//! used it in `used_streams` until its events are recorded.

use super::Shard;
use crate::allocator::block::{BlockId, BlockState};
use crate::allocator::core::Core;
use crate::driver::{Capture, Driver, DriverResult, EventId, StreamId};

impl Shard {
    /// Whether events on `streams` cannot be recorded now: a capture is routed to a pool, or
    /// one of them captures. A stream whose state the driver cannot give (destroyed, or its
    /// capture invalidated) does not count: waiting for it could hold the block for ever, and
    /// recording on it fails as it did before, an error of the free.
    pub(super) fn capture_underway<D: Driver>(&self, core: &Core<D>, streams: &[StreamId]) -> bool {
        self.graphs.capturing()
            || streams
                .iter()
                .any(|&s| matches!(core.driver.capture(s), Capture::Active(_)))
    }

    /// Whether a block freed during a capture is still held.
    pub(crate) fn holds_for_capture(&self) -> bool {
        self.pending.iter().any(|(e, _)| e.is_none())
    }

    /// Hold block `id` (out of `live`, its streams in `used_streams`) until its events can be
    /// recorded.
    pub(super) fn hold<D: Driver>(&mut self, core: &Core<D>, id: BlockId) {
        let b = &mut self.blocks[id];
        b.state = BlockState::Pending(1);
        core.ledger
            .shard(self.id)
            .on_free(b.tag, b.size, b.requested, true);
        self.pending.push((None, id));
        if self.recording {
            self.record_free(core, id, false);
        }
    }

    /// Record the events of the held block of entry `i` if no capture holds its streams any
    /// more: its entry gives way to one per event (at the end of `pending`) and it waits for
    /// them as any block freed while other streams used it. Returns whether entry `i` went;
    /// a block whose events cannot be recorded stays held.
    pub(super) fn record_held<D: Driver>(&mut self, core: &Core<D>, i: usize) -> bool {
        let id = self.pending[i].1;
        if self.capture_underway(core, &self.blocks[id].used_streams) {
            return false;
        }
        let streams = std::mem::take(&mut self.blocks[id].used_streams);
        match record_all(core, &streams) {
            Ok(events) => {
                self.pending.swap_remove(i);
                self.blocks[id].state = BlockState::Pending(events.len() as u32);
                self.pending
                    .extend(events.into_iter().map(|e| (Some(e), id)));
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not record the events of a block freed during a capture; it stays held");
                self.blocks[id].used_streams = streams;
                false
            }
        }
    }
}

/// An event on each of `streams`, now; on a failure, those already recorded are destroyed.
pub(super) fn record_all<D: Driver>(
    core: &Core<D>,
    streams: &[StreamId],
) -> DriverResult<Vec<EventId>> {
    let mut events = Vec::with_capacity(streams.len());
    for &s in streams {
        match core.driver.record_event(s) {
            Ok(e) => events.push(e),
            Err(e) => {
                for ev in events {
                    if let Err(e2) = core.driver.destroy_event(ev) {
                        tracing::warn!(error = %e2, "could not destroy an event of a free that failed");
                    }
                }
                return Err(e);
            }
        }
    }
    Ok(events)
}
