"""tests/python/h200_workloads.py's summary and marks, on results of its own here (no GPU): the
best mode's driver seconds within its warm steps against PyTorch's warm steps, a missing
reading, a tightened mark."""

import sys
from pathlib import Path

import pytest

RUNNER = Path(__file__).resolve().parents[2] / "tests" / "python"
if not (RUNNER / "h200_workloads.py").exists():
    pytest.skip("tests/python/h200_workloads.py is not here (outside the repository)", allow_module_level=True)
sys.path.insert(0, str(RUNNER))

import h200_workloads  # noqa: E402
import marks  # noqa: E402


def run(workload, config, seconds, driver_seconds=None, calls=0, warm_driver=None):
    """A case of 4 steps of `seconds / 4` each; under vram-ledger, `warm_driver` seconds of
    driver calls in its 2 warm steps (half each), the rest of `driver_seconds` in the first."""
    r = {"workload": workload, "config": config, "ok": True, "steps": 4, "seconds": seconds,
         "step_seconds": [seconds / 4] * 4, "peak_reserved": 110, "peak_allocated": 100, "ratio": 1.1}
    if config != "torch":
        r.update(driver_calls=calls, driver_seconds=driver_seconds)
        if warm_driver is not None:
            r["step_driver_seconds"] = [driver_seconds - warm_driver, 0.0, warm_driver / 2, warm_driver / 2]
    return r


@pytest.fixture(autouse=True)
def no_replay(monkeypatch):
    # Replay's column needs the binary; these tests check the marks only.
    monkeypatch.delenv("VRAM_LEDGER_BIN", raising=False)


def test_best_mode_under_one_percent_of_pytorchs_warm_steps_meets_its_mark():
    results = [run("serve-dyncache", "torch", 40.0), run("serve-dyncache", "compact+across", 41.0, 0.35, 600, 0.15),
               run("serve-dyncache", "remap", 40.5, 0.9, 200, 0.5), run("serve-dyncache", "torch", 44.0)]
    summary, m = h200_workloads.summarise(results)
    assert m.ok and list(m.met) == ["serve-dyncache_compact_warm_driver_within_1pct"], m.met
    row = summary["serve-dyncache"]["compact+across"]
    # 0.15 s within its warm steps against PyTorch's mean warm steps (21 s): 0.71%. The whole
    # run's 0.35 s against PyTorch's mean of 42 s is printed; remap's 2.4% is not marked.
    assert row["warm_driver_share"] == round(0.15 / 21.0, 5)
    assert row["driver_share"] == round(0.35 / 42.0, 5) and row["driver_calls"] == 600
    assert summary["serve-dyncache"]["remap"]["warm_driver_share"] == round(0.5 / 21.0, 5)
    assert row["wall_over_torch"] == round(41.0 / 42.0, 4) and row["replay_ratio"] is None


def test_best_mode_over_one_percent_misses():
    results = [run("moe-train", "torch", 10.0), run("moe-train", "remap+across", 10.3, 0.11, 0, 0.06)]
    _, m = h200_workloads.summarise(results)
    assert m.missed() == ["moe-train_remap_warm_driver_within_1pct"], m.met


def test_driver_seconds_in_the_first_steps_alone_do_not_miss():
    # 1 s of driver calls in the first steps (20% of PyTorch's mean wall time), none after.
    results = [run("moe-train", "torch", 10.0), run("moe-train", "remap+across", 11.0, 1.0, 0, 0.0)]
    summary, m = h200_workloads.summarise(results)
    assert m.ok and summary["moe-train"]["remap+across"]["driver_share"] == 0.1, m.met


def test_a_missing_driver_reading_or_no_pytorch_run_misses():
    _, m = h200_workloads.summarise([run("moe-train", "torch", 10.0), run("moe-train", "remap+across", 10.0, None)])
    assert m.missed() == ["moe-train_remap_warm_driver_within_1pct"], m.met
    _, m = h200_workloads.summarise([run("moe-train", "remap+across", 10.0, 0.001, 0, 0.0)])
    assert m.missed() == ["moe-train_remap_warm_driver_within_1pct"], m.met


def test_tightened_mark_misses(monkeypatch):
    monkeypatch.setattr(marks, "TIGHTEN", {"moe-train_remap_warm_driver_within_1pct"})
    results = [run("moe-train", "torch", 10.0), run("moe-train", "remap+across", 10.0, 0.001, 0, 0.001)]
    _, m = h200_workloads.summarise(results)
    assert m.missed() == ["moe-train_remap_warm_driver_within_1pct"], m.met


