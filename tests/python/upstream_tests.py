"""PyTorch's own tests (such as its test/test_cuda.py, carried to the GPU machine: PyTorch's
wheel does not ship them) run unchanged, once with PyTorch's allocator and once per segment
mode after `vram_ledger.install(mode)`, one pytest process per run. Every test that passes
with PyTorch's allocator must pass under install() in every mode, except the tests listed in
EXPECTED with their reason (they assert PyTorch's own segment layout). Prints one JSON object
per run and a summary; exits 1 when any mode fails a test PyTorch's allocator passes and that
is not listed, or when a run produced no results. Tests listed in ISOLATED (their outcome in
the whole file depends on the tests before them) run once more alone in every configuration,
and the outcome alone is the one compared.

    python3 tests/python/upstream_tests.py TEST_FILE [torch|native|expandable|compact|remap ...]
        [-- PYTEST_ARGS...]
    python3 tests/python/upstream_tests.py --saved [CONFIGS...]
    python3 tests/python/upstream_tests.py --retry-starved TEST_FILE [CONFIGS...] [-- PYTEST_ARGS...]

Runs may be made at different times or on different machines (a run of the whole file takes
minutes), or at once as one process per configuration: `--saved` runs nothing and compares the
runs kept in UPSTREAM_RESULTS (default all five). With VRAM_LEDGER_TORCH_EXTENSION=1 in the
environment, install() uses its C++ extension's allocator (`python/vram_ledger/_extension.py`);
each run's JSON says which.
A mode run alone is compared with an earlier `torch` run kept in
UPSTREAM_RESULTS (a folder of the runs' JSON results, default ./upstream-results).

Runs that share the GPU can starve one another: a test that needs more free memory than the
device has at that moment skips itself ("Insufficient cuda memory", PyTorch's largeTensorTest)
or fails with "CUDA out of memory", in one configuration and not another, and the comparison
would count that as lost. `--retry-starved`, run once the shared runs are over, runs each such
test of the kept runs once more alone and keeps that outcome (the run's JSON lists them under
`retried`). A test that runs out of memory alone too still fails: a mode's own out-of-memory is
still counted.
"""

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

from marks import Marks

MODES = ["native", "expandable", "compact", "remap"]
# Configurations run only when named: remap with moves that unmap once the stream's earlier
# work has finished (install(unmap_later=True)).
OPTIONAL = ["remap+later"]

# Tests that assert PyTorch's own segment layout or its own allocator's internals, with the
# reason; a failure of one of these under install() is reported, not counted.
EXPECTED = {
    "test_allocate_in_thread_to_pool": (
        "counts the segments PyTorch's allocator cuts for a thread's pool: it reuses a freed "
        "block at once on the stream that freed it, where vram-ledger reuses a pool's block once "
        "that stream's event has completed, so back-to-back allocations may take new segments"
    ),
    "test_graph_memory_stats_and_use_result_after_destroy_graph": "counts segments as PyTorch's allocator cuts them",
    "test_allocator_settings": "PyTorch's block rounding settings (roundup_power2_divisions) on its own blocks",
    "test_graph_capture_reclaim_2_streams": (
        "asserts that PyTorch's allocator reuses one block's address inside a capture once side "
        "streams are joined (its opt-in graph_capture_record_stream_reuse setting)"
    ),
    "test_graph_capture_reclaim_4_streams": "as test_graph_capture_reclaim_2_streams",
    "test_nested_mempool": (
        "counts the segments of three nested pools as PyTorch's allocator cuts them (one per "
        "20 MiB allocation); the virtual-memory modes map a pool's allocations into one "
        "reservation, its one segment (native passes)"
    ),
    "test_mempool_no_split": (
        "counts a free tail block that PyTorch's allocator leaves in the split pool's 20 MiB "
        "segment; compact maps only what the allocations use, so that segment has none (the "
        "no_split pool's one block per segment holds in every mode; the others pass)"
    ),
}

# Tests that only install(extension=True) can pass, because C++ calls the allocator for them
# where no Python patch reaches; expected lost in a run without the extension.
NEEDS_EXTENSION = {
    "test_cpp_memory_snapshot_pickle": "C++ starts the history and takes the snapshot itself (recordHistory, snapshot)",
    "test_memory_compile_regions": "torch.compile's regions reach only C++ (pushCompileContext)",
    "test_cachingAllocator_raw_alloc": "torch.cuda.caching_allocator_enable reaches only C++ (enable)",
    **{
        name: (
            "a graph pool's checkpoint reaches only C++ (getCheckpointState, "
            "setCheckpointPoolState, checkPoolLiveAllocations)"
        )
        for name in [
            "test_additional_free_following_checkpoint",
            "test_allocated_in_middle_of_segment",
            "test_assigning_back_deleter_fns_to_tensor",
            "test_check_pool_live_allocations",
            "test_middle_allocations_contiguous",
            "test_multiple_middle_allocations",
            "test_resnet",
            "test_simple",
            "test_tensor_dies_after_checkpoint",
        ]
    },
}

