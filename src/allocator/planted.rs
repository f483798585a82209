//! Bugs planted on purpose, to show that the property tests catch them.
//!
//! Built only with the `planted-bugs` feature, and then active only when the environment
//! variable `VRAM_LEDGER_PLANT` names one of them (`split_off_by_512`, `missed_merge`,
//! `segment_count`, `remap_spare`, `first_fit`, `limit_ignored`, `unmap_unsynced`,
//! `retire_early`). The first four break the allocator's structures; the others leave every
//! structure sound: a block that fits but is not the best, growth past the limit, and freed
//! memory unmapped while the device may still be using it (before a move, or a moved piece's
//! old mapping). Without the feature, [`active`] is the constant `false` and
//! every planted branch compiles away, so the cached path costs what it did.

/// A planted bug.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bug {
    /// A split leaves the free tail starting 512 bytes too early (it overlaps the allocation).
    SplitOffBy512,
    /// A freed block is not merged with a free successor.
    MissedMerge,
    /// Freeing a plain segment forgets to lower the segment count.
    SegmentCount,
    /// Remap mode: giving spare pieces back to the driver forgets the last one (a leak).
    RemapSpare,
    /// A request takes the cached block at the lowest address that fits, not the smallest.
    FirstFit,
    /// Growth does not check the limit.
    LimitIgnored,
    /// Free memory is unmapped with nothing synchronised first.
    UnmapUnsynced,
    /// A moved piece's old mapping is unmapped without asking whether its stream's work is done.
    RetireEarly,
}

#[cfg_attr(not(feature = "planted-bugs"), allow(dead_code))]
impl Bug {
    pub const ALL: [Bug; 8] = [
        Bug::SplitOffBy512,
        Bug::MissedMerge,
        Bug::SegmentCount,
        Bug::RemapSpare,
        Bug::FirstFit,
        Bug::LimitIgnored,
        Bug::UnmapUnsynced,
        Bug::RetireEarly,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            Bug::SplitOffBy512 => "split_off_by_512",
            Bug::MissedMerge => "missed_merge",
            Bug::SegmentCount => "segment_count",
            Bug::RemapSpare => "remap_spare",
            Bug::FirstFit => "first_fit",
            Bug::LimitIgnored => "limit_ignored",
            Bug::UnmapUnsynced => "unmap_unsynced",
            Bug::RetireEarly => "retire_early",
        }
    }
}

/// Whether `bug` is planted in this run.
#[cfg(feature = "planted-bugs")]
pub(crate) fn active(bug: Bug) -> bool {
    static PLANTED: std::sync::OnceLock<Option<Bug>> = std::sync::OnceLock::new();
    *PLANTED.get_or_init(|| {
        let name = std::env::var("VRAM_LEDGER_PLANT").ok()?;
        let bug = Bug::ALL.into_iter().find(|b| b.name() == name);
        if bug.is_none() {
            panic!("VRAM_LEDGER_PLANT={name:?} names no planted bug");
        }
        bug
    }) == Some(bug)
}

#[cfg(not(feature = "planted-bugs"))]
#[inline(always)]
pub(crate) const fn active(_bug: Bug) -> bool {
    false
}
