//! The free-block index of one (stream, pool): segregated bins with intrusive lists.
//!
//! Invariants:
//! - Sizes are multiples of 512 B. Sizes under 32 KiB have a bin each; above, every power of
//!   two is cut into 32 bins, so two blocks in one bin differ by less than 1/32 of their size.
//! - A block is in the list of the bin of its size exactly while it is `Free`; its size does
//!   not change while it is listed (callers remove, resize, reinsert).
//! - Bit `b` of `words` is set exactly when bin `b` is non-empty, and bit `w` of `summary`
//!   exactly when word `w` is non-zero; so the first non-empty bin at or above any bin is
//!   found with two bit scans.
//!
//! Best fit: the request's own bin is searched for the smallest block that fits (lowest
//! address on ties), then the next non-empty bin, whose blocks all fit, for its smallest.
//! Searches look at no more than [`SCAN`] entries of a bin, so a bin crowded with thousands of
//! near-equal blocks costs a bounded time at the price of a fit up to 1/32 looser.

use super::block::{Arena, BlockId, NIL};

const EXACT: usize = 64;
const SUB: u32 = 5;
pub(crate) const BINS: usize = EXACT + 47 * (1 << SUB);
const WORDS: usize = BINS.div_ceil(64);
const SCAN: usize = 16;

#[inline]
fn bin_of(size: u64) -> usize {
    let units = size >> 9;
    if units < EXACT as u64 {
        return units as usize;
    }
    let fl = 63 - units.leading_zeros();
    let sl = (units >> (fl - SUB)) & ((1 << SUB) - 1);
    EXACT + ((fl - 6) << SUB) as usize + sl as usize
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
        let head = self.heads[b];
        arena[id].free_prev = NIL;
        arena[id].free_next = head;
        if head != NIL {
            arena[head].free_prev = id;
        }
        self.heads[b] = id;
        self.words[b / 64] |= 1 << (b % 64);
        self.summary |= 1 << (b / 64);
        self.len += 1;
    }

    pub(crate) fn remove(&mut self, arena: &mut Arena, id: BlockId) {
        let b = bin_of(arena[id].size);
        let (prev, next) = (arena[id].free_prev, arena[id].free_next);
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
        self.len -= 1;
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
    fn best_in(&self, arena: &Arena, b: usize, size: u64) -> Option<BlockId> {
        let mut id = self.heads[b];
        let mut best: Option<(u64, u64, BlockId)> = None;
        let mut seen = 0;
        while id != NIL && seen < SCAN {
            let blk = &arena[id];
            if blk.size >= size && best.is_none_or(|(s, a, _)| (blk.size, blk.addr) < (s, a)) {
                best = Some((blk.size, blk.addr, id));
            }
            id = blk.free_next;
            seen += 1;
        }
        best.map(|(_, _, id)| id)
    }

    /// The best cached block for `size` bytes.
    #[inline]
    pub(crate) fn best_fit(&self, arena: &Arena, size: u64) -> Option<BlockId> {
        let b = bin_of(size);
        if let Some(id) = self.best_in(arena, b, size) {
            return Some(id);
        }
        let next = self.next_bin(b + 1)?;
        self.best_in(arena, next, 0)
    }

    /// Every listed block, for consistency checks.
    pub(crate) fn listed(&self, arena: &Arena) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(self.len);
        for &head in self.heads.iter() {
            let mut id = head;
            while id != NIL {
                out.push(id);
                id = arena[id].free_next;
            }
        }
        out
    }

    /// Whether `id` is listed in the bin of its size.
    pub(crate) fn contains(&self, arena: &Arena, id: BlockId) -> bool {
        let mut cur = self.heads[bin_of(arena[id].size)];
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

    #[test]
    fn bins_are_monotone_and_tight() {
        let mut last = 0;
        for units in 1u64..200_000 {
            let b = bin_of(units * 512);
            assert!(b >= last, "bins must not decrease with size");
            last = b;
        }
        assert_eq!(bin_of(512), 1);
        assert_eq!(bin_of(63 * 512), 63);
        assert!(bin_of((1u64 << 60) - 512) < BINS);
        // Within one bin, sizes differ by less than 1/32.
        let (lo, hi) = (
            64 * 512 * 1024,
            64 * 512 * 1024 + 64 * 512 * 1024 / 32 - 512,
        );
        assert_eq!(bin_of(lo), bin_of(hi));
        assert_ne!(bin_of(lo), bin_of(hi + 512));
    }
}
