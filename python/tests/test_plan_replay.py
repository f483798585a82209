"""examples/plan_replay.rs, the replayer that policies are tried on, against `vram-ledger replay`:
without plans or options it must reserve what the real replay reserves, and estimate the same
driver time, in every mode it is used with. Needs both built (`cargo test --release` builds
them, as CI does before these tests)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "release"
REPLAYER, CLI = BUILD / "examples" / "plan_replay", BUILD / "vram-ledger"
if not (REPLAYER.exists() and CLI.exists() and (ROOT / "tests" / "data").exists()):
    pytest.skip(f"{REPLAYER} or {CLI} not built, or no tests/data (cargo test --release builds both)",
                allow_module_level=True)

TRACES = ["streams-train-0", "conv-train-s0", "side-stream-s0"]


def real(trace, mode, *args):
    out = subprocess.run([str(CLI), "replay", str(trace), "--mode", mode, "--json", *args],
                         capture_output=True, text=True, check=True).stdout
    r = next(json.loads(l) for l in out.splitlines() if l.startswith("{"))
    return r["fragmentation_ratio"], r["driver_seconds"]


def small(trace, *args):
    out = subprocess.run([str(REPLAYER), str(trace), *args], capture_output=True, text=True, check=True).stdout
    return json.loads(out)


@pytest.mark.parametrize("mode", ["native", "compact", "remap"])
@pytest.mark.parametrize("name", TRACES)
def test_without_plans_it_replays_as_the_replay_does(name, mode):
    trace = ROOT / "tests" / "data" / f"{name}.pickle.gz"
    r = small(trace, "--mode", mode)
    ratio, seconds = real(trace, mode)
    assert r["ratio"] == pytest.approx(ratio, rel=1e-12)
    assert r["driver_seconds"] == pytest.approx(seconds, rel=1e-9)
    assert r["planned_blocks"] == r["long_lived_blocks"] == 0


@pytest.mark.parametrize("piece", ["71303168", "8388608", "2097152"])
def test_without_plans_remap_replays_ckpt_as_the_replay_does_at_every_piece(piece):
    trace = ROOT / "tests" / "data" / "ckpt-train-s0.pickle.gz"
    r = small(trace, "--piece", piece)
    ratio, seconds = real(trace, "remap", "--remap-piece", piece)
    assert r["ratio"] == pytest.approx(ratio, rel=1e-12)
    assert r["driver_seconds"] == pytest.approx(seconds, rel=1e-9)


@pytest.mark.parametrize("life", [["--segregate", "50"], ["--turnover", "--segregate", "0.5"],
                                  ["--turnover", "--predict", "--segregate", "0.5"],
                                  ["--regions", "--segregate", "50"]])
def test_the_long_lived_pool_takes_blocks_and_changes_the_outcome(life):
    trace = ROOT / "tests" / "data" / "streams-train-0.pickle.gz"
    plain, split = small(trace), small(trace, *life)
    assert split["long_lived_blocks"] > 0
    assert split["peak_reserved"] != plain["peak_reserved"]


def test_past_any_threshold_only_the_blocks_never_freed_live_long():
    sys.path.insert(0, str(ROOT / "scripts"))
    import plan_bound

    trace = ROOT / "tests" / "data" / "streams-train-0.pickle.gz"
    events, _ = plan_bound.load(str(trace))
    never = sum(1 for _, end, _ in plan_bound.lifetimes(events) if end == len(events))
    assert never > 0
    assert small(trace, "--turnover", "--segregate", "1e9")["long_lived_blocks"] == never


def test_a_bad_option_is_refused():
    r = subprocess.run([str(REPLAYER), "x", "--segregate"], capture_output=True, text=True)
    assert r.returncode != 0 and "--segregate needs a value" in r.stderr
