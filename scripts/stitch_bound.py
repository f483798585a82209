"""What stitching could reach (GMLake's idea), from a PyTorch memory snapshot: fragmentation,
and whether its mapping calls settle in the later steps, beside remap's moves.

    python3 scripts/stitch_bound.py TRACE.pickle[.gz] ...

The policy sketched: large-pool memory is physical chunks of one granule (2 MiB), each its own
handle, never moved or unmapped. A large block takes whole chunks. An allocation reuses a cached
virtual block of exactly its chunk count whose chunks are all free (no driver call); otherwise
it stitches free chunks (the lowest first, creating new ones for what is missing) into a new
virtual block, one map per chunk, and caches that block. A separate record of which live block holds each chunk
checks that no chunk is ever handed out twice (exit 1 if it were). A chunk can so be mapped in several
blocks at once; a block is free to reuse only when none of its chunks is in use through
another. The small pool (blocks of at most 1 MiB) is taken as PyTorch recorded it (its 2 MiB
segments), for both this sketch and the trace.

Optimistic where a real allocator could not be: a chunk is reusable at its block's
`free_completed` on any stream (no event waits), and cached blocks are never dropped. So the
fragmentation is about the floor for 2 MiB chunks, and the calls are a lower bound for this
policy. Printed per trace: peak reserved over peak live (live until `free_completed`, as the
replay counts it), the stitches and maps per tenth of the trace's events, chunks created, and
the most mappings held at once (every map made, since no block is dropped).
"""

import gzip
import heapq
import os
import pickle
import sys

GRANULE = 2 << 20
SMALL = 1 << 20


def load(path):
    with (gzip.open(path) if path.endswith(".gz") else open(path, "rb")) as f:
        snap = pickle.load(f)
    return max(snap["device_traces"], key=len)


class Stitcher:
    def __init__(self):
        self.chunks = 0
        self.free = set()  # chunks in use through no block
        self.blocks = []  # chunk ids of each cached virtual block
        self.busy = []  # per block: how many of its chunks are in use
        self.holders = []  # per chunk: the blocks that map it
        self.ready = {}  # chunk count -> ids of blocks with every chunk free
        self.stitches = self.maps = self.reused = 0
        self.owner = {}  # chunk -> the live block using it, kept apart from `busy` as a check

    def _use(self, chunk, delta):
        for b in self.holders[chunk]:
            was = self.busy[b]
            self.busy[b] += delta
            if was == 0:
                self.ready[len(self.blocks[b])].discard(b)
            elif self.busy[b] == 0:
                self.ready[len(self.blocks[b])].add(b)

    def alloc(self, size):
        n = -(-size // GRANULE)
        ready = self.ready.get(n)
        if ready:
            b = min(ready)
            self.reused += 1
        else:
            take = heapq.nsmallest(n, self.free)
            while len(take) < n:
                take.append(self.chunks)
                self.holders.append([])
                self.chunks += 1
            b = len(self.blocks)
            self.blocks.append(take)
            self.busy.append(0)
            self.ready.setdefault(n, set()).add(b)
            for c in take:
                self.holders[c].append(b)
            self.stitches += 1
            self.maps += n
        for c in self.blocks[b]:
            if c in self.owner:
                raise AssertionError(f"chunk {c} handed out through block {b} while block {self.owner[c]} uses it")
            self.owner[c] = b
            self._use(c, 1)
            self.free.discard(c)
        return b

    def release(self, b):
        for c in self.blocks[b]:
            del self.owner[c]
            self._use(c, -1)
            self.free.add(c)


def run(events):
    s = Stitcher()
    live, live_bytes, small_reserved = {}, 0, 0
    peak_live = peak_reserved = 0
    tenths = [[0, 0] for _ in range(10)]
    for i, e in enumerate(events):
        a, size = e["action"], e.get("size", 0)
        if a == "segment_alloc" and size == GRANULE:
            small_reserved += size
        elif a == "segment_free" and size == GRANULE:
            small_reserved -= size
        elif a == "alloc":
            live_bytes += size
            b = None
            if size > SMALL:
                before = (s.stitches, s.maps)
                b = s.alloc(size)
                t = tenths[i * 10 // len(events)]
                t[0] += s.stitches - before[0]
                t[1] += s.maps - before[1]
            live[e["addr"]] = (size, b)
        elif a == "free_completed" and e["addr"] in live:
            size, b = live.pop(e["addr"])
            live_bytes -= size
            if b is not None:
                s.release(b)
        peak_live = max(peak_live, live_bytes)
        peak_reserved = max(peak_reserved, s.chunks * GRANULE + small_reserved)
    return s, peak_live, peak_reserved, tenths


def main(paths):
    print("| trace | fragmentation | stitches (maps) by tenth of the trace | chunks created | allocations reusing a block | most mappings held |")
    print("| --- | --- | --- | --- | --- | --- |")
    for path in paths:
        try:
            s, peak_live, peak_reserved, tenths = run(load(path))
        except AssertionError as e:
            print(f"stitch_bound: {path}: {e}", file=sys.stderr)
            return 1
        name = os.path.basename(path).split(".")[0]
        by_tenth = " ".join(f"{st} ({mp})" for st, mp in tenths)
        print(f"| {name} | {peak_reserved / peak_live:.4f} | {by_tenth} | {s.chunks:,} | "
              f"{s.reused:,} of {s.reused + s.stitches:,} | {s.maps:,} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
