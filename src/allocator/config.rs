//! Allocator settings: the segment mode, the limit, and the knobs PyTorch users know.
//!
//! One mode type serves the allocator, replay, the CLI, the C ABI and Python; its names
//! (`native`, `expandable`, `compact`, `remap`) are the only spellings accepted anywhere.

use std::fmt;
use std::str::FromStr;

use crate::units::MIB;

/// How device memory is obtained.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum SegmentMode {
    /// PyTorch's default rules: one `cuMemAlloc` per segment (2 MiB, 20 MiB, or a 2 MiB
    /// multiple).
    #[default]
    Native,
    /// One virtual reservation per stream and pool; pages mapped on demand and unmapped by
    /// `empty_cache`, like PyTorch's `expandable_segments:True`.
    Expandable,
    /// Like `Expandable`, but each growth maps one piece of physical memory sized to the
    /// request (2 MiB granules), and before growing the allocator unmaps free memory of the
    /// same shard: physical memory moves to where it is needed, so reserved bytes follow live
    /// bytes. Costs a stream synchronisation and an unmap whenever it moves memory.
    Compact,
    /// Like `Expandable`, but physical memory is created in pieces of at most
    /// [`Config::remap_piece`], each mapped whole: before growing the large pool, the allocator
    /// unmaps pieces lying wholly inside free blocks anywhere in the shard and maps those same
    /// pieces where the request needs them (the small pool grows by new 2 MiB pages, so that no
    /// large piece ends up pinned under small blocks). A large block is rounded up to whole
    /// 2 MiB granules when that adds at most a 64th of it ([`super::rules::remap_round`]), so
    /// `Allocation::size` may exceed PyTorch's rounding. Few physical allocations, the least
    /// fragmentation.
    Remap,
}

impl SegmentMode {
    pub const ALL: [SegmentMode; 4] = [
        SegmentMode::Native,
        SegmentMode::Expandable,
        SegmentMode::Compact,
        SegmentMode::Remap,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            SegmentMode::Native => "native",
            SegmentMode::Expandable => "expandable",
            SegmentMode::Compact => "compact",
            SegmentMode::Remap => "remap",
        }
    }

    /// One line for `--list-modes`.
    pub const fn describe(self) -> &'static str {
        match self {
            SegmentMode::Native => {
                "plain cuMemAlloc segments (2 MiB, 20 MiB, 2 MiB multiples), PyTorch's default rules"
            }
            SegmentMode::Expandable => {
                "one virtual reservation per stream and pool, 2 MiB / 20 MiB pages mapped on demand"
            }
            SegmentMode::Compact => {
                "virtual memory mapped in request-sized pieces; free pieces are moved before growing"
            }
            SegmentMode::Remap => {
                "physical memory in pieces mapped whole; free pieces are remapped before growing"
            }
        }
    }

    /// Whether the mode maps physical memory into reserved address ranges.
    pub const fn is_virtual(self) -> bool {
        !matches!(self, SegmentMode::Native)
    }
}

impl fmt::Display for SegmentMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A mode name that is not one of [`SegmentMode::ALL`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown segment mode {0:?}: expected native, expandable, compact or remap")]
pub struct UnknownMode(pub String);

impl FromStr for SegmentMode {
    type Err = UnknownMode;
    fn from_str(s: &str) -> Result<Self, UnknownMode> {
        SegmentMode::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| UnknownMode(s.to_owned()))
    }
}

/// A cap on the bytes the allocator may hold from the driver.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Limit {
    Bytes(u64),
    /// A fraction of the device's total memory, in [0, 1] (0: none may be held).
    Fraction(f64),
}

/// Allocator settings. The defaults are PyTorch's.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Config {
    pub mode: SegmentMode,
    pub limit: Option<Limit>,
    /// Cached blocks at least this large are never split (PyTorch's `max_split_size_mb`).
    pub max_split_size: Option<u64>,
    /// Remap mode: the largest piece of large-pool memory one map call covers (rounded up to
    /// the granularity; default 68 MiB). Smaller pieces can be moved more finely (less
    /// fragmentation) but cost more map calls; the README has the measured trade-off.
    pub remap_piece: Option<u64>,
    /// Compact and remap modes: before growing, also take free memory that other streams'
    /// shards hold (unmapped where it lies wholly in free blocks, after the device is
    /// synchronised), so that memory cached for one stream serves another. Off by default
    /// until its device synchronisations are measured on a GPU; replay turns it on.
    pub move_across_streams: bool,
    /// Remap mode: a piece moved out of the growing stream's own free memory is mapped at its
    /// new place at once and unmapped from the old one only once the stream's work queued
    /// before the move has finished (an event, queried later), instead of after a
    /// synchronisation of the stream: stream order already keeps the new uses after the old
    /// ones. Moves from other streams' memory still synchronise. Off by default until it is
    /// measured on a GPU.
    pub unmap_later: bool,
    /// Keep each tag's memory in segments (and free lists) of its own, per stream, so that a
    /// tag can be put to sleep ([`crate::Allocator::sleep`]) without touching another tag's
    /// memory; graph pools are split by tag too, so a tag's graphs sleep with it. Costs at most
    /// a partly used page, and a reserved address range, per tag, stream and pool; off by
    /// default (PyTorch's layout).
    pub separate_tags: bool,
    /// Best fit looks at every free block of the request's size class, as PyTorch's does,
    /// instead of at most 16 (whose fit is within 1/32 of the best). Replay turns it on in
    /// native mode, to take PyTorch's decisions; off by default, because a class crowded with
    /// thousands of cached blocks would then cost a scan of them all under the shard's lock.
    pub exact_best_fit: bool,
}

impl Config {
    /// The defaults, in `mode`.
    pub fn with_mode(mode: SegmentMode) -> Config {
        Config {
            mode,
            ..Config::default()
        }
    }
}

/// Default [`Config::remap_piece`]: the middle of the widest range of piece sizes (48 to 90 MiB)
/// over which every shared replay trace that remap can fit within 2% of its floor does so within
/// 2x PyTorch's estimated driver time, so that the default and ±25% of it all pass.
pub const DEFAULT_REMAP_PIECE: u64 = 68 * MIB;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mode_names_round_trip_and_nothing_else_parses() {
        for m in SegmentMode::ALL {
            assert_eq!(m.name().parse::<SegmentMode>(), Ok(m));
            assert_eq!(serde_json::to_string(&m).unwrap(), format!("\"{m}\""));
        }
        for bad in ["plain", "Native", "", "remap "] {
            let e = bad.parse::<SegmentMode>().unwrap_err();
            assert!(e.to_string().contains("expected native"), "{e}");
        }
    }
}
