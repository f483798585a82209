"""scripts/stitch_bound.py's stitching sketch on hand-made traces whose outcome is worked out
here: reuse of a cached block, stitching of free chunks, new chunks for what is missing, and its
check that no chunk is handed out twice."""

import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
if not (SCRIPTS / "stitch_bound.py").exists():
    pytest.skip("scripts/stitch_bound.py is not here (outside the repository)", allow_module_level=True)
sys.path.insert(0, str(SCRIPTS))

import stitch_bound as sb  # noqa: E402
from trace_events import MIB, trace  # noqa: E402


def test_a_freed_block_of_the_same_chunk_count_is_reused_without_a_map():
    s, live, reserved, _ = sb.run(trace(("alloc", "a", 6), ("free_completed", "a", 6), ("alloc", "b", 5)))
    assert (s.stitches, s.maps, s.reused, s.chunks) == (1, 3, 1, 3)
    assert (live, reserved) == (6 * MIB, 6 * MIB)


def test_free_chunks_of_two_blocks_are_stitched_and_only_the_shortfall_is_created():
    s, live, reserved, _ = sb.run(trace(
        ("alloc", "a", 4), ("alloc", "keep", 2), ("alloc", "b", 4),
        ("free_completed", "a", 4), ("free_completed", "b", 4),
        ("alloc", "c", 10),  # 5 chunks: the 4 free ones stitched, 1 new
    ))
    assert s.chunks == 6 and s.stitches == 4 and s.maps == 2 + 1 + 2 + 5
    assert (live, reserved) == (12 * MIB, 12 * MIB)
    # a and b are not ready while c uses their chunks: a new 2-chunk block needs new chunks.
    s2, _, reserved2, _ = sb.run(trace(
        ("alloc", "a", 4), ("alloc", "keep", 2), ("alloc", "b", 4),
        ("free_completed", "a", 4), ("free_completed", "b", 4),
        ("alloc", "c", 10), ("alloc", "d", 4),
    ))
    assert s2.reused == 0 and s2.chunks == 8 and reserved2 == 16 * MIB


def test_small_blocks_are_left_to_the_recorded_small_pool():
    events = [{"action": "segment_alloc", "addr": 0x9000, "size": 2 * MIB}] + trace(("alloc", "s", 1))
    s, live, reserved, _ = sb.run(events)
    assert (s.chunks, live, reserved) == (0, MIB, 2 * MIB)


def test_a_chunk_handed_out_twice_is_caught(monkeypatch):
    # A broken ready-set (a block counted free while its chunk is in use) must trip the check.
    monkeypatch.setattr(sb.Stitcher, "_use", lambda self, chunk, delta: None)
    with pytest.raises(AssertionError, match="handed out"):
        sb.run(trace(("alloc", "a", 2), ("free_completed", "a", 2), ("alloc", "b", 2), ("alloc", "c", 2)))
