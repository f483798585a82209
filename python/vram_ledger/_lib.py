"""Finding and loading the shared library, and binding it from its own description of its entry
points (vram_ledger_abi_json): the argument and result types, the tags and the modes all come
from the library, so this package keeps no copy that could drift from it."""

from __future__ import annotations

import atexit
import ctypes
import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Tuple

_LOG = logging.getLogger("vram_ledger")


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


# The C types of the library's table. A `char *` result is a string the caller frees, so it is
# kept as an address for vram_ledger_string_free; a `const char *` one stays the library's.
_CTYPES: Dict[str, Any] = {
    "void": None,
    "int": ctypes.c_int,
    "int64_t": ctypes.c_int64,
    "uint64_t": ctypes.c_uint64,
    "double": ctypes.c_double,
    "ssize_t": ctypes.c_ssize_t,
    "void *": ctypes.c_void_p,
    "char *": ctypes.c_void_p,
    "const char *": ctypes.c_char_p,
    "void (*)(int, const char *)": ctypes.c_void_p,
    "void (*)(int, int64_t, int64_t, int64_t)": ctypes.c_void_p,
    "uint64_t (*)(int)": ctypes.c_void_p,
    "void * (*)(size_t, int, void *)": ctypes.c_void_p,
    "void (*)(void *, size_t, int, void *)": ctypes.c_void_p,
    "uint8_t (*)(void)": ctypes.c_void_p,
    "void (*)(void *, int64_t, uint64_t, uint64_t, uint16_t)": ctypes.c_void_p,
}

# Every entry point this package calls, or hands to PyTorch by name or by address: a library
# lacking one is refused at load, not at the first call that needs it.
USED = (
    "vram_ledger_abi_json",
    "vram_ledger_set_log_callback",
    "vram_ledger_last_error",
    "vram_ledger_string_free",
    "vram_ledger_device_count",
    "vram_ledger_configure",
    "vram_ledger_push_tag",
    "vram_ledger_pop_tag",
    "vram_ledger_current_tag",
    "vram_ledger_stats_json",
    "vram_ledger_memory_stats_json",
    "vram_ledger_set_cap",
    "vram_ledger_cap",
    "vram_ledger_reset_peaks",
    "vram_ledger_empty_cache",
    "vram_ledger_record_history",
    "vram_ledger_dump_snapshot",
    "vram_ledger_metrics",
    "vram_ledger_graph_begin",
    "vram_ledger_graph_end",
    "vram_ledger_graph_release",
    "vram_ledger_pool_checkpoint",
    "vram_ledger_pool_restore",
    "vram_ledger_pool_hold",
    "vram_ledger_pool_begin",
    "vram_ledger_pool_end",
    "vram_ledger_profile_begin",
    "vram_ledger_profile_end",
    "vram_ledger_malloc",
    "vram_ledger_malloc_or_throw",
    "vram_ledger_free",
    "vram_ledger_init",
    "vram_ledger_reset",
    "vram_ledger_memory_fraction",
    "vram_ledger_record_stream",
    "vram_ledger_set_oom_observer",
    "vram_ledger_set_context_source",
    "vram_ledger_set_memory_reporter",
    "vram_ledger_set_history_metadata",
    "vram_ledger_reset_accumulated",
    "vram_ledger_separate_tags",
    "vram_ledger_unmap_later",
    "vram_ledger_remap_piece",
    "vram_ledger_move_across_streams",
    "vram_ledger_sleep",
    "vram_ledger_wake",
    "vram_ledger_set_retain_host",
    "vram_ledger_set_sleep_file",
    "vram_ledger_set_zero_discarded",
    "vram_ledger_kv_reserve",
    "vram_ledger_kv_commit",
    "vram_ledger_kv_resize",
    "vram_ledger_kv_info",
    "vram_ledger_kv_release",
)


@dataclass(frozen=True)
class Abi:
    """What the library says about itself."""

    tag_bits: Dict[str, int]
    """Every spelling accepted for a tag (names first, in the library's order, each followed by
    its aliases) -> the tag's bit in sleep and wake masks."""
    expected_tags: str
    """The tags for error messages: "weights, activation (or activations), ..."."""
    modes: Tuple[str, ...]
    virtual_modes: FrozenSet[str]
    """The modes that map memory into reserved ranges, which sleep needs."""

    @property
    def tags(self) -> Tuple[str, ...]:
        return tuple(self.tag_bits)


def _symbol(lib: Any, path: str, name: str) -> Any:
    try:
        return getattr(lib, name)
    except AttributeError:
        raise VramLedgerError(f"{path} does not export {name}: it is not a vram-ledger library of this package's version; rebuild it") from None


