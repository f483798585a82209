//! Where a slow operation's time went (sleep's and wake's phases), for the debug log: seconds
//! between marks, summed by name, in a fixed-size table, so timing costs no allocation.

use std::time::Instant;

/// Where a sleep's or a wake's time went, logged at debug level: the seconds between marks,
/// summed by name (a wake marks once per tag). Fixed-size, so timing costs no allocation.
pub(crate) struct Phases {
    last: Instant,
    spent: [(&'static str, f64); 8],
    used: usize,
}

impl Phases {
    pub(crate) fn start() -> Phases {
        Phases {
            last: Instant::now(),
            spent: [("", 0.0); 8],
            used: 0,
        }
    }

    /// Charge the time since the last mark to `name`.
    pub(crate) fn mark(&mut self, name: &'static str) {
        let now = Instant::now();
        let secs = (now - self.last).as_secs_f64();
        self.last = now;
        let used = self.used;
        match self.spent[..used].iter().position(|(n, _)| *n == name) {
            Some(i) => self.spent[i].1 += secs,
            None if used < self.spent.len() => {
                self.spent[used] = (name, secs);
                self.used += 1;
            }
            None => {}
        }
    }

    pub(crate) fn log(&self, what: &str) {
        if tracing::enabled!(tracing::Level::DEBUG) {
            let parts: Vec<String> = self.spent[..self.used]
                .iter()
                .map(|(n, s)| format!("{n} {s:.4} s"))
                .collect();
            tracing::debug!(phases = %parts.join(", "), "{what}: where the time went");
        }
    }
}
