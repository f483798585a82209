"""torch.cuda.MemPool and use_mem_pool under install().

PyTorch's MemPool asks the allocator to create its pool (createOrIncrefPool), which a pluggable
allocator refuses, and use_mem_pool's routing calls reach the pluggable allocator, which passes
none of them on. install() puts the library's pools in their place: the MemPool below holds a
pool of the library's (`vram_ledger_pool_hold`), and use_mem_pool routes the calling thread's
allocations to it on every stream (`vram_ledger_pool_begin` / `_end`, then
`vram_ledger_graph_release` as PyTorch's releasePool). Its memory survives empty_cache while
the pool lives, is kept apart from every other allocation, and goes back to the driver once
the pool object and every use of it are gone; what is still allocated then goes with the next
empty_cache, as with PyTorch's allocator.

A MemPool with its own allocator (`MemPool(CUDAPluggableAllocator(...).allocator())`) takes
its segments from that allocator's functions, in every mode, and gives them back to them; the
library caches and splits them as its own, and counts them against the cap. install() records
the functions of every CUDAPluggableAllocator made after it. `use_on_oom=True` lets the pool's
free blocks serve an allocation that nothing else can. With `no_split=True` the pool's blocks
are never split: each allocation takes a whole free block of the pool, or a segment of its own,
in every mode."""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections import Counter
from typing import Any, Dict, List, Optional, Tuple

from . import _args
from ._lib import _LOG, VramLedgerError, _check, _last_error, load

# Routes in progress by pool id (use_mem_pool blocks not yet ended, every thread's), for
# use_count().
_IN_USE: Counter = Counter()
_IN_USE_LOCK = threading.Lock()

# The functions of each CUDAPluggableAllocator made since install(), by id() of its
# allocator() object: (that object, kept alive with its id; alloc and free addresses).
_FUNCTIONS: Dict[int, Tuple[Any, int, int]] = {}


def _pool(pool_id: Any) -> Tuple[int, int]:
    """PyTorch's MempoolId_t, a pair of ints, as the two uint64_t the library takes."""
    a, b = pool_id
    return tuple(_args.integer(x, "a pool id's part", maximum=(1 << 64) - 1, c_type="uint64_t") for x in (a, b))  # type: ignore[return-value]


def _release(device: int, pool_id: Tuple[int, int]) -> None:
    if load().vram_ledger_graph_release(device, *pool_id) != 0:
        _LOG.error("releasing memory pool %s failed: %s", pool_id, _last_error())


class MemPool:
    """A pool of vram-ledger's memory that `torch.cuda.use_mem_pool(pool)` allocates into, in
    the place of torch.cuda.MemPool under install(): the same id, allocator, use_count() and
    snapshot(). Made on the current device."""

    def __init__(self, allocator: Any = None, use_on_oom: bool = False, no_split: bool = False, **unsupported: Any) -> None:
        refused = sorted(unsupported)
        if refused:
            raise VramLedgerError(
                f"torch.cuda.MemPool({', '.join(refused)}=...) is not supported under vram_ledger.install() "
                "(MemPool(), MemPool(allocator) and use_on_oom are)"
            )
        functions = (None, None)
        if allocator is not None:
            known = _FUNCTIONS.get(id(allocator))
            if known is None or known[0] is not allocator:
                raise VramLedgerError(
                    "torch.cuda.MemPool(allocator): this allocator's functions are not known to vram-ledger; make it "
                    "with torch.cuda.memory.CUDAPluggableAllocator(path, alloc_name, free_name) after install()"
                )
            functions = known[1:]
        import torch

        self._id: Tuple[int, int] = _pool(torch.cuda.graph_pool_handle())
        self._device = int(torch.cuda.current_device())
        self._allocator = allocator
        flags = _args.flag(use_on_oom, "use_on_oom") | _args.flag(no_split, "no_split") << 1
        _check(load().vram_ledger_pool_hold(self._device, *self._id, *functions, flags))
        self._finalizer = weakref.finalize(self, _release, self._device, self._id)

    @property
    def id(self) -> Tuple[int, int]:
        return self._id

    @property
    def allocator(self) -> Any:
        return self._allocator

    @property
    def is_symmetric(self) -> bool:
        return False

    def use_count(self) -> int:
        """This object's reference and one per use_mem_pool block in progress, as PyTorch counts."""
        with _IN_USE_LOCK:
            return 1 + _IN_USE[self._id]

    def snapshot(self) -> List[Any]:
        """The pool's segments, as torch.cuda.memory_snapshot(self.id) gives them."""
        import torch

        return torch.cuda.memory_snapshot(self._id)


