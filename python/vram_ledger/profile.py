"""Profiling a dummy pass for the KV-cache budget, and the budget contract (the cap)."""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional

from . import _args
from ._lib import VramLedgerError, _check, _clean_up_after, _json, _last_error, load


class Profile:
    """Filled in when the `profile()` block exits: `result` (a dict) and `report` (lines)."""

    def __init__(self) -> None:
        self.result: Dict[str, Any] = {}
        self.report: List[str] = []

    @property
    def kv_budget(self) -> int:
        if "kv_budget" not in self.result:
            # Read inside the block: there is no budget yet.
            raise VramLedgerError("kv_budget is known once the profile() block has ended")
        return int(self.result["kv_budget"])


def set_cap(bytes: Optional[int], device: Optional[int] = None) -> None:
    """Hold this process to `bytes` of device memory in all (the budget contract: the
    allocator's bytes plus memory outside it, re-read before every growth), or lift the cap
    with None. profile() sets it to the requested memory unless told not to."""
    limit = _args.optional_integer(bytes, "bytes")
    _check(load().vram_ledger_set_cap(_args.device(device), -1 if limit is None else limit))


def cap(device: Optional[int] = None) -> Optional[int]:
    """The budget contract in bytes, or None when none is set."""
    c = int(load().vram_ledger_cap(_args.device(device)))
    if c == -2:
        raise VramLedgerError(_last_error())
    return None if c < 0 else c


def _synchronize(d: int) -> None:
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_initialized():
        torch.cuda.synchronize(d)


@contextlib.contextmanager
def profile(
    utilization: float, device: Optional[int] = None, margin_bytes: Optional[int] = None, contract: bool = True
) -> Iterator[Profile]:
    """Profile the dummy pass run inside the block; the KV-cache budget is
    ceil(total × utilization) − what this process needs besides the KV cache − margin. The
    default margin (None) is 0.25% of the requested memory in every mode (room for placing
    blocks differently while serving). With
    `contract` (the default), the process is then held to the requested memory while it serves
    (see set_cap)."""
    fraction = _args.utilization(utilization)
    margin = _args.optional_integer(margin_bytes, "margin_bytes")
    d = _args.device(device)
    _synchronize(d)
    previous = cap(d)
    _check(load().vram_ledger_profile_begin(d, fraction, -1 if margin is None else margin))
    p = Profile()

    def close() -> None:
        try:
            _end_profile(d, p)
        finally:
            # The library arms the contract when a scope ends; without one, the cap stays what
            # it was before (the user's own, or none).
            if not contract:
                set_cap(previous, d)

    try:
        yield p
    except BaseException as body_error:
        _clean_up_after(body_error, "closing the profiling scope", close)
        raise
    close()


def _end_profile(d: int, p: Profile) -> None:
    """Close the scope even when synchronising fails, so that the device is not left with a
    scope open."""
    try:
        _synchronize(d)
    finally:
        r = _json(load().vram_ledger_profile_end(d))
        p.report = r.pop("report", [])
        p.result = r
