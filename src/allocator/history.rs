//! The allocation history, as PyTorch records it (`_record_memory_history`): a bounded ring of
//! trace entries (allocations, frees requested and completed, segments allocated, freed, mapped
//! and unmapped), off by default, written out as PyTorch's snapshot pickle so that PyTorch's
//! memory_viz opens it and `vram-ledger replay` reads it back.
//!
//! The vocabulary of the history ([`Action`]) is PyTorch's trace vocabulary: the replay tool
//! reads traces in it, and the snapshot writer writes this history in it.
//!
//! Invariants:
//! - While recording is off, the cached path pays one test of a flag in the shard it already
//!   holds (`Shard::recording`), set and cleared under each shard's lock in turn; the ring's
//!   lock is taken only when an entry is written.
//! - The ring keeps the newest `max_entries` entries; older ones are dropped first, counted in
//!   `dropped`.
//! - Entries are written after the operation they describe succeeded, under the lock that
//!   made it, so a shard's entries are in the order its operations happened.
//! - An allocation's or a free's entry carries the host's context for it (an identifier the
//!   host resolves to stack frames, [`with_context`]); the host gathers it before the
//!   operation takes any lock of the allocator, so gathering it may wait on the host's own
//!   locks (Python's) without holding ours.
//! - Every entry carries the host's metadata in force when it was written (PyTorch's
//!   `_set_memory_metadata`), as an index into `metadata` (0: none). A string is replaced only
//!   once no kept entry names it, so an index always names the string it was written with.
//! - While recording, `live` maps the address of every allocation made with a context and not
//!   yet freed to that context, whatever the ring's bound dropped (a live block shows its
//!   allocation's stack as long as it lives); it is emptied when recording starts or stops,
//!   since frees made while it is off are not seen.

use std::cell::Cell;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::Instant;

use parking_lot::Mutex;

use crate::driver::StreamId;
use crate::tag::Tag;

/// One kind of trace entry, as PyTorch names them in `device_traces`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    Alloc,
    FreeRequested,
    FreeCompleted,
    SegmentAlloc,
    SegmentFree,
    SegmentMap,
    SegmentUnmap,
    Oom,
}

impl Action {
    pub const ALL: [Action; 8] = [
        Action::Alloc,
        Action::FreeRequested,
        Action::FreeCompleted,
        Action::SegmentAlloc,
        Action::SegmentFree,
        Action::SegmentMap,
        Action::SegmentUnmap,
        Action::Oom,
    ];

    /// PyTorch's name for it.
    pub const fn name(self) -> &'static str {
        match self {
            Action::Alloc => "alloc",
            Action::FreeRequested => "free_requested",
            Action::FreeCompleted => "free_completed",
            Action::SegmentAlloc => "segment_alloc",
            Action::SegmentFree => "segment_free",
            Action::SegmentMap => "segment_map",
            Action::SegmentUnmap => "segment_unmap",
            Action::Oom => "oom",
        }
    }

    /// The action PyTorch names `s`, if any.
    pub fn parse(s: &str) -> Option<Action> {
        Action::ALL.into_iter().find(|a| a.name() == s)
    }
}

/// How a segment event of sleep (memory given back) or wake (mapped again) is marked in a
/// snapshot's `user_metadata`, before the tag's name.
pub const SLEEP: &str = "sleep";
pub const WAKE: &str = "wake";

thread_local! {
    /// The host's context for the operation this thread is making, 0 for none.
    static CONTEXT: Cell<u64> = const { Cell::new(0) };
}

