"""PyTorch integration: install() as its CUDA allocator, the patches that make torch.cuda's
statistics and CUDA graphs work under a pluggable allocator, and MemPools backed by the library."""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import threading
import weakref
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

from . import _args, _extension, _mempool, _torch_stats
from ._configure import _apply, _validated
from ._lib import _LOG, VramLedgerError, _check, _clean_up_after, _last_error, library_path, load
from .tags import tag

if TYPE_CHECKING:
    from torch.cuda.memory import _CUDAAllocator

_INSTALLED: Dict[str, Any] = {}
_INSTALL_LOCK = threading.Lock()


def _address(fn: Any) -> Optional[int]:
    return ctypes.cast(fn, ctypes.c_void_p).value


def install(
    mode: Optional[str] = None,
    torch_stats: bool = True,
    cudagraph_trees: Optional[bool] = None,
    sleep: bool = False,
    extension: Optional[bool] = None,
    unmap_later: bool = False,
    remap_piece: Optional[int] = None,
    move_across_streams: bool = False,
) -> _CUDAAllocator:
    """Make vram-ledger PyTorch's CUDA allocator for this process, with the init, empty_cache,
    memory-fraction and record_stream hooks. Must run before any CUDA use; permanent. With
    `torch_stats` (the default), torch.cuda.memory_stats() and the functions built on it
    (memory_allocated, max_memory_allocated, memory_reserved, max_memory_reserved,
    memory_summary, reset_peak_memory_stats) answer with vram-ledger's figures, which a
    pluggable allocator otherwise cannot give; so do torch.accelerator's memory_stats family
    and reset_peak_memory_stats, torch.cuda.memory._record_memory_history, _snapshot,
    memory_snapshot and _dump_snapshot (the allocation history and segments in PyTorch's
    snapshot format, each allocation's tag as its user_metadata), and
    get_per_process_memory_fraction (set_per_process_memory_fraction reaches the library's
    limit through its hook). See `_torch_stats.py`.

    torch.compile(mode="reduce-overhead") captures CUDA graphs. Inductor's CUDA-graph trees
    checkpoint and restore a graph pool's state through C++ calls (getCheckpointState,
    setCheckpointPoolState) that only the extension's allocator answers. `cudagraph_trees`
    None (the default) leaves them on with the extension and turns them off without it
    (torch._inductor.config.triton.cudagraph_trees = False: inductor then captures each
    compiled graph with torch.cuda.graph, into a graph pool of vram-ledger's like any other
    capture); False turns them off; True without the extension is a ValueError.

    `mode` defaults to remap (`_configure.DEFAULT_MODE`, chosen by measurement: see its comment).
    `sleep=True` keeps each tag's memory apart so that `sleep()` can give a tag's memory back
    and `wake()` restore it at the same addresses; it needs a virtual-memory mode
    (expandable, compact or remap).

    `unmap_later=True` (remap mode only): when growth moves pieces of the stream's own free
    memory, their old mappings are unmapped once the stream's earlier work has finished (an
    event), instead of synchronising the stream first. Off by default.

    `remap_piece` (remap mode only): the largest piece of physical memory one map call covers,
    in bytes, rounded up to whole granules (default 68 MiB). Smaller pieces fragment less and
    make more driver calls (the README measures both).

    `move_across_streams=True` (compact and remap modes): before growing, also take the free
    memory cached for other streams, after synchronising the device, as `vram-ledger replay`
    does. Off by default.

    `extension=True` (default: the VRAM_LEDGER_TORCH_EXTENSION environment variable, else off)
    builds a small C++ extension the first time (torch.utils.cpp_extension: a C++ compiler,
    ninja and the CUDA headers; `_extension.py`) and installs its allocator instead of PyTorch's
    plain pluggable one: the same hooks, and also what C++ code calls on PyTorch's allocator
    directly (torch::cuda::_record_memory_history and _memory_snapshot_pickled, from an
    extension or TorchScript) and the compile contexts that
    `_record_memory_history(compile_context=True)` records on allocation entries (see
    docs/python.md). Returns PyTorch's current allocator."""
    # One install at a time: two threads must not both configure the library and hand
    # PyTorch an allocator each.
    with _INSTALL_LOCK:
        if "allocator" in _INSTALLED:
            return _INSTALLED["allocator"]
        settings = _validated(mode, sleep, unmap_later, remap_piece, move_across_streams)
        with_extension = _extension.wanted(extension)
        if cudagraph_trees is None:
            cudagraph_trees = with_extension
        elif cudagraph_trees and not with_extension:
            raise ValueError(
                "cudagraph_trees=True needs install(extension=True): inductor's CUDA-graph trees "
                "checkpoint graph pools through C++ calls that PyTorch's plain pluggable allocator refuses"
            )
        import torch

        # Checked before anything is configured: a refused install leaves the library as it was.
        if torch.cuda.is_initialized():
            raise VramLedgerError("install() must run before any CUDA use (CUDA is already initialised in this process)")
        lib = load()
        if with_extension:
            # Built before anything is configured: a failed build leaves the library as it was.
            _extension.module()
        _apply(settings)
        if with_extension:
            _extension.install(lib, _address, _torch_stats.record_from_cpp, _torch_stats.raw_snapshot)
            alloc = torch.cuda.memory._get_current_allocator()
        else:
            # The throwing hook: PyTorch does not check for NULL, so out of memory is an exception
            # ("CUDA out of memory. ..."), not a tensor at address 0.
            alloc = torch.cuda.memory.CUDAPluggableAllocator(library_path(), "vram_ledger_malloc_or_throw", "vram_ledger_free")
            raw = alloc.allocator()
            raw.set_init_fn(_address(lib.vram_ledger_init))
            raw.set_reset_fn(_address(lib.vram_ledger_reset))
            raw.set_memory_fraction_fn(_address(lib.vram_ledger_memory_fraction))
            raw.set_record_stream_fn(_address(lib.vram_ledger_record_stream))
            torch.cuda.memory.change_current_allocator(alloc)
        _patch_graphs(torch)
        _mempool.patch(torch)
        _report_to_profiler(torch)
        if torch_stats:
            _torch_stats.patch(torch)
        if not cudagraph_trees:
            _plain_inductor_graphs()
        _INSTALLED["allocator"] = alloc
        return alloc


