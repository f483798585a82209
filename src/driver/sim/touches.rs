//! Which queued work reads or writes which device addresses, so that a test can check the one
//! promise a caching allocator makes about memory the device may still be using: nothing is
//! unmapped while work queued before its free, on a stream that used it, has not finished. On
//! a real GPU such an unmap is undefined behaviour (a fault, or a write into whatever the
//! driver puts in those pages next), so here it is recorded, not answered with an error, and a
//! test asks for the record ([`SimDevice::unsafe_unmaps`]).
//!
//! The same physical memory may be mapped at two addresses at once, so a touch also notes the
//! physical memory behind its range when it was queued: a block handed to one stream must not
//! share physical memory with another stream's unfinished work, at whatever address.
//!
//! Invariants:
//! - A touch is one unit of work on its stream (`submit_touching` queues it): it is done once
//!   the stream's completed count reaches the count it was queued at, as every other unit of
//!   work is.
//! - A touch's physical parts are (handle, start offset, end offset) of each mapping its range
//!   overlapped when it was queued; memory of no mapping (a plain segment, never mapped twice)
//!   is noted as handle 0 with its addresses. Handles are never reused.
//! - Touches are kept only while unfinished; the checks drop finished ones as they pass.

use super::{DeviceState, SimDevice};
use crate::driver::{DevicePtr, StreamId};

/// Physical memory: (handle, start offset, end offset); handle 0 is memory of no mapping, by
/// address.
type Part = (u64, u64, u64);

/// Work queued on `stream` as its `seq`-th unit that uses `[va, va + bytes)`, and the physical
/// memory behind that range when it was queued.
#[derive(Clone, Debug)]
pub(super) struct Touch {
    stream: StreamId,
    seq: u64,
    va: DevicePtr,
    bytes: u64,
    parts: Vec<Part>,
}

fn overlap(a: &[Part], b: &[Part]) -> bool {
    a.iter()
        .any(|&(h, lo, hi)| b.iter().any(|&(g, l, e)| h == g && lo < e && l < hi))
}

impl DeviceState {
    /// The physical memory behind `[va, va + bytes)` now.
    fn parts(&self, va: DevicePtr, bytes: u64) -> Vec<Part> {
        let end = va + bytes;
        let mut parts = Vec::new();
        let mut covered = 0;
        for p in self.processes.values() {
            for (&at, m) in p.mappings.range(..end).rev() {
                if at + m.bytes <= va {
                    break;
                }
                let (lo, hi) = (at.max(va), (at + m.bytes).min(end));
                parts.push((m.handle, lo - at, hi - at));
                covered += hi - lo;
            }
        }
        if covered < bytes {
            parts.push((0, va, end));
        }
        parts
    }

    /// Drop finished touches.
    fn drop_finished(&mut self) {
        let streams = &self.streams;
        self.touches
            .retain(|t| streams.get(&t.stream).is_some_and(|s| s.completed < t.seq));
    }

    /// Record the unmap of `[va, va + bytes)` if unfinished work still uses it.
    pub(super) fn check_unmap(&mut self, va: DevicePtr, bytes: u64) {
        self.drop_finished();
        let under: Vec<String> = self
            .touches
            .iter()
            .filter(|t| t.va < va + bytes && va < t.va + t.bytes)
            .map(|t| {
                format!(
                    "unmapped {va:#x}+{bytes} while work {} on {:?} (using {:#x}+{}) had not \
                     finished",
                    t.seq, t.stream, t.va, t.bytes
                )
            })
            .collect();
        self.unsafe_unmaps.extend(under);
    }
}

impl SimDevice {
    /// Queue one unit of work on `stream` that uses `[va, va + bytes)` (a kernel reading or
    /// writing a tensor there).
    pub fn submit_touching(&self, stream: StreamId, va: DevicePtr, bytes: u64) {
        let mut st = self.state.lock();
        let parts = st.parts(va, bytes);
        let seq = st.queue_unit(stream);
        st.touches.push(Touch {
            stream,
            seq,
            va,
            bytes,
            parts,
        });
    }

    /// The streams other than `except` whose unfinished work uses part of the physical memory
    /// behind `[va, va + bytes)`, through whatever address: memory handed to `except` there
    /// would be written while they still use it.
    pub fn unfinished_users(&self, va: DevicePtr, bytes: u64, except: StreamId) -> Vec<StreamId> {
        let mut st = self.state.lock();
        st.drop_finished();
        let parts = st.parts(va, bytes);
        let mut users: Vec<StreamId> = st
            .touches
            .iter()
            .filter(|t| t.stream != except && overlap(&t.parts, &parts))
            .map(|t| t.stream)
            .collect();
        users.sort_unstable_by_key(|s| s.0);
        users.dedup();
        users
    }

    /// Every unmap so far of memory that unfinished work still used, described.
    pub fn unsafe_unmaps(&self) -> Vec<String> {
        self.state.lock().unsafe_unmaps.clone()
    }
}

#[cfg(test)]
mod tests {
    use crate::driver::sim::SimDriver;
    use crate::driver::{Driver, StreamId};

    #[test]
    fn an_unmap_is_unsafe_only_while_work_that_used_the_range_runs() {
        let d = SimDriver::new();
        let g = d.granularity();
        let (a, b) = (StreamId(1), StreamId(2));
        let va = d.reserve_va(4 * g).unwrap();
        let h = d.create_physical(g).unwrap();
        let map = |at| {
            d.map(at, g, h).unwrap();
            d.set_access(at, g).unwrap();
        };
        map(va);
        let dev = d.device().clone();
        dev.submit_touching(a, va, 512);
        // Other work, and work on another range, do not make it unsafe; a's does until it ends.
        dev.submit_touching(b, va + g, 512);
        assert_eq!(dev.unfinished_users(va, g, b), vec![a]);
        assert!(dev.unfinished_users(va, g, a).is_empty());
        d.sync_stream(b).unwrap();
        d.unmap(va, g).unwrap();
        assert_eq!(dev.unsafe_unmaps().len(), 1, "{:?}", dev.unsafe_unmaps());
        map(va + 2 * g);
        d.sync_stream(a).unwrap();
        d.unmap(va + 2 * g, g).unwrap();
        map(va);
        dev.submit_touching(a, va, g);
        dev.complete(a);
        d.unmap(va, g).unwrap();
        dev.submit_touching(b, va, g);
        d.sync_device().unwrap();
        map(va);
        d.unmap(va, g).unwrap();
        assert_eq!(dev.unsafe_unmaps().len(), 1, "{:?}", dev.unsafe_unmaps());
    }

    #[test]
    fn work_through_one_address_uses_the_memory_behind_another() {
        let d = SimDriver::new();
        let g = d.granularity();
        let (a, b) = (StreamId(1), StreamId(2));
        let va = d.reserve_va(4 * g).unwrap();
        let h = d.create_physical(g).unwrap();
        for at in [va, va + 2 * g] {
            d.map(at, g, h).unwrap();
            d.set_access(at, g).unwrap();
        }
        let dev = d.device().clone();
        dev.submit_touching(a, va + 512, 512);
        // The same handle, mapped again: its first kilobyte is a's until a finishes.
        assert_eq!(dev.unfinished_users(va + 2 * g, 1024, b), vec![a]);
        assert!(dev.unfinished_users(va + 2 * g + 1024, 512, b).is_empty());
        dev.complete(a);
        assert!(dev.unfinished_users(va + 2 * g, 1024, b).is_empty());
    }
}
