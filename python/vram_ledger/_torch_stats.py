"""torch.cuda's and torch.accelerator's memory statistics, history, snapshots and memory
fraction under install(). PyTorch's pluggable allocator answers none of them ("does not yet
support ..."), so install() points the entry points they call at vram-ledger's figures:
torch.cuda.memory_stats and reset_peak_memory_stats themselves, and the torch._C functions that
torch.cuda.memory._record_memory_history, _snapshot, memory_snapshot, _dump_snapshot,
get/set_per_process_memory_fraction, reset_accumulated_memory_stats, out-of-memory observers,
whether a history is recorded (_cuda_isHistoryEnabled) and torch.accelerator's memory functions (memory_stats, empty_cache and the resets) call. Patching at
torch._C reaches every Python caller, whichever wrapper it went through. An entry point this
torch does not have is left alone."""

from __future__ import annotations

import atexit
import collections
import ctypes
import os
import pickle
import sys
import tempfile
from typing import Any, Callable, Dict, List, Optional

from . import _args, _extension, _frames, _mempool
from ._args import INT64_MAX
from ._lib import _LOG, _check, load
from .metrics import dump_snapshot, memory_stats, record_history, reset_peak_memory_stats

# The history metadata set through torch per device (PyTorch's _set_memory_metadata).
_METADATA: Dict[int, str] = {}

# The fraction set through torch per device; PyTorch's default is the whole device.
_FRACTIONS: Dict[int, float] = {}

# The key of a trace entry's stack identifier in the library's snapshot (src/replay/snapshot.rs).
CONTEXT_KEY = "vram-ledger:context"
# ... and of the list of every live allocation's identifier.
LIVE_KEY = "vram-ledger:live-contexts"

# Out-of-memory observers attached through torch, called as PyTorch's allocator calls its own:
# (device, bytes asked for, bytes allocated on the device, device's free bytes).
_OBSERVERS: List[Callable[[int, int, int, int], Any]] = []


def _notify(device: int, size: int, allocated: int, free: int) -> None:
    # Called from the library on the failing thread; an observer's error must not unwind
    # into it.
    for observer in list(_OBSERVERS):
        try:
            observer(device, size, allocated, free)
        except Exception:  # noqa: BLE001 - logged, as PyTorch's allocator would not stop either
            _LOG.exception("an out-of-memory observer failed")


_OBSERVER = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64)(_notify)


def patch(torch: Any) -> None:
    mem = torch.cuda.memory
    if getattr(mem, "_vram_ledger_stats", False):
        return
    from torch.cuda._utils import _get_device_index

    def index(device: Any) -> int:
        return _get_device_index(device, optional=True)

    # Before CUDA is initialised there is nothing to report (as with PyTorch's allocator), and
    # asking the library would create a device's context and profiling baseline too early.
    def memory_stats_(device: Any = None) -> Dict[str, int]:
        if not torch.cuda.is_initialized():
            return collections.OrderedDict()
        return collections.OrderedDict(sorted(memory_stats(index(device)).items()))

    def reset_peak_memory_stats_(device: Any = None) -> None:
        if torch.cuda.is_initialized():
            reset_peak_memory_stats(index(device))

    for owner in (mem, torch.cuda):
        owner.memory_stats = memory_stats_
        owner.reset_peak_memory_stats = reset_peak_memory_stats_
    _patch_c(torch, torch._C, index)
    mem._vram_ledger_stats = True


