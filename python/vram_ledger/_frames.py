"""Stack frames in the recorded history, as PyTorch's `_record_memory_history(context=...,
stacks=...)` records them. The library calls `_source` on the allocating or freeing thread
before it takes any lock; this gathers the stack (PyTorch's CapturedTraceback where torch has
it, else Python's own frames) and returns an identifier, which the history's entry carries.
A snapshot resolves the identifiers into `frames`.

What is gathered follows PyTorch's `context`: None gathers nothing; "state" an allocation's
stack, shown on its block while it lives; "alloc" also on the history's allocation entries;
"all" also a free's stack, on its free entries. `stacks="all"` adds C++ frames where torch can
give them. The newest `_KEPT` stacks are kept (an entry dropped from the history's bound takes
its frames with it anyway).

Invariants: an identifier is never 0 (0 is "none" to the library); each identifier's frames are
fixed when it is gathered.
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import os
import sys
import threading
from typing import Any, Dict, List, Optional, Tuple

_ALLOCATION, _FREE = 0, 1
_KEPT = 200_000
_HERE = os.path.dirname(os.path.abspath(__file__))

# identifier -> (the stack as gathered, whether the history's entry shows it)
_stacks: "collections.OrderedDict[int, Tuple[Any, bool]]" = collections.OrderedDict()
_lock = threading.Lock()
_ids = itertools.count(1)
# What is gathered: (allocations, allocation entries show it, frees, C++ frames), or None.
_mode: Optional[Tuple[bool, bool, bool, bool]] = None


def configure(context: Optional[str], stacks: str) -> None:
    """Gather stacks as PyTorch's `context` and `stacks` say (context None: none)."""
    global _mode
    if context is None:
        _mode = None
    elif context in ("state", "alloc", "all"):
        _mode = (True, context != "state", context == "all", stacks == "all")
    else:
        raise ValueError(f"context must be None, 'state', 'alloc' or 'all', not {context!r}")


def _gather(cpp: bool) -> Any:
    try:
        from torch.utils._traceback import CapturedTraceback

        return CapturedTraceback.extract(script=True, cpp=cpp)
    except Exception:  # noqa: BLE001 - a torch without it: Python's own frames
        frames = []
        f = sys._getframe(1)
        while f is not None:
            frames.append((f.f_code.co_filename, f.f_lineno, f.f_code.co_name))
            f = f.f_back
        return frames


def _source(kind: int) -> int:
    mode = _mode
    if mode is None or (kind == _FREE and not mode[2]) or (kind == _ALLOCATION and not mode[0]):
        return 0
    stack = _gather(mode[3])
    with _lock:
        i = next(_ids)
        _stacks[i] = (stack, kind == _FREE or mode[1])
        while len(_stacks) > _KEPT:
            _stacks.popitem(last=False)
    return i


SOURCE = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_int)(_source)


def _frames(stack: Any) -> List[Dict[str, Any]]:
    """Innermost first, as PyTorch lists them, without this package's own frames."""
    if isinstance(stack, list):
        raw = [(f, n, name) for f, n, name in stack]
    else:
        raw = [(f.filename, f.lineno, f.name) for f in reversed(stack.summary())]
    return [{"filename": f, "line": int(n or 0), "name": name} for f, n, name in raw if not f.startswith(_HERE)]


def resolve(snapshot: Dict[str, Any], key: str, skip_actions: Optional[List[str]] = None) -> None:
    """Replace each trace entry's identifier (under `key`) by its frames (where the entry shows
    them), give each live block the frames of its allocation, and drop the entries of
    `skip_actions`."""
    skip = set(skip_actions or ())
    with _lock:
        stacks = dict(_stacks)
    resolved: Dict[int, List[Dict[str, Any]]] = {}

    def frames_of(i: int) -> List[Dict[str, Any]]:
        if i not in resolved:
            resolved[i] = _frames(stacks[i][0]) if i in stacks else []
        return resolved[i]

    allocated_by: Dict[int, int] = {}
    for d, trace in enumerate(snapshot.get("device_traces", [])):
        kept = []
        for e in trace:
            i = e.pop(key, 0)
            if i and e.get("action") == "alloc":
                allocated_by[(d, e["addr"])] = i
            if i and stacks.get(i, (None, False))[1]:
                e["frames"] = frames_of(i)
            if e.get("action") not in skip:
                kept.append(e)
        trace[:] = kept
    for seg in snapshot.get("segments", []):
        for b in seg.get("blocks", []):
            i = allocated_by.get((seg.get("device", 0), b.get("address")))
            if i and b.get("state") == "active_allocated":
                b["frames"] = frames_of(i)
