"""The library's configuration without PyTorch: for a process that allocates through the C ABI
or from Rust, and for trying sleep and the KV cache on simulated devices. `install()` takes the
same settings, checks them the same way and applies them before it hands PyTorch the
allocator.

Invariant: every setting is checked before any is applied, so a refused call leaves the
library as it was.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from . import _args
from ._lib import _check, abi, load

# The mode used when none is named. Measured on an H200 in the order engines work (weights,
# profile, KV cache, CUDA graphs, serve; tests/python/h200_engine.py): remap, expandable and
# compact met every mark in every scenario (peak usage 99.71-99.89% of the request, no forward
# refused, graph replays equal to eager; docs/results.md section 3), while native left up to
# 0.9% of its request unused on one model. Of those, remap fragments least on replayed
# workloads and, like every virtual-memory mode, can sleep.
DEFAULT_MODE = "remap"


class Settings(NamedTuple):
    mode: str
    sleep: bool
    unmap_later: bool
    remap_piece: Optional[int]
    move_across_streams: bool


def _validated(mode, sleep, unmap_later, remap_piece, move_across_streams) -> Settings:
    mode = _args.mode(mode)
    if mode is None:
        mode = DEFAULT_MODE
    if sleep and mode not in abi().virtual_modes:
        first, *others = [m for m in abi().modes if m in abi().virtual_modes]
        raise ValueError(f"sleep=True needs a virtual-memory mode: mode={first!r}, or {', or '.join(others)}")
    if not isinstance(unmap_later, bool):
        raise TypeError(f"unmap_later must be True or False, not {unmap_later!r}")
    if unmap_later and mode != "remap":
        raise ValueError(f"unmap_later=True applies to remap mode only, not {mode!r}")
    remap_piece = _args.optional_integer(remap_piece, "remap_piece", minimum=1, maximum=2**64 - 1, c_type="uint64_t")
    if remap_piece is not None and mode != "remap":
        raise ValueError(f"remap_piece applies to remap mode only, not {mode!r}")
    across = _args.flag(move_across_streams, "move_across_streams")
    if across and mode not in ("compact", "remap"):
        raise ValueError(f"move_across_streams=True applies to compact and remap modes only, not {mode!r}")
    return Settings(mode, bool(sleep), unmap_later, remap_piece, across)


def _apply(s: Settings) -> None:
    lib = load()
    _check(lib.vram_ledger_configure(s.mode.encode()))
    if s.sleep:
        _check(lib.vram_ledger_separate_tags(1))
    if s.unmap_later:
        _check(lib.vram_ledger_unmap_later(1))
    if s.remap_piece is not None:
        _check(lib.vram_ledger_remap_piece(s.remap_piece))
    if s.move_across_streams:
        _check(lib.vram_ledger_move_across_streams(1))


def configure(
    mode: Optional[str] = None,
    sleep: bool = False,
    unmap_later: bool = False,
    remap_piece: Optional[int] = None,
    move_across_streams: bool = False,
) -> None:
    """Configure every device's allocator as `install()` would, without PyTorch: must run
    before any device is used in this process (`VramLedgerError` after). The arguments are
    `install()`'s, with its defaults and checks (`ValueError`, `TypeError`)."""
    _apply(_validated(mode, sleep, unmap_later, remap_piece, move_across_streams))
