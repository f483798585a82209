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
//! Poisoning: a panic while the data is being changed leaves the lock POISONED instead of FREE,
//! and every later `lock` refuses, since the data may be half-updated. The lock word has three
//! states, so the exchange that takes the lock also reports the poison. Two ways in:
//! - [`SpinLock::with`], for the cached path: the section is a closure, and a guard armed
//!   around it poisons the lock only if the closure unwinds (a normal return disarms it), so
//!   nothing asks whether the thread is panicking;
//! - [`SpinLock::lock`], a guard for sections that span calls (the slow paths): its drop poisons
//!   when the thread is panicking and was not already unwinding when it took the lock (a
//!   `Drop` freeing memory during a panic elsewhere is a whole, normal operation).

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

    /// Run `f` on the data with the lock held; refused once a panic poisoned it. A panic in
    /// `f` poisons the lock and unwinds on.
    #[inline]
    pub(crate) fn with<R>(&self, f: impl FnOnce(&mut T) -> R) -> Result<R, Poisoned> {
        match self
            .state
            .compare_exchange(FREE, LOCKED, Ordering::Acquire, Ordering::Relaxed)
        {
            Ok(_) => {}
            Err(_) => self.wait()?,
        }
        struct PoisonOnUnwind<'a>(&'a AtomicU8);
        impl Drop for PoisonOnUnwind<'_> {
            fn drop(&mut self) {
                self.0.store(POISONED, Ordering::Release);
            }
        }
        let armed = PoisonOnUnwind(&self.state);
        // SAFETY: the exchange above made this the only holder (module invariant).
        let r = f(unsafe { &mut *self.data.get() });
        std::mem::forget(armed);
        self.state.store(FREE, Ordering::Release);
        Ok(r)
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
        self.wait().map(|()| SpinGuard::new(self))
    }

    /// Wait until the lock is taken by this thread (or found poisoned).
    #[cold]
    fn wait(&self) -> Result<(), Poisoned> {
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
                Ok(_) => return Ok(()),
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
    fn a_panic_inside_with_poisons_and_a_normal_section_does_not() {
        let l = Arc::new(SpinLock::new(0u64));
        assert_eq!(
            l.with(|v| {
                *v += 1;
                *v
            }),
            Ok(1)
        );
        let l2 = l.clone();
        let r = std::thread::spawn(move || {
            l2.with(|v| {
                *v = 7;
                panic!("half-way through");
            })
        })
        .join();
        assert!(r.is_err());
        assert!(l.with(|_| ()).is_err());
        assert!(l.lock().is_err());
    }

    #[test]
    fn with_taken_while_already_unwinding_is_not_poisoned() {
        struct FreeOnDrop(Arc<SpinLock<u64>>);
        impl Drop for FreeOnDrop {
            fn drop(&mut self) {
                self.0.with(|v| *v += 1).unwrap();
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
        assert_eq!(l.with(|v| *v), Ok(1));
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
