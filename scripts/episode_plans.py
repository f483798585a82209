"""Plans for the episodes that repeat an earlier one exactly, for `examples/plan_replay.rs` to
serve them from arenas while the allocator serves the rest:

    python3 scripts/episode_plans.py TRACE.pickle[.gz] OUT.json      (needs numpy)

Episodes and signatures are `episode_bound.py`'s. The plan made at a signature's first sighting
(`plan_bound.plan`) is written for every later episode with that signature, each block named by
its place among the trace's allocations (the replayer counts them the same way):
`{"episodes": [{"arena": BYTES, "blocks": [[ALLOC_ORDINAL, OFFSET, SIZE], ...]}]}`. Every plan is
checked by `plan_bound.overlaps` on each episode it is used for, its first sighting included; a
failed check exits 1.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from episode_bound import episodes, plan_for  # noqa: E402
from plan_bound import iterations, lifetimes, load  # noqa: E402


def plans(events, ends):
    """The repeated episodes' plans, and the number of signatures seen."""
    ordinal = {}
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            ordinal[i] = len(ordinal)
    cuts, by_iteration = iterations(events, ends, lifetimes(events))
    seen, out = {}, []
    for it, mine in sorted(by_iteration.items()):
        for ep in episodes(mine, cuts[it], cuts[it + 1])[0]:
            offset, arena, repeat, holds = plan_for(seen, ep)
            if not holds:
                raise ValueError("a plan overlaps live blocks on an episode it is used for")
            if repeat:
                blocks = [[ordinal[b[0]], int(o), int(b[2])] for b, o in zip(ep, offset)]
                out.append({"arena": int(arena), "blocks": blocks})
    return out, len(seen)


def main(argv):
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        out, signatures = plans(*load(argv[0]))
    except ValueError as e:
        print(f"episode_plans: {argv[0]}: {e}", file=sys.stderr)
        return 1
    with open(argv[1], "w") as f:
        json.dump({"episodes": out}, f)
    print(f"{argv[0]}: {len(out)} repeated episodes planned, {sum(len(e['blocks']) for e in out)} blocks, "
          f"{signatures} signatures")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