def patch(torch: Any) -> None:
    """Put MemPool in torch.cuda's place, and route use_mem_pool's calls to the library."""
    lib = load()
    memory = torch.cuda.memory

    def begin(device: int, pool_id: Any) -> None:
        pool = _pool(pool_id)
        _check(lib.vram_ledger_pool_begin(_args.device(device), *pool))
        with _IN_USE_LOCK:
            _IN_USE[pool] += 1

    def end(device: int, pool_id: Any) -> None:
        pool = _pool(pool_id)
        _check(lib.vram_ledger_pool_end(_args.device(device), *pool))
        with _IN_USE_LOCK:
            _IN_USE[pool] -= 1
            if _IN_USE[pool] <= 0:
                del _IN_USE[pool]

    def release(device: int, pool_id: Any) -> None:
        _check(lib.vram_ledger_graph_release(_args.device(device), *_pool(pool_id)))

    # torch.cuda.memory's names (use_mem_pool) and torch._C's (inductor's CUDA-graph trees call
    # them there): PyTorch's bindings would reach its pluggable allocator, which drops them.
    for name, fn in [
        ("_cuda_beginAllocateCurrentThreadToPool", begin),
        ("_cuda_endAllocateToPool", end),
        ("_cuda_releasePool", release),
    ]:
        setattr(memory, name, fn)
        setattr(torch._C, name, fn)
    memory.MemPool = MemPool
    torch.cuda.MemPool = MemPool

    class CUDAPluggableAllocator(memory.CUDAPluggableAllocator):  # type: ignore[misc, valid-type]
        """PyTorch's, and its functions recorded for MemPool(allocator)."""

        def __init__(self, path_to_so_file: str, alloc_fn_name: str, free_fn_name: str) -> None:
            super().__init__(path_to_so_file, alloc_fn_name, free_fn_name)
            so = ctypes.CDLL(path_to_so_file)
            raw = self.allocator()
            address = lambda name: ctypes.cast(getattr(so, name), ctypes.c_void_p).value  # noqa: E731
            _FUNCTIONS[id(raw)] = (raw, address(alloc_fn_name), address(free_fn_name))

    memory.CUDAPluggableAllocator = CUDAPluggableAllocator
    if hasattr(torch.cuda, "CUDAPluggableAllocator"):
        torch.cuda.CUDAPluggableAllocator = CUDAPluggableAllocator


def pool_filter(snapshot: Any, arg: Optional[Any]) -> Any:
    """The snapshot as torch._C._cuda_memorySnapshot(arg) gives it: torch 2.11 passes
    (pool id's two parts, include_traces), older versions the pool id or None. A pool id of
    (0, 0), no pool, leaves every segment; include_traces false leaves the history out."""
    if arg is None:
        return snapshot
    parts = tuple(arg)
    want = tuple(int(x) for x in parts[:2])
    if len(parts) > 2 and not parts[2]:
        snapshot["device_traces"] = [[] for _ in snapshot.get("device_traces", [])]
    if want != (0, 0):
        snapshot["segments"] = [s for s in snapshot["segments"] if tuple(s.get("segment_pool_id", (0, 0))) == want]
    return snapshot
