//! The invariant checker: a pure function over a [`StateDump`], so that a test can break a
//! copy of a real state and see the checker catch it.
//!
//! What it checks (the contracts every part of the allocator keeps):
//! - blocks of each segment tile it exactly, in address order (no overlap, no gap);
//! - segments never overlap one another;
//! - every allocated or pending block lies in mapped memory, or in memory asleep;
//! - Σ tags = allocated (bytes, requested bytes, counts), and those equal what the blocks say;
//! - allocated ≤ active ≤ reserved + sleeping, active = allocated + pending, reserved = mapped
//!   bytes + spare (held, unmapped) bytes, sleeping = asleep bytes, cached = reserved +
//!   sleeping − allocated, the segment count matches, the graph pools' gauge = what their
//!   segments map, every peak ≥ its current;
//! - reserved + lost (mappings whose undo failed) = what the driver says the allocator holds,
//!   when the driver can tell;
//! - the KV cache's usable bytes are mapped (usable ≤ mapped);
//! - the shards' own structures are consistent (`problems` collected while dumping).

pub use crate::allocator::dump::{BlockDump, DumpState, SegmentDump, StateDump};
use crate::ledger::Counter;
use crate::tag::Tag;

/// The first broken invariant found.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invariant broken: {0}")]
pub struct Violation(pub String);

fn ensure(ok: bool, msg: impl FnOnce() -> String) -> Result<(), Violation> {
    if ok {
        Ok(())
    } else {
        Err(Violation(msg()))
    }
}

fn covered(mapped: &[(u64, u64)], addr: u64, size: u64) -> bool {
    let mut cursor = addr;
    for &(a, l) in mapped {
        if a <= cursor && cursor < a + l {
            cursor = a + l;
        }
        if cursor >= addr + size {
            return true;
        }
    }
    cursor >= addr + size
}

fn peak_ok(name: &str, c: Counter) -> Result<(), Violation> {
    ensure(c.peak >= c.current, || {
        format!("{name}: peak {} below current {}", c.peak, c.current)
    })
}

/// A dump of an allocator on the simulated driver, with what the driver itself says the
/// allocator holds (so that [`check`] compares it with the ledger's reserved bytes).
pub fn sim_dump(a: &crate::Allocator<crate::driver::sim::SimDriver>) -> StateDump {
    let mut d = a.dump();
    d.driver_held = Some(a.driver().held_bytes());
    d
}

/// [`check`] an allocator on the simulated driver ([`sim_dump`]).
pub fn check_sim(a: &crate::Allocator<crate::driver::sim::SimDriver>) -> Result<(), Violation> {
    check(&sim_dump(a))
}

