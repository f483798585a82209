"""tests/python/h200_torch.py's latency mark on readings of its own here (no GPU): installed
`torch.empty` + `del` against PyTorch's allocator, three processes each."""

import sys
from pathlib import Path

import pytest

RUNNER = Path(__file__).resolve().parents[2] / "tests" / "python"
if not (RUNNER / "h200_torch.py").exists():
    pytest.skip("tests/python/h200_torch.py is not here (outside the repository)", allow_module_level=True)
sys.path.insert(0, str(RUNNER))

import h200_torch  # noqa: E402

NATIVE = [2100.0, 2000.0, 2050.0]  # median 2,050 ns


def test_a_median_within_the_tolerance_is_met_and_one_past_it_misses():
    limit = 2050.0 * (1 + h200_torch.LATENCY_TOLERANCE)
    m, ours, native = h200_torch.latency_compared([limit - 1, 1000.0, 9000.0], NATIVE)
    assert (ours, native) == (limit - 1, 2050.0) and m.ok, m.met
    m, _, _ = h200_torch.latency_compared([limit + 1, 1000.0, 9000.0], NATIVE)
    assert m.missed() == ["installed_not_slower"], m.met


def test_one_slow_process_on_either_side_does_not_decide():
    # Ours 10% slower in the median: PyTorch's one slow process must not rescue it.
    m, _, _ = h200_torch.latency_compared([2255.0] * 3, [2000.0, 2050.0, 9000.0])
    assert not m.ok, m.met
    # Ours equal but for one slow process: met.
    m, _, _ = h200_torch.latency_compared([2000.0, 2050.0, 9000.0], NATIVE)
    assert m.ok, m.met


@pytest.mark.parametrize("ours, native", [([], NATIVE), ([2000.0] * 3, [])])
def test_a_side_without_readings_misses(ours, native):
    m, _, _ = h200_torch.latency_compared(ours, native)
    assert not m.ok, m.met


def test_tightened_mark_misses(monkeypatch):
    import marks

    monkeypatch.setattr(marks, "TIGHTEN", {"installed_not_slower"})
    m, _, _ = h200_torch.latency_compared([1000.0] * 3, NATIVE)
    assert m.missed() == ["installed_not_slower"], m.met
