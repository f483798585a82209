"""Host-side cost of torch.empty + del with many blocks cached and live, as a training step
leaves them: one process per configuration (PyTorch's allocator or install(mode)), each timing
the same seeded sequence. Prints one JSON object per configuration.

    python3 scripts/torch_population_bench.py [CONFIG ...]     (default: torch native remap torch native remap)

The sequence: LIVE tensors of sizes drawn from a training-like mix (512 B to 64 MiB, most of
them small) are made and half of them freed, so the cache holds thousands of free blocks of
every size class beside live ones; then OPS random steps each free a random live tensor or
make a new one. The figure is the mean wall time per step (Python's own cost included, the
same in every configuration); no kernel is launched, so the device does not wait.
"""

import json
import os
import random
import subprocess
import sys
import time

LIVE = int(os.environ.get("POP_LIVE", "6000"))
OPS = int(os.environ.get("POP_OPS", "200000"))


def sizes(rng, n):
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.6:
            out.append(rng.randrange(512, 1 << 20, 512))
        elif r < 0.9:
            out.append(rng.randrange(1 << 20, 16 << 20, 4096))
        else:
            out.append(rng.randrange(16 << 20, 64 << 20, 1 << 16))
    return out


def case(config):
    if config != "torch":
        import vram_ledger as vl

        vl.install(mode=config)
    import torch

    rng = random.Random("population")
    live = [torch.empty(s, dtype=torch.uint8, device="cuda") for s in sizes(rng, LIVE)]
    for i in range(len(live) - 1, -1, -2):
        del live[i]
    pool = sizes(rng, 4096)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for k in range(OPS):
        if live and rng.random() < 0.5:
            live.pop(rng.randrange(len(live)))
        else:
            live.append(torch.empty(pool[k % len(pool)], dtype=torch.uint8, device="cuda"))
    dt = time.perf_counter() - t0
    stats = torch.cuda.memory_stats()
    print(json.dumps({"config": config, "ops": OPS, "ns_per_op": round(dt / OPS * 1e9, 1),
                      "live_at_end": len(live), "reserved": torch.cuda.memory_reserved(),
                      "segments": stats.get("segment.all.current")}), flush=True)


def main(argv):
    if argv[:1] == ["_case"]:
        case(argv[1])
        return 0
    failed = False
    for config in argv or ["torch", "native", "remap", "torch", "native", "remap"]:
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "_case", config],
                           capture_output=True, text=True, timeout=300)
        sys.stdout.write(r.stdout)
        if r.returncode != 0 or not r.stdout.strip():
            print(json.dumps({"config": config, "ok": False, "stderr": r.stderr[-1500:]}))
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
