//! Which shard serves a stream: the first streams seen are dealt to shards round-robin, so
//! that up to [`SHARDS`] streams never share a lock (hashing real `CUstream` pointers into 16
//! shards puts two of eight streams together more often than not); later streams, or a full
//! table, fall back to a hash.
//!
//! Each thread remembers the last stream it looked up (per table): an engine thread allocates
//! on one stream almost always, so the cached path reads a thread-local instead of probing.
//!
//! Invariants: a stream's shard never changes once assigned (its blocks live there), and every
//! thread sees the same one; lookups take no lock: an open-addressing table of atomics where a
//! slot is claimed by one compare-and-swap, its value written, then its key published
//! (release/acquire); a key, once published, is never removed; a thread that meets a claimed
//! slot waits for it to be published before deciding whose it is (checked with loom). A
//! thread's remembered lookup names its table by a number no other table of the process gets,
//! so it is never taken for another table's (a table dropped and another made at its address).

#[cfg(loom)]
use loom::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
#[cfg(not(loom))]
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crate::driver::StreamId;

pub(crate) const SHARDS: usize = 16;
// Under loom, a table small enough to explore every interleaving, collisions included.
#[cfg(not(loom))]
const SLOTS: usize = 256;
#[cfg(loom)]
const SLOTS: usize = 2;

#[inline]
fn pause() {
    #[cfg(loom)]
    loom::thread::yield_now();
    #[cfg(not(loom))]
    std::hint::spin_loop();
}
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
    /// This table's number, for the threads' remembered lookups (none under loom, which
    /// models the table's atomics, not the thread-local shortcut).
    #[cfg_attr(loom, allow(dead_code))]
    id: u64,
}

/// The numbers tables get (0 is none's: a thread that has looked nothing up).
static TABLES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

#[cfg(not(loom))]
thread_local! {
    /// (table number, stream, shard) of this thread's last lookup.
    static LAST: std::cell::Cell<(u64, u64, usize)> = const { std::cell::Cell::new((0, 0, 0)) };
}

impl Default for StreamTable {
    fn default() -> Self {
        StreamTable {
            keys: (0..SLOTS).map(|_| AtomicU64::new(EMPTY)).collect(),
            shards: (0..SLOTS).map(|_| AtomicUsize::new(0)).collect(),
            next: AtomicUsize::new(0),
            id: TABLES.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        }
    }
}

impl StreamTable {
    /// The shard that serves `stream`, assigned on its first use.
    #[cfg(not(loom))]
    #[inline]
    pub(crate) fn shard(&self, stream: StreamId) -> usize {
        let (table, s, shard) = LAST.get();
        if table == self.id && s == stream.0 {
            return shard;
        }
        self.remember(stream)
    }

    #[cfg(not(loom))]
    #[cold]
    fn remember(&self, stream: StreamId) -> usize {
        let shard = self.lookup(stream);
        LAST.set((self.id, stream.0, shard));
        shard
    }

    #[cfg(loom)]
    pub(crate) fn shard(&self, stream: StreamId) -> usize {
        self.lookup(stream)
    }

    fn lookup(&self, stream: StreamId) -> usize {
        let key = stream.0.wrapping_add(1);
        if key == EMPTY || key == CLAIMED {
            return Self::fallback(stream);
        }
        let start = mix(stream.0) as usize;
        for probe in 0..SLOTS {
            let i = (start + probe) % SLOTS;
            loop {
                match self.keys[i].load(Ordering::Acquire) {
                    k if k == key => return self.shards[i].load(Ordering::Relaxed),
                    EMPTY => {
                        if self.keys[i]
                            .compare_exchange(EMPTY, CLAIMED, Ordering::Acquire, Ordering::Acquire)
                            .is_ok()
                        {
                            return self.publish(i, key);
                        }
                        // Someone else claimed it first: look at it again.
                    }
                    // Being published, perhaps for this very stream: wait, then look again.
                    CLAIMED => pause(),
                    _ => break,
                }
            }
        }
        Self::fallback(stream)
    }

    #[cold]
    fn publish(&self, i: usize, key: u64) -> usize {
        let shard = self.next.fetch_add(1, Ordering::Relaxed) % SHARDS;
        self.shards[i].store(shard, Ordering::Relaxed);
        self.keys[i].store(key, Ordering::Release);
        shard
    }

    fn fallback(stream: StreamId) -> usize {
        (mix(stream.0) >> 60) as usize % SHARDS
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::Arc;

    /// Two threads meet two streams for the first time, in every interleaving: both agree on
    /// each stream's shard, and the two streams get different shards.
    #[test]
    fn loom_first_use_of_streams_agrees() {
        loom::model(|| {
            let t = Arc::new(StreamTable::default());
            let t2 = t.clone();
            let h = loom::thread::spawn(move || (t2.shard(StreamId(7)), t2.shard(StreamId(9))));
            let a = (t.shard(StreamId(9)), t.shard(StreamId(7)));
            let b = h.join().unwrap();
            assert_eq!(a.0, b.1, "stream 9");
            assert_eq!(a.1, b.0, "stream 7");
            assert_ne!(a.0, a.1, "two streams, two shards");
        });
    }
}

#[cfg(all(test, not(loom)))]
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
    fn a_thread_remembers_lookups_per_table() {
        let (a, b) = (StreamTable::default(), StreamTable::default());
        // Table `a` deals streams 1 and 2 to shards 0 and 1; `b` deals stream 2 first.
        assert_eq!(a.shard(StreamId(1)), 0);
        assert_eq!(b.shard(StreamId(2)), 0);
        assert_eq!(a.shard(StreamId(2)), 1);
        // The thread's remembered lookup (stream 2 in `a`) is not taken for `b`'s.
        assert_eq!(b.shard(StreamId(2)), 0);
        assert_eq!(a.shard(StreamId(2)), 1);
        assert_eq!(a.shard(StreamId(1)), 0);
        // A table made where a dropped one stood starts afresh.
        drop(a);
        let c = StreamTable::default();
        assert_eq!(c.shard(StreamId(2)), 0);
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
