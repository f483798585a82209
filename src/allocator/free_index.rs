//! The free-block index of one (owner, pool): segregated bins with intrusive lists.
//!
//! Invariants:
//! - Sizes are multiples of 512 B. A block of `n` units of 512 B goes by `n - 1`: under 64
//!   units a bin each; above, every power of two is cut into 32 bins, so two blocks in one bin
//!   differ by less than 1/32 of their size. (Going by `n - 1` puts a power-of-two block at
//!   the top of its bin, so splitting a small front off it, the common case of a fresh 2 MiB
//!   segment, leaves the rest in the same bin.)
//! - A block is listed in exactly one bin while it is `Free`, the bin its `bin` field names,
//!   which is the bin of its size: a listed block whose size changes is rebinned
//!   ([`FreeIndex::resized`]), which costs nothing while the size stays in the bin.
//! - Bit `b` of `words` is set exactly when bin `b` is non-empty, and bit `w` of `summary`
//!   exactly when word `w` is non-zero; so the first non-empty bin at or above any bin is
//!   found with two bit scans.
//!
//! Best fit: the request's own bin is searched for the smallest block that fits (lowest
//! address on ties), then the next non-empty bin, whose blocks all fit, for its smallest.
//! Searches look at no more than [`SCAN`] entries of a bin, so a bin crowded with thousands of
//! near-equal blocks costs a bounded time at the price of a fit up to 1/32 looser, except an
//! exact search (`Config::exact_best_fit`, native replay), which looks at every entry:
//! PyTorch's best fit is exact, and
//! on a checkpointed training run with 222 segments of one layout the bounded search took a
//! block of the same size at a higher address than PyTorch did, and made 2 segments more.

use super::block::{Arena, BlockId, NIL};
use super::planted::{self, Bug};

const EXACT: usize = 64;
const SUB: u32 = 5;
pub(crate) const BINS: usize = EXACT + 47 * (1 << SUB);
const WORDS: usize = BINS.div_ceil(64);
const SCAN: usize = 16;

#[inline]
fn bin_of(size: u64) -> u16 {
    let u = (size >> 9).saturating_sub(1);
    if u < EXACT as u64 {
        return u as u16;
    }
    let fl = 63 - u.leading_zeros();
    let sl = (u >> (fl - SUB)) & ((1 << SUB) - 1);
    (EXACT as u32 + ((fl - 6) << SUB) + sl as u32) as u16
}

#[derive(Debug)]
pub(crate) struct FreeIndex {
    heads: Box<[BlockId]>,
    words: [u64; WORDS],
    summary: u32,
    len: usize,
}

impl Default for FreeIndex {
    fn default() -> Self {
        FreeIndex {
            heads: vec![NIL; BINS].into_boxed_slice(),
            words: [0; WORDS],
            summary: 0,
            len: 0,
        }
    }
}

impl FreeIndex {
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn insert(&mut self, arena: &mut Arena, id: BlockId) {
        let b = bin_of(arena[id].size);
        self.link(arena, id, b);
        self.len += 1;
    }

    pub(crate) fn remove(&mut self, arena: &mut Arena, id: BlockId) {
        self.unlink(arena, id);
        self.len -= 1;
    }

    /// Listed block `id` changed size: it moves to the bin of its new size, if that is another.
    #[inline]
    pub(crate) fn resized(&mut self, arena: &mut Arena, id: BlockId) {
        let blk = &arena[id];
        let b = bin_of(blk.size);
        if b != blk.bin {
            self.rebin(arena, id, b);
        }
    }

    #[inline(never)]
    fn rebin(&mut self, arena: &mut Arena, id: BlockId, b: u16) {
        self.unlink(arena, id);
        self.link(arena, id, b);
    }

    #[inline]
    fn link(&mut self, arena: &mut Arena, id: BlockId, b: u16) {
        let bi = b as usize;
        let head = self.heads[bi];
        let blk = &mut arena[id];
        blk.bin = b;
        blk.free_prev = NIL;
        blk.free_next = head;
        if head != NIL {
            arena[head].free_prev = id;
        }
        self.heads[bi] = id;
        self.words[bi / 64] |= 1 << (bi % 64);
        self.summary |= 1 << (bi / 64);
    }

