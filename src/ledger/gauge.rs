//! The ledger's gauges: a current value with its high-water mark, for any number of writers
//! ([`Gauge`], the slow path's reserved bytes and segments) or for one writer at a time
//! ([`LocalGauge`], a shard's counters, written under its lock).
//!
//! Invariants: a peak (and a high-water mark) is never below the current value when read; a
//! low-water mark never above it; only `reset_peak` moves the peak down, only `set_mark` the
//! marks.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use super::Counter;

/// A current value and its high-water mark, shared by any number of writers; and a high- and
/// a low-water mark that only [`Gauge::set_mark`] resets (the KV cache's sizing reads how high
/// reserved memory rose, and how low graph pools fell, since it last sized the cache, whatever
/// the user did to the peaks).
#[derive(Default, Debug)]
pub(crate) struct Gauge {
    current: AtomicU64,
    peak: AtomicU64,
    mark: AtomicU64,
    low: AtomicU64,
}

impl Gauge {
    pub(crate) fn add(&self, n: u64) {
        let now = self.current.fetch_add(n, Relaxed) + n;
        if now > self.peak.load(Relaxed) {
            self.peak.fetch_max(now, Relaxed);
        }
        if now > self.mark.load(Relaxed) {
            self.mark.fetch_max(now, Relaxed);
        }
    }

    /// Start new high- and low-water marks at the current value. A change that races with it
    /// may be missed if it is undone before the second read.
    pub(crate) fn set_mark(&self) {
        let now = self.current.load(Relaxed);
        self.mark.store(now, Relaxed);
        self.low.store(now, Relaxed);
        let now = self.current.load(Relaxed);
        self.mark.fetch_max(now, Relaxed);
        self.low.fetch_min(now, Relaxed);
    }

    /// The highest value since [`Gauge::set_mark`] (or since the start).
    pub(crate) fn since_mark(&self) -> u64 {
        self.mark.load(Relaxed).max(self.current.load(Relaxed))
    }

    /// The lowest value since [`Gauge::set_mark`] (0 before the first).
    pub(crate) fn low_since_mark(&self) -> u64 {
        self.low.load(Relaxed).min(self.current.load(Relaxed))
    }

    pub(crate) fn sub(&self, n: u64) {
        let now = self.current.fetch_sub(n, Relaxed) - n;
        if now < self.low.load(Relaxed) {
            self.low.fetch_min(now, Relaxed);
        }
    }

    pub(crate) fn get(&self) -> u64 {
        self.current.load(Relaxed)
    }

    pub(super) fn read(&self) -> Counter {
        // A concurrent add raises the peak right after the current; never show peak < current.
        let current = self.current.load(Relaxed);
        let peak = self.peak.load(Relaxed).max(current);
        Counter { current, peak }
    }

    pub(super) fn reset_peak(&self) {
        self.peak.store(self.current.load(Relaxed), Relaxed);
        // An add racing with the store above may have lost its peak update; restore it.
        self.peak.fetch_max(self.current.load(Relaxed), Relaxed);
    }
}

/// A gauge with one writer at a time (the holder of its shard's lock): the current value is a
/// plain load and store; the peak takes an atomic max only when exceeded, so that a reset from
/// another thread is never overwritten by a stale peak.
#[derive(Default, Debug)]
pub(crate) struct LocalGauge {
    current: AtomicU64,
    peak: AtomicU64,
}

impl LocalGauge {
    #[inline]
    pub(super) fn add(&self, n: u64) {
        let now = self.current.load(Relaxed) + n;
        self.current.store(now, Relaxed);
        if now > self.peak.load(Relaxed) {
            self.peak.fetch_max(now, Relaxed);
        }
    }

    #[inline]
    pub(super) fn sub(&self, n: u64) {
        self.current.store(self.current.load(Relaxed) - n, Relaxed);
    }

    pub(super) fn get(&self) -> u64 {
        self.current.load(Relaxed)
    }

    pub(super) fn read(&self) -> Counter {
        let current = self.current.load(Relaxed);
        Counter {
            current,
            peak: self.peak.load(Relaxed).max(current),
        }
    }

    pub(super) fn reset_peak(&self) {
        self.peak.store(self.current.load(Relaxed), Relaxed);
        self.peak.fetch_max(self.current.load(Relaxed), Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gauges_marks_follow_it_from_the_last_set_mark_whatever_resets_the_peak() {
        let g = Gauge::default();
        g.add(100);
        g.set_mark();
        g.add(50);
        g.sub(120);
        g.add(40);
        g.reset_peak();
        assert_eq!(g.get(), 70);
        assert_eq!(g.since_mark(), 150, "the highest since the mark");
        assert_eq!(g.low_since_mark(), 30, "the lowest since the mark");
        assert_eq!(g.read().peak, 70, "the peak was reset");
        g.set_mark();
        assert_eq!((g.since_mark(), g.low_since_mark()), (70, 70));
    }
}
