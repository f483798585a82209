"""The pure-Python parts, against the real library, on a machine without a GPU."""

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import vram_ledger as vl


def test_library_is_found_in_the_repository():
    path = Path(vl.library_path())
    assert path.name == "libvram_ledger.so" and path.is_file()


def test_env_var_naming_a_missing_file_is_a_clear_error(tmp_path):
    missing = tmp_path / "nope.so"
    code = f"import vram_ledger as vl\ntry:\n    vl.library_path()\nexcept vl.VramLedgerError as e:\n    print(e)\n"
    out = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "VRAM_LEDGER_LIB": str(missing)}, capture_output=True, text=True
    )
    assert f"VRAM_LEDGER_LIB={missing} does not name a file" in out.stdout


def test_env_var_wins(tmp_path):
    real = vl.library_path()
    link = tmp_path / "libcopy.so"
    link.write_bytes(Path(real).read_bytes())
    out = subprocess.run(
        [sys.executable, "-c", "import vram_ledger as vl; print(vl.library_path())"],
        env={**os.environ, "VRAM_LEDGER_LIB": str(link)},
        capture_output=True,
        text=True,
    )
    assert out.stdout.strip() == str(link)


def test_tags_nest_per_thread():
    assert vl.current_tag() == "untracked"
    with vl.tag("weights"):
        assert vl.current_tag() == "weights"
        with vl.tag("kv"):
            assert vl.current_tag() == "kv_cache"
        seen = []
        t = threading.Thread(target=lambda: seen.append(vl.current_tag()))
        t.start()
        t.join()
        assert seen == ["untracked"], "another thread is not tagged"
        assert vl.current_tag() == "weights"
    assert vl.current_tag() == "untracked"


def test_unknown_tag_raises_the_library_message():
    with pytest.raises(vl.VramLedgerError, match="unknown tag \"weight\""):
        with vl.tag("weight"):
            pass
    assert vl.current_tag() == "untracked", "a failed push changes nothing"
    with pytest.raises(TypeError):
        with vl.tag(3):
            pass


@pytest.mark.skipif(vl._lib().vram_ledger_device_count() > 0, reason="a GPU is present: device 0 exists")
def test_device_errors_become_exceptions():
    with pytest.raises(vl.VramLedgerError, match="no device with ordinal 0|no CUDA"):
        vl.stats(0)
    with pytest.raises(vl.VramLedgerError, match="not a device ordinal"):
        vl.memory_stats(-1)
    with pytest.raises(TypeError):
        vl.stats("0")
    with pytest.raises(vl.VramLedgerError):
        vl.empty_cache(7)


def test_profile_checks_its_arguments_before_calling_the_library():
    for bad in (0, 1.5, -0.1, True, "0.9", float("nan")):
        with pytest.raises(ValueError):
            with vl.profile(bad):
                pass
    with pytest.raises(ValueError):
        with vl.profile(0.5, margin_bytes=-1):
            pass


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError):
        vl.install(mode="fast")


def test_the_c_abi_survives_abuse():
    lib = vl._lib()
    assert lib.vram_ledger_pop_tag() == -1
    assert "without a matching push_tag" in vl._last_error()
    assert lib.vram_ledger_set_tag(None) == -1
    assert "NULL" in vl._last_error()
    assert lib.vram_ledger_configure(b"warp") == -1
    assert "unknown mode" in vl._last_error()
    assert not lib.vram_ledger_malloc(-5, 0, None)
    assert "negative size" in vl._last_error()
    assert not lib.vram_ledger_profile_end(0)
    lib.vram_ledger_free(None, 0, 0, None)  # no allocation: an error, not a crash
    lib.vram_ledger_string_free(None)
