"""What planning each training iteration from a recorded one could reach (STAlloc's idea), from
a PyTorch memory snapshot: a bound for a planning policy, and how often a later iteration
repeats the recorded one closely enough for a plan to apply.

    python3 scripts/plan_bound.py TRACE.pickle[.gz] ...      (needs numpy)

Iterations end where the snapshot's own annotations say an optimiser call ended
(`Optimizer.zero_grad` by default, `PLAN_BOUNDARY=Optimizer.step` for the other). A block is
transient in an iteration when it is allocated and its free completed inside it; every other
block live during the iteration is persistent there.

For each iteration, with full knowledge of that iteration's transient blocks (their order,
sizes and lifetimes, taken from the trace itself, so an oracle), a greedy planner places them in
one arena (largest first, each at the tightest gap left by the blocks already placed that
overlap it in time). Printed per trace:

- `arena / transient peak`: the worst iteration's arena over its own peak transient live bytes
  (1.0 when the greedy plan packs the iteration perfectly);
- `static bound`: the worst iteration's (largest persistent bytes + arena) over the trace's peak
  live bytes, what an allocator with a fixed arena per iteration beside the persistent blocks
  would reserve at most (persistent blocks packed without loss);
- `repeats`: the share of later iterations' transient allocations whose size equals the size
  at the same position in iteration 1, which a plan recorded there and applied by position
  could serve.

Each plan is checked independently of the planner: no two blocks whose lifetimes overlap may
overlap in the arena; a failed check exits 1.
"""

import bisect
import gzip
import os
import pickle
import sys

import numpy as np

BOUNDARY = os.environ.get("PLAN_BOUNDARY", "Optimizer.zero_grad")


def load(path):
    with (gzip.open(path) if path.endswith(".gz") else open(path, "rb")) as f:
        snap = pickle.load(f)
    events = max(snap["device_traces"], key=len)
    ends = sorted(a["time_us"] for a in snap.get("external_annotations") or []
                  if a.get("stage") == "END" and str(a.get("name", "")).startswith(BOUNDARY))
    return events, ends


def lifetimes(events):
    """(alloc index, free-completed index or len(events), size), in allocation order."""
    live, out = {}, []
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = (i, e["size"])
        elif e["action"] == "free_completed" and e["addr"] in live:
            start, size = live.pop(e["addr"])
            out.append((start, i, size))
    out += [(start, len(events), size) for start, size in live.values()]
    out.sort()
    return out


def peak(blocks, lo, hi):
    """The most bytes of `blocks` live at once within event indices [lo, hi)."""
    d = np.zeros(hi - lo + 1, dtype=np.int64)
    for s, e, z in blocks:
        s, e = max(s, lo), min(e, hi)
        if s < e:
            d[s - lo] += z
            d[e - lo] -= z
    return int(np.cumsum(d).max()) if len(blocks) else 0


def plan(blocks):
    """Offsets for `blocks` (start, end, size) in one arena, and the arena's size."""
    start = np.array([b[0] for b in blocks])
    end = np.array([b[1] for b in blocks])
    size = np.array([b[2] for b in blocks], dtype=np.int64)
    offset = np.zeros(len(blocks), dtype=np.int64)
    placed = np.zeros(len(blocks), dtype=bool)
    arena = 0
    for k in sorted(range(len(blocks)), key=lambda k: -blocks[k][2]):
        near = np.nonzero(placed & (start < end[k]) & (end > start[k]))[0]
        at = 0
        if len(near):
            order = np.argsort(offset[near])
            lo = offset[near][order]
            reach = np.maximum.accumulate(lo + size[near][order])
            gap_at = np.concatenate(([0], reach[:-1]))
            gaps = lo - gap_at
            fits = np.nonzero(gaps >= size[k])[0]
            at = gap_at[fits[np.argmin(gaps[fits])]] if len(fits) else reach[-1]
        offset[k], placed[k] = at, True
        arena = max(arena, int(at + size[k]))
    return offset, arena


def overlaps(blocks, offset):
    """Whether two blocks live at the same time share an address (a sweep, not the planner)."""
    sweep = sorted([(s, 1, k) for k, (s, _, _) in enumerate(blocks)]
                   + [(e, 0, k) for k, (_, e, _) in enumerate(blocks)])
    live = []
    for _, opens, k in sweep:
        span = (int(offset[k]), int(offset[k]) + blocks[k][2])
        if not opens:
            live.remove(span)
            continue
        i = bisect.bisect_left(live, span)
        if (i > 0 and live[i - 1][1] > span[0]) or (i < len(live) and live[i][0] < span[1]):
            return True
        live.insert(i, span)
    return False


def iterations(events, ends, blocks):
    """The event indices where iterations begin (and the end), and each iteration's transient
    blocks (allocated and freed inside it) by its index."""
    n = len(events)
    times = [e["time_us"] for e in events]
    cuts = sorted({0, n, *(bisect.bisect_right(times, t) for t in ends)})
    transient = {}
    for b in blocks:
        it = bisect.bisect_right(cuts, b[0]) - 1
        if b[1] < n and it == bisect.bisect_right(cuts, b[1]) - 1:
            transient.setdefault(it, []).append(b)
    return cuts, transient


def main(paths):
    bad = False
    print("| trace | iterations | arena / transient peak | static bound | repeats |")
    print("| --- | --- | --- | --- | --- |")
    for path in paths:
        events, ends = load(path)
        n = len(events)
        blocks = lifetimes(events)
        cuts, transient = iterations(events, ends, blocks)
        peak_live = peak(blocks, 0, n)
        name = os.path.basename(path).split(".")[0]
        if len(cuts) < 4:
            print(f"| {name} | {len(cuts) - 1} | no repeating iterations ({BOUNDARY} ends {len(ends)} times) | | |")
            continue
        worst_pack, worst_static, sizes = 0.0, 0.0, {}
        for it in range(len(cuts) - 1):
            mine = transient.get(it, [])
            if not mine:
                continue
            offset, arena = plan(mine)
            if overlaps(mine, offset):
                print(f"plan_bound: {name} iteration {it}: the plan overlaps live blocks", file=sys.stderr)
                bad = True
            own = set(mine)
            persistent = peak([b for b in blocks if b not in own], cuts[it], cuts[it + 1])
            worst_pack = max(worst_pack, arena / peak(mine, cuts[it], cuts[it + 1]))
            worst_static = max(worst_static, (persistent + arena) / peak_live)
            sizes[it] = [b[2] for b in mine]
        ref = sizes.get(1, [])
        later = [s for it, s in sizes.items() if it > 1]
        same = sum(sum(a == b for a, b in zip(s, ref)) for s in later)
        total = sum(len(s) for s in later)
        print(f"| {name} | {len(cuts) - 1} | {worst_pack:.4f} | {worst_static:.4f} | "
              f"{same:,} of {total:,} ({same / max(total, 1):.0%}) |")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