# c10's profiler entry points, as libc10 exports them (the report's totals are size_t in some
# versions, int64_t in others: the same registers).
_PROFILING = "_ZN3c1022memoryProfilingEnabledEv"
_REPORTS = ["_ZN3c1027reportMemoryUsageToProfilerEPvlmmNS_6DeviceE", "_ZN3c1027reportMemoryUsageToProfilerEPvlllNS_6DeviceE"]


def _report_to_profiler(torch: Any) -> None:
    """Report allocations and frees to torch.profiler while it records memory, as PyTorch's
    allocator does (`src/ffi/profiler.rs`); without c10's entry points, nothing is reported."""
    import os

    where = getattr(torch, "__file__", None)
    if where is None:  # no installed torch (a stand-in)
        return
    try:
        c10 = ctypes.CDLL(os.path.join(os.path.dirname(where), "lib", "libc10.so"))
    except OSError as e:
        _LOG.debug("torch.profiler will see no memory events: %s", e)
        return
    profiling = getattr(c10, _PROFILING, None)
    report = next((f for f in (getattr(c10, n, None) for n in _REPORTS) if f is not None), None)
    if profiling is None or report is None:
        _LOG.debug("torch.profiler will see no memory events: libc10 exports no %s", _PROFILING if profiling is None else "reportMemoryUsageToProfiler")
        return
    lib = load()
    lib.vram_ledger_set_memory_reporter(_address(profiling), _address(report))
    # Handed back before the interpreter shuts down, when libc10 may be going too.
    import atexit

    atexit.register(lib.vram_ledger_set_memory_reporter, None, None)


def _plain_inductor_graphs() -> None:
    try:
        import torch._inductor.config as inductor
    except ImportError:  # a torch without inductor has nothing to turn off
        return
    inductor.triton.cudagraph_trees = False


