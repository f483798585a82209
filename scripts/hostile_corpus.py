#!/usr/bin/env python3
"""Writes tests/data/hostile/: snapshots that `vram-ledger replay` must refuse with one line and
exit code 2, or (the stream cases) replay in every mode. tests/hostile.rs states what each must
give; this script only makes them, the same bytes on every run.

    python3 scripts/hostile_corpus.py

The gzip bomb is not here: a deflate stream expands at most about 1,030 times, so a bomb past
the reader's 1 GiB limit is a megabyte or more; tests/hostile.rs writes one at run time.
"""

import gzip
import io
import os
import pickle
import random

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "hostile")
PROTO = b"\x80\x04"


def gz(data):
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0, compresslevel=9) as f:
        f.write(data)
    return buf.getvalue()


def event(action="alloc", addr=0x7F00_0000_0000, size=1 << 20, stream=0, **extra):
    e = {"action": action, "addr": addr, "size": size, "stream": stream,
         "time_us": 0, "frames": [], "user_metadata": ""}
    e.update(extra)
    return e


def snapshot(events):
    return pickle.dumps({"segments": [], "device_traces": [events],
                         "allocator_settings": {"expandable_segments": False}}, protocol=4)


def on_streams(handles):
    """Per stream: a segment, a block allocated, freed and its free completed, then a block
    that stays live; one block freed with work still pending on another stream."""
    events = []
    for i, s in enumerate(handles):
        base = 0x7F00_0000_0000 + (i << 32)
        events += [
            event("segment_alloc", base, 20 << 20, s),
            event("alloc", base, 2 << 20, s),
            event("free_requested", base, 2 << 20, s),
            event("free_completed", base, 2 << 20, s),
            event("alloc", base + (4 << 20), 4 << 20, s),
        ]
    last = 0x7E00_0000_0000
    events += [event("alloc", last, 8 << 20, handles[0]),
               event("free_requested", last, 8 << 20, handles[0]),
               event("alloc", last + (8 << 20), 8 << 20, handles[-1]),
               event("free_completed", last, 8 << 20, handles[0])]
    return snapshot(events)


def memo_chain(n):
    """Each tuple holds a reference to the one before: nesting carried by the memo."""
    body = b"]q\x00"
    for i in range(1, n + 1):
        body += b"j" + (i - 1).to_bytes(4, "little") + b"\x85r" + i.to_bytes(4, "little")
    return PROTO + body + b"."


def linked_after_fetch(n):
    """Empty lists memoised, then each appended to the one before through a fetched reference:
    nesting n deep that no single value shows when it is built."""
    body = b""
    for i in range(n):
        body += b"]r" + i.to_bytes(4, "little") + b"0"
    for i in range(n - 1):
        body += b"j" + i.to_bytes(4, "little") + b"j" + (i + 1).to_bytes(4, "little") + b"a0"
    return PROTO + body + b"j\x00\x00\x00\x00."


def memo_fan(n):
    """A list memoised before its n items (as Python's pickler writes it), then fetched n
    times: n * n values from 4n bytes."""
    return PROTO + b"]\x94(" + b"K\x01" * n + b"e0(" + b"h\x00" * n + b"l."


