//! What a sleep and a wake report (`sleep.rs`): bytes moved, given back and held, and where
//! the time went.

use crate::tag::Tag;

/// What one sleep did.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct SleepReport {
    /// Tags put to sleep by this call (tags already asleep are left as they are).
    pub tags: Vec<Tag>,
    /// Device bytes copied to host memory.
    pub offloaded_bytes: u64,
    /// Device bytes of discarded tags.
    pub discarded_bytes: u64,
    /// Bytes given back to the driver (the sleeping tags' mappings; the cache of every tag
    /// is given back too, beforehand, and not counted here).
    pub given_back_bytes: u64,
    /// Bytes of sleeping tags still held because a release or unmap failed.
    pub held_bytes: u64,
    /// Host memory holding the offloaded tags (pageable, or page-locked where retained).
    pub host_bytes: u64,
    pub seconds: f64,
    /// Of `seconds`, the copies to host memory (with the host memory's allocation).
    pub copy_seconds: f64,
    /// Threads that copied through the staging ring (0: none staged).
    pub copy_workers: usize,
}

/// What one wake did.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct WakeReport {
    pub tags: Vec<Tag>,
    /// Fresh device memory mapped at the sleeping addresses.
    pub mapped_bytes: u64,
    /// Bytes copied back from host memory.
    pub restored_bytes: u64,
    /// Bytes of discarded tags filled with zeros.
    pub zeroed_bytes: u64,
    /// Host memory still held after the wake (retained, or not freeable).
    pub host_bytes_after: u64,
    pub seconds: f64,
    /// Of `seconds`, putting contents back (copies and zero fills).
    pub copy_seconds: f64,
}

/// What giving back sleeping tags' memory did.
#[derive(Default)]
pub(super) struct GivenBack {
    pub(super) gone: u64,
    pub(super) held: u64,
    pub(super) discarded: u64,
}

impl SleepReport {
    pub(super) fn add(&mut self, g: &GivenBack) {
        self.given_back_bytes += g.gone;
        self.held_bytes += g.held;
        self.discarded_bytes += g.discarded;
    }
}
