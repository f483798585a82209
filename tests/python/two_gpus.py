"""Two ranks, one GPU each, with vram-ledger as PyTorch's allocator: all-reduce tagged tensors
over NCCL, profile, and see NCCL's own buffers as memory outside the allocator.

Marks, per rank (`marks.py`): the all-reduce is right, and memory outside the allocator grew
by at least 1 MiB while NCCL set up (its buffers; a missing figure misses). A rank that misses
one exits 1, and so does the script."""

import json
import os
import socket
import sys

from marks import Marks


def rank_main(rank, world, port):
    import vram_ledger as vl

    vl.install()
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    with vl.tag("weights"):
        w = torch.randn(64 << 20, device="cuda")  # 256 MiB of weights
    with vl.profile(0.3, device=rank) as p:
        dist.init_process_group("nccl", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}", device_id=torch.device("cuda", rank))
        with vl.tag("activation"):
            t = torch.full((64 << 20,), float(rank + 1), device="cuda")
            dist.all_reduce(t)
            torch.cuda.synchronize()
            ok = bool((t == sum(range(1, world + 1))).all())
            del t
    r = p.result
    before, after = r.get("non_allocator_baseline"), r.get("non_allocator")
    nccl = None if before is None or after is None else after - before
    m = Marks()
    m.true("all_reduce_ok", ok)
    m.at_least("nccl_outside_allocator", nccl, 1 << 20, 1 << 60)
    print("RESULT " + json.dumps({
        "rank": rank, "all_reduce_ok": ok, "weights": r["weights"], "activation_peak": r["activation_peak"],
        "non_allocator_before": before, "non_allocator_after": after,
        "nccl_outside_allocator": nccl, "kv_budget": r["kv_budget"],
        "source": r["source"], "report": p.report, "missed": m.missed(), "ok": m.ok,
    }), flush=True)
    dist.destroy_process_group()
    del w
    if not m.ok:
        sys.exit(1)


def main():
    import torch.multiprocessing as mp

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    mp.spawn(rank_main, args=(2, port), nprocs=2)


if __name__ == "__main__":
    main()
