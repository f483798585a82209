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
from trace_events import MIB, step, trace  # noqa: E402


def test_a_repeated_micro_batch_is_one_signature_and_a_new_shape_another():
    events = trace(*step("x", 4, 2), *step("y", 4, 2), *step("z", 6, 2))
    blocks = pb.lifetimes(events)
    eps, crossing = eb.episodes(blocks, 0, len(events))
    assert [len(e) for e in eps] == [2, 2, 2] and crossing == []
    sigs = [eb.signature(e) for e in eps]
    assert sigs[0] == sigs[1] != sigs[2]
    # Freed in the other order, or one freed before the other is allocated, the same sizes are
    # other signatures: a plan made for one of these need not hold for another.
    other = trace(("alloc", "a", 4), ("alloc", "b", 2), ("free_completed", "a", 4), ("free_completed", "b", 2))
    apart = trace(("alloc", "a", 4), ("free_completed", "a", 4), ("alloc", "b", 2), ("free_completed", "b", 2))
    assert len({sigs[0], eb.signature(pb.lifetimes(other)), eb.signature(pb.lifetimes(apart))}) == 3


def test_a_block_kept_across_micro_batches_neither_holds_them_open_nor_is_planned():
    # `g` (a gradient) lives from the first micro-batch to the end: over half the span.
    events = trace(("alloc", "g", 8), *step("x", 4, 2), *step("y", 4, 2), *step("z", 4, 2),
                   ("free_completed", "g", 8))
    blocks = pb.lifetimes(events)
    eps, crossing = eb.episodes(blocks, 0, len(events))
    assert [b[2] for b in crossing] == [8 * MIB]
    assert len(eps) == 3 and len({eb.signature(e) for e in eps}) == 1


def test_a_block_that_outlives_its_episode_crosses_the_cut_and_does_not_end_the_next():
    # `c` is 0.5% of the first episode's peak, so that episode ends when `a` is freed; `c` is
    # freed inside the next one, where its 5 MiB equal all that episode has allocated so far:
    # counted there, its free would end that episode at once.
    events = trace(("alloc", "a", 1000), ("alloc", "c", 5), ("free_completed", "a", 1000),
                   ("alloc", "y1", 5), ("free_completed", "c", 5), ("alloc", "y2", 2),
                   ("free_completed", "y2", 2), ("free_completed", "y1", 5),
                   *step("z", 5, 2), *step("w", 5, 2))
    blocks = pb.lifetimes(events)
    eps, crossing = eb.episodes(blocks, 0, len(events))
    assert [b[2] for b in crossing] == [5 * MIB]
    assert [[b[2] // MIB for b in e] for e in eps] == [[1000], [5, 2], [5, 2], [5, 2]]


def test_main_counts_replays_and_bounds_them(capsys, monkeypatch):
    # Iteration 0: a long block `g` around two micro-batches of one shape. Iteration 1: two of
    # another shape, a block that is never freed allocated between them.
    events = trace(("alloc", "g", 1), *step("x", 4, 2), *step("y", 4, 2), ("free_completed", "g", 1),
                   *step("z", 6, 2), ("alloc", "keep", 1), *step("w", 6, 2))
    monkeypatch.setattr(eb, "load", lambda path: (events, [9]))
    assert eb.main(["t.pickle"]) == 0
    row = capsys.readouterr().out.strip().splitlines()[-1]
    # 2 iterations, 4 episodes, 2 signatures, the last new in iteration 1; y's and w's
    # allocations replayed; `g` left out. The peak, 9 MiB, is w's arena beside `keep`: the
    # bound holds a replay's arena where it is used.
    assert row == "| t | 2 | 4 | 2 | 1 | 4 of 8 (50%) | 1 | 1.0000 | 1.0000 |"
