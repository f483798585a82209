//! Fault injection for the simulated driver: every call is counted by kind, and a planted
//! fault makes the Nth call of a kind fail (once, or from then on), panic, or stall (succeed
//! after a wait, as a real driver's call that waits for the device).
//!
//! Invariant: a call is counted before any fault or validation applies, so "the Nth call"
//! means the Nth call made, whatever happened to the calls before it.

use parking_lot::Mutex;

use super::SimDriver;
use crate::driver::counting::CallCounters;
use crate::driver::{DriverCall, DriverError, DriverErrorKind, DriverResult};

/// What a planted fault does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Fault {
    /// The one call fails.
    Once,
    /// That call and every later one of its kind fail.
    FromThen,
    /// The one call panics (a bug below the allocator, or in a callback).
    Panic,
    /// The one call waits this long, then goes on as if nothing was planted.
    Stall(std::time::Duration),
}

#[derive(Debug, Default)]
pub(super) struct Faults {
    counts: CallCounters,
    /// (call, the absolute call number it strikes at, what it does).
    planted: Mutex<Vec<(DriverCall, u64, Fault)>>,
    /// Calls a planted fault made fail, ever.
    struck: std::sync::atomic::AtomicU64,
}

impl Faults {
    pub(super) fn calls(&self, call: DriverCall) -> u64 {
        self.counts.get(call)
    }

    /// Strike the `n`th call of `call` from now (n = 1: the next one).
    pub(super) fn plant(&self, call: DriverCall, n: u64, fault: Fault) {
        assert!(n >= 1, "calls are counted from 1");
        let at = self.calls(call) + n;
        self.planted.lock().push((call, at, fault));
    }

    pub(super) fn struck(&self) -> u64 {
        self.struck.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub(super) fn clear(&self) {
        self.planted.lock().clear();
    }

    /// Count a call of `call` and say whether a planted fault strikes it. A stall planted on
    /// the same call as another fault waits first: a failed call can take time too.
    pub(super) fn count(&self, call: DriverCall) -> DriverResult<()> {
        let n = self.counts.bump(call);
        let (mut wait, mut hit) = (std::time::Duration::ZERO, None);
        for &(c, at, f) in self.planted.lock().iter() {
            if c != call || !(n == at || (f == Fault::FromThen && n > at)) {
                continue;
            }
            match f {
                Fault::Stall(w) => wait += w,
                _ => {
                    hit.get_or_insert(f);
                }
            }
        }
        if !wait.is_zero() {
            std::thread::sleep(wait);
        }
        match hit {
            None | Some(Fault::Stall(_)) => Ok(()),
            Some(Fault::Panic) => panic!("injected panic in {call} call #{n}"),
            Some(_) => {
                self.struck
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                Err(DriverError::new(
                    call,
                    DriverErrorKind::Injected,
                    format!("injected fault on call #{n}"),
                ))
            }
        }
    }
}

/// Planting faults in a simulated process, and what they did.
impl SimDriver {
    /// How many times `call` was made.
    pub fn calls(&self, call: DriverCall) -> u64 {
        self.faults.calls(call)
    }

    /// Fail the `n`th call of `call` from now (n = 1: the next one).
    pub fn fail_nth(&self, call: DriverCall, n: u64) {
        self.faults.plant(call, n, Fault::Once);
    }

    /// Fail every call of `call` from the `n`th from now on.
    pub fn fail_from(&self, call: DriverCall, n: u64) {
        self.faults.plant(call, n, Fault::FromThen);
    }

    /// Panic in the `n`th call of `call` from now, to test what a panic leaves behind.
    pub fn panic_nth(&self, call: DriverCall, n: u64) {
        self.faults.plant(call, n, Fault::Panic);
    }

    /// Make the `n`th call of `call` from now wait `wait` before it goes on.
    pub fn stall_nth(&self, call: DriverCall, n: u64, wait: std::time::Duration) {
        self.faults.plant(call, n, Fault::Stall(wait));
    }

    pub fn clear_faults(&self) {
        self.faults.clear();
    }

    /// How many calls planted faults have made fail, over this driver's life: an error the
    /// allocator returns while this does not move had another cause.
    pub fn faults_struck(&self) -> u64 {
        self.faults.struck()
    }
}
