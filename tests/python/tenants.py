"""Another process on the GPU, without vram-ledger, for the scripts that serve beside one.

    python3 tenants.py hold    keeps 70% of the device until killed
    python3 tenants.py churn   allocates and frees 10 GiB every 30 ms until killed

`beside(kind)` runs one for the length of a `with` block: it returns once the tenant holds its
memory (the tenant prints READY then), and kills it when the block ends, also on an error, so
that no tenant outlives the case that wanted it.
"""

import contextlib
import subprocess
import sys
import time

KINDS = ("hold", "churn")


def run(kind):
    import torch

    if kind == "hold":
        x = torch.empty(int(torch.cuda.get_device_properties(0).total_memory * 0.7), dtype=torch.uint8, device="cuda")
        x.fill_(1)
        print("READY", flush=True)
        # Killed by `beside`; the bound only keeps a tenant whose parent died from staying.
        time.sleep(3600)
    else:
        print("READY", flush=True)
        while True:
            x = torch.empty(10 << 30, dtype=torch.uint8, device="cuda")
            x.fill_(1)
            torch.cuda.synchronize()
            del x
            torch.cuda.empty_cache()
            time.sleep(0.03)


@contextlib.contextmanager
def beside(kind, command=None):
    """A tenant of `kind` running for the `with` block (`command`: what to run instead, for
    tests without a GPU). Raises RuntimeError when it ends without saying READY."""
    if kind not in KINDS:
        raise ValueError(f"no tenant {kind!r}: one of {', '.join(KINDS)}")
    p = subprocess.Popen(command or [sys.executable, __file__, kind], stdout=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline().strip()
        if line != "READY":
            raise RuntimeError(f"tenant {kind!r} did not start: it printed {line!r}, exit {p.poll()}")
        yield p
    finally:
        p.kill()
        p.wait()


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in KINDS:
        sys.exit(f"usage: tenants.py {{{'|'.join(KINDS)}}}")
    run(sys.argv[1])
