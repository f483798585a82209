//! Sizing rules: how a request is rounded, which pool serves it, how large a new segment is,
//! and when a free block is split. These follow PyTorch's caching allocator so that a workload
//! behaves the way its authors expect; each rule is a pure function, tested on its own.

use crate::units::MIB;

/// Smallest block; every size is a multiple of it.
pub const MIN_BLOCK: u64 = 512;
/// Requests of at most this size (after rounding) use the small pool.
pub const SMALL_SIZE: u64 = MIB;
/// Segment size of the small pool.
pub const SMALL_BUFFER: u64 = 2 * MIB;
/// Segment size for large requests under [`MIN_LARGE_ALLOC`].
pub const LARGE_BUFFER: u64 = 20 * MIB;
/// Large requests of at least this size get a segment of their own size.
pub const MIN_LARGE_ALLOC: u64 = 10 * MIB;
/// Larger segments are rounded up to this.
pub const ROUND_LARGE: u64 = 2 * MIB;
/// Requests of at least this size are rejected outright: no device has 1 EiB.
pub const ABSURD_SIZE: u64 = 1 << 60;

/// Which free list a block lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PoolKind {
    Small = 0,
    Large = 1,
}

/// Round a request up to the allocator's block size: at least 512 B, a multiple of 512 B.
#[inline]
pub const fn round_size(size: u64) -> u64 {
    if size < MIN_BLOCK {
        MIN_BLOCK
    } else {
        size.div_ceil(MIN_BLOCK) * MIN_BLOCK
    }
}

/// Remap mode rounds a large block up to a whole granule when that adds at most this fraction
/// of it (1/64: every block of 128 MiB or more, smaller ones only when nearly whole granules).
pub const REMAP_ALIGN_WASTE: u64 = 64;

/// Remap mode's block size for a `rounded` request: a large block up to a whole granule when
/// that adds at most 1/[`REMAP_ALIGN_WASTE`] of it. A block that ends inside a granule makes the
/// blocks carved after it start inside one, and a block that reaches a fraction of a MiB into
/// the next piece pins that piece whole (on gpt2-train, the 147.2 MiB blocks at the bottom of
/// the reservation set every block above them 0.8 MiB off the granules).
#[inline]
pub const fn remap_round(rounded: u64, granularity: u64) -> u64 {
    if rounded <= SMALL_SIZE {
        return rounded;
    }
    let up = rounded.div_ceil(granularity) * granularity;
    if (up - rounded) * REMAP_ALIGN_WASTE <= rounded {
        up
    } else {
        rounded
    }
}

/// The pool for a rounded size.
#[inline]
pub const fn pool_for(rounded: u64) -> PoolKind {
    if rounded <= SMALL_SIZE {
        PoolKind::Small
    } else {
        PoolKind::Large
    }
}

/// Size of the plain segment created when no cached block fits a rounded request.
#[inline]
pub const fn segment_size(rounded: u64) -> u64 {
    if rounded <= SMALL_SIZE {
        SMALL_BUFFER
    } else if rounded < MIN_LARGE_ALLOC {
        LARGE_BUFFER
    } else {
        rounded.div_ceil(ROUND_LARGE) * ROUND_LARGE
    }
}

/// Page size of an expandable segment in this pool (PyTorch maps 2 MiB pages for the small
/// pool and 20 MiB pages for the large one), rounded up to the driver's granularity.
#[inline]
pub const fn expandable_page(pool: PoolKind, granularity: u64) -> u64 {
    let want = match pool {
        PoolKind::Small => SMALL_BUFFER,
        PoolKind::Large => LARGE_BUFFER,
    };
    want.div_ceil(granularity) * granularity
}

/// Whether a free block of `block` bytes serving `rounded` bytes is split, leaving the tail
/// free. The large pool keeps a tail of at most 1 MiB attached (internal waste, but no tiny
/// large-pool blocks) and never splits for an oversize request (at least `max_split`); the
/// small pool and expandable segments split any tail of 512 B or more.
#[inline]
pub const fn should_split(
    pool: PoolKind,
    expandable: bool,
    max_split: u64,
    block: u64,
    rounded: u64,
) -> bool {
    let remaining = block - rounded;
    match pool {
        _ if expandable => remaining >= MIN_BLOCK,
        PoolKind::Small => remaining >= MIN_BLOCK,
        PoolKind::Large => rounded < max_split && remaining > SMALL_SIZE,
    }
}