def _patch_c(torch: Any, C: Any, index: Any) -> None:
    def record(
        enabled: Optional[str] = "all",
        context: Any = "all",
        stacks: str = "all",
        max_entries: int = sys.maxsize,
        clear_history: bool = False,
        _compile_context: bool = False,
        _global_record_annotations: bool = False,
        skip_actions: Optional[List[str]] = None,
    ) -> None:
        # "state" and "all" both need what the ring keeps; None stops recording. Called again
        # while recording, it goes on (with the new context) unless told to clear, as
        # PyTorch's does.
        _record(torch.cuda.current_device(), enabled is not None, max_entries, clear_history, context, stacks, skip_actions, _compile_context)

    def record_legacy(
        enabled: bool,
        record_context: bool = True,
        trace_alloc_max_entries: int = 1,
        trace_alloc_record_context: bool = False,
        record_context_cpp: bool = False,
        clear_history: bool = False,
        _compile_context: bool = False,
        _global_record_annotations: bool = False,
        skip_actions: Optional[List[str]] = None,
    ) -> None:
        # PyTorch's own mapping: allocation stacks in the history, else on live blocks only.
        context = "alloc" if trace_alloc_record_context else "state" if record_context else None
        stacks = "all" if record_context_cpp else "python"
        _record(torch.cuda.current_device(), bool(enabled), trace_alloc_max_entries, clear_history, context, stacks, skip_actions, _compile_context)

    def snapshot(arg: Any = None, *_: Any, **__: Any) -> Dict[str, Any]:
        return _mempool.pool_filter(_snapshot(torch.cuda.current_device()), arg)

    set_fraction = getattr(C, "_cuda_setMemoryFraction", None)

    def set_memory_fraction(fraction: float, device: int) -> None:
        set_fraction(fraction, device)  # PyTorch's check, then the library's hook
        _FRACTIONS[int(device)] = float(fraction)

    def get_memory_fraction(device: int) -> float:
        return _FRACTIONS.get(int(device), 1.0)

    def attach_oom_observer(observer: Callable[[int, int, int, int], Any]) -> None:
        if not _OBSERVERS:
            lib = load()
            lib.vram_ledger_set_oom_observer(ctypes.cast(_OBSERVER, ctypes.c_void_p))
            # Handed back before the interpreter shuts down, after which it could not run.
            atexit.register(lib.vram_ledger_set_oom_observer, None)
        _OBSERVERS.append(observer)

    def device_stats(device: Any) -> Dict[str, Any]:
        return _nested(memory_stats(index(device)))

    def reset_peaks(device: Any) -> None:
        reset_peak_memory_stats(index(device))

    def reset_accumulated(device: Any) -> None:
        _check(load().vram_ledger_reset_accumulated(_args.device(index(device))))

    def set_memory_metadata(metadata: str) -> None:
        if not torch.cuda.is_initialized():
            torch.cuda.init()
        _check(load().vram_ledger_set_history_metadata(torch.cuda.current_device(), _args.text(metadata, "metadata")))
        _METADATA[torch.cuda.current_device()] = str(metadata)

    def get_memory_metadata() -> str:
        return _METADATA.get(torch.cuda.current_device(), "") if torch.cuda.is_initialized() else ""

    # torch.accelerator asks the device allocator PyTorch registered for CUDA, which is its own
    # caching allocator, never initialised under install(): without these, memory_stats is empty
    # and empty_cache gives back nothing of the library's.
    def allocator_initialized() -> bool:
        return bool(torch.cuda.is_initialized())

    def empty_cache_() -> None:
        # Every device's, as torch.cuda.empty_cache (the library's reset hook) does.
        if torch.cuda.is_initialized():
            load().vram_ledger_reset()

    for name, fn in [
        ("_cuda_record_memory_history", record),
        ("_cuda_record_memory_history_legacy", record_legacy),
        ("_cuda_memorySnapshot", snapshot),
        ("_cuda_setMemoryFraction", set_memory_fraction if set_fraction else None),
        ("_cuda_getMemoryFraction", get_memory_fraction),
        ("_cuda_attach_out_of_memory_observer", attach_oom_observer),
        ("_accelerator_getDeviceStats", device_stats),
        ("_accelerator_resetPeakStats", reset_peaks),
        ("_cuda_resetAccumulatedMemoryStats", reset_accumulated),
        ("_accelerator_resetAccumulatedStats", reset_accumulated),
        ("_cuda_setMemoryMetadata", set_memory_metadata),
        ("_cuda_getMemoryMetadata", get_memory_metadata),
        ("_cuda_isHistoryEnabled", lambda: bool(_RECORDING)),
        ("_accelerator_isAllocatorInitialized", allocator_initialized),
        ("_accelerator_emptyCache", empty_cache_),
    ]:
        if fn is not None and hasattr(C, name):
            setattr(C, name, fn)


# Devices recording their history through torch, and the actions their snapshots leave out.
_RECORDING: Dict[int, List[str]] = {}
_SOURCE_SET: List[bool] = []


