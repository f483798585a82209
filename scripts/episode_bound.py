"""How often a workload repeats itself exactly, in pieces smaller than an iteration: the question
behind plans keyed by a micro-batch's shape, from a PyTorch memory snapshot.

    python3 scripts/episode_bound.py TRACE.pickle[.gz] ...      (needs numpy)

Iterations are cut as `plan_bound.py` cuts them (where `Optimizer.zero_grad` ended; a trace
without such annotations is one iteration). A block is transient in an iteration when it is
allocated and its free completed inside it; one that lives over half the iteration (a gradient
kept across micro-batches) is left out of what follows. An iteration is cut again wherever the
transient blocks allocated since the last cut are down to `EPISODE_LOW` (1% by default) of
their peak bytes: each piece is an episode (a micro-batch's forward and backward, the
optimiser's step, a serving step). An episode's signature is its exact sequence of
allocations and frees of its transient blocks (each allocation's size, each free by which of
the episode's allocations it frees).

Two episodes with one signature allocate the same sizes and free them in the same order, so a
plan made for the first (offsets in one arena) is valid for the second as it stands. Printed per
trace:

- `iterations`; `episodes`, `signatures`: how many, and how many distinct;
- `last new`: the iteration (from 0) where the last signature not seen before appeared: after
  it, every episode could follow a plan;
- `crossing a cut`: transient blocks left out or live across a cut, which no episode's plan
  holds (they count with the other blocks below);
- `replayed`: of the transient allocations inside episodes, those in episodes whose signature
  an earlier episode had, the ones a plan recorded at the first sighting could serve;
- `arena / peak`: the worst first sighting's greedy plan (`plan_bound.plan`) over its own peak
  transient live bytes;
- `bound`: the most that the repeated episodes, each holding its plan's arena over its span,
  and every other block packed without loss (first sightings included: they are left to
  another policy) would reserve, over the trace's peak live bytes.

Every plan is checked by `plan_bound.overlaps`, a sweep independent of the planner, on the
episode it was made for and on each repeat; a failed check exits 1.
"""

import bisect
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plan_bound import iterations, lifetimes, load, overlaps, peak, plan  # noqa: E402

# An episode ends where the blocks allocated in it are down to this share of their peak bytes.
LOW = float(os.environ.get("EPISODE_LOW", "0.01"))


def episodes(transient, lo, hi):
    """Cut [lo, hi) into episodes: an episode ends once the live bytes of the blocks allocated
    in it fall to at most `LOW` of their peak (blocks allocated before it do not hold it open).
    Returns the blocks that lie wholly inside one episode, per episode, and the others: those
    that outlive the episode they were allocated in, and those left out for living over half
    the span."""
    starts, ends = {}, {}
    # Blocks that live over half the iteration (gradients kept across micro-batches) would hold
    # every episode open: they are not planned, and count with the other blocks.
    long = [b for b in transient if b[1] - b[0] > (hi - lo) // 2]
    transient = [b for b in transient if b[1] - b[0] <= (hi - lo) // 2]
    for b in transient:
        starts.setdefault(b[0], []).append(b)
        ends.setdefault(b[1], []).append(b)
    bounds, cut, live, top = [lo], lo, 0, 0
    for i in range(lo, hi):
        for b in ends.get(i, ()):
            if b[0] >= cut:
                live -= b[2]
        for b in starts.get(i, ()):
            live += b[2]
            top = max(top, live)
        if top and live <= LOW * top:
            cut, live, top = i + 1, 0, 0
            bounds.append(cut)
    bounds.append(hi)
    out, crossing = {}, []
    for b in transient:
        k = bisect.bisect_right(bounds, b[0]) - 1
        if b[1] <= bounds[k + 1]:
            out.setdefault(k, []).append(b)
        else:
            crossing.append(b)
    return [out[k] for k in sorted(out)], crossing + long


def signature(blocks):
    """The episode's allocations and frees in event order: sizes, and frees by allocation."""
    steps = [(s, 1, k, z) for k, (s, _, z) in enumerate(blocks)]
    steps += [(e, 0, k, 0) for k, (_, e, _) in enumerate(blocks)]
    return tuple((z, k) if opens else (-1, k) for _, opens, k, z in sorted(steps))


def plan_for(seen, ep):
    """The plan of `ep`'s signature, made now if this is its first sighting (`seen`: signature ->
    offsets and arena), checked on `ep` by the independent sweep: (offsets, arena, whether `ep`
    repeats an earlier episode, whether the plan holds on it)."""
    sig = signature(ep)
    repeat = sig in seen
    if not repeat:
        seen[sig] = plan(ep)
    offset, arena = seen[sig]
    return offset, arena, repeat, not overlaps(ep, offset)


def main(paths):
    bad = False
    print("| trace | iterations | episodes | signatures | last new | replayed | crossing a cut | arena / peak | bound |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for path in paths:
        events, ends = load(path)
        n = len(events)
        blocks = lifetimes(events)
        cuts, by_iteration = iterations(events, ends, blocks)
        seen, replayed, total, worst_pack, carried, count_eps, last_new = {}, 0, 0, 0.0, 0, 0, 0
        # Each repeated episode's arena over its span, and the live bytes of every other block
        # (first sightings included: another policy serves them).
        usage = np.zeros(n + 1, dtype=np.int64)
        planned = set()
        for it, mine in sorted(by_iteration.items()):
            eps, crossing = episodes(mine, cuts[it], cuts[it + 1])
            carried += len(crossing)
            count_eps += len(eps)
            for ep in eps:
                total += len(ep)
                lo, hi = min(b[0] for b in ep), max(b[1] for b in ep)
                _, arena, repeat, holds = plan_for(seen, ep)
                if repeat:
                    replayed += len(ep)
                    planned.update(ep)
                    usage[lo] += arena
                    usage[hi] -= arena
                else:
                    last_new = it
                    worst_pack = max(worst_pack, arena / peak(ep, lo, hi))
                if not holds:
                    print(f"episode_bound: {path}: a plan overlaps live blocks", file=sys.stderr)
                    bad = True
        for s, e, z in blocks:
            if (s, e, z) not in planned:
                usage[s] += z
                usage[min(e, n)] -= z
        bound = int(np.cumsum(usage).max()) / peak(blocks, 0, n)
        name = os.path.basename(path).split(".")[0]
        print(f"| {name} | {len(cuts) - 1} | {count_eps:,} | {len(seen):,} | {last_new} | {replayed:,} of {total:,} "
              f"({replayed / max(total, 1):.0%}) | {carried:,} | {worst_pack:.4f} | {bound:.4f} |")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