# Tests whose outcome in a run of the whole file depends on the tests before them, run once more
# alone in every configuration (PyTorch's allocator too); the outcome alone is the one compared.
ISOLATED = {
    "test_tensor_delete_after_allocator_delete": (
        "reads counters of a test allocator library that earlier tests load and leave set: "
        "load_inline rebuilds it, with fresh counters, only when the source differs from the "
        "last build, so the outcome follows how far test_mempool_with_allocator got (it fails "
        "under every configuration, at a different line: torch 2.11's MemPool has no "
        "`allocator` attribute, vram-ledger's has)"
    ),
    "test_no_triton_on_import": (
        "its class's tearDown compares the graph-pool segments left with the count its setUp "
        "took, which includes a pool the test before it left: under install() "
        "test_allocate_in_thread_to_pool (EXPECTED) fails with its graph alive, and a graph the "
        "garbage collector frees during this test takes its pool with it"
    ),
    **{
        name: (
            "its class's tearDown compares the graph-pool segments left with the count its setUp "
            "took: a test listed in EXPECTED that fails before it (test_allocate_in_thread_to_pool "
            "in the class, test_graph_memory_stats_and_use_result_after_destroy_graph outside "
            "native) leaves its graph alive in the failure's traceback, and the garbage collector "
            "frees that graph's pool during this test"
        )
        for name in ["test_allocated_in_middle_of_segment", "test_additional_free_following_checkpoint"]
    },
    "test_repeat_graph_capture_cublas_workspace_memory": (
        "compares the device's used memory (cudaMemGetInfo, every process's) before and after "
        "ten captures, so other processes on the GPU and what the tests before it left decide "
        "the outcome"
    ),
}

# Installs vram-ledger before the test file imports torch's CUDA state: pytest loads it as a
# plugin (`-p`) from this folder.
PLUGIN = "vram_ledger_upstream_plugin"
# Bridges testing helpers the file imports from where this torch keeps them (every run).
COMPAT = "vram_ledger_upstream_compat"


def results_dir():
    d = os.environ.get("UPSTREAM_RESULTS", "upstream-results")
    os.makedirs(d, exist_ok=True)
    return d


def test_id(classname, name):
    """`Class::test`: the module path pytest puts before the class depends on where the file
    was and where pytest ran, which runs made at different times need not share."""
    return f"{classname.split('.')[-1]}::{name}"


def outcomes(junit_path):
    """test id -> "passed" | "failed" | "skipped", from pytest's JUnit XML."""
    out = {}
    for case in ET.parse(junit_path).getroot().iter("testcase"):
        test = test_id(case.get("classname"), case.get("name"))
        if case.find("failure") is not None or case.find("error") is not None:
            out[test] = "failed"
        elif case.find("skipped") is not None:
            out[test] = "skipped"
        else:
            out[test] = "passed"
    return out


def failures(junit_path):
    """test id -> the first line of its failure's message (at most 300 characters), for the
    tests that failed: a run kept from a machine whose logs did not come back still says why."""
    out = {}
    for case in ET.parse(junit_path).getroot().iter("testcase"):
        found = case.find("failure")
        if found is None:
            found = case.find("error")
        if found is not None:
            text = (found.get("message") or found.text or "").strip().splitlines()
            out[test_id(case.get("classname"), case.get("name"))] = (text[0] if text else "")[:300]
    return out


def starved(junit_path):
    """Ids of the tests that skipped themselves for want of free device memory, or failed
    because the device ran out of it."""
    out = []
    for case in ET.parse(junit_path).getroot().iter("testcase"):
        failed = case.find("failure")
        if failed is None:
            failed = case.find("error")
        if failed is not None:
            text = (failed.get("message") or "") + "\n" + (failed.text or "")
            hit = "CUDA out of memory" in text
        else:
            skipped = case.find("skipped")
            message = "" if skipped is None else (skipped.get("message") or "")
            hit = message.startswith("Insufficient") and "memory" in message
        if hit:
            out.append(test_id(case.get("classname"), case.get("name")))
    return out


