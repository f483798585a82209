"""vram-ledger for PyTorch: a device allocator that keeps an exact, tagged ledger.

    import vram_ledger
    vram_ledger.install()                      # before any CUDA use
    with vram_ledger.tag("weights"):
        model = build_model().cuda()
    with vram_ledger.profile(utilization=0.9) as p:
        dummy_forward(model)
    kv_bytes = p.result["kv_budget"]

`tag()` and `profile()` never hide an exception raised in their block: if cleaning up after
it fails too, that failure is logged (logger "vram_ledger") and attached to it as a note; after
a block that succeeded, a failed clean-up raises. `install()` changes nothing when it refuses.

Tags are per thread. Autograd runs the backward pass on its own threads, which carry no tag:
their allocations are counted as "untracked" (set a tag inside a hook to change that).

The shared library is found from, in order: the VRAM_LEDGER_LIB environment variable, this
package's folder (where `pip install ./python` puts it), and the repository's target/release
folder. Failures inside the library (a failed free or record_stream, which return nothing, too)
are logged through `logging` (logger "vram_ledger", level WARNING). With VRAM_LEDGER_LOG set
(`debug`, `off`, any tracing filter) the library logs to stderr itself, at that level.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import ctypes
import itertools
import json
import logging
import os
import threading
import weakref
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

__all__ = [
    "VramLedgerError",
    "library_path",
    "install",
    "mempool",
    "tag",
    "current_tag",
    "stats",
    "memory_stats",
    "reset_peak_memory_stats",
    "empty_cache",
    "profile",
    "report",
    "set_cap",
    "cap",
    "metrics",
    "record_history",
    "dump_snapshot",
]

TAGS = ("weights", "activation", "kv_cache", "kv", "untracked")
MODES = ("native", "expandable", "compact", "remap")


class VramLedgerError(RuntimeError):
    """An error reported by the vram-ledger library, with its message."""


def _candidates() -> List[Path]:
    out = []
    env = os.environ.get("VRAM_LEDGER_LIB")
    if env:
        out.append(Path(env))
    here = Path(__file__).resolve().parent
    out.append(here / "libvram_ledger.so")
    out.append(here.parent.parent / "target" / "release" / "libvram_ledger.so")
    return out


def library_path() -> str:
    """The shared library this package will load."""
    env = os.environ.get("VRAM_LEDGER_LIB")
    if env and not Path(env).is_file():
        raise VramLedgerError(f"VRAM_LEDGER_LIB={env} does not name a file")
    for c in _candidates():
        if c.is_file():
            return str(c)
    tried = ", ".join(str(c) for c in _candidates())
    raise VramLedgerError(f"libvram_ledger.so not found (tried: {tried}); build it with `cargo build --release` or set VRAM_LEDGER_LIB")


_LOG = logging.getLogger("vram_ledger")

_LIB: Optional[ctypes.CDLL] = None
_LOCK = threading.Lock()


def _lib() -> ctypes.CDLL:
    global _LIB
    with _LOCK:
        if _LIB is None:
            lib = ctypes.CDLL(library_path())
            c_int, c_char_p, c_void_p = ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p
            for name, args, res in [
                ("vram_ledger_configure", [c_char_p], c_int),
                ("vram_ledger_set_tag", [c_char_p], c_int),
                ("vram_ledger_push_tag", [c_char_p], c_int),
                ("vram_ledger_pop_tag", [], c_int),
                ("vram_ledger_current_tag", [], c_char_p),
                ("vram_ledger_stats_json", [c_int], c_void_p),
                ("vram_ledger_memory_stats_json", [c_int], c_void_p),
                ("vram_ledger_reset_peaks", [c_int], c_int),
                ("vram_ledger_set_cap", [c_int, ctypes.c_int64], c_int),
                ("vram_ledger_cap", [c_int], ctypes.c_int64),
                ("vram_ledger_empty_cache", [c_int], c_int),
                ("vram_ledger_metrics", [], c_void_p),
                ("vram_ledger_record_history", [c_int, c_int, ctypes.c_int64], c_int),
                ("vram_ledger_dump_snapshot", [c_int, c_char_p], c_int),
                ("vram_ledger_graph_begin", [c_int, c_void_p, ctypes.c_uint64, ctypes.c_uint64], c_int),
                ("vram_ledger_graph_end", [c_int, c_void_p, ctypes.c_uint64, ctypes.c_uint64], c_int),
                ("vram_ledger_graph_release", [c_int, ctypes.c_uint64, ctypes.c_uint64], c_int),
                ("vram_ledger_profile_begin", [c_int, ctypes.c_double, ctypes.c_int64], c_int),
                ("vram_ledger_profile_end", [c_int], c_void_p),
                ("vram_ledger_last_error", [], c_char_p),
                ("vram_ledger_string_free", [c_void_p], None),
                ("vram_ledger_device_count", [], c_int),
                ("vram_ledger_malloc", [ctypes.c_ssize_t, c_int, c_void_p], c_void_p),
                ("vram_ledger_free", [c_void_p, ctypes.c_ssize_t, c_int, c_void_p], None),
                ("vram_ledger_separate_tags", [c_int], c_int),
                ("vram_ledger_sleep", [c_int, c_int, c_int], c_void_p),
                ("vram_ledger_wake", [c_int, c_int], c_void_p),
                ("vram_ledger_set_retain_host", [c_int, c_int], c_int),
            ]:
                f = getattr(lib, name)
                f.argtypes = args
                f.restype = res
            lib.vram_ledger_set_log_callback.argtypes = [ctypes.c_void_p]
            lib.vram_ledger_set_log_callback.restype = None
            if not os.environ.get("VRAM_LEDGER_LOG"):
                # Failures inside the library reach `logging` (logger "vram_ledger"); an
                # explicit VRAM_LEDGER_LOG keeps the library's own stderr output and filter.
                # Handed back before the interpreter shuts down, after which a callback into
                # Python could not run: frees during teardown log to stderr.
                lib.vram_ledger_set_log_callback(ctypes.cast(_FORWARD, ctypes.c_void_p))
                atexit.register(lib.vram_ledger_set_log_callback, None)
            _LIB = lib
        return _LIB


@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p)
def _FORWARD(level: int, message: bytes) -> None:
    _LOG.log(level, "%s", message.decode("utf-8", "replace"))


def _last_error() -> str:
    return (_lib().vram_ledger_last_error() or b"").decode("utf-8", "replace")


def _check(rc: int) -> None:
    if rc != 0:
        raise VramLedgerError(_last_error())


def _json(ptr: Optional[int]) -> Any:
    if not ptr:
        raise VramLedgerError(_last_error())
    try:
        return json.loads(ctypes.string_at(ptr).decode())
    finally:
        _lib().vram_ledger_string_free(ptr)


def _device(device: Optional[int]) -> int:
    if device is None:
        try:
            import torch

            if torch.cuda.is_initialized():
                return torch.cuda.current_device()
        except ImportError:
            pass
        return 0
    if isinstance(device, bool) or not isinstance(device, int):
        raise TypeError(f"device must be an int, not {type(device).__name__}")
    return device


_INSTALLED: Dict[str, Any] = {}


def _address(fn: Any) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def install(mode: Optional[str] = None, torch_stats: bool = True, cudagraph_trees: bool = False, sleep: bool = False) -> Any:
    """Make vram-ledger PyTorch's CUDA allocator for this process, with the init, empty_cache,
    memory-fraction and record_stream hooks. Must run before any CUDA use; permanent. With
    `torch_stats` (the default), torch.cuda.memory_stats() and the functions built on it
    (memory_allocated, max_memory_allocated, memory_reserved, max_memory_reserved,
    memory_summary, reset_peak_memory_stats) answer with vram-ledger's figures, which a
    pluggable allocator otherwise cannot give.

    torch.compile(mode="reduce-overhead") captures CUDA graphs. Inductor's CUDA-graph trees
    checkpoint and restore the private pool state of PyTorch's own allocator, which a
    pluggable allocator cannot provide, so install() turns them off
    (torch._inductor.config.triton.cudagraph_trees = False): inductor then captures each
    compiled graph with torch.cuda.graph, into a graph pool of vram-ledger's like any other
    capture. `cudagraph_trees=True` leaves inductor's setting alone.

    `sleep=True` keeps each tag's memory apart so that `sleep()` can give a tag's memory back
    and `wake()` restore it at the same addresses; it needs a virtual-memory mode
    (expandable, compact or remap)."""
    if "allocator" in _INSTALLED:
        return _INSTALLED["allocator"]
    if mode is not None and mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
    if sleep and mode in (None, "native"):
        raise ValueError("sleep=True needs a virtual-memory mode: install(mode='expandable', sleep=True), or compact, or remap")
    import torch

    # Checked before anything is configured: a refused install leaves the library as it was.
    if torch.cuda.is_initialized():
        raise VramLedgerError("install() must run before any CUDA use (CUDA is already initialised in this process)")
    if mode is not None:
        _check(_lib().vram_ledger_configure(mode.encode()))
    lib = _lib()
    if sleep:
        _check(lib.vram_ledger_separate_tags(1))
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
    if torch_stats:
        _patch_torch_stats(torch)
    if not cudagraph_trees:
        _plain_inductor_graphs()
    _INSTALLED["allocator"] = alloc
    return alloc


def _plain_inductor_graphs() -> None:
    try:
        import torch._inductor.config as inductor
    except ImportError:  # a torch without inductor has nothing to turn off
        return
    inductor.triton.cudagraph_trees = False


def _patch_torch_stats(torch: Any) -> None:
    """torch.cuda.memory_stats() (PyTorch's keys and meanings, plus `tag.*`) and
    reset_peak_memory_stats() from vram-ledger; everything PyTorch builds on them follows."""
    mem = torch.cuda.memory
    if getattr(mem, "_vram_ledger_stats", False):
        return
    from torch.cuda._utils import _get_device_index

    # Before CUDA is initialised there is nothing to report (as with PyTorch's allocator), and
    # asking the library would create a device's context and profiling baseline too early.
    def memory_stats_(device: Any = None) -> Dict[str, int]:
        if not torch.cuda.is_initialized():
            return collections.OrderedDict()
        stats = memory_stats(_get_device_index(device, optional=True))
        return collections.OrderedDict(sorted(stats.items()))

    def reset_peak_memory_stats_(device: Any = None) -> None:
        if torch.cuda.is_initialized():
            reset_peak_memory_stats(_get_device_index(device, optional=True))

    for owner in (mem, torch.cuda):
        owner.memory_stats = memory_stats_
        owner.reset_peak_memory_stats = reset_peak_memory_stats_
    mem._vram_ledger_stats = True


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
    lib = _lib()

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
_POOL_ALIASES: Dict[Any, Any] = {}


def _release_pool(d: int, pool: Any) -> None:
    if _lib().vram_ledger_graph_release(d, pool[0], pool[1]) != 0:
        _LOG.error("releasing CUDA graph pool %s failed: %s", pool, _last_error())


class TaggedPool:
    """A torch.cuda.MemPool whose segments come from vram-ledger; `with pool:` allocates into it
    (under the pool's tag, if it has one)."""

    def __init__(self, tag_name: Optional[str]):
        import torch

        if tag_name is not None and tag_name not in TAGS:
            raise ValueError(f"tag must be one of {', '.join(TAGS)}, not {tag_name!r}")
        self.tag = tag_name
        self._plug = _INSTALLED.get("pool_allocator")
        if self._plug is None:
            self._plug = torch.cuda.memory.CUDAPluggableAllocator(library_path(), "vram_ledger_malloc", "vram_ledger_free")
            _INSTALLED["pool_allocator"] = self._plug
        self.pool = torch.cuda.MemPool(self._plug.allocator())
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "TaggedPool":
        import torch

        self._stack.enter_context(torch.cuda.use_mem_pool(self.pool))
        if self.tag is not None:
            self._stack.enter_context(tag(self.tag))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()


def mempool(tag_name: Optional[str] = None) -> TaggedPool:
    """A torch.cuda.MemPool backed by vram-ledger: PyTorch's allocator stays in charge (its
    statistics keep working) and asks vram-ledger for whole segments."""
    return TaggedPool(tag_name)


@contextlib.contextmanager
def tag(name: str) -> Iterator[None]:
    """Tag this thread's allocations inside the block: weights, activation, kv_cache (or kv),
    untracked. Nests."""
    if not isinstance(name, str):
        raise TypeError(f"tag name must be a str, not {type(name).__name__}")
    _check(_lib().vram_ledger_push_tag(name.encode()))
    try:
        yield
    except BaseException as body_error:
        _clean_up_after(body_error, "restoring the previous tag", lambda: _check(_lib().vram_ledger_pop_tag()))
        raise
    _check(_lib().vram_ledger_pop_tag())


def _clean_up_after(body_error: BaseException, what: str, clean_up: Any) -> None:
    """Run a context manager's clean-up after its body raised. A failure here must not replace
    the body's exception (the one the user needs): it is logged and attached to it as a note."""
    try:
        clean_up()
    except Exception as e:
        note = f"vram_ledger: {what} also failed: {type(e).__name__}: {e}"
        _LOG.error(note)
        if hasattr(body_error, "add_note"):  # Python 3.11+
            body_error.add_note(note)


def current_tag() -> str:
    """This thread's tag."""
    return _lib().vram_ledger_current_tag().decode()


def stats(device: Optional[int] = None) -> Dict[str, Any]:
    """The ledger: per tag and allocator-wide current and peak figures, driver calls."""
    return _json(_lib().vram_ledger_stats_json(_device(device)))


def memory_stats(device: Optional[int] = None) -> Dict[str, int]:
    """torch.cuda.memory_stats()'s keys (which PyTorch cannot give under a pluggable
    allocator), plus `tag.*` keys."""
    return _json(_lib().vram_ledger_memory_stats_json(_device(device)))


def reset_peak_memory_stats(device: Optional[int] = None) -> None:
    _check(_lib().vram_ledger_reset_peaks(_device(device)))


def empty_cache(device: Optional[int] = None) -> None:
    _check(_lib().vram_ledger_empty_cache(_device(device)))


class Profile:
    """Filled in when the `profile()` block exits: `result` (a dict) and `report` (lines)."""

    def __init__(self) -> None:
        self.result: Dict[str, Any] = {}
        self.report: List[str] = []

    @property
    def kv_budget(self) -> int:
        return int(self.result["kv_budget"])


def set_cap(bytes: Optional[int], device: Optional[int] = None) -> None:
    """Hold this process to `bytes` of device memory in all (the budget contract: the
    allocator's bytes plus memory outside it, re-read before every growth), or lift the cap
    with None. profile() sets it to the requested memory unless told not to."""
    if bytes is not None and (isinstance(bytes, bool) or not isinstance(bytes, int) or bytes < 0):
        raise ValueError(f"bytes must be a non-negative int or None, not {bytes!r}")
    _check(_lib().vram_ledger_set_cap(_device(device), -1 if bytes is None else bytes))


def cap(device: Optional[int] = None) -> Optional[int]:
    """The budget contract in bytes, or None when none is set."""
    c = int(_lib().vram_ledger_cap(_device(device)))
    if c == -2:
        raise VramLedgerError(_last_error())
    return None if c < 0 else c


@contextlib.contextmanager
def profile(
    utilization: float, device: Optional[int] = None, margin_bytes: Optional[int] = None, contract: bool = True
) -> Iterator[Profile]:
    """Profile the dummy pass run inside the block; the KV-cache budget is
    ceil(total × utilization) − what this process needs besides the KV cache − margin. The
    default margin (None) is none in native mode and 0.25% of the requested memory in the
    virtual-memory modes (room for placing blocks differently while serving). With
    `contract` (the default), the process is then held to the requested memory while it serves
    (see set_cap)."""
    if isinstance(utilization, bool) or not isinstance(utilization, (int, float)) or not (0.0 < utilization <= 1.0):
        raise ValueError(f"utilization must be a number in (0, 1], not {utilization!r}")
    if margin_bytes is not None and (isinstance(margin_bytes, bool) or not isinstance(margin_bytes, int) or margin_bytes < 0):
        raise ValueError(f"margin_bytes must be a non-negative int or None, not {margin_bytes!r}")
    d = _device(device)
    try:
        import torch

        if torch.cuda.is_initialized():
            torch.cuda.synchronize(d)
    except ImportError:
        pass
    previous = cap(d)
    _check(_lib().vram_ledger_profile_begin(d, float(utilization), -1 if margin_bytes is None else margin_bytes))
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
        try:
            import torch

            if torch.cuda.is_initialized():
                torch.cuda.synchronize(d)
        except ImportError:
            pass
    finally:
        r = _json(_lib().vram_ledger_profile_end(d))
        p.report = r.pop("report", [])
        p.result = r


_TAG_BITS = {"weights": 1, "activation": 2, "kv_cache": 4, "kv": 4, "untracked": 8}


def _names(tags: Any) -> List[str]:
    return [tags] if isinstance(tags, str) else list(tags or ())


def _mask(tags: Any, what: str) -> int:
    mask = 0
    for t in _names(tags):
        if t not in _TAG_BITS:
            raise ValueError(f"{what}: unknown tag {t!r}; expected one of weights, activation, kv_cache (or kv), untracked")
        mask |= _TAG_BITS[t]
    return mask


def _per_device(ptr: Optional[int]) -> Dict[int, Any]:
    return {int(k): v for k, v in _json(ptr).items()}


def sleep(offload: Any = (), discard: Any = (), device: Optional[int] = None, force: bool = False) -> Dict[int, Any]:
    """Give the memory of the `offload` tags (copied to page-locked host memory first) and of
    the `discard` tags (contents lost) back to the GPU, keeping their addresses: pointers and
    captured CUDA graphs stay valid for after `wake()`. The cache of every tag is given back
    too. Needs `install(mode=..., sleep=True)`. Every device in use unless `device` is given;
    returns each device's report (bytes offloaded, discarded, given back; host bytes; seconds).
    Tensors of a sleeping tag must not be used until it wakes; freeing them is deferred.

    "untracked" is refused unless `force=True`: PyTorch keeps its own buffers there (cuBLAS
    workspaces, for instance), and the next kernel that touches one while it sleeps would end
    the process's CUDA context."""
    if not force and "untracked" in (_names(offload) + _names(discard)):
        raise ValueError("sleeping 'untracked' would take PyTorch's own buffers (cuBLAS workspaces, ...) away; pass force=True if nothing uses them")
    d = -1 if device is None else _device(device)
    return _per_device(_lib().vram_ledger_sleep(d, _mask(offload, "offload"), _mask(discard, "discard")))


def wake(tags: Any = None, device: Optional[int] = None) -> Dict[int, Any]:
    """Map fresh memory at the sleeping tags' addresses (all of them, or `tags`) and copy the
    offloaded contents back. If the device lacks room the error says so, the tag stays asleep
    with nothing lost, and wake can be retried."""
    mask = _mask(tags, "tags")
    if tags is not None and mask == 0:
        return {}  # an empty selection wakes nothing (None wakes every tag)
    d = -1 if device is None else _device(device)
    return _per_device(_lib().vram_ledger_wake(d, mask))


def set_retain_host(retain: bool = True, device: Optional[int] = None) -> None:
    """Keep the page-locked host memory of offloaded tags after wake, so that the next sleep
    does not pin it again (default: freed at wake)."""
    d = -1 if device is None else _device(device)
    _check(_lib().vram_ledger_set_retain_host(d, 1 if retain else 0))


def record_history(enabled: bool = True, max_entries: int = 100_000, device: Optional[int] = None) -> None:
    """Record (or stop recording) the allocation history, as torch.cuda.memory's
    _record_memory_history does: a ring of the newest `max_entries` allocations, frees and
    segment events, each allocation with its tag. Off by default; starting clears it."""
    if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries <= 0:
        raise ValueError(f"max_entries must be a positive int, not {max_entries!r}")
    _check(_lib().vram_ledger_record_history(_device(device), 1 if enabled else 0, max_entries))


def dump_snapshot(path: str, device: Optional[int] = None) -> None:
    """Write the segments now and the recorded history in PyTorch's snapshot format
    (torch.cuda.memory._dump_snapshot's pickle): PyTorch's memory_viz opens it, each
    allocation's tag as its user_metadata, and `vram-ledger replay` reads it."""
    _check(_lib().vram_ledger_dump_snapshot(_device(device), os.fspath(path).encode()))


def metrics() -> str:
    """Every device in use, in Prometheus' text exposition format, for an engine's `/metrics`
    endpoint: `vram_ledger_allocated_bytes` and `vram_ledger_allocated_peak_bytes` by device and
    tag; `vram_ledger_reserved_bytes`, `_reserved_peak_bytes`, `_cached_bytes`,
    `_graph_pool_bytes` and `_cap_bytes` by device; the counters `vram_ledger_ooms_total`,
    `_alloc_retries_total`, and `vram_ledger_driver_calls_total` by device and call."""
    ptr = _lib().vram_ledger_metrics()
    if not ptr:
        raise VramLedgerError(_last_error())
    try:
        return ctypes.string_at(ptr).decode()
    finally:
        _lib().vram_ledger_string_free(ptr)


def report(device: Optional[int] = None) -> str:
    """The ledger as a short table, in GiB."""
    s = stats(device)
    g = lambda b: f"{b / (1 << 30):.2f} GiB"  # noqa: E731
    lines = [f"{'tag':<12} {'allocated':>12} {'peak':>12}"]
    for t, v in s["per_tag"].items():
        lines.append(f"{t:<12} {g(v['allocated_bytes']['current']):>12} {g(v['allocated_bytes']['peak']):>12}")
    lines.append(
        f"reserved {g(s['reserved_bytes']['current'])} (peak {g(s['reserved_bytes']['peak'])}), cached {g(s['cached_bytes'])}"
    )
    return "\n".join(lines)
