"""tests/python/bench_marks.py and marks.py: the cached path's marks against PyTorch's allocator,
on JSON lines of its own here (no GPU), and a tightened mark."""

import json
import sys
from pathlib import Path

import pytest

RUNNER = Path(__file__).resolve().parents[2] / "tests" / "python"
if not (RUNNER / "bench_marks.py").exists():
    pytest.skip("tests/python/bench_marks.py is not here (outside the repository)", allow_module_level=True)
sys.path.insert(0, str(RUNNER))

import bench_marks  # noqa: E402


def lines(ours, theirs):
    out = ["gpu_bench: a line that is not JSON"]
    for size, ns in ours.items():
        out.append(json.dumps({"what": "vram-ledger mixed 64", "ns_per_pair": ns} if size == "mixed"
                              else {"what": "vram-ledger cached pair", "size": size, "ns_per_pair": ns}))
    for size, ns in theirs.items():
        out.append(json.dumps({"what": "PyTorch native mixed 64", "ns_per_pair": ns} if size == "mixed"
                              else {"what": "PyTorch native raw_alloc+raw_delete", "size": size, "ns_per_pair": ns}))
    return out


FAST = {"512B": 50.0, "1MiB": 60.0, "20MiB": 50.0, "mixed": 70.0}
TORCH = {"512B": 400.0, "1MiB": 400.0, "20MiB": 350.0, "mixed": 550.0}


def test_faster_everywhere_meets_every_mark():
    m = bench_marks.check(*bench_marks.readings(lines(FAST, TORCH)))
    assert m.ok and len(m.met) == 4, m.met


def test_slower_at_one_size_misses_that_size():
    m = bench_marks.check(*bench_marks.readings(lines({**FAST, "20MiB": 351.0}, TORCH)))
    assert m.missed() == ["faster_than_torch_20MiB"], m.met


def test_a_size_one_side_did_not_report_misses():
    ours = {k: v for k, v in FAST.items() if k != "mixed"}
    m = bench_marks.check(*bench_marks.readings(lines(ours, TORCH)))
    assert m.missed() == ["faster_than_torch_mixed"], m.met
    m = bench_marks.check(*bench_marks.readings(lines(FAST, {})))
    assert len(m.missed()) == 4, m.met


def test_a_tightened_true_mark_misses(monkeypatch):
    import marks

    monkeypatch.setattr(marks, "TIGHTEN", {"graph_pools_held"})
    m = marks.Marks()
    m.true("graph_pools_held", True)
    m.true("near_eager", True)
    m.true("replays_identical", 1)  # a count is not True
    assert m.missed() == ["graph_pools_held", "replays_identical"] and not m.ok, m.met


def test_marks_of_checks_holds_each_check_to_true(monkeypatch):
    import marks

    monkeypatch.setattr(marks, "TIGHTEN", {"viewers_draw"})
    m = marks.Marks.of({"replay_reproduces_peak": True, "viewers_draw": True, "weights_tag_recorded": 0})
    assert m.missed() == ["viewers_draw", "weights_tag_recorded"] and not m.ok, m.met
