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
package's folder (where the wheel and `pip install ./python` put it), and the repository's
target/release folder. A failure that raises is not logged as well; failures of calls that return
nothing (a failed free or record_stream) are logged through `logging` (logger "vram_ledger",
level WARNING). With VRAM_LEDGER_LOG set
(`debug`, `off`, any tracing filter) the library logs to stderr itself, at that level.

Every public function, with its errors, is described in docs/python.md in the repository.
"""

from __future__ import annotations

from . import _lib
from ._configure import configure
from ._lib import VramLedgerError, library_path
from ._torch import TaggedPool, install, mempool
from .kv import KvCache, kv_cache, kv_reserve
from .metrics import dump_snapshot, empty_cache, memory_stats, metrics, record_history, report, reset_peak_memory_stats, stats
from .profile import Profile, cap, profile, set_cap
from .sleep import set_retain_host, set_sleep_file, set_zero_discarded, sleep, wake
from .tags import current_tag, tag

__all__ = [
    "VramLedgerError",
    "library_path",
    "TAGS",
    "MODES",
    "install",
    "configure",
    "mempool",
    "TaggedPool",
    "tag",
    "current_tag",
    "stats",
    "memory_stats",
    "reset_peak_memory_stats",
    "empty_cache",
    "profile",
    "Profile",
    "report",
    "set_cap",
    "cap",
    "metrics",
    "record_history",
    "dump_snapshot",
    "sleep",
    "wake",
    "set_retain_host",
    "set_sleep_file",
    "set_zero_discarded",
    "kv_reserve",
    "kv_cache",
    "KvCache",
]


def __getattr__(name: str) -> tuple[str, ...]:
    # TAGS (every accepted tag spelling) and MODES are the library's, read when it is first
    # needed: importing the package loads nothing.
    if name == "TAGS":
        return _lib.abi().tags
    if name == "MODES":
        return _lib.abi().modes
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
