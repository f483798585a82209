//! The shard lock: one compare-exchange to take, one plain release store to give back.
//!
//! Why not a parking mutex: its unlock must be a compare-and-swap to learn whether a thread
//! sleeps on it, and a locked instruction costs as much as a third of a cached allocation.
//! Critical sections here are tens of nanoseconds, so a waiter spins briefly, then yields its
//! core (threads may outnumber cores) instead of sleeping.
//!
//! Invariant: `data` is only reached through a guard, and at most one guard exists at a time
//! (the exchange from FREE to LOCKED is the only way to make one).
//!
//! Poisoning: a guard dropped while its thread panics, when it was not already unwinding as it
//! took the lock, leaves the lock POISONED instead of FREE, and every later `lock` refuses, since the data may be half-updated. The lock word has
//! three states, so the exchange that takes the lock also reports the poison: the uncontended
//! path costs what it did, plus `thread::panicking` on taking and on release (a load of a
//! global that only changes while some thread panics).

use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU8, Ordering};

const FREE: u8 = 0;
const LOCKED: u8 = 1;
const POISONED: u8 = 2;

pub(crate) struct SpinLock<T> {
    state: AtomicU8,
    data: UnsafeCell<T>,
}

/// The lock's data was being changed when a thread panicked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Poisoned;

// SAFETY: the lock hands out at most one guard at a time, so `T` is only ever reached from one
// thread at a time; sending it between threads needs `T: Send`.
unsafe impl<T: Send> Sync for SpinLock<T> {}
unsafe impl<T: Send> Send for SpinLock<T> {}

pub(crate) struct SpinGuard<'a, T> {
    lock: &'a SpinLock<T>,
    /// The thread was already unwinding when it took the lock (a `Drop` freeing memory during
    /// a panic elsewhere): its own operation completes normally and poisons nothing.
    unwinding: bool,
}

impl<T> SpinLock<T> {
    pub(crate) fn new(data: T) -> Self {
        SpinLock {
            state: AtomicU8::new(FREE),
            data: UnsafeCell::new(data),
        }
    }

    /// Take the lock; refused once a panic poisoned it.
    #[inline]
    pub(crate) fn lock(&self) -> Result<SpinGuard<'_, T>, Poisoned> {
        // A compare-exchange, not a swap: a swap would write LOCKED over POISONED.
        match self
            .state
            .compare_exchange(FREE, LOCKED, Ordering::Acquire, Ordering::Relaxed)
        {
            Ok(_) => Ok(SpinGuard::new(self)),
            Err(_) => self.lock_slow(),
        }
    }

    /// Take the lock if it is free now; `None` when another thread holds it or it is poisoned.
    pub(crate) fn try_lock(&self) -> Option<SpinGuard<'_, T>> {
        self.state
            .compare_exchange(FREE, LOCKED, Ordering::Acquire, Ordering::Relaxed)
            .ok()
            .map(|_| SpinGuard::new(self))
    }

    /// Held by another thread (wait), or poisoned (refuse, leaving the poison in place).
    #[cold]
    fn lock_slow(&self) -> Result<SpinGuard<'_, T>, Poisoned> {
        let mut spins = 0u32;
        loop {
            // Wait on a plain load, so waiters do not bounce the cache line.
            let mut now = self.state.load(Ordering::Relaxed);
            while now == LOCKED {
                if spins < 64 {
                    std::hint::spin_loop();
                    spins += 1;
                } else {
                    std::thread::yield_now();
                }
                now = self.state.load(Ordering::Relaxed);
            }
            if now == POISONED {
                return Err(Poisoned);
            }
            match self
                .state
                .compare_exchange(FREE, LOCKED, Ordering::Acquire, Ordering::Relaxed)
            {
                Ok(_) => return Ok(SpinGuard::new(self)),
                Err(POISONED) => return Err(Poisoned),
                Err(_) => {}
            }
        }
    }
}

impl<'a, T> SpinGuard<'a, T> {
    #[inline]
    fn new(lock: &'a SpinLock<T>) -> Self {
        SpinGuard {
            lock,
            unwinding: std::thread::panicking(),
        }
    }
}

impl<T> Deref for SpinGuard<'_, T> {
    type Target = T;
    #[inline]
    fn deref(&self) -> &T {
        // SAFETY: this guard is the only one (module invariant).
        unsafe { &*self.lock.data.get() }
    }
}

impl<T> DerefMut for SpinGuard<'_, T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: this guard is the only one (module invariant).
        unsafe { &mut *self.lock.data.get() }
    }
}

impl<T> Drop for SpinGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        let next = if std::thread::panicking() && !self.unwinding {
            POISONED
        } else {
            FREE
        };
        self.lock.state.store(next, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn excludes_under_contention() {
        let l = Arc::new(SpinLock::new(0u64));
        let hs: Vec<_> = (0..8)
            .map(|_| {
                let l = l.clone();
                std::thread::spawn(move || {
                    for _ in 0..20_000 {
                        // A read-modify-write split in two: lost updates would show a race.
                        let mut g = l.lock().unwrap();
                        let v = *g;
                        std::hint::black_box(&v);
                        *g = v + 1;
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        assert_eq!(*l.lock().unwrap(), 160_000);
    }

    #[test]
    fn a_panic_under_the_lock_poisons_it() {
        let l = Arc::new(SpinLock::new(0u64));
        let l2 = l.clone();
        let r = std::thread::spawn(move || {
            let mut g = l2.lock().unwrap();
            *g = 1;
            panic!("half-way through");
        })
        .join();
        assert!(r.is_err());
        assert!(l.lock().is_err());
        // Refusing must not leave the lock held.
        assert!(l.lock().is_err());
    }

    #[test]
    fn a_lock_taken_while_already_unwinding_is_not_poisoned() {
        struct FreeOnDrop(Arc<SpinLock<u64>>);
        impl Drop for FreeOnDrop {
            fn drop(&mut self) {
                // A buffer freed while its owner unwinds: a whole, normal operation.
                *self.0.lock().unwrap() += 1;
            }
        }
        let l = Arc::new(SpinLock::new(0u64));
        let l2 = l.clone();
        let r = std::thread::spawn(move || {
            let _buffer = FreeOnDrop(l2);
            panic!("elsewhere in the engine");
        })
        .join();
        assert!(r.is_err());
        assert_eq!(*l.lock().unwrap(), 1);
    }
}