    #[inline]
    fn unlink(&mut self, arena: &mut Arena, id: BlockId) {
        let blk = &arena[id];
        let (b, prev, next) = (blk.bin as usize, blk.free_prev, blk.free_next);
        if prev != NIL {
            arena[prev].free_next = next;
        } else {
            debug_assert_eq!(self.heads[b], id, "block is not listed in its bin");
            self.heads[b] = next;
            if next == NIL {
                self.words[b / 64] &= !(1 << (b % 64));
                if self.words[b / 64] == 0 {
                    self.summary &= !(1 << (b / 64));
                }
            }
        }
        if next != NIL {
            arena[next].free_prev = prev;
        }
    }

    /// The first non-empty bin at or after `b`.
    #[inline]
    fn next_bin(&self, b: usize) -> Option<usize> {
        let w = b / 64;
        let bits = self.words[w] & (!0u64 << (b % 64));
        if bits != 0 {
            return Some(w * 64 + bits.trailing_zeros() as usize);
        }
        let rest = self.summary & (!0u32).checked_shl(w as u32 + 1).unwrap_or(0);
        if rest == 0 {
            return None;
        }
        let w = rest.trailing_zeros() as usize;
        Some(w * 64 + self.words[w].trailing_zeros() as usize)
    }

    /// The smallest block of bin `b` holding at least `size` bytes (lowest address on ties).
    #[inline]
    fn best_in(&self, arena: &Arena, b: usize, size: u64, exact: bool) -> Option<BlockId> {
        let mut id = self.heads[b];
        let mut best: Option<(u64, u64, BlockId)> = None;
        let mut seen = 0;
        let scan = if exact { usize::MAX } else { SCAN };
        while id != NIL && seen < scan {
            let blk = &arena[id];
            if blk.size >= size && best.is_none_or(|(s, a, _)| (blk.size, blk.addr) < (s, a)) {
                best = Some((blk.size, blk.addr, id));
            }
            id = blk.free_next;
            seen += 1;
        }
        best.map(|(_, _, id)| id)
    }

    /// The best cached block for `size` bytes; `exact` looks at every candidate.
    #[inline]
    pub(crate) fn best_fit(&self, arena: &Arena, size: u64, exact: bool) -> Option<BlockId> {
        if planted::active(Bug::FirstFit) {
            return self.first_fit(arena, size);
        }
        let b = bin_of(size) as usize;
        if let Some(id) = self.best_in(arena, b, size, exact) {
            return Some(id);
        }
        let next = self.next_bin(b + 1)?;
        self.best_in(arena, next, 0, exact)
    }

    /// The planted policy error: the listed block at the lowest address that fits.
    #[cold]
    fn first_fit(&self, arena: &Arena, size: u64) -> Option<BlockId> {
        let fits = self
            .listed(arena)
            .into_iter()
            .filter(|&id| arena[id].size >= size);
        fits.min_by_key(|&id| arena[id].addr)
    }