def _patch_graphs(torch: Any) -> None:
    """Give every CUDA graph captured in this process a graph pool, as PyTorch's allocator does
    (its pluggable allocator does not pass the pool calls on): memory freed during a capture is
    never handed to code outside the graph while the graph can replay; graphs captured with
    the same `pool=` share memory; resetting or destroying the last graph that uses a pool gives
    its memory back. Also measures what capturing and instantiating adds outside the allocator."""
    G = torch.cuda.CUDAGraph
    if getattr(G, "_vram_ledger_pools", False):
        return
    begin, end, reset = G.capture_begin, G.capture_end, G.reset
    lib = load()

    def capture_begin(self: Any, *args: Any, **kwargs: Any) -> None:
        begin(self, *args, **kwargs)
        d = torch.cuda.current_device()
        stream = torch.cuda.current_stream(d).cuda_stream
        # PyTorch names the graph's pool only once the capture is over: a shared pool is the
        # one passed in; a graph's private pool gets an id of ours, which no handle can equal.
        shared = args[0] if args else kwargs.get("pool")
        if shared is not None:
            shared = tuple(int(x) for x in shared)
            pool = _POOL_ALIASES.get(shared, shared)
        else:
            pool = (next(_PRIVATE_POOLS), 0)
        if lib.vram_ledger_graph_begin(d, stream, pool[0], pool[1]) != 0:
            error = VramLedgerError(_last_error())
            # Leave no capture running behind the error (torch.cuda.graph's exit never runs).
            try:
                end(self)
            except Exception as e:  # noqa: BLE001 - the first error is the one to raise
                _LOG.error("ending the capture after a failed graph pool also failed: %s", e)
            raise error
        # One reference per captured graph, dropped by reset() or when the graph is collected.
        self._vram_ledger_pool = (d, pool, stream, weakref.finalize(self, _release_pool, d, pool))

    def capture_end(self: Any) -> None:
        d, pool, stream, _ = self._vram_ledger_pool
        try:
            end(self)
            # Another graph may share this one's pool by PyTorch's name for it (`pool=g.pool()`).
            _POOL_ALIASES.setdefault(tuple(int(x) for x in self.pool()), pool)
        except BaseException as body_error:
            _clean_up_after(body_error, "ending the graph pool", lambda: _check(lib.vram_ledger_graph_end(d, stream, pool[0], pool[1])))
            raise
        _check(lib.vram_ledger_graph_end(d, stream, pool[0], pool[1]))

    def reset_(self: Any) -> None:
        reset(self)
        held = getattr(self, "_vram_ledger_pool", None)
        if held is not None:
            held[3]()  # a finalizer runs once: a later collection does nothing

    G.capture_begin, G.capture_end, G.reset = capture_begin, capture_end, reset_
    G._vram_ledger_pools = True


_PRIVATE_POOLS = itertools.count(1 << 62)
# PyTorch's name for a graph's private pool -> ours (PyTorch names it only after the capture).
_POOL_ALIASES: Dict[Tuple[int, ...], Tuple[int, ...]] = {}


def _release_pool(d: int, pool: Tuple[int, ...]) -> None:
    if load().vram_ledger_graph_release(d, pool[0], pool[1]) != 0:
        _LOG.error("releasing CUDA graph pool %s failed: %s", pool, _last_error())


class TaggedPool:
    """A torch.cuda.MemPool whose segments come from vram-ledger; `with pool:` allocates into it
    (under the pool's tag, if it has one)."""

    def __init__(self, tag_name: Optional[str]):
        self.tag = _args.pool_tag(tag_name)
        import torch

        if "allocator" in _INSTALLED:
            # install() put the library's MemPool in torch.cuda's place (`_mempool.py`).
            self.pool = torch.cuda.MemPool()
        else:
            self._plug = _INSTALLED.get("pool_allocator")
            if self._plug is None:
                self._plug = torch.cuda.memory.CUDAPluggableAllocator(library_path(), "vram_ledger_malloc", "vram_ledger_free")
                _INSTALLED["pool_allocator"] = self._plug
            self.pool = torch.cuda.MemPool(self._plug.allocator())
        # One context stack per `with` block and thread: the same pool may be entered nested,
        # or from several threads at once, and each exit must close only its own block's route
        # and tag (both are per thread in the library and in PyTorch).
        self._blocks = threading.local()

    def __enter__(self) -> TaggedPool:
        import torch

        stack = contextlib.ExitStack()
        try:
            stack.enter_context(torch.cuda.use_mem_pool(self.pool))
            if self.tag is not None:
                stack.enter_context(tag(self.tag))
        except BaseException:
            stack.close()
            raise
        blocks = getattr(self._blocks, "open", None)
        if blocks is None:
            blocks = self._blocks.open = []
        blocks.append(stack)
        return self

    def __exit__(self, *exc: object) -> None:
        self._blocks.open.pop().close()


def mempool(tag_name: Optional[str] = None) -> TaggedPool:
    """A torch.cuda.MemPool backed by vram-ledger. Without install(), PyTorch's allocator stays
    in charge (its statistics keep working) and asks vram-ledger for whole segments; under
    install(), it is the library's own pool (`_mempool.py`)."""
    return TaggedPool(tag_name)
