"""The KV cache sized last, in the order engines work: weights, profile, reserve the KV cache,
capture CUDA graphs against it, commit it to what the budget contract leaves, serve.

    kv = vram_ledger.kv_reserve(block_bytes, initial_blocks=64)   # after profile()
    cache = kv.tensor(torch.bfloat16, (2, layers, block_tokens, heads, head_dim))
    ... capture CUDA graphs that read and write `cache` ...
    kv.commit()                      # now kv.usable_blocks blocks may be used
    ... serve, its largest batches included ...
    kv.commit()                      # again: sized from serving's largest rise
    kv.resize(n, free_from=m)        # grow or shrink while serving

In every mode the whole range is reserved at once, so `cache` keeps its shape and address while
the blocks behind it are mapped; only blocks below `usable_blocks` may be touched.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, Optional, Sequence

from . import _args
from ._lib import VramLedgerError, _check, _json, load

_UINT64_MAX = (1 << 64) - 1

# The library holds one KV cache per device and its calls name only the device, so a handle
# checks that the cache it was made for is still the device's before each call. One lock for
# every handle: the check and the call must not be split by another thread's release and
# reserve. Each reserve or release through this module counts a new generation of the device,
# which tells apart a new cache that landed at the old one's address.
_LOCK = threading.Lock()
_GENERATION: Dict[int, int] = {}


class KvCache:
    """A KV cache of `reserved_blocks` blocks of `block_bytes` at `base`, `usable_blocks` of
    them usable now. Its figures are refreshed by every call that changes it."""

    def __init__(self, device: int, figures: Dict[str, Any]) -> None:
        self.device = device
        self._generation = _GENERATION.get(device, 0)
        self._released = False
        self._update(figures)

    def _check_current(self) -> None:
        """Raise unless this handle's cache is still the device's (call under `_LOCK`)."""
        if self._released:
            raise VramLedgerError(f"this KV cache on device {self.device} was released")
        f = _json(load().vram_ledger_kv_info(self.device))
        same = (f is not None and _GENERATION.get(self.device, 0) == self._generation
                and int(f["base"]) == self.base and int(f["block_bytes"]) == self.block_bytes)
        if not same:
            self._released = True
            raise VramLedgerError(f"the KV cache at {self.base:#x} on device {self.device} was released; "
                                  "kv_cache() gives the device's current one")

    def _update(self, f: Dict[str, Any]) -> None:
        self.base = int(f["base"])
        self.block_bytes = int(f["block_bytes"])
        self.reserved_blocks = int(f["reserved_blocks"])
        self.usable_blocks = int(f["usable_blocks"])
        self.reserved_bytes = int(f["reserved_bytes"])
        self.mapped_bytes = int(f["mapped_bytes"])

    def tensor(self, dtype: Any, block_shape: Sequence[int] = ()) -> Any:
        """A torch tensor over the whole reserved range: `(reserved_blocks, *block_shape)` of
        `dtype` (one block holds exactly `block_shape` of it). It never moves or changes shape;
        blocks at or above `usable_blocks` are not backed by memory and must not be touched.
        Keep this KvCache alive while the tensor is used."""
        import torch

        with _LOCK:
            self._check_current()
        itemsize = torch.empty((), dtype=dtype).element_size()
        per_block = itemsize
        for n in block_shape:
            per_block *= int(n)
        if per_block != self.block_bytes:
            raise ValueError(f"a block of shape {tuple(block_shape)} of {dtype} is {per_block} bytes, not the KV cache's {self.block_bytes}")
        raw = torch.as_tensor(_DeviceBytes(self.base, self.reserved_blocks * self.block_bytes), device=f"cuda:{self.device}")
        return raw.view(dtype).view(self.reserved_blocks, *[int(n) for n in block_shape])

    def commit(self) -> Dict[str, Any]:
        """Map the KV cache up to what the budget contract leaves now (call it once the CUDA
        graphs are captured, instantiated and replayed): returns `kv`, `room` (what was
        measured: cap, eager work now and the transient kept for it, serving's largest rise,
        graph pools, outside the allocator, tags asleep, margin, the allocator's limit, room) and
        `blocks_before`. Called again
        once the engine has served its largest batches, it keeps serving's largest rise
        instead of the profiled pass's (once serving has taken at least what that pass takes
        in fresh memory), so memory the profile kept for cuts serving did not make goes to
        the KV cache."""
        with _LOCK:
            self._check_current()
            r = _json(load().vram_ledger_kv_commit(self.device))
            self._update(r["kv"])
            return r

    def resize(self, blocks: int, free_from: Optional[int] = None) -> "KvCache":
        """Make `blocks` usable while serving. Shrinking needs every block from `free_from`
        (default: `blocks`) on to be free; growing maps more within the reservation and what the
        budget contract leaves. On an error the KV cache is as it was."""
        n = _args.integer(blocks, "blocks", maximum=_UINT64_MAX, c_type="uint64_t")
        free = n if free_from is None else _args.integer(free_from, "free_from", maximum=_UINT64_MAX, c_type="uint64_t")
        with _LOCK:
            self._check_current()
            self._update(_json(load().vram_ledger_kv_resize(self.device, n, free)))
        return self

    def release(self) -> None:
        """Give the KV cache back; tensors over it must not be used again, nor this handle (or
        any other for the same cache): their calls raise."""
        with _LOCK:
            self._check_current()
            _check(load().vram_ledger_kv_release(self.device))
            _GENERATION[self.device] = _GENERATION.get(self.device, 0) + 1
            self._released = True
            self.usable_blocks = 0
            self.mapped_bytes = 0

    def __repr__(self) -> str:
        return (f"KvCache(device={self.device}, base={self.base:#x}, block_bytes={self.block_bytes}, "
                f"usable_blocks={self.usable_blocks}, reserved_blocks={self.reserved_blocks})")


class _DeviceBytes:
    """`bytes` of device memory at `ptr`, as the CUDA array interface describes it (torch makes a
    tensor over it without copying or owning it)."""

    def __init__(self, ptr: int, bytes: int) -> None:
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (bytes,), "typestr": "|u1", "version": 3}


def kv_reserve(block_bytes: int, max_bytes: Optional[int] = None, initial_blocks: int = 0, device: Optional[int] = None) -> KvCache:
    """Reserve the KV cache (after profile()): address space for `max_bytes` (default: the
    device's memory) in blocks of `block_bytes`, `initial_blocks` of them usable now for
    warm-up and capture."""
    b = _args.integer(block_bytes, "block_bytes", minimum=1, maximum=_UINT64_MAX, c_type="uint64_t")
    m = _args.optional_integer(max_bytes, "max_bytes", minimum=1)
    n = _args.integer(initial_blocks, "initial_blocks", maximum=_UINT64_MAX, c_type="uint64_t")
    d = _args.device(device)
    with _LOCK:
        f = _json(load().vram_ledger_kv_reserve(d, b, -1 if m is None else m, n))
        _GENERATION[d] = _GENERATION.get(d, 0) + 1
        return KvCache(d, f)


def kv_cache(device: Optional[int] = None) -> Optional[KvCache]:
    """The KV cache reserved on `device`, or None."""
    d = _args.device(device)
    with _LOCK:
        f = _json(load().vram_ledger_kv_info(d))
        return None if f is None else KvCache(d, f)


__all__ = ["KvCache", "kv_reserve", "kv_cache", "VramLedgerError"]
