"""Sleep and wake by tag: a tag's device memory given back and restored at the same addresses."""

from __future__ import annotations

import os
from typing import Any, Dict, Iterable, Optional, Union

from . import _args
from ._lib import _check, _json, abi, load

Tags = Union[str, Iterable[str], None]


def _per_device(ptr: Optional[int]) -> Dict[int, Dict[str, Any]]:
    return {int(k): v for k, v in _json(ptr).items()}


def sleep(offload: Tags = (), discard: Tags = (), device: Optional[int] = None, force: bool = False) -> Dict[int, Dict[str, Any]]:
    """Give the memory of the `offload` tags (copied to host memory first) and of
    the `discard` tags (contents lost) back to the GPU, keeping their addresses: pointers and
    captured CUDA graphs stay valid for after `wake()`. The cache of every tag is given back
    too. Needs `install(mode=..., sleep=True)`. Every device in use unless `device` is given;
    returns each device's report (bytes offloaded, discarded, given back; host bytes; seconds).
    Tensors of a sleeping tag must not be used until it wakes; freeing them is deferred.

    "untracked" is refused unless `force=True`: PyTorch keeps its own buffers there (cuBLAS
    workspaces, for instance), and the next kernel that touches one while it sleeps would end
    the process's CUDA context."""
    offload_mask, discard_mask = _args.tag_mask(offload, "offload"), _args.tag_mask(discard, "discard")
    if not force and (offload_mask | discard_mask) & abi().tag_bits["untracked"]:
        raise ValueError("sleeping 'untracked' would take PyTorch's own buffers (cuBLAS workspaces, ...) away; pass force=True if nothing uses them")
    d = _args.devices(device)
    return _per_device(load().vram_ledger_sleep(d, offload_mask, discard_mask))


def wake(tags: Tags = None, device: Optional[int] = None) -> Dict[int, Dict[str, Any]]:
    """Map fresh memory at the sleeping tags' addresses (all of them, or `tags`) and copy the
    offloaded contents back. If the device lacks room the error says so, the tag stays asleep
    with nothing lost, and wake can be retried."""
    mask = _args.tag_mask(tags, "tags")
    if tags is not None and mask == 0:
        return {}  # an empty selection wakes nothing (None wakes every tag)
    d = _args.devices(device)
    return _per_device(load().vram_ledger_wake(d, mask))


def set_retain_host(retain: bool = True, device: Optional[int] = None) -> None:
    """Keep the host memory of offloaded tags after wake, for the next sleep (default: freed at
    wake). Memory retained from the start of a sleep is page-locked: later sleeps and wakes copy
    at the copy engine's full speed and pin nothing. Without it, sleep copies through a small
    page-locked ring into pageable memory."""
    _check(load().vram_ledger_set_retain_host(_args.devices(device), 1 if retain else 0))


def set_sleep_file(path: Optional[Union[str, "os.PathLike[str]"]] = None, device: Optional[int] = None) -> None:
    """Offload to disk from the next sleep on: each offloaded tag goes to a new file
    `PATH.dev<N>.<tag>` (which must not exist; its directory must), created at sleep and removed
    at once, its blocks reserved first. The host's page cache holds it and writes it back, and
    gives the memory up when the host needs it. `None` (the default) offloads to host memory. A
    tag whose host memory is retained keeps that memory's kind until a wake frees it."""
    if path is None:
        raw = None
    else:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"the sleep file's path must be a str or a path, not {type(path).__name__}")
        text = os.fsdecode(path)
        if not text or "\0" in text:
            raise ValueError("the sleep file's path must be a non-empty path without NUL characters")
        raw = text.encode()
    _check(load().vram_ledger_set_sleep_file(_args.devices(device), raw))


def set_zero_discarded(zero: bool = True, device: Optional[int] = None) -> None:
    """Whether wake fills discarded tags' memory with zeros (the default), or leaves it as fresh
    memory comes: stale data of this process, one device memset cheaper."""
    _check(load().vram_ledger_set_zero_discarded(_args.devices(device), 1 if zero else 0))