def _read_abi(lib: Any, path: str) -> Dict[str, Any]:
    """The library's description of itself, as parsed JSON."""
    describe = _symbol(lib, path, "vram_ledger_abi_json")
    free = _symbol(lib, path, "vram_ledger_string_free")
    last_error = _symbol(lib, path, "vram_ledger_last_error")
    # Bound by hand: these three read the table that binds everything else.
    describe.argtypes, describe.restype = [], ctypes.c_void_p
    free.argtypes, free.restype = [ctypes.c_void_p], None
    last_error.argtypes, last_error.restype = [], ctypes.c_char_p
    ptr = describe()
    if not ptr:
        raise VramLedgerError(f"{path}: vram_ledger_abi_json failed: {(last_error() or b'').decode('utf-8', 'replace')}")
    try:
        return json.loads(ctypes.string_at(ptr).decode())
    finally:
        free(ptr)


def _bind(lib: Any, path: str, described: Dict[str, Any]) -> Abi:
    """Give each entry point its ctypes signature from `described`, after checking that every
    function this package calls is there with types it knows."""
    try:
        functions = {f["name"]: (f["returns"], list(f["args"])) for f in described["functions"]}
        tags = [(t["name"], list(t["aliases"]), int(t["bit"])) for t in described["tags"]]
        modes = [(m["name"], bool(m["virtual"])) for m in described["modes"]]
    except (KeyError, TypeError, ValueError) as e:
        raise VramLedgerError(f"{path}: its description of itself lacks or garbles {e}") from None
    missing = [n for n in USED if n not in functions or not hasattr(lib, n)]
    if missing:
        raise VramLedgerError(f"{path} lacks {', '.join(missing)}, which this package calls: it was built from another version; rebuild it")
    untyped = []
    for name, (returns, args) in functions.items():
        unknown = [t for t in [returns, *args] if t not in _CTYPES]
        if unknown or not hasattr(lib, name):
            # A newer library's entry point this package does not call is left unbound.
            if name in USED:
                untyped.append(f"{name} ({', '.join(unknown)})")
            continue
        f = getattr(lib, name)
        f.restype = _CTYPES[returns]
        f.argtypes = [_CTYPES[t] for t in args]
    if untyped:
        raise VramLedgerError(f"{path}: no ctypes type for the C types of {'; '.join(untyped)}")
    return Abi(
        tag_bits={s: bit for name, aliases, bit in tags for s in [name, *aliases]},
        expected_tags=", ".join(name + (f" (or {', '.join(aliases)})" if aliases else "") for name, aliases, _ in tags),
        modes=tuple(name for name, _ in modes),
        virtual_modes=frozenset(name for name, virtual in modes if virtual),
    )


_LIB: Optional[ctypes.CDLL] = None
_ABI: Optional[Abi] = None
_LOCK = threading.Lock()


def _loaded() -> Tuple[ctypes.CDLL, Abi]:
    global _LIB, _ABI
    with _LOCK:
        if _LIB is None or _ABI is None:
            path = library_path()
            try:
                lib = ctypes.CDLL(path)
            except OSError as e:
                # A file that is no shared library for this machine (or a broken build).
                raise VramLedgerError(f"cannot load {path}: {e}") from e
            described = _bind(lib, path, _read_abi(lib, path))
            if not os.environ.get("VRAM_LEDGER_LOG"):
                # Failures of calls that return nothing reach `logging` (logger "vram_ledger"); an
                # explicit VRAM_LEDGER_LOG keeps the library's own stderr output and filter.
                # Handed back before the interpreter shuts down, after which a callback into
                # Python could not run: frees during teardown log to stderr.
                lib.vram_ledger_set_log_callback(ctypes.cast(_FORWARD, ctypes.c_void_p))
                atexit.register(lib.vram_ledger_set_log_callback, None)
            _LIB, _ABI = lib, described
        return _LIB, _ABI


def load() -> ctypes.CDLL:
    """The library, loaded and bound at the first call."""
    return _loaded()[0]


def abi() -> Abi:
    """The library's tags and modes (loading it at the first call)."""
    return _loaded()[1]


@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p)
def _FORWARD(level: int, message: bytes) -> None:
    _LOG.log(level, "%s", message.decode("utf-8", "replace"))


def _last_error() -> str:
    return (load().vram_ledger_last_error() or b"").decode("utf-8", "replace")


def _check(rc: int) -> None:
    if rc != 0:
        raise VramLedgerError(_last_error())


def _string(ptr: Optional[int]) -> str:
    """A string the library returned (NULL: its error), freed once read."""
    if not ptr:
        raise VramLedgerError(_last_error())
    try:
        return ctypes.string_at(ptr).decode()
    finally:
        load().vram_ledger_string_free(ptr)


def _json(ptr: Optional[int]) -> Any:
    return json.loads(_string(ptr))


def _clean_up_after(body_error: BaseException, what: str, clean_up: Callable[[], None]) -> None:
    """Run a context manager's clean-up after its body raised. A failure here must not replace
    the body's exception (the one the user needs): it is logged and attached to it as a note."""
    try:
        clean_up()
    except Exception as e:
        note = f"vram_ledger: {what} also failed: {type(e).__name__}: {e}"
        _LOG.error(note)
        if hasattr(body_error, "add_note"):  # Python 3.11+
            body_error.add_note(note)
