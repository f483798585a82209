"""tests/python/upstream_tests.py, the runner of PyTorch's own tests under install(), on a test
file of its own here (no PyTorch): it reads pytest's results, and a mode that loses a test
PyTorch's allocator passes fails it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

RUNNER = Path(__file__).resolve().parents[2] / "tests" / "python"
if not (RUNNER / "upstream_tests.py").exists():
    # These tests are copied beside an installed wheel to test the package; the runner is the
    # repository's, not the package's.
    pytest.skip("tests/python/upstream_tests.py is not here (outside the repository)", allow_module_level=True)
sys.path.insert(0, str(RUNNER))

import upstream_tests  # noqa: E402

TESTS = """
import unittest

class TestThings(unittest.TestCase):
    def test_passes(self):
        pass

    def test_fails(self):
        self.fail("as it should")

    @unittest.skip("not here")
    def test_skipped(self):
        pass
"""


def test_a_run_is_read_from_pytests_results(tmp_path):
    f = tmp_path / "test_things.py"
    f.write_text(TESTS)
    env = {**os.environ, "UPSTREAM_RESULTS": str(tmp_path / "results")}
    r = subprocess.run([sys.executable, str(RUNNER / "upstream_tests.py"), str(f), "torch"],
                       env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    first = json.loads(r.stdout.splitlines()[0])
    assert first == {"config": "torch", "ok": True, "counts": {"passed": 1, "failed": 1, "skipped": 1}}, first
    saved = json.loads((tmp_path / "results" / "torch.json").read_text())
    # The class's name as pytest writes it depends on where pytest finds its root folder.
    by_name = {k.split(".")[-1]: v for k, v in saved["outcomes"].items()}
    assert by_name == {"TestThings::test_passes": "passed", "TestThings::test_fails": "failed",
                       "TestThings::test_skipped": "skipped"}, saved["outcomes"]
    # Why each failed, kept with the run: a machine's logs may not come back.
    why = {k.split(".")[-1]: v for k, v in saved["failures"].items()}
    assert list(why) == ["TestThings::test_fails"] and "as it should" in why["TestThings::test_fails"], why


def outcome(**tests):
    # pytest's exit code when it ran the whole file and some tests failed.
    return {"outcomes": {f"m.T::{k}": v for k, v in tests.items()}, "returncode": 1}


def test_a_mode_that_loses_a_passing_test_misses():
    torch = outcome(a="passed", b="passed", c="failed", d="skipped")
    same = dict(outcome(a="passed", b="passed", c="failed", d="skipped"), config="remap")
    r = upstream_tests.compare(torch, same)
    assert r["ok"] and r["lost"] == [], r
    worse = dict(outcome(a="passed", b="failed", c="passed", d="skipped"), config="native",
                 failures={"m.T::b": "AssertionError: 2 != 1"})
    r = upstream_tests.compare(torch, worse)
    assert not r["ok"] and r["lost"] == ["T::b"] and r["missed"] == ["passes_what_torch_passes"], r
    assert r["lost_unexpected_why"] == {"T::b": "AssertionError: 2 != 1"}, r
    missing = dict(outcome(a="passed"), config="compact")
    assert upstream_tests.compare(torch, missing)["lost"] == ["T::b"], "a test that did not run is lost"
    none = dict(outcome(), config="expandable")
    assert upstream_tests.compare(torch, none)["missed"] == ["passes_what_torch_passes", "results_read"]


def test_a_listed_layout_test_is_reported_not_counted(monkeypatch):
    monkeypatch.setitem(upstream_tests.EXPECTED, "b", "asserts PyTorch's segment count")
    torch = outcome(a="passed", b="passed")
    r = upstream_tests.compare(torch, dict(outcome(a="passed", b="failed"), config="remap"))
    assert r["ok"] and r["lost"] == ["T::b"] and r["lost_unexpected"] == [], r


def test_tests_that_need_the_extension_count_only_with_it(monkeypatch):
    monkeypatch.setitem(upstream_tests.NEEDS_EXTENSION, "b", "C++ calls the allocator")
    torch = outcome(a="passed", b="passed")
    lost_b = outcome(a="passed", b="failed")
    without = upstream_tests.compare(torch, dict(lost_b, config="remap", extension=""))
    assert without["ok"] and without["lost"] == ["T::b"], without
    with_it = upstream_tests.compare(torch, dict(lost_b, config="remap", extension="1"))
    assert not with_it["ok"] and with_it["lost_unexpected"] == ["T::b"], with_it


def test_runs_from_other_folders_compare_by_class_and_test():
    # A run kept from an earlier time named its tests with the folder pytest saw then.
    torch = {"outcomes": {"upstream.test_cuda.T::a": "passed"}, "returncode": 0}
    mode = {"outcomes": {"test_cuda.T::a": "passed"}, "config": "native", "returncode": 0}
    r = upstream_tests.compare(torch, mode)
    assert r["ok"] and r["lost"] == [], r


def test_a_file_that_fails_to_import_is_no_reading():
    # pytest records a collection error as one failed entry and nothing passed, in every
    # configuration alike: that must miss, not compare equal.
    broken = {"outcomes": {"upstream.test_cuda::test_cuda": "failed"}}
    r = upstream_tests.compare(broken, dict(broken, config="expandable"))
    assert not r["ok"] and "results_read" in r["missed"], r
    torch = outcome(a="passed")
    r = upstream_tests.compare(torch, dict(broken, config="remap"))
    assert not r["ok"] and "results_read" in r["missed"], r


def test_saved_runs_are_compared_without_running_anything(tmp_path, monkeypatch, capsys):
    # The configurations run at once, one process each; --saved compares what they kept.
    monkeypatch.setenv("UPSTREAM_RESULTS", str(tmp_path))
    for config, outcomes in [("torch", {"T::a": "passed", "T::b": "passed"}), ("remap", {"T::a": "passed", "T::b": "passed"}),
                             ("native", {"T::a": "passed", "T::b": "failed"})]:
        (tmp_path / f"{config}.json").write_text(json.dumps({"config": config, "outcomes": outcomes, "extension": "1",
                                                             "returncode": 1}))
    assert upstream_tests.main(["--saved", "torch", "remap"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line.get("mode") for line in lines] == [None, "remap", None] and lines[1]["extension"] == "1", lines
    assert upstream_tests.main(["--saved", "torch", "native"]) == 1, "native lost T::b"
    assert upstream_tests.main(["--saved", "torch", "compact"]) == 1, "a configuration that kept no run is no reading"
    assert "no saved run of compact" in capsys.readouterr().err


def test_a_run_pytest_did_not_finish_misses():
    # Interrupted (2), an internal error (3), nothing collected (5): the outcomes are partial.
    torch = outcome(a="passed")
    for code in (2, 3, 5, None):
        r = upstream_tests.compare(torch, dict(outcome(a="passed"), config="remap", returncode=code))
        assert not r["ok"] and r["missed"] == ["pytest_finished"], (code, r)
    r = upstream_tests.compare(dict(torch, returncode=2), dict(outcome(a="passed"), config="remap"))
    assert r["missed"] == ["pytest_finished"], r


def test_a_report_left_by_an_earlier_run_is_not_read_as_this_ones(tmp_path):
    results = tmp_path / "results"
    env = {**os.environ, "UPSTREAM_RESULTS": str(results)}
    good = tmp_path / "test_things.py"
    good.write_text(TESTS)
    r = subprocess.run([sys.executable, str(RUNNER / "upstream_tests.py"), str(good), "torch"],
                       env=env, capture_output=True, text=True)
    assert r.returncode == 0 and (results / "torch.xml").exists(), r.stdout + r.stderr
    # The next run's file does not even parse: pytest writes no report of tests run.
    good.write_text("def broken(:\n")
    r = subprocess.run([sys.executable, str(RUNNER / "upstream_tests.py"), str(good), "torch"],
                       env=env, capture_output=True, text=True)
    saved = json.loads((results / "torch.json").read_text())
    assert "passed" not in saved["outcomes"].values(), saved["outcomes"]
    assert r.returncode == 1, r.stdout + r.stderr


STARVED = """
import os
import unittest