/// Check every invariant of a dump.
pub fn check(d: &StateDump) -> Result<(), Violation> {
    if let Some(p) = d.problems.first() {
        return Err(Violation(p.clone()));
    }
    let mut per_tag = [(0u64, 0u64, 0u64); Tag::COUNT];
    let (mut pending, mut mapped_total, mut asleep_total) = (0u64, 0u64, 0u64);
    let mut ranges: Vec<(u64, u64)> = Vec::new();
    for s in &d.segments {
        ranges.push((s.base, s.size));
        let mut cursor = s.base;
        for b in &s.blocks {
            ensure(b.addr == cursor, || {
                format!(
                    "segment {:#x}: block at {:#x} should start at {:#x} (overlap or gap)",
                    s.base, b.addr, cursor
                )
            })?;
            ensure(b.size > 0, || format!("empty block at {:#x}", b.addr))?;
            cursor = b.addr + b.size;
            match b.state {
                DumpState::Allocated => {
                    let t = &mut per_tag[b.tag.index()];
                    t.0 += b.size;
                    t.1 += b.requested;
                    t.2 += 1;
                }
                DumpState::Pending => pending += b.size,
                DumpState::Free | DumpState::Unmapped => {}
            }
            let must_be_mapped = b.state != DumpState::Unmapped;
            let backed = if s.asleep.is_empty() {
                covered(&s.mapped, b.addr, b.size)
            } else {
                let mut all = [s.mapped.as_slice(), s.asleep.as_slice()].concat();
                all.sort_unstable();
                covered(&all, b.addr, b.size)
            };
            ensure(!must_be_mapped || backed, || {
                format!(
                    "{:?} block {:#x}+{} is not in mapped memory",
                    b.state, b.addr, b.size
                )
            })?;
        }
        ensure(cursor == s.base + s.size, || {
            format!(
                "segment {:#x}: blocks end at {cursor:#x}, not at its end",
                s.base
            )
        })?;
        mapped_total += s.mapped.iter().map(|m| m.1).sum::<u64>();
        asleep_total += s.asleep.iter().map(|m| m.1).sum::<u64>();
    }
    ranges.sort_unstable();
    for w in ranges.windows(2) {
        ensure(w[0].0 + w[0].1 <= w[1].0, || {
            format!("segments at {:#x} and {:#x} overlap", w[0].0, w[1].0)
        })?;
    }

    let l = &d.ledger;
    let kv = &l.kv_cache;
    ensure(kv.usable <= kv.mapped.current, || {
        format!(
            "the KV cache counts {} bytes usable, {} mapped",
            kv.usable, kv.mapped.current
        )
    })?;
    for t in Tag::ALL {
        let s = &l.per_tag[t];
        let (bytes, req, n) = per_tag[t.index()];
        ensure(s.allocated_bytes.current == bytes, || {
            format!(
                "{t}: ledger says {} allocated, blocks say {bytes}",
                s.allocated_bytes.current
            )
        })?;
        ensure(s.requested_bytes.current == req, || {
            format!(
                "{t}: requested {} vs blocks {req}",
                s.requested_bytes.current
            )
        })?;
        ensure(s.allocations.current == n, || {
            format!("{t}: {} allocations vs {n} blocks", s.allocations.current)
        })?;
        peak_ok(t.name(), s.allocated_bytes)?;
        peak_ok(t.name(), s.requested_bytes)?;
        peak_ok(t.name(), s.allocations)?;
    }
    let sum = |f: fn(&crate::ledger::TagStats) -> u64| {
        Tag::ALL.iter().map(|&t| f(&l.per_tag[t])).sum::<u64>()
    };
    ensure(
        sum(|s| s.allocated_bytes.current) == l.all.allocated_bytes.current,
        || "Σ tags ≠ allocated".into(),
    )?;
    ensure(
        sum(|s| s.requested_bytes.current) == l.all.requested_bytes.current,
        || "Σ tags ≠ requested".into(),
    )?;
    ensure(
        sum(|s| s.allocations.current) == l.all.allocations.current,
        || "Σ tags ≠ allocation count".into(),
    )?;
    ensure(
        sum(|s| s.total_allocations) == l.all.total_allocations,
        || "Σ tags ≠ total allocations".into(),
    )?;
    let allocated = l.all.allocated_bytes.current;
    let (active, reserved) = (l.active_bytes.current, l.reserved_bytes.current);
    let sleeping: u64 = l.sleeping_bytes.0.iter().sum();
    ensure(sleeping == asleep_total, || {
        format!("the ledger counts {sleeping} bytes asleep, the segments {asleep_total}")
    })?;
    ensure(allocated <= active && active <= reserved + sleeping, || {
        format!("allocated {allocated} ≤ active {active} ≤ reserved {reserved} + sleeping {sleeping} does not hold")
    })?;
    ensure(active == allocated + pending, || {
        format!("active {active} ≠ allocated {allocated} + pending {pending}")
    })?;
    ensure(reserved == mapped_total + d.spare, || {
        format!(
            "reserved {reserved} ≠ mapped {mapped_total} + spare {}",
            d.spare
        )
    })?;
    ensure(l.cached_bytes == reserved + sleeping - allocated, || {
        "cached ≠ reserved + sleeping − allocated".into()
    })?;
    let plain = d.segments.iter().filter(|s| !s.expandable).count() as u64;
    ensure(l.segments.current == plain, || {
        format!(
            "ledger counts {} segments, {plain} exist",
            l.segments.current
        )
    })?;
    ensure(d.committed == reserved, || {
        format!("committed {} ≠ reserved {reserved}", d.committed)
    })?;
    let in_pools: u64 = d
        .segments
        .iter()
        .filter(|s| s.pool_key.is_some())
        .flat_map(|s| &s.mapped)
        .map(|&(_, len)| len)
        .sum();
    ensure(l.graph_reserved_bytes.current == in_pools, || {
        format!(
            "the ledger counts {} bytes of graph pools, their segments map {in_pools}",
            l.graph_reserved_bytes.current
        )
    })?;
    for (name, c) in [
        ("all.allocated", l.all.allocated_bytes),
        ("all.requested", l.all.requested_bytes),
        ("all.allocations", l.all.allocations),
        ("active", l.active_bytes),
        ("reserved", l.reserved_bytes),
        ("segments", l.segments),
    ] {
        peak_ok(name, c)?;
    }
    if let Some(held) = d.driver_held {
        let lost = l.lost_bytes;
        // Pools' own allocators hold the rest of what is reserved.
        let external: u64 = d
            .segments
            .iter()
            .filter(|s| s.external)
            .map(|s| s.size)
            .sum();
        ensure(held + external == reserved + lost, || {
            format!("driver holds {held} bytes for us and pools' own allocators {external}, ledger reserves {reserved} and lost {lost}")
        })?;
    }
    Ok(())
}
