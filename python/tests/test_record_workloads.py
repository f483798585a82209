"""scripts/record_workloads.py's step count from the environment: the recorded count by default,
`WORKLOAD_STEPS` when set, a clear error for a count below one."""

import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
if not (SCRIPTS / "record_workloads.py").exists():
    pytest.skip("scripts/record_workloads.py is not here (outside the repository)", allow_module_level=True)
sys.path.insert(0, str(SCRIPTS))

import record_workloads  # noqa: E402


def test_the_recorded_count_unless_the_environment_names_another(monkeypatch):
    monkeypatch.delenv("WORKLOAD_STEPS", raising=False)
    assert record_workloads.training_steps(6) == 6
    monkeypatch.setenv("WORKLOAD_STEPS", "")
    assert record_workloads.training_steps(8) == 8
    monkeypatch.setenv("WORKLOAD_STEPS", "20")
    assert record_workloads.training_steps(6) == 20


@pytest.mark.parametrize("bad", ["0", "-3"])
def test_a_count_below_one_is_refused(monkeypatch, bad):
    monkeypatch.setenv("WORKLOAD_STEPS", bad)
    with pytest.raises(ValueError, match="at least 1"):
        record_workloads.training_steps(6)