class TestMemory(unittest.TestCase):
    def test_large(self):
        # As PyTorch's largeTensorTest does when the device lacks free memory at that moment.
        if os.path.exists(os.environ["NEIGHBOUR"]):
            raise unittest.SkipTest("Insufficient cuda memory")

    def test_large_too(self):
        # Its name contains the starved test's: a retry must not run it.
        with open(os.environ["RAN"], "a") as f:
            f.write("ran ")

    @unittest.skip("not here")
    def test_skipped_otherwise(self):
        pass

    def test_out_of_memory_when_shared(self):
        # As a tensor that cannot be allocated while a neighbour holds the device's memory.
        if os.path.exists(os.environ["NEIGHBOUR"]):
            raise RuntimeError("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 16.00 MiB.")

    def test_out_of_memory_alone_too(self):
        # A mode's own out-of-memory: it fails alone as well, and must still count.
        raise RuntimeError("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 TiB.")

    def test_fails_otherwise(self):
        # Not a question of memory: a retry must not run it.
        with open(os.environ["RAN"], "a") as f:
            f.write("ran ")
        self.fail("wrong answer")

class TestOther(unittest.TestCase):
    def test_large(self):
        # Another class's test of the same name: a retry must not run it either.
        with open(os.environ["RAN"], "a") as f:
            f.write("ran ")
