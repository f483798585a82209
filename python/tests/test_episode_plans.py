"""scripts/episode_plans.py on hand-made traces: which episodes get a plan, how their blocks are
named for the replayer, and that the offsets are the first sighting's."""

import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
if not (SCRIPTS / "episode_plans.py").exists():
    pytest.skip("scripts/episode_plans.py is not here (outside the repository)", allow_module_level=True)
sys.path.insert(0, str(SCRIPTS))

import episode_plans as ep  # noqa: E402
from trace_events import MIB, step, trace  # noqa: E402


def test_only_repeats_are_planned_with_the_first_sightings_offsets_by_allocation_ordinal():
    # x and z share a shape, y is another; a segment event between them is not an allocation.
    events = trace(*step("x", 4, 2), *step("y", 6, 2), *step("z", 4, 2))
    events.insert(4, {"action": "segment_alloc", "addr": 0x9000, "size": 20 * MIB, "time_us": 3.5})
    out, signatures = ep.plans(events, [])
    assert signatures == 2
    assert len(out) == 1
    # z's blocks are the 5th and 6th allocations; the plan of x puts the larger first.
    assert out[0] == {"arena": 6 * MIB, "blocks": [[4, 0, 4 * MIB], [5, 4 * MIB, 2 * MIB]]}


def test_a_trace_that_never_repeats_gets_no_plan():
    out, signatures = ep.plans(trace(*step("x", 4, 2), *step("y", 6, 2), *step("z", 8, 2)), [])
    assert out == [] and signatures == 3


@pytest.mark.parametrize("shapes", [[4, 4], [4, 6]])
def test_a_plan_that_overlaps_live_blocks_is_refused(monkeypatch, shapes):
    # A planner that puts both blocks at offset 0: the check must catch it where the plan is
    # used: on a repeat, and on first sightings that nothing repeats.
    import episode_bound

    monkeypatch.setattr(episode_bound, "plan", lambda blocks: ([0] * len(blocks), 4 * MIB))
    with pytest.raises(ValueError, match="overlaps"):
        ep.plans(trace(*(e for k, s in enumerate(shapes) for e in step(f"m{k}", s, 2))), [])