def pytest_command(config, test_file, junit):
    """The pytest command line and environment of a run of `config`, its report into `junit`."""
    env = dict(os.environ)
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "pytest", test_file, "-p", "no:cacheprovider", "-p", COMPAT, f"--junitxml={junit}"]
    if config != "torch":
        env["VRAM_LEDGER_UPSTREAM_MODE"] = config
        cmd += ["-p", PLUGIN]
    return cmd, env


def run_alone(config, test_file, test, cmd, env, pytest_args, label):
    """`test` (an id, `Class::test`) of `test_file` run alone, selected by its node id (`-k`
    would also run every test whose name contains it): its outcome ("not run" when pytest
    reported nothing) and, when it failed, why."""
    name = test.split("::")[-1]
    alone = os.path.join(results_dir(), f"{config}-{label}{name}.xml")
    if os.path.exists(alone):
        os.remove(alone)
    cmd_alone = [f"--junitxml={alone}" if c.startswith("--junitxml=") else
                 f"{test_file}::{test}" if c == test_file else c for c in cmd]
    with open(os.path.join(results_dir(), f"{config}-{label}{name}.log"), "w") as log:
        subprocess.run(cmd_alone + ["-v"] + pytest_args, env=env, stdout=log, stderr=subprocess.STDOUT)
    got = outcomes(alone).get(test, "not run") if os.path.exists(alone) else "not run"
    return got, failures(alone).get(test, "") if got == "failed" else None


def run(config, test_file, pytest_args):
    """One pytest process for `config` ("torch", or a segment mode under install())."""
    junit = os.path.join(results_dir(), f"{config}.xml")
    # A report left by an earlier run in the same folder must not pass for this one's.
    for old in [junit] + [os.path.join(results_dir(), f"{config}-{n}.xml") for n in ISOLATED]:
        if os.path.exists(old):
            os.remove(old)
    cmd, env = pytest_command(config, test_file, junit)
    # pytest's report goes to a file as it runs, one line per test (-v) with the slowest tests
    # at the end: a run killed from outside still shows how far it got and where it stood.
    log_path = os.path.join(results_dir(), f"{config}.log")
    with open(log_path, "w") as log:
        r = subprocess.run(cmd + ["-v", "--durations=20"] + pytest_args, env=env, stdout=log, stderr=subprocess.STDOUT)
    with open(log_path, errors="replace") as log:
        tail = log.read()[-4000:]
    found = outcomes(junit) if os.path.exists(junit) else {}
    why = failures(junit) if os.path.exists(junit) else {}
    isolated = {}
    for test in [t for t in found if t.split("::")[-1] in ISOLATED]:
        got, failed_why = run_alone(config, test_file, test, cmd, env, pytest_args, "")
        why.pop(test, None)
        if failed_why is not None:
            why[test] = failed_why
        isolated[test] = {"in_file": found[test], "alone": got}
        found[test] = got
    extension = env.get("VRAM_LEDGER_TORCH_EXTENSION", "") if config != "torch" else ""
    result = {"config": config, "returncode": r.returncode, "outcomes": found, "isolated": isolated, "tail": tail,
              "extension": extension, "failures": why}
    with open(os.path.join(results_dir(), f"{config}.json"), "w") as f:
        json.dump(result, f)
    return result


def compare(torch_run, mode_run):
    """What a mode's run lost against PyTorch's allocator, and its marks."""
    def by_id(run):
        # Results kept from earlier runs may carry the module path too.
        return {test_id(*t.rsplit("::", 1)): o for t, o in run["outcomes"].items()}

    theirs, ours = by_id(torch_run), by_id(mode_run)
    passed = {t for t, o in theirs.items() if o == "passed"}
    lost = sorted(t for t in passed if ours.get(t) != "passed")
    with_extension = mode_run.get("extension", "").strip().lower() in ("1", "true", "yes", "on")
    allowed = EXPECTED if with_extension else {**EXPECTED, **NEEDS_EXTENSION}
    unexpected = [t for t in lost if t.split("::")[-1] not in allowed]
    m = Marks()
    # A file that fails to import leaves one failed entry and nothing passed: that is no reading.
    m.true("results_read", bool(passed) and "passed" in ours.values())
    # pytest exits 0 or 1 when it ran the file to its end (1: some tests failed); anything else
    # (interrupted, an internal error, nothing collected) leaves the outcomes incomplete.
    m.true("pytest_finished", mode_run.get("returncode") in (0, 1) and torch_run.get("returncode") in (0, 1))
    m.true("passes_what_torch_passes", not unexpected)
    counts = {o: sum(1 for v in ours.values() if v == o) for o in ("passed", "failed", "skipped")}
    why = {test_id(*t.rsplit("::", 1)): w for t, w in mode_run.get("failures", {}).items()}
    failed_how = {t: why.get(t, ours.get(t, "not run")) for t in unexpected}
    return {"mode": mode_run["config"], "extension": mode_run.get("extension", ""), "torch_passed": len(passed), "counts": counts, "lost": lost,
            "lost_unexpected": unexpected, "lost_unexpected_why": failed_how, "marks": m.met, "ok": m.ok, "missed": m.missed()}


