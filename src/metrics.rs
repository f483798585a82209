//! The ledger as metrics, in Prometheus' text exposition format (version 0.0.4), ready for an
//! engine's `/metrics` endpoint: per device, and per tag where the ledger keeps tags.
//!
//! | metric | type | labels | meaning |
//! | --- | --- | --- | --- |
//! | `vram_ledger_allocated_bytes` | gauge | device, tag | bytes handed out now |
//! | `vram_ledger_allocated_peak_bytes` | gauge | device, tag | their peak since the last reset |
//! | `vram_ledger_reserved_bytes` | gauge | device | bytes held from the driver now |
//! | `vram_ledger_reserved_peak_bytes` | gauge | device | their peak |
//! | `vram_ledger_cached_bytes` | gauge | device | reserved but not handed out |
//! | `vram_ledger_graph_pool_bytes` | gauge | device | held for CUDA graph pools |
//! | `vram_ledger_graph_outside_bytes` | gauge | device | memory outside the allocator that graph capture and instantiation added |
//! | `vram_ledger_lost_bytes` | gauge | device | memory left with the driver by mappings whose undo failed |
//! | `vram_ledger_kv_reserved_bytes` | gauge | device | address space reserved for the KV cache |
//! | `vram_ledger_kv_mapped_bytes` | gauge | device | physical memory mapped into it |
//! | `vram_ledger_kv_usable_bytes` | gauge | device | the bytes of the KV blocks the engine may use |
//! | `vram_ledger_cap_bytes` | gauge | device | the budget contract (only when set) |
//! | `vram_ledger_alloc_retries_total` | counter | device | allocations retried after a release |
//! | `vram_ledger_ooms_total` | counter | device | allocations refused |
//! | `vram_ledger_driver_calls_total` | counter | device, call | driver calls, by name |
//! | `vram_ledger_driver_seconds_total` | counter | device, call | time spent in them, by name |
//!
//! Reading them takes no lock on the allocation path (the ledger is summed from its shards).

use std::fmt::Write;

use crate::ledger::Snapshot;
use crate::tag::Tag;

/// A per-device family: its name, its help, and its value for a device (none: no sample).
type PerDevice<'a> = (&'a str, &'a str, &'a dyn Fn(&DeviceMetrics) -> Option<u64>);

/// One device's figures.
pub struct DeviceMetrics {
    pub device: usize,
    pub snapshot: Snapshot,
    pub cap: Option<u64>,
}