"""


def test_a_test_starved_of_memory_by_a_neighbour_is_run_again_alone(tmp_path):
    f = tmp_path / "test_memory.py"
    f.write_text(STARVED)
    neighbour = tmp_path / "neighbour"
    neighbour.write_text("holds the device's memory")
    ran = tmp_path / "ran"
    env = {**os.environ, "UPSTREAM_RESULTS": str(tmp_path / "results"), "NEIGHBOUR": str(neighbour), "RAN": str(ran)}
    runner = [sys.executable, str(RUNNER / "upstream_tests.py")]
    r = subprocess.run(runner + [str(f), "torch"], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert ran.read_text() == "ran ran ran ", "the whole file ran once"
    # The neighbour is gone once the shared runs are over.
    neighbour.unlink()
    r = subprocess.run(runner + ["--retry-starved", str(f), "torch"], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert ran.read_text() == "ran ran ran ", "the retry ran only the starved tests"
    saved = json.loads((tmp_path / "results" / "torch.json").read_text())
    by_name = {k.split(".")[-1]: v for k, v in saved["outcomes"].items()}
    assert by_name == {"TestMemory::test_large": "passed", "TestMemory::test_large_too": "passed",
                       "TestMemory::test_skipped_otherwise": "skipped", "TestOther::test_large": "passed",
                       "TestMemory::test_out_of_memory_when_shared": "passed",
                       "TestMemory::test_out_of_memory_alone_too": "failed",
                       "TestMemory::test_fails_otherwise": "failed"}, by_name
    retried = {k.split(".")[-1]: v for k, v in saved["retried"].items()}
    assert retried == {"TestMemory::test_large": {"shared": "skipped", "alone": "passed"},
                       "TestMemory::test_out_of_memory_when_shared": {"shared": "failed", "alone": "passed"},
                       "TestMemory::test_out_of_memory_alone_too": {"shared": "failed", "alone": "failed"}}, retried
    why = {k.split(".")[-1]: v for k, v in saved["failures"].items()}
    assert "1.00 TiB" in why["TestMemory::test_out_of_memory_alone_too"], why
    assert "TestMemory::test_out_of_memory_when_shared" not in why, why
    r = subprocess.run(runner + ["--saved", "torch"], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    # A second retry runs nothing again: with the neighbour back, a run would skip.
    neighbour.write_text("holds the device's memory again")
    r = subprocess.run(runner + ["--retry-starved", str(f), "torch"], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout.splitlines()[0])["retried"] == saved["retried"], r.stdout
    again = json.loads((tmp_path / "results" / "torch.json").read_text())
    assert {k.split(".")[-1]: v for k, v in again["outcomes"].items()}["TestMemory::test_large"] == "passed"


def test_a_retry_without_a_kept_run_is_refused(tmp_path):
    env = {**os.environ, "UPSTREAM_RESULTS": str(tmp_path)}
    (tmp_path / "torch.json").write_text(json.dumps({"config": "torch", "outcomes": {}, "returncode": 0}))
    (tmp_path / "torch.xml").write_text("<testsuites><testsuite/></testsuites>")
    r = subprocess.run([sys.executable, str(RUNNER / "upstream_tests.py"), "--retry-starved", "x.py", "remap",
                        "torch"], env=env, capture_output=True, text=True)
    assert r.returncode == 1 and "no kept run of remap" in r.stderr, r.stdout + r.stderr
    # The configuration after the missing one is still retried.
    assert json.loads(r.stdout.splitlines()[0]) == {"config": "torch", "retried": {}}, r.stdout
    r = subprocess.run([sys.executable, str(RUNNER / "upstream_tests.py"), "--retry-starved", "x.py", "bogus"],
                       env=env, capture_output=True, text=True)
    assert r.returncode == 2, r.stdout + r.stderr
