"""`vram-ledger replay` on a recording that began after the program had allocated: real traces
cut where PyTorch's `max_entries` would have dropped their oldest events, their end state kept.
What the replay puts back, and PyTorch's figures after the cut, are checked against the whole
trace, which this file walks for itself. Needs the CLI built (`cargo test --release`)."""

import gzip
import json
import os
import pickle
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLI = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "release" / "vram-ledger"
if not (CLI.exists() and (ROOT / "tests" / "data").exists()):
    pytest.skip(f"{CLI} not built, or no tests/data (cargo test --release builds it)", allow_module_level=True)


def load(name):
    with gzip.open(ROOT / "tests" / "data" / f"{name}.pickle.gz") as f:
        return pickle.load(f)


def replay(snapshot, tmp_path, mode="native"):
    path = tmp_path / "cut.pickle"
    with open(path, "wb") as f:
        pickle.dump(snapshot, f)
    out = subprocess.run([str(CLI), "replay", str(path), "--mode", mode, "--json"],
                         capture_output=True, text=True, check=True).stdout
    return next(json.loads(l) for l in out.splitlines() if l.startswith("{"))


def walk(events, cut):
    """From the whole trace: the blocks and segments live at event `cut`, and after it the peak
    of PyTorch's reserved bytes and of the bytes live until their free completed."""
    blocks, segments = {}, {}
    reserved = live = 0
    peak_reserved = peak_live = None
    for i, e in enumerate(events):
        if i == cut:
            at_cut = (sum(blocks.values()), len(blocks), sum(segments.values()), len(segments))
            peak_reserved, peak_live = reserved, live
        a, addr, size = e["action"], e["addr"], e["size"]
        if a == "alloc":
            blocks[addr] = size
            live += size
        elif a == "free_completed":
            live -= blocks.pop(addr)
        elif a == "segment_alloc":
            segments[addr] = size
            reserved += size
        elif a == "segment_free":
            reserved -= segments.pop(addr)
        if i >= cut:
            peak_reserved, peak_live = max(peak_reserved, reserved), max(peak_live, live)
    return at_cut, peak_reserved, peak_live


@pytest.mark.parametrize("name", ["gpt2-train", "conv-train-s0", "side-stream-s0", "streams-train-0"])
@pytest.mark.parametrize("fraction", [0.3, 0.7])
def test_a_cut_recording_is_replayed_with_what_was_live_at_the_cut(name, fraction, tmp_path):
    snap = load(name)
    dev = max(range(len(snap["device_traces"])), key=lambda d: len(snap["device_traces"][d]))
    events = snap["device_traces"][dev]
    cut = int(len(events) * fraction)
    (block_bytes, nblocks, segment_bytes, nsegments), peak_reserved, peak_live = walk(events, cut)
    assert nblocks > 0 and nsegments > 0, "the cut must fall where memory is live"
    snap["device_traces"][dev] = events[cut:]
    r = replay(snap, tmp_path)
    assert r["before"] == {"blocks": nblocks, "block_bytes": block_bytes,
                           "segments": nsegments, "segment_bytes": segment_bytes}
    assert r["unmatched_frees"] == 0
    assert r["torch_peak_reserved"] == peak_reserved
    assert r["peak_live"] == peak_live
    assert r["ooms"] == 0 and r["peak_reserved"] >= peak_live


@pytest.mark.parametrize("name", ["gpt2-train", "streams-train-0"])
def test_a_whole_recording_gets_nothing_put_back(name, tmp_path):
    r = replay(load(name), tmp_path)
    assert r["before"] == {"blocks": 0, "block_bytes": 0, "segments": 0, "segment_bytes": 0}


def test_without_the_end_state_the_frees_still_say_what_was_live(tmp_path):
    snap = load("streams-train-0")
    events = snap["device_traces"][0]
    cut = len(events) // 2
    (_, _, _, _), _, _ = walk(events, cut)
    freed_later = {e["addr"] for e in events[cut:] if e["action"] in ("free_requested", "free_completed")}
    allocated_before = {}
    for e in events[:cut]:
        if e["action"] == "alloc":
            allocated_before[e["addr"]] = e["size"]
        elif e["action"] == "free_completed":
            allocated_before.pop(e["addr"], None)
    want = {a: s for a, s in allocated_before.items() if a in freed_later}
    del snap["segments"]
    snap["device_traces"][0] = events[cut:]
    r = replay(snap, tmp_path)
    assert r["before"]["blocks"] == len(want) > 0
    assert r["before"]["block_bytes"] == sum(want.values())
    assert r["unmatched_frees"] == 0