/// Every metric of `devices`, each family introduced once by its `# HELP` and `# TYPE` lines.
pub fn prometheus(devices: &[DeviceMetrics]) -> String {
    let mut out = String::new();
    let mut family = |name: &str, kind: &str, help: &str, samples: &mut dyn FnMut(&mut String)| {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} {kind}");
        samples(&mut out);
    };
    let per_tag = |out: &mut String, name: &str, value: &dyn Fn(&Snapshot, Tag) -> u64| {
        for d in devices {
            for t in Tag::ALL {
                let _ = writeln!(
                    out,
                    "{name}{{device=\"{}\",tag=\"{}\"}} {}",
                    d.device,
                    t.name(),
                    value(&d.snapshot, t)
                );
            }
        }
    };
    let per_device =
        |out: &mut String, name: &str, value: &dyn Fn(&DeviceMetrics) -> Option<u64>| {
            for d in devices {
                if let Some(v) = value(d) {
                    let _ = writeln!(out, "{name}{{device=\"{}\"}} {v}", d.device);
                }
            }
        };
    let name = "vram_ledger_allocated_bytes";
    family(name, "gauge", "Bytes handed out now, by tag.", &mut |o| {
        per_tag(o, name, &|s, t| s.per_tag[t].allocated_bytes.current)
    });
    let name = "vram_ledger_allocated_peak_bytes";
    family(
        name,
        "gauge",
        "Peak bytes handed out since the last reset, by tag.",
        &mut |o| per_tag(o, name, &|s, t| s.per_tag[t].allocated_bytes.peak),
    );
    let gauges: [PerDevice; 10] = [
        (
            "vram_ledger_reserved_bytes",
            "Bytes held from the driver now.",
            &|d| Some(d.snapshot.reserved_bytes.current),
        ),
        (
            "vram_ledger_reserved_peak_bytes",
            "Peak bytes held from the driver.",
            &|d| Some(d.snapshot.reserved_bytes.peak),
        ),
        (
            "vram_ledger_cached_bytes",
            "Bytes held but not handed out.",
            &|d| Some(d.snapshot.cached_bytes),
        ),
        (
            "vram_ledger_graph_pool_bytes",
            "Bytes held for CUDA graph pools.",
            &|d| Some(d.snapshot.graph_reserved_bytes.current),
        ),
        (
            "vram_ledger_graph_outside_bytes",
            "Memory outside the allocator that graph capture and instantiation added.",
            &|d| Some(d.snapshot.graph_outside_bytes),
        ),
        (
            "vram_ledger_lost_bytes",
            "Device memory left with the driver by mappings whose undo failed.",
            &|d| Some(d.snapshot.lost_bytes),
        ),
        (
            "vram_ledger_kv_reserved_bytes",
            "Address space reserved for the KV cache.",
            &|d| Some(d.snapshot.kv_cache.reserved),
        ),
        (
            "vram_ledger_kv_mapped_bytes",
            "Physical memory mapped into the KV cache's range.",
            &|d| Some(d.snapshot.kv_cache.mapped.current),
        ),
        (
            "vram_ledger_kv_usable_bytes",
            "The bytes of the KV cache blocks the engine may use.",
            &|d| Some(d.snapshot.kv_cache.usable),
        ),
        (
            "vram_ledger_cap_bytes",
            "The budget contract: what this process may use in all.",
            &|d| d.cap,
        ),
    ];
    for (name, help, value) in gauges {
        family(name, "gauge", help, &mut |o| per_device(o, name, value));
    }
    let counters: [PerDevice; 2] = [
        (
            "vram_ledger_alloc_retries_total",
            "Allocations retried after releasing the cache.",
            &|d| Some(d.snapshot.alloc_retries),
        ),
        (
            "vram_ledger_ooms_total",
            "Allocations refused for want of memory.",
            &|d| Some(d.snapshot.ooms),
        ),
    ];
    for (name, help, value) in counters {
        family(name, "counter", help, &mut |o| per_device(o, name, value));
    }
    let name = "vram_ledger_driver_calls_total";
    family(name, "counter", "Driver calls made, by call.", &mut |o| {
        for d in devices {
            for (call, n) in d.snapshot.driver_calls.nonzero() {
                let _ = writeln!(
                    o,
                    "{name}{{device=\"{}\",call=\"{}\"}} {n}",
                    d.device,
                    call.name()
                );
            }
        }
    });
    let name = "vram_ledger_driver_seconds_total";
    family(
        name,
        "counter",
        "Seconds the allocator's threads spent in driver calls, by call.",
        &mut |o| {
            for d in devices {
                for (call, ns) in d.snapshot.driver_time.nonzero() {
                    let _ = writeln!(
                        o,
                        "{name}{{device=\"{}\",call=\"{}\"}} {}",
                        d.device,
                        call.name(),
                        seconds(ns)
                    );
                }
            }
        },
    );
    out
}