def retry_starved(test_file, configs, pytest_args):
    """Each kept run's tests that skipped or failed for want of free memory (in the file, or in
    their run alone for an ISOLATED test, which also ran beside the other configurations), run
    once more alone; that outcome replaces the one in the run's JSON. A test retried already is
    not run again. Prints one line per configuration; exits 1 when a configuration kept no run (the
    others are still retried)."""
    status = 0
    for config in configs:
        path = os.path.join(results_dir(), f"{config}.json")
        junit = os.path.join(results_dir(), f"{config}.xml")
        if not os.path.exists(path) or not os.path.exists(junit):
            print(f"no kept run of {config} in {results_dir()}", file=sys.stderr)
            status = 1
            continue
        with open(path) as f:
            result = json.load(f)
        by_id = {test_id(*t.rsplit("::", 1)): t for t in result["outcomes"]}
        retried = result.setdefault("retried", {})
        hungry = [t for t in starved(junit) if t.split("::")[-1] not in ISOLATED]
        for name in ISOLATED:
            alone = os.path.join(results_dir(), f"{config}-{name}.xml")
            if os.path.exists(alone):
                hungry += [t for t in starved(alone) if t.split("::")[-1] == name]
        cmd, env = pytest_command(config, test_file, junit)
        for test in hungry:
            if test not in by_id or by_id[test] in retried:
                continue
            got, failed_why = run_alone(config, test_file, test, cmd, env, pytest_args, "retried-")
            key = by_id[test]
            retried[key] = {"shared": result["outcomes"][key], "alone": got}
            result["outcomes"][key] = got
            # The shared run's message would say why a test failed that passed alone.
            failures_kept = result.setdefault("failures", {})
            failures_kept.pop(key, None)
            if failed_why is not None:
                failures_kept[key] = failed_why
        with open(path, "w") as f:
            json.dump(result, f)
        print(json.dumps({"config": config, "retried": retried}))
    return status


def main(argv):
    if "--" in argv:
        i = argv.index("--")
        argv, pytest_args = argv[:i], argv[i + 1:]
    else:
        pytest_args = []
    if not argv:
        print(__doc__)
        return 2
    retry = argv[0] == "--retry-starved"
    if retry and len(argv) == 1:
        print("--retry-starved TEST_FILE [CONFIGS...]", file=sys.stderr)
        return 2
    saved_only = argv[0] == "--saved"
    test_file, configs = argv[retry], argv[retry + 1:] or ["torch", *MODES]
    unknown = [c for c in configs if c != "torch" and c not in MODES + OPTIONAL]
    if unknown:
        print(f"unknown configuration {unknown}: torch or one of {MODES + OPTIONAL}", file=sys.stderr)
        return 2
    if retry:
        return retry_starved(test_file, configs, pytest_args)
    if saved_only:
        runs = {}
        for c in configs:
            path = os.path.join(results_dir(), f"{c}.json")
            if not os.path.exists(path):
                print(f"no saved run of {c} in {results_dir()}", file=sys.stderr)
                return 1
            with open(path) as f:
                runs[c] = json.load(f)
    else:
        runs = {c: run(c, test_file, pytest_args) for c in configs}
    saved = os.path.join(results_dir(), "torch.json")
    if "torch" not in runs and os.path.exists(saved):
        with open(saved) as f:
            runs["torch"] = json.load(f)
    if "torch" not in runs:
        print("no run with PyTorch's allocator to compare with (run `torch` first)", file=sys.stderr)
        return 1
    ok = "passed" in runs["torch"]["outcomes"].values()
    for c in configs:
        if c == "torch":
            print(json.dumps({"config": "torch", "ok": ok,
                              "counts": {o: sum(1 for v in runs[c]["outcomes"].values() if v == o)
                                         for o in ("passed", "failed", "skipped")}}))
            continue
        r = compare(runs["torch"], runs[c])
        print(json.dumps(r))
        ok = ok and r["ok"]
    print(json.dumps({"summary": True, "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