def _record(
    device: int,
    enabled: bool,
    max_entries: int,
    clear: bool,
    context: Any,
    stacks: str,
    skip: Optional[List[str]],
    compile_context: bool = False,
    source: Optional[int] = None,
) -> None:
    """Start, go on with or stop the device's history. `source`: the context source's address
    when C++ recorded through the extension's allocator (its stacks are gathered there), else
    the package's own; `compile_context`: record torch.compile's region on each entry (the
    extension's allocator only: plain pluggable allocators cannot see the regions)."""
    lib = load()
    ext = _extension.loaded()
    if source is None and ext is not None:
        # This history is the package's own now; what C++ recorded stays readable unless the
        # history ends or is cleared.
        ext.stopped(not enabled or clear)
    if not enabled:
        record_history(False, 1, device)
        _RECORDING.pop(device, None)
        if not _RECORDING:
            lib.vram_ledger_set_context_source(None, 0)
            _frames.configure(None, stacks)
            if ext is not None:
                ext.set_compile_contexts(False)
        if ext is not None:
            ext.set_history_enabled(bool(_RECORDING))
        return
    if ext is not None:
        ext.set_compile_contexts(bool(compile_context))
    kinds = _frames.configure(context, stacks, ext.compile_context if ext is not None and compile_context else None)
    if device not in _RECORDING or clear:
        record_history(True, min(max(int(max_entries), 1), INT64_MAX), device)
        if not _RECORDING or clear:
            _frames.clear()
    _RECORDING[device] = list(skip or [])
    if kinds and not _SOURCE_SET:
        # Handed back before the interpreter shuts down, after which it could not run.
        atexit.register(lib.vram_ledger_set_context_source, None, 0)
        _SOURCE_SET.append(True)
    if ext is not None:
        ext.set_history_enabled(True)
    if source is not None:
        # C++'s recorder names each entry's stack and compile context (`csrc/torch_allocator.cpp`):
        # every allocation is asked, since PyTorch's own callbacks may push compile contexts
        # whatever the context (it names none that has neither); frees only with "all".
        lib.vram_ledger_set_context_source(ctypes.c_void_p(source), 0b11 if context == "all" else 0b01)
        return
    lib.vram_ledger_set_context_source(ctypes.cast(_frames.SOURCE, ctypes.c_void_p) if kinds else None, kinds)


def record_from_cpp(enabled: bool, max_entries: int, context: Optional[str], clear: bool, skip: List[str], source: int) -> None:
    """The extension allocator's recordHistory, called by C++ with the GIL held: the history as
    `_record_memory_history` would start it, with C++'s recorder as the context source."""
    import torch

    # PyTorch's C++ entry point registers its compile-context callbacks with its own option,
    # which this call does not see: the regions reach the allocator's pushCompileContext.
    _record(torch.cuda.current_device(), bool(enabled), max_entries, bool(clear), context, "python", skip, compile_context=False, source=source)


def raw_snapshot(device: int, pool: Any, include_traces: bool) -> Dict[str, Any]:
    """The extension allocator's snapshot: the library's segments and history as PyTorch's
    pickle has them, with each entry's context id (under `context_key`) unresolved, for C++ to
    turn into PyTorch's SnapshotInfo."""
    snap = _read_snapshot(device)
    live = snap.pop(LIVE_KEY, [])
    if set(_RECORDING) <= {device}:
        _frames.keep_cpp(_extension.loaded(), set(live) | set(_frames.context_ids(snap, CONTEXT_KEY)))
    snap = _mempool.pool_filter(snap, (*tuple(pool), include_traces))
    skip = set(_RECORDING.get(device) or ())
    for trace in snap.get("device_traces", []):
        trace[:] = [e for e in trace if e.get("action") not in skip]
    snap["context_key"] = CONTEXT_KEY
    snap["expandable_segments"] = bool(snap.get("allocator_settings", {}).get("expandable_segments", False))
    return snap


def _read_snapshot(device: int) -> Dict[str, Any]:
    """The library's pickle for the device, read back; `device_traces` indexed by device."""
    fd, path = tempfile.mkstemp(prefix="vram-ledger-snapshot-", suffix=".pickle")
    os.close(fd)
    try:
        dump_snapshot(path, device)
        with open(path, "rb") as f:
            snap = pickle.load(f)
    finally:
        os.unlink(path)
    # A graph's private pool has an id of ours until its capture ends; PyTorch's name for it
    # (graph.pool()) from then on, as PyTorch's snapshot shows it.
    from ._torch import _POOL_ALIASES

    theirs = {ours: name for name, ours in _POOL_ALIASES.items() if name != ours}
    for seg in snap.get("segments", []):
        pool = tuple(seg.get("segment_pool_id", (0, 0)))
        if pool in theirs:
            seg["segment_pool_id"] = theirs[pool]
    traces = snap.get("device_traces", [])
    if device > 0 and len(traces) == 1:
        snap["device_traces"] = [[] for _ in range(device)] + traces
    return snap


def _snapshot(device: int) -> Dict[str, Any]:
    """The device's segments and recorded history, as torch.cuda.memory._snapshot returns them:
    the library writes PyTorch's pickle, read back here; `device_traces` is indexed by device."""
    snap = _read_snapshot(device)
    _frames.resolve(snap, CONTEXT_KEY, LIVE_KEY, _RECORDING.get(device), prune=set(_RECORDING) <= {device}, cpp=_extension.loaded())
    return snap


def _nested(flat: Dict[str, int]) -> Dict[str, Any]:
    """torch.accelerator's nested statistics ({"allocated_bytes": {"all": {"current": ...}}})
    from memory_stats' flat keys; torch.accelerator.memory_stats flattens them back."""
    out: Dict[str, Any] = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                break
        else:
            node[leaf] = value
    return out
