"""Remap's piece size and moves across streams, from Python and C to the allocator: install()'s
checks, and on simulated devices the driver calls each setting makes (a setting that did not
reach the allocator would leave them as the defaults make them). And `cases.options`, which
names them in the GPU scripts' configurations."""

import sys
from pathlib import Path

import pytest

import vram_ledger as vl
from test_pure import run_on_sim

MIB = 1 << 20

CALLS = r"""
import re
def calls():
    text = vl.metrics()
    return {k: int(v) for k, v in re.findall(r'driver_calls_total\{device="0",call="(\w+)"\} (\d+)', text)}
"""


@pytest.mark.parametrize(
    "piece, pieces",
    [
        (0, 1),  # the default, 68 MiB: one piece holds 40 MiB
        (2 * MIB, 20),
        (3 * MIB, 10),  # rounded up to whole 2 MiB granules: 4 MiB
        (2**64 - 1, 1),  # larger than any device: whole granules, no overflow
    ],
)
def test_remap_piece_reaches_the_allocator(piece, pieces):
    r = run_on_sim(
        CALLS
        + f"""
assert lib.vram_ledger_configure(b"remap") == 0
assert lib.vram_ledger_remap_piece({piece}) == 0
x = lib.vram_ledger_malloc(40 << 20, 0, None)
print(json.dumps({{"ok": bool(x), "calls": calls(), "reserved": vl.stats(0)["reserved_bytes"]["current"]}}))
"""
    )
    assert r["ok"] and r["reserved"] == 40 * MIB, r
    assert r["calls"]["create_physical"] == pieces and r["calls"]["map"] == pieces, r


@pytest.mark.parametrize("across", [0, 1])
def test_move_across_streams_reaches_the_allocator(across):
    """40 MiB freed on one stream, then 40 MiB asked for on another: without the setting the
    second stream grows; with it, it takes the first stream's piece after a device-wide wait."""
    r = run_on_sim(
        CALLS
        + f"""
assert lib.vram_ledger_configure(b"remap") == 0
assert lib.vram_ledger_move_across_streams({across}) == 0
a, b = 0x1000, 0x2000
x = lib.vram_ledger_malloc(40 << 20, 0, a)
lib.vram_ledger_free(x, 40 << 20, 0, a)
y = lib.vram_ledger_malloc(40 << 20, 0, b)
print(json.dumps({{"ok": bool(x and y), "calls": calls(), "reserved": vl.stats(0)["reserved_bytes"]["current"]}}))
"""
    )
    assert r["ok"], r
    if across:
        assert r["reserved"] == 40 * MIB and r["calls"]["create_physical"] == 1, r
        assert r["calls"].get("sync_device", 0) >= 1, r
    else:
        assert r["reserved"] == 80 * MIB and r["calls"]["create_physical"] == 2, r
        assert r["calls"].get("sync_device", 0) == 0, r


@pytest.mark.parametrize(
    "kw, error, match",
    [
        (dict(mode="expandable", remap_piece=2 * MIB), ValueError, "remap mode only"),
        (dict(mode="remap", remap_piece=0), ValueError, "at least 1"),
        (dict(mode="remap", remap_piece=2**64), OverflowError, "uint64_t"),
        (dict(mode="remap", remap_piece="2M"), TypeError, "int or None"),
        (dict(mode="remap", remap_piece=True), TypeError, "int or None"),
        (dict(mode="remap", move_across_streams=1), TypeError, "True or False"),
        (dict(mode="native", move_across_streams=True), ValueError, "compact and remap"),
        (dict(mode="expandable", move_across_streams=True), ValueError, "compact and remap"),
    ],
)
def test_install_checks_the_growth_options_first(kw, error, match):
    """Refused before anything is configured or torch imported: these need no GPU."""
    with pytest.raises(error, match=match):
        vl.install(**kw)


RUNNER = Path(__file__).resolve().parents[2] / "tests" / "python"


@pytest.mark.skipif(not (RUNNER / "cases.py").exists(), reason="tests/python is not here (outside the repository)")
def test_configuration_names_give_install_options():
    sys.path.insert(0, str(RUNNER))
    try:
        import cases
    finally:
        sys.path.remove(str(RUNNER))
    assert cases.options("torch") == ("torch", {})
    assert cases.options("remap+later") == ("remap", {"unmap_later": True})
    assert cases.options("remap+across@2M") == ("remap", {"move_across_streams": True, "remap_piece": 2 * MIB})
    assert cases.options("remap@512K+later") == ("remap", {"remap_piece": 512 << 10, "unmap_later": True})
    assert cases.options("remap@3145728") == ("remap", {"remap_piece": 3 * MIB})
    assert cases.mode_of("compact+across") == "compact" and cases.mode_of("remap@1G") == "remap"
    for bad in ("remap+soon", "remap@", "remap@2T", "remap@-1", "remap@2MB", "remap@0", "remap@\u0663M"):
        with pytest.raises(ValueError, match="unknown option"):
            cases.options(bad)
    for bad in ("remap@2M@4M", "remap+later+later"):
        with pytest.raises(ValueError, match="given twice"):
            cases.options(bad)
    for bad in ("torch@2M", "torch+across", "", "+later", "@2M"):
        with pytest.raises(ValueError, match="a mode first"):
            cases.options(bad)