def test_a_case_process_that_fails_or_prints_no_result_is_reported(tmp_path):
    import cases

    script = tmp_path / "case.py"
    script.write_text(
        "import sys\n"
        "kind = sys.argv[2]\n"
        "if kind != 'silent':\n"
        "    print('RESULT {\"ok\": true, \"kind\": \"%s\"}' % kind)\n"
        "sys.exit(3 if kind == 'crash' else 0)\n"
    )
    assert cases.run(str(script), ["fine"], 60) == ([{"ok": True, "kind": "fine"}], None)
    results, failure = cases.run(str(script), ["crash"], 60)
    assert results == [{"ok": True, "kind": "crash"}] and failure["returncode"] == 3 and not failure["ok"]
    results, failure = cases.run(str(script), ["silent"], 60)
    assert results == [] and failure["returncode"] == 0 and not failure["ok"]


def test_the_share_spent_waiting_for_the_device_is_printed_beside_the_mark():
    r = run("moe-train", "remap+across", 10.0, 0.5, 0, 0.45)
    r.update(wait_seconds=0.45, waits=12)
    summary, m = h200_workloads.summarise([run("moe-train", "torch", 10.0), r])
    row = summary["moe-train"]["remap+across"]
    assert (row["driver_share"], row["wait_share"], row["waits"]) == (0.05, 0.045, 12)
    # The mark still counts every second in driver calls, waits included.
    assert m.missed() == ["moe-train_remap_warm_driver_within_1pct"], m.met


def test_a_best_mode_asked_for_that_gave_no_result_misses():
    results = [run("moe-train", "torch", 10.0)]
    asked = [("moe-train", "torch"), ("moe-train", "remap+across"), ("moe-train", "compact+across")]
    _, m = h200_workloads.summarise(results, asked)
    # Only the best mode has a mark: compact's failure shows in the exit code alone.
    assert m.missed() == ["moe-train_remap_warm_driver_within_1pct"], m.met


def test_step_times_give_warm_medians_and_first_steps_beside_pytorchs():
    def timed(config, steps):
        r = run("conv-train", config, sum(steps))
        r["step_seconds"] = steps
        return r

    results = [timed("torch", [2.0, 1.0, 0.50, 0.52, 0.48]), timed("torch", [2.2, 1.0, 0.60, 0.62, 0.58]),
               timed("remap+across", [2.5, 1.1, 0.55, 0.56, 0.90])]
    summary, _ = h200_workloads.summarise(results)
    row = summary["conv-train"]["remap+across"]
    assert row["warm_median_s"] == [0.56] and row["first_steps_s"] == [3.6]
    assert summary["conv-train"]["torch"]["warm_median_s"] == [0.5, 0.6]
    # Against PyTorch's mean warm median (0.55) and mean first steps (3.1).
    assert row["warm_over_torch"] == round(0.56 / 0.55, 4) and row["first_steps_extra_s"] == 0.5


def test_runs_too_short_to_have_warm_steps_give_no_step_figures():
    r = run("conv-train", "remap+across", 5.0, 0.01)
    r["step_seconds"] = [2.0, 3.0]
    summary, _ = h200_workloads.summarise([r])
    assert "warm_median_s" not in summary["conv-train"]["remap+across"]


def test_warm_steps_add_up_step_by_step_and_driver_seconds_within_them_are_a_share():
    def timed(config, steps, driver=None):
        r = run("moe-train", config, sum(steps), None if driver is None else sum(driver))
        r["step_seconds"] = steps
        if driver is not None:
            r["step_driver_seconds"] = driver
        return r

    # Steps of different lengths (one seed: the same lengths under both allocators).
    results = [timed("torch", [3.0, 1.0, 0.6, 0.2, 0.6]), timed("torch", [3.0, 1.0, 0.8, 0.2, 0.6]),
               timed("remap+across", [3.5, 1.0, 0.7, 0.3, 0.6], [0.4, 0.1, 0.02, 0.01, 0.0])]
    summary, _ = h200_workloads.summarise(results)
    row = summary["moe-train"]["remap+across"]
    # Warm sums: PyTorch's mean 1.5 s, this run's 1.6 s; 0.03 s of driver calls within them.
    assert row["warm_sum_over_torch"] == round(1.6 / 1.5, 4)
    assert row["warm_driver_share"] == round(0.03 / 1.5, 5)
    # A run whose steps differ in number from PyTorch's has no sum to set beside it.
    short = timed("remap+across", [3.5, 1.0, 0.7, 0.3], [0.4, 0.1, 0.02, 0.01])
    summary, _ = h200_workloads.summarise(results[:2] + [short])
    assert "warm_sum_over_torch" not in summary["moe-train"]["remap+across"]