    /// Every listed block, for consistency checks: the bins the bitmap says are non-empty,
    /// which are all of them while [`FreeIndex::bitmap_agrees`].
    pub(crate) fn listed(&self, arena: &Arena) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(self.len);
        for (w, &word) in self.words.iter().enumerate() {
            let mut bits = word;
            while bits != 0 {
                let mut id = self.heads[w * 64 + bits.trailing_zeros() as usize];
                bits &= bits - 1;
                while id != NIL {
                    out.push(id);
                    id = arena[id].free_next;
                }
            }
        }
        out
    }

    /// Whether bit `b` of `words` is set exactly when bin `b` has a head, and bit `w` of
    /// `summary` exactly when word `w` is non-zero. The bins of a zero word are compared with
    /// empty ones whole: a check that costs little next to the thousand-odd bins, most empty.
    pub(crate) fn bitmap_agrees(&self) -> bool {
        const EMPTY: [BlockId; 64] = [NIL; 64];
        self.words.iter().enumerate().all(|(w, &word)| {
            let heads = &self.heads[w * 64..((w + 1) * 64).min(BINS)];
            let bins_agree = if word == 0 {
                heads == &EMPTY[..heads.len()]
            } else {
                word.checked_shr(heads.len() as u32).unwrap_or(0) == 0
                    && heads
                        .iter()
                        .enumerate()
                        .all(|(i, &h)| (h != NIL) == (word & (1 << i) != 0))
            };
            bins_agree && ((self.summary >> w) & 1 != 0) == (word != 0)
        }) && self.summary >> WORDS == 0
    }

    /// Whether `id` is listed in the bin of its size (and names that bin).
    pub(crate) fn contains(&self, arena: &Arena, id: BlockId) -> bool {
        let b = bin_of(arena[id].size);
        if arena[id].bin != b {
            return false;
        }
        let mut cur = self.heads[b as usize];
        while cur != NIL {
            if cur == id {
                return true;
            }
            cur = arena[cur].free_next;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::allocator::block::{BlockState, Fresh};
    use crate::allocator::rules::PoolKind;

    /// A free large-pool block of `size` bytes at `addr`, listed in `idx`.
    fn listed_block(arena: &mut Arena, idx: &mut FreeIndex, addr: u64, size: u64) -> BlockId {
        let id = arena.insert(Fresh {
            addr,
            size,
            segment: 0,
            list: 0,
            state: BlockState::Free,
            pool: PoolKind::Large,
            prev: NIL,
            next: NIL,
        });
        idx.insert(arena, id);
        id
    }

    /// The listing walks the bins the bitmap names; the bitmap check catches a bin whose bit
    /// is wrong either way, and a summary bit that is.
    #[test]
    fn the_bitmap_names_exactly_the_listed_bins() {
        let mut arena = Arena::default();
        let mut idx = FreeIndex::default();
        let ids: Vec<BlockId> = [512u64, 4096, 2 << 20, 1 << 30, (1 << 30) + (64 << 20)]
            .iter()
            .map(|&size| listed_block(&mut arena, &mut idx, size, size))
            .collect();
        assert!(idx.bitmap_agrees());
        let mut listed = idx.listed(&arena);
        listed.sort_unstable();
        assert_eq!(listed, ids);
        idx.remove(&mut arena, ids[2]);
        assert!(idx.bitmap_agrees());
        assert_eq!(idx.listed(&arena).len(), idx.len());

        let b = arena[ids[3]].bin as usize;
        idx.words[b / 64] &= !(1 << (b % 64));
        assert!(!idx.bitmap_agrees(), "a listed bin without its bit");
        assert!(idx.listed(&arena).len() < idx.len());
        idx.words[b / 64] |= 1 << (b % 64);
        let empty = bin_of(8 << 20) as usize;
        idx.words[empty / 64] |= 1 << (empty % 64);
        assert!(!idx.bitmap_agrees(), "a bit without a listed bin");
        idx.words[empty / 64] &= !(1 << (empty % 64));
        assert!(idx.bitmap_agrees());
        idx.summary |= 1 << (WORDS - 1);
        assert!(!idx.bitmap_agrees(), "a summary bit without a word");
    }

    #[test]
    fn an_exact_search_finds_the_lowest_address_among_many_blocks_of_one_size() {
        // Blocks listed highest address first, more of them than a bounded search looks at:
        // the lowest is found only by the exact search.
        let mut arena = Arena::default();
        let mut idx = FreeIndex::default();
        let size = 36 << 20;
        let n = SCAN as u64 * 2;
        let ids: Vec<BlockId> = (0..n)
            .map(|i| listed_block(&mut arena, &mut idx, (i + 1) << 30, size))
            .collect();
        let lowest = ids[0];
        assert_eq!(idx.best_fit(&arena, 32 << 20, true), Some(lowest));
        let bounded = idx.best_fit(&arena, 32 << 20, false).unwrap();
        assert_eq!(arena[bounded].size, size);
        assert_ne!(
            bounded, lowest,
            "the bounded search looks at {SCAN} blocks only"
        );
    }

    #[test]
    fn bins_are_monotone_and_tight() {
        let mut last = 0;
        for units in 1u64..200_000 {
            let b = bin_of(units * 512);
            assert!(b >= last, "bins must not decrease with size");
            last = b;
        }
        assert_eq!(bin_of(512), 0);
        assert_eq!(bin_of(64 * 512), 63);
        assert!((bin_of((1u64 << 60) - 512) as usize) < BINS);
        // Within one bin, sizes differ by less than 1/32.
        let lo = 64 * 512 * 1024 + 512;
        let hi = lo + 64 * 512 * 1024 / 32 - 512;
        assert_eq!(bin_of(lo), bin_of(hi));
        assert_ne!(bin_of(lo), bin_of(hi + 512));
        assert_ne!(bin_of(lo), bin_of(lo - 512));
        // A power of two is the top of its bin: a small front split off leaves it there.
        assert_eq!(bin_of(2 << 20), bin_of((2 << 20) - 4096));
    }
}