def files():
    n = 300_000
    yield "deep-lists.pickle.gz", gz(PROTO + b"]" * n + b"a" * (n - 1) + b".")
    yield "deep-marks.pickle.gz", gz(PROTO + b"(" * n + b"l" * n + b".")
    yield "deep-memo-chain.pickle", memo_chain(1000)
    yield "changed-after-fetch.pickle", linked_after_fetch(1000)
    yield "recursive-list.pickle", b"\x80\x02]q\x00h\x00a."
    yield "memo-written-twice.pickle", PROTO + b"]q\x00]q\x00."
    yield "memo-fan.pickle.gz", gz(memo_fan(20_000))
    yield "huge-text-integer.pickle.gz", gz(b"\x80\x02L" + b"9" * 3_000_000 + b"L\n.")
    yield "huge-binary-integer.pickle.gz", gz(
        PROTO + b"\x8b" + (2_000_000).to_bytes(4, "little") + b"\x07" * 2_000_000 + b"K\x01a.")
    yield "size-2-60.pickle", snapshot([event(size=1 << 60)])
    yield "size-2-62.pickle", snapshot([event(size=1 << 62)])
    yield "size-negative.pickle", snapshot([event(size=-4096)])
    yield "size-a-string.pickle", snapshot([event(size="4096")])
    yield "size-2-70.pickle", snapshot([event(size=1 << 70)])
    yield "addr-negative.pickle", snapshot([event(action="free_requested", addr=-1)])
    yield "addr-2-63.pickle", snapshot([event(addr=1 << 63)])
    yield "addr-a-float.pickle", snapshot([event(addr=1.5)])
    yield "stream-a-list.pickle", snapshot([event(stream=[7])])
    yield "metadata-an-integer.pickle", snapshot([event(user_metadata=3)])
    yield "action-missing.pickle", pickle.dumps({"device_traces": [[{"addr": 1}]]}, protocol=4)
    yield "entry-not-a-dict.pickle", pickle.dumps({"device_traces": [[7]]}, protocol=4)
    yield "traces-not-a-list.pickle", pickle.dumps({"device_traces": {"0": []}}, protocol=4)
    yield "no-devices.pickle", pickle.dumps({"device_traces": []}, protocol=4)
    yield "top-not-a-dict.pickle", pickle.dumps([1, 2, 3], protocol=4)
    yield "empty.pickle", b""
    yield "truncated.pickle", snapshot([event()] * 50)[:-200]
    truncated = gz(snapshot([event(addr=0x7F00_0000_0000 + (i << 21)) for i in range(2000)]))
    yield "truncated.pickle.gz", truncated[: len(truncated) // 2]
    yield "gzip-of-gzip.pickle.gz", gz(gz(snapshot([event()])))
    yield "too-many-streams.pickle.gz", gz(snapshot(
        [event(addr=0x7F00_0000_0000 + (i << 21), stream=0x7F00_0000_0000 + (i << 8))
         for i in range(1024)]))
    # The decoder sorts set members and dict keys; a NaN among them made its sort panic.
    nan = float("nan")
    yield "nan-set-member.pickle", pickle.dumps({nan, *range(1, 30)}, protocol=4)
    yield "nan-dict-key.pickle", pickle.dumps({nan: 0, **{i: 0 for i in range(1, 30)}}, protocol=4)
    yield "nan-text-float.pickle", b"\x80\x02(dp0\nFnan\nI0\ns" + b"".join(
        b"I%d\nI0\ns" % i for i in range(1, 30)) + b"."
    # Its order between floats and large integers is not total either: a set of both made the
    # sort panic (found by fuzzing).
    r = random.Random(1)
    mixed = set()
    for _ in range(300):
        k = r.randint(60, 200)
        mixed.add(r.choice([float(2**k) * r.random(), 2**k + r.randint(0, 5), -(2**k), -float(2**k) * r.random()]))
    yield "set-of-floats-and-integers.pickle", pickle.dumps(mixed, protocol=4)
    # The end state (`segments`), read to put back what was live before the recording.
    yield "segments-a-dict.pickle", pickle.dumps(
        {"segments": {"0": []}, "device_traces": [[event()]]}, protocol=4)
    seg = {"device": 0, "address": 0x7F00_0000_0000, "total_size": 2 << 20, "stream": 0,
           "blocks": [{"address": -1, "size": 512, "requested_size": 512, "state": "active_allocated"}]}
    yield "segment-block-negative.pickle", pickle.dumps(
        {"segments": [seg], "device_traces": [[event()]]}, protocol=4)
    yield "segment-size-2-62.pickle", pickle.dumps(
        {"segments": [dict(seg, total_size=1 << 62, blocks=[])], "device_traces": [[event()]]}, protocol=4)
    yield "pointer-stream.pickle", on_streams([0x7F12_3456_7000])
    yield "high-bit-streams.pickle", on_streams(
        [0, 1 << 59, (1 << 63) | 0x10, (1 << 64) - 1, -8, 0x7000_0000_0000, 0x7F12_3456_7000])


def main():
    os.makedirs(OUT, exist_ok=True)
    for name, data in files():
        with open(os.path.join(OUT, name), "wb") as f:
            f.write(data)
        print(f"{name}: {len(data)} bytes")


if __name__ == "__main__":
    main()
