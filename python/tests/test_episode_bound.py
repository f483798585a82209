"""scripts/episode_bound.py on hand-made traces whose outcome is worked out here: where episodes
are cut, which blocks cross a cut or live too long to be planned, and which episodes repeat an
earlier one exactly."""

import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
if not (SCRIPTS / "episode_bound.py").exists():
    pytest.skip("scripts/episode_bound.py is not here (outside the repository)", allow_module_level=True)
sys.path.insert(0, str(SCRIPTS))

import episode_bound as eb  # noqa: E402
import plan_bound as pb  # noqa: E402
from trace_events import MIB, trace  # noqa: E402


def step(tag, first, second):
    """A micro-batch: two blocks, the second freed first."""
    return [("alloc", f"{tag}a", first), ("alloc", f"{tag}b", second),
            ("free_completed", f"{tag}b", second), ("free_completed", f"{tag}a", first)]


def test_a_repeated_micro_batch_is_one_signature_and_a_new_shape_another():
    events = trace(*step("x", 4, 2), *step("y", 4, 2), *step("z", 6, 2))
    blocks = pb.lifetimes(events)
    eps, crossing = eb.episodes(blocks, 0, len(events))
    assert [len(e) for e in eps] == [2, 2, 2] and crossing == []
    sigs = [eb.signature(e) for e in eps]
    assert sigs[0] == sigs[1] != sigs[2]
    # Freed in the other order, the same sizes are another signature: a plan made for one
    # order need not hold for the other.
    other = trace(("alloc", "a", 4), ("alloc", "b", 2), ("free_completed", "a", 4), ("free_completed", "b", 2))
    assert eb.signature(pb.lifetimes(other)) != sigs[0]


def test_a_block_kept_across_micro_batches_neither_holds_them_open_nor_is_planned():
    # `g` (a gradient) lives from the first micro-batch to the end: over half the span.
    events = trace(("alloc", "g", 8), *step("x", 4, 2), *step("y", 4, 2), *step("z", 4, 2),
                   ("free_completed", "g", 8))
    blocks = pb.lifetimes(events)
    eps, crossing = eb.episodes(blocks, 0, len(events))
    assert [b[2] for b in crossing] == [8 * MIB]
    assert len(eps) == 3 and len({eb.signature(e) for e in eps}) == 1


def test_a_block_that_outlives_its_episode_crosses_the_cut():
    # `c` is allocated in the first micro-batch and freed in the second: it crosses the cut
    # made when the first one's other blocks are gone... only once its own bytes are a small
    # share of the episode's peak, so make it small.
    events = trace(("alloc", "a", 400), ("alloc", "c", 1), ("free_completed", "a", 400),
                   *step("y", 400, 100), ("free_completed", "c", 1),
                   *step("z", 400, 100), *step("w", 400, 100))
    blocks = pb.lifetimes(events)
    eps, crossing = eb.episodes(blocks, 0, len(events))
    assert [b[2] for b in crossing] == [MIB]
    assert sum(len(e) for e in eps) == len(blocks) - 1


def test_main_counts_replayed_allocations(tmp_path, capsys, monkeypatch):
    events = trace(*step("x", 4, 2), *step("y", 4, 2), *step("z", 6, 2))
    monkeypatch.setattr(eb, "load", lambda path: (events, []))
    assert eb.main(["t.pickle"]) == 0
    row = capsys.readouterr().out.strip().splitlines()[-1]
    # Three episodes, two signatures, the second episode's two allocations replayed; the plan
    # packs each episode exactly; the bound is the 8 MiB peak over itself.
    assert row == "| t | 1 | 3 | 2 | 0 | 2 of 6 (33%) | 0 | 1.0000 | 1.0000 |"
