//! Which shard serves a stream: the first streams seen are dealt to shards round-robin, so
//! that up to [`SHARDS`] streams never share a lock (hashing real `CUstream` pointers into 16
//! shards puts two of eight streams together more often than not); later streams, or a full
//! table, fall back to a hash.
//!
//! Invariants: a stream's shard never changes once assigned (its blocks live there); lookups
//! take no lock: an open-addressing table of atomics where a key, once published, is never
//! removed, and its value is written before the key is (release/acquire).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crate::driver::StreamId;

pub(crate) const SHARDS: usize = 16;
const SLOTS: usize = 256;
const EMPTY: u64 = 0;
const CLAIMED: u64 = u64::MAX;

fn mix(x: u64) -> u64 {
    // splitmix64's finaliser.
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

pub(crate) struct StreamTable {
    /// Stream id + 1 (so that the default stream is not EMPTY), or EMPTY / CLAIMED.
    keys: Box<[AtomicU64]>,
    shards: Box<[AtomicUsize]>,
    next: AtomicUsize,
}

impl Default for StreamTable {
    fn default() -> Self {
        StreamTable {
            keys: (0..SLOTS).map(|_| AtomicU64::new(EMPTY)).collect(),
            shards: (0..SLOTS).map(|_| AtomicUsize::new(0)).collect(),
            next: AtomicUsize::new(0),
        }
    }
}

impl StreamTable {
    #[inline]
    pub(crate) fn shard(&self, stream: StreamId) -> usize {
        let key = stream.0.wrapping_add(1);
        let start = mix(stream.0) as usize;
        for probe in 0..SLOTS {
            let i = (start + probe) % SLOTS;
            match self.keys[i].load(Ordering::Acquire) {
                k if k == key => return self.shards[i].load(Ordering::Relaxed),
                EMPTY => return self.claim(i, key, stream),
                _ => {}
            }
        }
        Self::fallback(stream)
    }

    #[cold]
    fn claim(&self, mut i: usize, key: u64, stream: StreamId) -> usize {
        for _ in 0..SLOTS {
            match self.keys[i].compare_exchange(
                EMPTY,
                CLAIMED,
                Ordering::Acquire,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    let shard = self.next.fetch_add(1, Ordering::Relaxed) % SHARDS;
                    self.shards[i].store(shard, Ordering::Relaxed);
                    self.keys[i].store(key, Ordering::Release);
                    return shard;
                }
                Err(_) => {
                    // Someone claimed this slot: wait until it is published, then see whose.
                    let k = loop {
                        let k = self.keys[i].load(Ordering::Acquire);
                        if k != CLAIMED {
                            break k;
                        }
                        std::hint::spin_loop();
                    };
                    if k == key {
                        return self.shards[i].load(Ordering::Relaxed);
                    }
                    i = (i + 1) % SLOTS;
                    // Skip slots owned by other streams.
                    while !matches!(self.keys[i].load(Ordering::Acquire), EMPTY | CLAIMED) {
                        if self.keys[i].load(Ordering::Acquire) == key {
                            return self.shards[i].load(Ordering::Relaxed);
                        }
                        i = (i + 1) % SLOTS;
                    }
                }
            }
        }
        Self::fallback(stream)
    }

    fn fallback(stream: StreamId) -> usize {
        (mix(stream.0) >> 60) as usize % SHARDS
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_streams_get_distinct_shards_and_keep_them() {
        let t = StreamTable::default();
        // Pointers that differ only in high bits, like CUstream handles can.
        let streams: Vec<StreamId> = (0..SHARDS as u64)
            .map(|i| StreamId(0x5555_0000_0000 + (i << 32)))
            .collect();
        let shards: Vec<usize> = streams.iter().map(|&s| t.shard(s)).collect();
        let mut sorted = shards.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), SHARDS, "{shards:?}");
        for (s, sh) in streams.iter().zip(&shards) {
            assert_eq!(t.shard(*s), *sh);
        }
    }

    #[test]
    fn concurrent_first_use_agrees() {
        let t = std::sync::Arc::new(StreamTable::default());
        let seen: Vec<Vec<usize>> = (0..8)
            .map(|_| {
                let t = t.clone();
                std::thread::spawn(move || {
                    (0..300u64).map(|i| t.shard(StreamId(i * 0x100))).collect()
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect();
        for s in &seen[1..] {
            assert_eq!(
                s, &seen[0],
                "every thread sees each stream in the same shard"
            );
        }
    }
}