/// Run `f` with `context` as this thread's context: the allocation and free entries it
/// records carry it (0: none). The C ABI sets it around one allocation or free when the host
/// names contexts (PyTorch's stack frames, `vram_ledger_set_context_source`).
pub fn with_context<R>(context: u64, f: impl FnOnce() -> R) -> R {
    struct Restore(u64);
    impl Drop for Restore {
        fn drop(&mut self) {
            CONTEXT.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(CONTEXT.with(|c| c.replace(context)));
    f()
}

/// One trace entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HistoryEntry {
    pub action: Action,
    pub addr: u64,
    pub size: u64,
    pub stream: StreamId,
    pub tag: Tag,
    /// A segment event of sleep or wake: `tag`'s memory given back, or mapped again at the
    /// same addresses (not the cache's).
    pub sleep: bool,
    /// Microseconds since recording started.
    pub time_us: u64,
    /// The host's context of an allocation or a free ([`with_context`]), 0 for none.
    pub context: u64,
    /// The host's metadata in force then: 1 + its index in `Allocator::history_metadata_table`,
    /// 0 for none.
    pub metadata: u32,
}

/// Distinct metadata strings a history keeps at most.
pub const MAX_METADATA: usize = 4096;

struct Ring {
    max: usize,
    entries: VecDeque<HistoryEntry>,
    dropped: u64,
    start: Instant,
    live: HashMap<u64, u64>,
    metadata: Vec<String>,
    current: u32,
}

pub(crate) struct History {
    on: AtomicBool,
    ring: Mutex<Ring>,
}

impl Default for History {
    fn default() -> Self {
        History {
            on: AtomicBool::new(false),
            ring: Mutex::new(Ring {
                max: 0,
                entries: VecDeque::new(),
                dropped: 0,
                start: Instant::now(),
                live: HashMap::new(),
                metadata: Vec::new(),
                current: 0,
            }),
        }
    }
}

impl History {
    /// Start (clearing what was recorded) or stop recording.
    pub(crate) fn set(&self, enabled: bool, max_entries: usize) {
        let mut r = self.ring.lock();
        if enabled {
            r.max = max_entries.max(1);
            r.entries.clear();
            r.dropped = 0;
            r.start = Instant::now();
        }
        r.live.clear();
        self.on.store(enabled, Relaxed);
    }

    /// Whether recording is on (for the slow paths: segment events).
    pub(crate) fn on(&self) -> bool {
        self.on.load(Relaxed)
    }

    /// Write an entry if recording is on. `stream` is the stream the work was on (a graph
    /// pool's memory, which no one stream owns, is recorded on the default stream).
    #[cold]
    pub(crate) fn record(&self, action: Action, addr: u64, size: u64, stream: StreamId, tag: Tag) {
        self.record_entry(action, addr, size, stream, tag, false);
    }

    /// [`History::record`] of a segment event of sleep or wake of `tag`.
    #[cold]
    pub(crate) fn record_sleep(&self, action: Action, addr: u64, size: u64, tag: Tag) {
        self.record_entry(action, addr, size, StreamId::DEFAULT, tag, true);
    }

    fn record_entry(
        &self,
        action: Action,
        addr: u64,
        size: u64,
        stream: StreamId,
        tag: Tag,
        sleep: bool,
    ) {
        if !self.on() {
            return;
        }
        let mut r = self.ring.lock();
        if r.entries.len() >= r.max {
            r.entries.pop_front();
            r.dropped += 1;
        }
        let time_us = r.start.elapsed().as_micros() as u64;
        let metadata = r.current;
        let mut context = match action {
            Action::Alloc | Action::FreeRequested => CONTEXT.with(Cell::get),
            _ => 0,
        };
        match action {
            Action::Alloc if context != 0 => {
                r.live.insert(addr, context);
            }
            Action::FreeRequested => {
                // A free gathered without a stack of its own shows its allocation's, as
                // PyTorch's history does.
                let allocated = r.live.remove(&addr);
                if context == 0 {
                    context = allocated.unwrap_or(0);
                }
            }
            _ => {}
        }
        r.entries.push_back(HistoryEntry {
            action,
            addr,
            size,
            stream,
            tag,
            sleep,
            time_us,
            context,
            metadata,
        });
    }

    /// Attach `metadata` to the entries written from now on ("" or None: none). Past
    /// [`MAX_METADATA`] distinct strings, one that no kept entry names any more is reused; if
    /// every one is still named, the entries go without (logged).
    pub(crate) fn set_metadata(&self, metadata: Option<&str>) {
        let mut r = self.ring.lock();
        let Some(m) = metadata.filter(|m| !m.is_empty()) else {
            r.current = 0;
            return;
        };
        let i = match r.metadata.iter().position(|s| s == m) {
            Some(i) => i,
            None if r.metadata.len() < MAX_METADATA => {
                r.metadata.push(m.to_owned());
                r.metadata.len() - 1
            }
            None => {
                let mut named = vec![false; r.metadata.len()];
                for e in r.entries.iter().filter(|e| e.metadata > 0) {
                    named[e.metadata as usize - 1] = true;
                }
                let Some(free) = named.iter().position(|&n| !n) else {
                    tracing::warn!(
                        metadata = m,
                        "every history metadata string is still named: entries go without"
                    );
                    r.current = 0;
                    return;
                };
                r.metadata[free] = m.to_owned();
                free
            }
        };
        r.current = i as u32 + 1;
    }

    /// The metadata in force, if any.
    pub(crate) fn metadata(&self) -> Option<String> {
        let r = self.ring.lock();
        (r.current > 0).then(|| r.metadata[r.current as usize - 1].clone())
    }

    /// The metadata strings, by [`HistoryEntry::metadata`] − 1.
    pub(crate) fn metadata_table(&self) -> Vec<String> {
        self.ring.lock().metadata.clone()
    }

    /// The context of each live allocation made with one while recording, by address.
    pub(crate) fn live_contexts(&self) -> HashMap<u64, u64> {
        self.ring.lock().live.clone()
    }

    /// The entries recorded, oldest first, and how many were dropped to keep the bound.
    pub(crate) fn entries(&self) -> (Vec<HistoryEntry>, u64) {
        let r = self.ring.lock();
        (r.entries.iter().copied().collect(), r.dropped)
    }
}
