"""configure(): the library set up as install() would, without PyTorch (simulated devices in a
child process, since the configuration is fixed once a device is used)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import vram_ledger as vl


def on_sim(code: str) -> dict:
    package = str(Path(vl.__file__).resolve().parent.parent)
    env = {**os.environ, "VRAM_LEDGER_DRIVER": "sim", "VRAM_LEDGER_LIB": vl.library_path(),
           "PYTHONPATH": os.pathsep.join(filter(None, [package, os.environ.get("PYTHONPATH")]))}
    env.pop("VRAM_LEDGER_SIM_DEVICES", None)
    out = subprocess.run([sys.executable, "-c", "import json\nimport vram_ledger as vl\n" + textwrap.dedent(code)],
                         env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_configured_to_sleep_a_tag_sleeps_and_wakes_without_pytorch():
    r = on_sim("""
        vl.configure(mode="remap", sleep=True)
        lib = vl._lib.load()
        with vl.tag("activation"):
            ptr = lib.vram_ledger_malloc(64 << 20, 0, 0)
        vl.sleep(discard="activation")
        asleep = vl.stats()["sleeping_bytes"]
        vl.wake()
        awake = vl.stats()["sleeping_bytes"]
        lib.vram_ledger_free(ptr, 64 << 20, 0, 0)
        print(json.dumps({"ptr": ptr, "asleep": asleep, "awake": awake}))
    """)
    assert r["ptr"]
    assert r["asleep"]["activation"] >= 64 << 20 and r["awake"]["activation"] == 0, r


def test_without_it_sleep_says_what_is_missing():
    r = on_sim("""
        lib = vl._lib.load()
        lib.vram_ledger_malloc(1 << 20, 0, 0)
        try:
            vl.sleep(discard="activation")
            print(json.dumps({"error": None}))
        except vl.VramLedgerError as e:
            print(json.dumps({"error": str(e)}))
    """)
    assert "virtual-memory mode" in r["error"], r


def test_after_a_device_is_used_it_is_refused_and_changes_nothing():
    r = on_sim("""
        lib = vl._lib.load()
        lib.vram_ledger_malloc(1 << 20, 0, 0)
        try:
            vl.configure(mode="remap", sleep=True)
            refused = None
        except vl.VramLedgerError as e:
            refused = str(e)
        try:
            vl.sleep(discard="activation")
            still = None
        except vl.VramLedgerError as e:
            still = str(e)
        print(json.dumps({"refused": refused, "still": still}))
    """)
    assert "in use already" in r["refused"], r
    assert "virtual-memory mode" in r["still"], r


@pytest.mark.parametrize("kwargs, error", [
    ({"mode": "native", "sleep": True}, ValueError),
    ({"mode": "compact", "unmap_later": True}, ValueError),
    ({"mode": "native", "remap_piece": 2 << 20}, ValueError),
    ({"remap_piece": 0}, ValueError),
    ({"unmap_later": 1}, TypeError),
    ({"mode": "sideways"}, ValueError),
])
def test_bad_settings_are_refused_before_any_is_applied(kwargs, error):
    with pytest.raises(error):
        vl.configure(**kwargs)
