"""Stack frames in the recorded history, as PyTorch's `_record_memory_history(context=...,
stacks=...)` records them. The library calls `_source` on the allocating or freeing thread
before it takes any lock; this gathers the stack (PyTorch's own traceback capture where torch
has it, else Python's frames) and returns an identifier, which the history's entry, and the
live block while it lives, carry. A snapshot resolves the identifiers into `frames`.

What is gathered follows PyTorch's `context`: None gathers nothing; "state" an allocation's
stack, shown on its block while it lives; "alloc" also on the history's allocation entries;
"all" also a free's stack, on its free entries. `stacks="all"` adds C++ frames where torch can
give them. The library asks only for the kinds gathered (`KINDS`). While compile contexts are
recorded (the extension's allocator, `_extension.py`), each allocation's identifier also names
the torch.compile region it was made in, even with context None.

Invariants: an identifier is never 0 (0 is "none" to the library) and never has `CPP_ID` set
(those are the extension's), and its frames are fixed when it is gathered. Stacks are kept
until the history is cleared; each snapshot drops those nothing refers to any more, and
between snapshots the newest `_KEPT` are kept.
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import os
import sys
import threading
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from ._lib import _LOG

_ALLOCATION, _FREE = 0, 1
_KEPT = 1_000_000
_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep

# identifier -> (the stack as gathered or None, whether the history's entry shows it, the
# compile context it was gathered in or "")
_stacks: "collections.OrderedDict[int, Tuple[Any, bool, str]]" = collections.OrderedDict()
# Reentrant: the garbage collector may free a tensor (and so call `_source`) on this thread
# while it holds the lock.
_lock = threading.RLock()
_ids = itertools.count(1)
# What is gathered: (allocation entries show it, frees, C++ frames, a stack at all), or None.
_mode: Optional[Tuple[bool, bool, bool, bool]] = None
# The extension's current compile context on this thread ("" none), while compile contexts
# are recorded.
_compile: Optional[Callable[[], str]] = None
# Identifiers with this bit are named by the extension's C++ recorder (`csrc/torch_allocator.cpp`).
# Not bit 63: the snapshot's pickle holds identifiers as signed 64-bit integers.
CPP_ID = 1 << 62


def configure(context: Optional[str], stacks: str, compile_context: Optional[Callable[[], str]] = None) -> int:
    """Gather stacks as PyTorch's `context` and `stacks` say (context None: none), and the
    compile context from `compile_context` on each allocation; returns the kinds the library is
    to ask for (bit 0 allocations, bit 1 frees)."""
    global _mode, _compile
    if context is not None and context not in ("state", "alloc", "all"):
        raise ValueError(f"context must be None, 'state', 'alloc' or 'all', not {context!r}")
    _compile = compile_context
    if context is None:
        _mode = (False, False, False, False) if compile_context is not None else None
        return 0b01 if compile_context is not None else 0
    _mode = (context != "state", context == "all", stacks == "all", True)
    # Frees only with "all": otherwise the library gives a free's entry its allocation's
    # identifier, whose stack PyTorch shows there too (and whose region, a known difference).
    return 0b11 if context == "all" else 0b01


def clear() -> None:
    """Forget every stack (the history they belonged to was cleared)."""
    with _lock:
        _stacks.clear()


def _gather(cpp: bool) -> Any:
    try:
        import torch
        from torch.utils._traceback import CapturedTraceback

        return CapturedTraceback(torch._C._profiler.gather_traceback(python=True, script=True, cpp=cpp))
    except Exception:  # noqa: BLE001 - a torch without it: Python's own frames
        frames = []
        f: Any = sys._getframe(1)
        while f is not None:
            frames.append((f.f_code.co_filename, f.f_lineno, f.f_code.co_name))
            f = f.f_back
        return frames


def _source(kind: int) -> int:
    # Called from the library through ctypes: whatever happens here must become "no context",
    # never an exception into the library (ctypes would return an undefined value).
    try:
        mode, compile_context = _mode, _compile
        if mode is None:
            return 0
        stack = _gather(mode[2]) if mode[3] else None
        region = compile_context() if compile_context is not None else ""
        if stack is None and not region:
            return 0
        with _lock:
            i = next(_ids)
            _stacks[i] = (stack, stack is not None and (kind == _FREE or mode[0]), region)
            while len(_stacks) > _KEPT:
                _stacks.popitem(last=False)
        return i
    except BaseException:  # noqa: BLE001 - see above
        return 0


SOURCE = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_int)(_source)


def _ours(filename: str) -> bool:
    """This package's frames, and the capture's own."""
    return filename.startswith(_HERE) or filename.replace(os.sep, "/").endswith("torch/utils/_traceback.py")


def _frames(stack: Any, summary: Any = None) -> List[Dict[str, Any]]:
    """Innermost first, as PyTorch lists them (`summary`: the stack's, if already made)."""
    if stack is None:
        return []
    if isinstance(stack, list):
        raw = [(f, n, name) for f, n, name in stack]
    else:
        raw = [(f.filename, f.lineno, f.name) for f in reversed(summary if summary is not None else stack.summary())]
    return [{"filename": f, "line": int(n or 0), "name": name} for f, n, name in raw if not _ours(f)]


def _symbolize_together(ids: List[int], stacks: Dict[int, Tuple[Any, bool]]) -> Dict[int, Any]:
    """The summaries of every torch traceback these ids name, symbolized in one call as
    PyTorch's own batch formatting does (C++ frames are slow to symbolize one stack at a
    time); {} where torch cannot, and each stack is then summarized alone."""
    wanted = [i for i in set(ids) if i in stacks and stacks[i][0] is not None and not isinstance(stacks[i][0], list)]
    if not wanted:
        return {}
    try:
        import torch
        from torch.utils._traceback import _extract_symbolized_tb

        symbolized = torch._C._profiler.symbolize_tracebacks([stacks[i][0].tb for i in wanted])
        return {i: _extract_symbolized_tb(t, stacks[i][0].skip) for i, t in zip(wanted, symbolized)}
    except Exception:  # noqa: BLE001 - only a speed-up
        return {}


def context_ids(snapshot: Dict[str, Any], key: str) -> List[int]:
    """The identifiers (under `key`) of every trace entry and then every block, 0 where none."""
    return [e.get(key, 0) for t in snapshot.get("device_traces", []) for e in t] + [
        b.get(key, 0) for seg in snapshot.get("segments", []) for b in seg.get("blocks", [])
    ]


def resolve(
    snapshot: Dict[str, Any],
    key: str,
    live_key: str,
    skip_actions: Optional[List[str]] = None,
    prune: bool = False,
    cpp: Optional[Any] = None,
) -> None:
    """Replace each identifier (under `key`, on trace entries and live blocks) by its frames,
    where the entry shows them, and give each trace entry its `compile_context` ("N/A" outside
    a compiled region, as PyTorch writes it); drop the entries of `skip_actions`; with `prune`
    (the snapshot is of the only device recording), forget the stacks nothing in it refers to.
    `cpp`: the extension, which names the identifiers its C++ recorder gave (`CPP_ID`)."""
    skip = set(skip_actions or ())
    with _lock:
        stacks = dict(_stacks)
    ids = context_ids(snapshot, key)
    summaries = _symbolize_together(ids, stacks)
    resolved: Dict[int, List[Dict[str, Any]]] = {}
    cpp_ids = sorted({i for i in ids if i & CPP_ID}) if cpp is not None else []
    try:
        cpp_named = cpp.resolve(cpp_ids) if cpp_ids else []
    except Exception as e:  # noqa: BLE001 - the snapshot is still worth having without them
        _LOG.warning("the stacks C++ recorded could not be read: %s", e)
        cpp_named = []
    for i, named in zip(cpp_ids, cpp_named):
        if named is not None:
            frames, shows, region = named
            resolved[i] = [{"filename": f["filename"], "line": int(f["line"]), "name": f["name"]} for f in frames]
            stacks[i] = (None, bool(shows), str(region))
    # Live allocations' stacks are kept, those of asleep memory too, which the snapshot's
    # segments leave out.
    seen: Set[int] = set(snapshot.pop(live_key, []))

    def frames_of(i: int) -> List[Dict[str, Any]]:
        seen.add(i)
        if i not in resolved:
            resolved[i] = _frames(stacks[i][0], summaries.get(i)) if i in stacks else []
        return resolved[i]

    for trace in snapshot.get("device_traces", []):
        kept = []
        for e in trace:
            i = e.pop(key, 0)
            named = stacks.get(i, (None, False, ""))
            if i and named[1]:
                e["frames"] = frames_of(i)
            elif i:
                seen.add(i)
            e["compile_context"] = named[2] or "N/A"
            if e.get("action") not in skip:
                kept.append(e)
        trace[:] = kept
    for seg in snapshot.get("segments", []):
        for b in seg.get("blocks", []):
            i = b.pop(key, 0)
            if i:
                b["frames"] = frames_of(i)
    if prune:
        with _lock:
            for i in [i for i in stacks if i not in seen]:
                _stacks.pop(i, None)
        keep_cpp(cpp, seen)


def keep_cpp(cpp: Optional[Any], seen: Set[int]) -> None:
    """Let the extension forget the stacks C++ recorded that nothing in a snapshot of every
    recording device refers to (as `resolve` prunes its own)."""
    if cpp is None:
        return
    try:
        cpp.keep(sorted(i for i in seen if i & CPP_ID))
    except Exception as e:  # noqa: BLE001 - only memory is at stake
        _LOG.warning("the stacks C++ recorded could not be pruned: %s", e)
