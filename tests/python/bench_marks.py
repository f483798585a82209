"""The cached path against PyTorch's caching allocator, from one run of both benchmarks
(`bin/gpu_bench` and `scripts/torch_alloc_bench.py`, their JSON lines in one file):

    python3 tests/python/bench_marks.py GPU_BENCH_JSONL

Marks (`marks.py`): for each size both measured (512B, 1MiB, 20MiB) and for 64 mixed sizes, a
vram-ledger cached pair takes less time than PyTorch's raw_alloc + raw_delete of the same
size. A size either side did not report misses. Prints one JSON line; exits 1 on a miss.
`VRAM_LEDGER_TIGHTEN=faster_than_torch_SIZE` asks for 1000 times faster, to see it fail.
"""

import json
import sys

from marks import Marks

SIZES = ["512B", "1MiB", "20MiB", "mixed"]


def readings(lines):
    """(ours, PyTorch's) ns per pair by size, from the benchmarks' JSON lines."""
    ours, theirs = {}, {}
    for line in lines:
        line = line.strip()
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        what = r.get("what", "")
        if what == "vram-ledger cached pair":
            ours[r["size"]] = r["ns_per_pair"]
        elif what == "vram-ledger mixed 64":
            ours["mixed"] = r["ns_per_pair"]
        elif what == "PyTorch native raw_alloc+raw_delete":
            theirs[r["size"]] = r["ns_per_pair"]
        elif what == "PyTorch native mixed 64":
            theirs["mixed"] = r["ns_per_pair"]
    return ours, theirs


def check(ours, theirs):
    m = Marks()
    for size in SIZES:
        mine, torch = ours.get(size), theirs.get(size)
        ratio = None if mine is None or not torch else mine / torch
        m.at_most(f"faster_than_torch_{size}", ratio, 1.0, 0.001)
    return m


def main(argv):
    if len(argv) != 1:
        print(__doc__)
        return 2
    with open(argv[0]) as f:
        ours, theirs = readings(f)
    m = check(ours, theirs)
    print(json.dumps({"ours_ns": ours, "torch_ns": theirs, "marks": m.met, "missed": m.missed(), "ok": m.ok}))
    return 0 if m.ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
