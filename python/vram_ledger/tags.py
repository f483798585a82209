"""Tagging a thread's allocations."""

from __future__ import annotations

import contextlib
from typing import Iterator

from . import _args
from ._lib import _check, _clean_up_after, load


@contextlib.contextmanager
def tag(name: str) -> Iterator[None]:
    """Tag this thread's allocations inside the block: weights, activation, kv_cache (or kv),
    untracked. Nests."""
    name = _args.tag_name(name)
    lib = load()
    _check(lib.vram_ledger_push_tag(name.encode()))
    try:
        yield
    except BaseException as body_error:
        _clean_up_after(body_error, "restoring the previous tag", lambda: _check(lib.vram_ledger_pop_tag()))
        raise
    _check(lib.vram_ledger_pop_tag())


def current_tag() -> str:
    """This thread's tag."""
    return load().vram_ledger_current_tag().decode()
