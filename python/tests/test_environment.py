"""What the environment chooses, read once per process (so each case runs in a child): a
backend the variables do not name, or a library file that is none, is an error that says so,
never a silent fall-back to the CUDA driver or a bare OSError."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import vram_ledger as vl


def child(code: str, **env) -> subprocess.CompletedProcess:
    package = str(Path(vl.__file__).resolve().parent.parent)
    full = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package, os.environ.get("PYTHONPATH")])),
            "VRAM_LEDGER_LIB": vl.library_path()}
    for k in ("VRAM_LEDGER_DRIVER", "VRAM_LEDGER_SIM_DEVICES", "VRAM_LEDGER_LOG"):
        full.pop(k, None)
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True)


STATS = """
import vram_ledger as vl
try:
    vl.stats()
    print("ok")
except vl.VramLedgerError as e:
    print("error:", e)
"""


@pytest.mark.parametrize("driver, sim_devices, says", [
    ("SIM", None, 'VRAM_LEDGER_DRIVER="SIM" names no backend'),
    ("bogus", None, 'VRAM_LEDGER_DRIVER="bogus" names no backend'),
    ("sim", "abc", 'VRAM_LEDGER_SIM_DEVICES="abc" is not a count of devices'),
    ("sim", "-1", 'VRAM_LEDGER_SIM_DEVICES="-1" is not a count of devices'),
])
def test_a_backend_the_environment_does_not_name_is_refused(driver, sim_devices, says):
    env = {"VRAM_LEDGER_DRIVER": driver, **({"VRAM_LEDGER_SIM_DEVICES": sim_devices} if sim_devices else {})}
    out = child(STATS, **env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("error:") and says in out.stdout, out.stdout


@pytest.mark.parametrize("sim_devices", [None, "1", " 2 "])
def test_the_simulated_backend_runs_with_a_count_or_none(sim_devices):
    env = {"VRAM_LEDGER_DRIVER": "sim", **({"VRAM_LEDGER_SIM_DEVICES": sim_devices} if sim_devices else {})}
    out = child(STATS, **env)
    assert out.stdout.strip() == "ok", out.stdout + out.stderr


@pytest.mark.parametrize("not_a_library", ["/etc/hostname", "__file__"])
def test_a_file_that_is_no_library_raises_the_packages_error(not_a_library, tmp_path):
    path = str(Path(vl.__file__)) if not_a_library == "__file__" else not_a_library
    if not os.path.exists(path):
        pytest.skip(f"{path} is not on this machine")
    out = child(STATS, VRAM_LEDGER_DRIVER="sim", VRAM_LEDGER_LIB=path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"error: cannot load {path}:"), out.stdout


# The library straight through ctypes, in a child: the C entry points as a C caller sees them.
LIB = """
import ctypes, vram_ledger as vl
lib = ctypes.CDLL(vl.library_path())
lib.vram_ledger_last_error.restype = ctypes.c_char_p
"""

COUNT = LIB + """
print(lib.vram_ledger_device_count(), lib.vram_ledger_last_error().decode())
"""


@pytest.mark.parametrize("driver, sim_devices, says", [
    ("bogus", None, 'VRAM_LEDGER_DRIVER="bogus" names no backend'),
    ("sim", "abc", 'VRAM_LEDGER_SIM_DEVICES="abc" is not a count of devices'),
])
def test_a_device_count_of_0_from_a_backend_it_cannot_use_says_why(driver, sim_devices, says):
    env = {"VRAM_LEDGER_DRIVER": driver, **({"VRAM_LEDGER_SIM_DEVICES": sim_devices} if sim_devices else {})}
    out = child(COUNT, **env)
    count, _, why = out.stdout.strip().partition(" ")
    assert count == "0" and says in why, out.stdout + out.stderr


def test_a_device_count_from_a_backend_that_works_leaves_no_error():
    out = child(COUNT, VRAM_LEDGER_DRIVER="sim", VRAM_LEDGER_SIM_DEVICES="3")
    assert out.stdout.strip() == "3", out.stdout + out.stderr


NULL_THEN_CONFIGURE = LIB + """
lib.vram_ledger_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
lib.vram_ledger_record_stream.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
lib.vram_ledger_configure.argtypes = [ctypes.c_char_p]
lib.vram_ledger_free(None, 0, 0, None)
lib.vram_ledger_free(None, 0, 99, None)
lib.vram_ledger_record_stream(None, None)
print(lib.vram_ledger_configure(b"remap"), lib.vram_ledger_last_error().decode())
"""


def test_freeing_null_puts_no_device_in_use_and_logs_nothing():
    # NULL is ignored, whatever device it names: the configuration is still open after it, and
    # nothing reaches stderr (a failure of a void entry point is logged there).
    out = child(NULL_THEN_CONFIGURE, VRAM_LEDGER_DRIVER="sim")
    assert out.stdout.strip() == "0", out.stdout + out.stderr
    assert out.stderr == "", out.stderr


HISTORY_OFF = LIB + """
lib.vram_ledger_record_history.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64]
print(lib.vram_ledger_record_history(0, 1, 0), lib.vram_ledger_record_history(0, 1, 10),
      lib.vram_ledger_record_history(0, 0, 0))
"""


def test_stopping_the_history_reads_no_max_entries():
    out = child(HISTORY_OFF, VRAM_LEDGER_DRIVER="sim")
    assert out.stdout.split() == ["-1", "0", "0"], out.stdout + out.stderr
