"""Checkpoints of a graph pool for the extension allocator (`csrc/torch_allocator.cpp`):
PyTorch's torch._C._cuda_getCheckpointState, _cuda_setCheckpointPoolState and
_cuda_checkPoolLiveAllocations reach its getCheckpointState, setCheckpointPoolState and
checkPoolLiveAllocations, which call these with the GIL held. Inductor's CUDA-graph trees use
them to record graph after graph into one pool, putting the pool back to the state a graph left
before recording the next.

The library keeps the checkpoint (`vram_ledger_pool_checkpoint`: the pool's allocated blocks,
JSON) and restores it (`vram_ledger_pool_restore`: everything the pool holds allocated is freed,
the checkpoint's blocks are allocated again at their addresses); C++ keeps PyTorch's side, the
metadata its frees need and the storages whose deleters it swaps."""

from __future__ import annotations

import json
from typing import Any, List, Tuple

from . import _args
from ._lib import _string, load
from ._mempool import _pool


def _library_pool(pool: Any) -> Tuple[int, int]:
    """The library's id of PyTorch's pool `pool` (a graph's private pool has one of ours)."""
    from ._torch import _POOL_ALIASES

    ours = _pool(pool)
    return _POOL_ALIASES.get(ours, ours)  # type: ignore[return-value]


def checkpoint(device: int, pool: Any) -> Tuple[str, List[int]]:
    """The pool's checkpoint as the library writes it, and the addresses it holds allocated."""
    text = _string(load().vram_ledger_pool_checkpoint(_args.device(device), *_library_pool(pool)))
    return text, [int(b["addr"]) for b in json.loads(text)["blocks"]]


def restore(device: int, pool: Any, text: str) -> Tuple[List[int], List[int]]:
    """Put the pool back to checkpoint `text`; the addresses freed, and those allocated again."""
    done = json.loads(_string(load().vram_ledger_pool_restore(_args.device(device), *_library_pool(pool), text.encode())))
    return [int(p) for p in done["freed"]], [int(b["addr"]) for b in done["made"]]