/// Whether a cached free block may serve a request, given `max_split_size` (PyTorch's rule:
/// an oversize block never serves a smaller-than-oversize request, and an oversize request
/// takes an oversize block only if it wastes less than 20 MiB).
#[inline]
pub const fn may_serve(max_split: u64, block: u64, rounded: u64) -> bool {
    if rounded < max_split {
        block < max_split
    } else {
        block < rounded + LARGE_BUFFER
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remap_rounds_a_large_block_to_the_granule_when_it_costs_at_most_a_64th() {
        let g = 2 * MIB;
        // gpt2-train's 147.2 MiB blocks: 0.8 MiB more, under 1/64 of them.
        let b = round_size(154_361_856);
        assert_eq!(remap_round(b, g), 148 * MIB);
        // A 6.8 MiB block would grow by 1.2 MiB, far more than 1/64 of it.
        let b = round_size(7_130_112);
        assert_eq!(remap_round(b, g), b);
        // Whole granules, the small pool, and the boundary itself.
        assert_eq!(remap_round(32 * MIB, g), 32 * MIB);
        assert_eq!(remap_round(MIB, g), MIB);
        assert_eq!(remap_round(512, g), 512);
        // Above 128 MiB every block is rounded (under 2 MiB is under a 64th of it); below, only
        // those close to a whole granule.
        assert_eq!(remap_round(130 * MIB + 512, g), 132 * MIB);
        assert_eq!(remap_round(127 * MIB, g), 128 * MIB);
        assert_eq!(remap_round(64 * MIB + 512, g), 64 * MIB + 512);
    }

    #[test]
    fn rounding_is_512_multiples_with_512_minimum() {
        assert_eq!(round_size(0), 512);
        assert_eq!(round_size(1), 512);
        assert_eq!(round_size(511), 512);
        assert_eq!(round_size(512), 512);
        assert_eq!(round_size(513), 1024);
        assert_eq!(round_size(1_000_000), 1_000_448);
        assert_eq!(round_size(MIB), MIB);
    }

    #[test]
    fn pools_split_at_one_mib() {
        assert_eq!(pool_for(MIB), PoolKind::Small);
        assert_eq!(pool_for(MIB + 512), PoolKind::Large);
    }

    #[test]
    fn segment_sizes_are_2_20_or_2mib_multiples() {
        assert_eq!(segment_size(512), 2 * MIB);
        assert_eq!(segment_size(MIB), 2 * MIB);
        assert_eq!(segment_size(MIB + 512), 20 * MIB);
        assert_eq!(segment_size(10 * MIB - 512), 20 * MIB);
        assert_eq!(segment_size(10 * MIB), 10 * MIB);
        assert_eq!(segment_size(10 * MIB + 512), 12 * MIB);
        assert_eq!(segment_size(1 << 30), 1 << 30);
    }

    #[test]
    fn split_rules() {
        // Small pool: any tail of at least 512 B is split off.
        let none = u64::MAX;
        assert!(should_split(
            PoolKind::Small,
            false,
            none,
            2 * MIB,
            2 * MIB - 512
        ));
        assert!(!should_split(PoolKind::Small, false, none, 1024, 1024));
        // Large pool: only tails above 1 MiB.
        assert!(!should_split(
            PoolKind::Large,
            false,
            none,
            20 * MIB,
            19 * MIB
        ));
        assert!(should_split(
            PoolKind::Large,
            false,
            none,
            20 * MIB,
            19 * MIB - 512
        ));
        // ... and never for an oversize request.
        assert!(!should_split(
            PoolKind::Large,
            false,
            64 * MIB,
            100 * MIB,
            64 * MIB
        ));
        assert!(should_split(
            PoolKind::Large,
            false,
            64 * MIB,
            100 * MIB,
            32 * MIB
        ));
        // Expandable: like the small pool.
        assert!(should_split(
            PoolKind::Large,
            true,
            none,
            20 * MIB,
            20 * MIB - 512
        ));
    }

    #[test]
    fn max_split_size_rules() {
        let max = 64 * MIB;
        assert!(may_serve(max, 32 * MIB, 16 * MIB));
        assert!(
            !may_serve(max, 64 * MIB, 16 * MIB),
            "oversize block for a small request"
        );
        assert!(may_serve(max, 80 * MIB, 64 * MIB));
        assert!(!may_serve(max, 84 * MIB, 64 * MIB), "wastes 20 MiB or more");
        assert!(
            may_serve(u64::MAX, 1 << 40, 512),
            "no limit: anything serves"
        );
    }

    #[test]
    fn expandable_pages() {
        assert_eq!(expandable_page(PoolKind::Small, 2 * MIB), 2 * MIB);
        assert_eq!(expandable_page(PoolKind::Large, 2 * MIB), 20 * MIB);
        assert_eq!(expandable_page(PoolKind::Large, 64 * MIB), 64 * MIB);
    }
}
