"""The ledger and PyTorch-style statistics, the cache, Prometheus metrics, and the allocation
history with PyTorch's snapshot format."""

from __future__ import annotations

import os
from typing import Any, Dict, Optional, Union

from . import _args
from ._lib import _check, _json, _string, load


def stats(device: Optional[int] = None) -> Dict[str, Any]:
    """The ledger: per tag and allocator-wide current and peak figures, driver calls."""
    return _json(load().vram_ledger_stats_json(_args.device(device)))


def memory_stats(device: Optional[int] = None) -> Dict[str, int]:
    """torch.cuda.memory_stats()'s keys (which PyTorch cannot give under a pluggable
    allocator), plus `tag.*` keys."""
    return _json(load().vram_ledger_memory_stats_json(_args.device(device)))


def reset_peak_memory_stats(device: Optional[int] = None) -> None:
    """Start every peak figure of the device over from its current value."""
    _check(load().vram_ledger_reset_peaks(_args.device(device)))


def empty_cache(device: Optional[int] = None) -> None:
    """Give the device's cached, unused memory back to the driver."""
    _check(load().vram_ledger_empty_cache(_args.device(device)))


def record_history(enabled: bool = True, max_entries: int = 100_000, device: Optional[int] = None) -> None:
    """Record (or stop recording) the allocation history, as torch.cuda.memory's
    _record_memory_history does: a ring of the newest `max_entries` allocations, frees and
    segment events, each allocation with its tag. Off by default; starting clears it."""
    n = _args.integer(max_entries, "max_entries", minimum=1)
    _check(load().vram_ledger_record_history(_args.device(device), 1 if enabled else 0, n))


def dump_snapshot(path: Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"], device: Optional[int] = None) -> None:
    """Write the segments now and the recorded history in PyTorch's snapshot format
    (torch.cuda.memory._dump_snapshot's pickle): PyTorch's memory_viz opens it, each
    allocation's tag as its user_metadata, and `vram-ledger replay` reads it."""
    target = _args.path(path)
    _check(load().vram_ledger_dump_snapshot(_args.device(device), target))


def metrics() -> str:
    """Every device in use, in Prometheus' text exposition format, for an engine's `/metrics`
    endpoint: `vram_ledger_allocated_bytes` and `vram_ledger_allocated_peak_bytes` by device and
    tag; `vram_ledger_reserved_bytes`, `_reserved_peak_bytes`, `_cached_bytes`,
    `_graph_pool_bytes` and `_cap_bytes` by device; the counters `vram_ledger_ooms_total`,
    `_alloc_retries_total`, `vram_ledger_driver_calls_total` and `vram_ledger_driver_seconds_total`
    (time spent in those calls) by device and call."""
    return _string(load().vram_ledger_metrics())


def _gib(b: int) -> str:
    return f"{b / (1 << 30):.2f} GiB"


def report(device: Optional[int] = None) -> str:
    """The ledger as a short table, in GiB."""
    s = stats(device)
    lines = [f"{'tag':<12} {'allocated':>12} {'peak':>12}"]
    for t, v in s["per_tag"].items():
        lines.append(f"{t:<12} {_gib(v['allocated_bytes']['current']):>12} {_gib(v['allocated_bytes']['peak']):>12}")
    lines.append(
        f"reserved {_gib(s['reserved_bytes']['current'])} (peak {_gib(s['reserved_bytes']['peak'])}), cached {_gib(s['cached_bytes'])}"
    )
    return "\n".join(lines)