def test_a_workload_the_readme_reports_over_the_goal_is_printed_not_marked():
    assert h200_workloads.OVER_GOAL == {"ckpt-train", "side-stream"}
    for workload in ("ckpt-train", "side-stream"):
        results = [run(workload, "torch", 10.0), run(workload, "remap+across", 10.0, 5.0, 0, 2.5)]
        summary, m = h200_workloads.summarise(results, [(workload, "torch"), (workload, "remap+across")])
        row = summary[workload]["remap+across"]
        assert row["over_goal"] and row["warm_driver_share"] == 0.5
        assert not any("warm_driver" in name for name in m.met), m.met
        assert h200_workloads.open_goals(summary) == {f"{workload}_remap_warm_driver_within_1pct": False}


def test_a_deterministic_workload_reserves_what_the_replay_predicts(monkeypatch):
    replayed = {"conv-train": 1.0070, "ckpt-train": 1.1012}
    monkeypatch.setattr(h200_workloads, "replay_ratio", lambda w, c: None if c == "pytorch" else replayed.get(w))

    def best(workload, ratio):
        r = run(workload, "remap+across", 10.0, 0.01, 0, 0.0)
        r["ratio"] = ratio
        return [run(workload, "torch", 10.0), r]

    # ckpt's GPU ratio 0.0003 under the replay's: met (its warm share is not marked: over_goal).
    _, m = h200_workloads.summarise(best("ckpt-train", 1.1009))
    assert m.ok and list(m.met) == ["ckpt-train_remap_ratio_as_replayed"], m.met
    # conv 0.0025 over it: missed, beside its warm-share mark, met.
    _, m = h200_workloads.summarise(best("conv-train", 1.0095))
    assert m.missed() == ["conv-train_remap_ratio_as_replayed"], m.met
    assert m.met["conv-train_remap_warm_driver_within_1pct"]
    # No replay to compare with: no reading, a miss.
    monkeypatch.setattr(h200_workloads, "replay_ratio", lambda w, c: None)
    _, m = h200_workloads.summarise(best("conv-train", 1.0070))
    assert m.missed() == ["conv-train_remap_ratio_as_replayed"], m.met


def test_each_steps_driver_seconds_come_from_readings_before_the_first_step_and_after_each():
    # Read before the first step (0.5 s of set-up), then after each of three steps.
    assert h200_workloads.step_differences([0.5, 0.75, 0.75, 1.0]) == [0.25, 0.0, 0.25]
    assert h200_workloads.step_differences([0.5]) == []


def test_a_gap_of_exactly_the_tolerance_meets_the_ratio_mark_either_way(monkeypatch):
    monkeypatch.setattr(h200_workloads, "replay_ratio", lambda w, c: None if c == "pytorch" else 1.007)
    for ratio in (1.008, 1.006):
        r = run("conv-train", "remap+across", 10.0, 0.01, 0, 0.0)
        r["ratio"] = ratio
        _, m = h200_workloads.summarise([run("conv-train", "torch", 10.0), r])
        assert m.met["conv-train_remap_ratio_as_replayed"], (ratio, m.met)


def test_tightened_marks_miss_even_at_zero(monkeypatch):
    monkeypatch.setattr(h200_workloads, "replay_ratio", lambda w, c: None if c == "pytorch" else 1.007)
    monkeypatch.setattr(marks, "TIGHTEN", {"conv-train_remap_ratio_as_replayed", "conv-train_remap_warm_driver_within_1pct"})
    r = run("conv-train", "remap+across", 10.0, 0.0, 0, 0.0)
    r["ratio"] = 1.007
    _, m = h200_workloads.summarise([run("conv-train", "torch", 10.0), r])
    assert m.missed() == ["conv-train_remap_ratio_as_replayed", "conv-train_remap_warm_driver_within_1pct"], m.met


def test_the_worst_run_decides_the_warm_share():
    # Two runs of the best mode: 0.02 s and 0.2 s of driver calls in warm steps of 5 s.
    results = [run("moe-train", "torch", 10.0), run("moe-train", "remap+across", 10.0, 0.1, 0, 0.02),
               run("moe-train", "remap+across", 10.0, 0.3, 0, 0.2)]
    summary, m = h200_workloads.summarise(results)
    assert summary["moe-train"]["remap+across"]["warm_driver_share"] == 0.04
    assert m.missed() == ["moe-train_remap_warm_driver_within_1pct"], m.met


def test_a_best_mode_that_gave_no_result_misses_the_marks_its_workload_has():
    # ckpt is over the goal (no warm-share mark) but reserves what the replay predicts.
    asked = [("ckpt-train", "torch"), ("ckpt-train", "remap+across")]
    _, m = h200_workloads.summarise([run("ckpt-train", "torch", 10.0)], asked)
    assert m.missed() == ["ckpt-train_remap_ratio_as_replayed"], m.met
