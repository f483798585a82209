//! Human-readable renderings of ledger figures.

use crate::ledger::Snapshot;
use crate::tag::Tag;
use crate::units::Bytes;

/// A table of the ledger: per tag current and peak, then allocator-wide figures.
pub fn ledger_table(s: &Snapshot) -> String {
    let calls: Vec<String> = s
        .driver_calls
        .nonzero()
        .map(|(c, n)| format!("{n} {c}"))
        .collect();
    let calls = calls.join(", ");
    let mut out = String::new();
    out.push_str(&format!(
        "{:<12} {:>14} {:>14} {:>12} {:>12}\n",
        "tag", "allocated", "peak", "live", "total"
    ));
    for t in Tag::ALL {
        let x = &s.per_tag[t];
        out.push_str(&format!(
            "{:<12} {:>14} {:>14} {:>12} {:>12}\n",
            t.name(),
            Bytes(x.allocated_bytes.current),
            Bytes(x.allocated_bytes.peak),
            x.allocations.current,
            x.total_allocations
        ));
    }
    out.push_str(&format!(
        "{:<12} {:>14} {:>14} {:>12} {:>12}\n",
        "all",
        Bytes(s.all.allocated_bytes.current),
        Bytes(s.all.allocated_bytes.peak),
        s.all.allocations.current,
        s.all.total_allocations
    ));
    out.push_str(&format!(
        "reserved {} (peak {}), cached {}, plain segments {}; driver calls: {}; {} retries, {} OOMs\n",
        Bytes(s.reserved_bytes.current),
        Bytes(s.reserved_bytes.peak),
        Bytes(s.cached_bytes),
        s.segments.current,
        calls,
        s.alloc_retries,
        s.ooms
    ));
    out
}
