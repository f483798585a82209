"""install(extension=True): the allocator as PyTorch's C++ sees it (`csrc/torch_allocator.cpp`),
built with torch's C++ extension tools the first time (torch caches the build, in
TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions) and loaded in place of PyTorch's plain
pluggable allocator. It is that allocator, with the library's hooks, plus what C++ code calls
on the current allocator directly and the pluggable one refuses: `recordHistory` and
`snapshot` (torch::cuda::_record_memory_history, _memory_snapshot_pickled), the compile
contexts of torch.compile's regions, and graph pools' checkpoints (`_checkpoint.py`). The
build needs a C++ compiler, ninja and the CUDA headers (what torch.utils.cpp_extension
needs); without them install(extension=True) fails before anything is configured.

Invariants: the module is built and loaded at most once per process (`_MODULE`), after a
failed build nothing of it is installed, and a build is never reused by another torch version
(`name`)."""

from __future__ import annotations

import os
import re
import threading
from typing import Any, Callable, List, Optional

_MODULE: List[Any] = []
_LOCK = threading.Lock()
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "torch_allocator.cpp")
# install()'s default for `extension` when it is not named.
ENV = "VRAM_LEDGER_TORCH_EXTENSION"


def wanted(extension: Optional[bool]) -> bool:
    if extension is not None:
        return bool(extension)
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{ENV} must be 1 or 0 (true/false, yes/no, on/off), not {os.environ[ENV]!r}")


def module() -> Any:
    """The built extension (built on first use)."""
    with _LOCK:
        if not _MODULE:
            import torch
            from torch.utils.cpp_extension import load

            _MODULE.append(load(name=name(torch.__version__), sources=[SOURCE], with_cuda=True, extra_cflags=["-O2"], verbose=False))
        return _MODULE[0]


def name(torch_version: str) -> str:
    """The build's name, which names torch's cache folder for it: torch's version in it, since
    torch reuses a cached build whose source and flags are unchanged, and a build against
    another torch's headers would not match the running one's classes."""
    return "vram_ledger_extension_" + re.sub(r"[^0-9A-Za-z]", "_", torch_version)


def loaded() -> Optional[Any]:
    """The extension if install() loaded it, else None (nothing is built)."""
    return _MODULE[0] if _MODULE else None


def install(lib: Any, address: Callable[[Any], Optional[int]], record: Callable[..., None], raw_snapshot: Callable[..., Any]) -> None:
    """Make the extension's allocator PyTorch's current one, with the library's hooks."""
    from . import _checkpoint

    m = module()
    m.install(
        address(lib.vram_ledger_malloc_or_throw),
        address(lib.vram_ledger_free),
        address(lib.vram_ledger_init),
        address(lib.vram_ledger_reset),
        address(lib.vram_ledger_memory_fraction),
        address(lib.vram_ledger_record_stream),
        record,
        raw_snapshot,
        _checkpoint.checkpoint,
        _checkpoint.restore,
    )
