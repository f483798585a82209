"""tests/python/tenants.py: the co-tenant a GPU script serves beside lives exactly as long as
its `with` block, here with stand-in commands (no GPU)."""

import subprocess
import sys
from pathlib import Path

import pytest

RUNNER = Path(__file__).resolve().parents[2] / "tests" / "python"
if not (RUNNER / "tenants.py").exists():
    pytest.skip("tests/python/tenants.py is not here (outside the repository)", allow_module_level=True)
sys.path.insert(0, str(RUNNER))

import tenants  # noqa: E402

READY_THEN_WAIT = [sys.executable, "-c", "import time; print('READY', flush=True); time.sleep(60)"]


def test_the_tenant_runs_inside_the_block_and_is_gone_after_it():
    with tenants.beside("hold", READY_THEN_WAIT) as p:
        assert p.poll() is None
    assert p.returncode is not None


def test_an_error_in_the_block_still_ends_the_tenant():
    with pytest.raises(KeyError):
        with tenants.beside("churn", READY_THEN_WAIT) as p:
            raise KeyError("the case failed")
    assert p.returncode is not None


def test_a_tenant_that_never_says_ready_is_an_error_not_a_hang():
    cmd = [sys.executable, "-c", "import sys; print('no GPU', flush=True); sys.exit(3)"]
    with pytest.raises(RuntimeError, match="did not start.*no GPU"):
        with tenants.beside("hold", cmd):
            pytest.fail("the block must not run")


def test_unknown_kinds_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match="no tenant 'sit'"):
        with tenants.beside("sit", READY_THEN_WAIT):
            pass
    r = subprocess.run([sys.executable, str(RUNNER / "tenants.py"), "sit"], capture_output=True, text=True)
    assert r.returncode != 0 and "usage" in r.stderr
