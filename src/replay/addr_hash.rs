//! The hash of the replay's maps keyed by trace address: one folded multiply (std's default,
//! SipHash, costs 8% of a small trace's replay). Keyed per map from std's random
//! state, so that a trace cannot be made to collide without knowing the key.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};

/// An odd constant of mixed bits (from the golden ratio).
const MIX: u64 = 0x9e37_79b9_7f4a_7c15;

#[derive(Clone)]
pub(super) struct AddrHash(u64);

impl Default for AddrHash {
    fn default() -> Self {
        AddrHash(RandomState::new().hash_one(MIX))
    }
}

impl BuildHasher for AddrHash {
    type Hasher = AddrHasher;

    fn build_hasher(&self) -> AddrHasher {
        AddrHasher(self.0)
    }
}

pub(super) struct AddrHasher(u64);

impl AddrHasher {
    #[inline]
    fn mix(&mut self, x: u64) {
        let m = u128::from(x ^ self.0) * u128::from(MIX);
        self.0 = (m as u64) ^ ((m >> 64) as u64);
    }
}

impl Hasher for AddrHasher {
    #[inline]
    fn write_u64(&mut self, x: u64) {
        self.mix(x);
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.mix(u64::from_le_bytes(word));
        }
    }

    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Addresses a snapshot holds (multiples of 512 and of 2 MiB) spread over the low bits
    /// a hash table indexes by, and two maps key differently.
    #[test]
    fn aligned_addresses_spread_and_keys_differ() {
        let h = AddrHash::default();
        for step in [512u64, 2 << 20] {
            let mut buckets = [0u32; 64];
            for i in 0..64_000u64 {
                buckets[(h.hash_one(0x7f00_0000_0000 + i * step) & 63) as usize] += 1;
            }
            let (lo, hi) = (buckets.iter().min().unwrap(), buckets.iter().max().unwrap());
            assert!(*lo > 800 && *hi < 1200, "step {step}: {lo}..{hi}");
        }
        assert_ne!(h.hash_one(1u64), AddrHash::default().hash_one(1u64));
    }
}