/// Nanoseconds as seconds in plain decimal, exact: no float rounding, no exponent.
fn seconds(ns: u64) -> String {
    format!("{}.{:09}", ns / 1_000_000_000, ns % 1_000_000_000)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::sim::SimDriver;
    use crate::{Allocator, Config, StreamId};

    #[test]
    fn seconds_are_exact_decimals() {
        assert_eq!(seconds(0), "0.000000000");
        assert_eq!(seconds(5), "0.000000005");
        assert_eq!(seconds(1_000_000_005), "1.000000005");
        assert_eq!(seconds(u64::MAX), "18446744073.709551615");
    }

    #[test]
    fn metrics_are_prometheus_text_with_the_ledgers_figures() {
        let a = Allocator::new(SimDriver::new(), Config::default()).unwrap();
        let w = a
            .allocate_tagged(3 << 20, StreamId::DEFAULT, Tag::Weights)
            .unwrap();
        let x = a
            .allocate_tagged(5 << 20, StreamId::DEFAULT, Tag::Activation)
            .unwrap();
        a.free(x.ptr).unwrap();
        a.set_cap(Some(7 << 30));
        let kv = a.reserve_kv(3 << 20, Some(1 << 30), 5).unwrap();
        let text = prometheus(&[DeviceMetrics {
            device: 3,
            snapshot: a.snapshot(),
            cap: a.cap(),
        }]);
        let sample = |line: &str| text.lines().any(|l| l == line);
        assert!(sample(&format!(
            "vram_ledger_allocated_bytes{{device=\"3\",tag=\"weights\"}} {}",
            w.size
        )));
        assert!(sample(&format!(
            "vram_ledger_allocated_peak_bytes{{device=\"3\",tag=\"activation\"}} {}",
            x.size
        )));
        assert!(sample(
            "vram_ledger_allocated_bytes{device=\"3\",tag=\"activation\"} 0"
        ));
        assert!(sample(&format!(
            "vram_ledger_cap_bytes{{device=\"3\"}} {}",
            7u64 << 30
        )));
        // The KV cache as the allocator reported it when reserving it.
        for (name, v) in [
            ("reserved", kv.reserved_bytes),
            ("mapped", kv.mapped_bytes),
            ("usable", kv.usable_blocks * kv.block_bytes),
        ] {
            let line = format!("vram_ledger_kv_{name}_bytes{{device=\"3\"}} {v}");
            assert!(sample(&line), "{line}");
        }
        assert!(
            kv.usable_blocks >= 5 && kv.mapped_bytes >= 15 << 20,
            "{kv:?}"
        );
        // The simulated driver's own count of the segments it handed out.
        let segments = a.driver().calls(crate::driver::DriverCall::AllocSegment);
        assert!(sample(&format!(
            "vram_ledger_driver_calls_total{{device=\"3\",call=\"alloc_segment\"}} {segments}"
        )));
        // Time in the calls made: a sample for each, in seconds with nanoseconds.
        let spent = a
            .snapshot()
            .driver_time
            .nanos(crate::driver::DriverCall::AllocSegment);
        assert!(spent > 0);
        let prefix = "vram_ledger_driver_seconds_total{device=\"3\",call=\"alloc_segment\"} ";
        let line = text
            .lines()
            .find(|l| l.starts_with(prefix))
            .expect("a sample for the segments' calls");
        let shown: f64 = line[prefix.len()..].parse().unwrap();
        assert!(
            (shown * 1e9 - spent as f64).abs() < 1.0,
            "{line} vs {spent} ns"
        );
        // Every sample belongs to a family declared before it, once.
        let mut declared = std::collections::HashSet::new();
        for l in text.lines() {
            if let Some(rest) = l.strip_prefix("# TYPE ") {
                let name = rest.split(' ').next().unwrap();
                assert!(declared.insert(name.to_string()), "{name} declared twice");
            } else if !l.starts_with('#') {
                let name = l.split('{').next().unwrap();
                assert!(declared.contains(name), "{l}");
                let value = l.rsplit(' ').next().unwrap();
                if name.ends_with("_seconds_total") {
                    assert!(value.parse::<f64>().is_ok_and(|v| v >= 0.0), "{l}");
                } else {
                    assert!(value.parse::<u64>().is_ok(), "{l}");
                }
            }
        }
    }
}
