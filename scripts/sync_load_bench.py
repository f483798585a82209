#!/usr/bin/env python3
"""What a stream or device synchronisation costs in the middle of real work, the price the
replay's driver-time estimate should give the synchronisations an allocator makes when it moves
memory (`src/driver/cost.rs` prices one on an idle stream).

`tests/python/h200_step_cost.py`'s training loop (a Llama of 1024 hidden and 12 layers, fp32
weights, bf16 autocast, activation checkpointing, AdamW; two micro-batches of 4 sequences of
512, 1024 or 1536 tokens, seeded) under PyTorch's own allocator. Steps alternate: a plain step,
then one where a synchronisation is made at SYNCS_PER_STEP points chosen at random among the
decoder layers' forward and backward calls (the places where an allocation, and so a move,
would happen), alternately of the current stream and of the device. Reported, in µs:

- wait: how long each synchronisation call itself blocked (the GPU work queued behind the host);
- cost per sync: each synced step against the median of the plain steps of the same shapes
  (steps without such a plain step are left out: `paired_steps`), divided by the syncs per
  step: what each one added to the step, the overlap lost included; the median and mean over
  those steps. This is the figure to price a synchronisation with.

    python3 scripts/sync_load_bench.py [STEPS]     (default 24: 12 plain, 12 with syncs)

Prints one JSON object. Exits 1 when a reading is missing (no step of either kind timed).
"""

import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

# The training loop of `tests/python/h200_step_cost.py`: the step whose cost is measured there.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "python"))
import h200_step_cost  # noqa: E402

SYNCS_PER_STEP = int(os.environ.get("SYNCS_PER_STEP", "16"))


def main(argv):
    import torch

    steps = int(argv[0]) if argv else 24
    rng = random.Random("sync")
    m, opt = h200_step_cost.checkpointed_llama(torch)

    waits = {"stream": [], "device": []}
    state = {"points": set(), "calls": 0, "kind": 0}

    def maybe_sync():
        i = state["calls"]
        state["calls"] += 1
        if i not in state["points"]:
            return
        kind = "stream" if state["kind"] % 2 == 0 else "device"
        state["kind"] += 1
        t0 = time.perf_counter()
        if kind == "stream":
            torch.cuda.current_stream().synchronize()
        else:
            torch.cuda.synchronize()
        waits[kind].append((time.perf_counter() - t0) * 1e6)

    def before_layer(_module, args, kwargs):
        # A point in the forward, and one in the backward: when the gradient of the layer's
        # input is computed (a tensor hook, which checkpointing leaves alone).
        maybe_sync()
        x = args[0] if args else kwargs.get("hidden_states")
        if torch.is_tensor(x) and x.requires_grad:
            x.register_hook(lambda _grad: maybe_sync())

    for layer in m.model.layers:
        layer.register_forward_pre_hook(before_layer, with_kwargs=True)

    def step(seqs):
        h200_step_cost.train_step(torch, m, opt, seqs)

    # Hook calls per step: each layer's forward and its input's gradient, per micro-batch (the
    # recomputed forward calls the layer's own forward, which has no hook).
    calls_per_step = None
    plain, synced = [], []
    # Two untimed steps first: kernels loaded and the cache filled.
    for s in range(steps + 2):
        seqs = [1024, 1024] if s < 2 else [rng.choice([512, 1024, 1536]) for _ in range(2)]
        with_syncs = s >= 2 and s % 2 == 1 and calls_per_step
        state["calls"] = 0
        state["points"] = set(rng.sample(range(calls_per_step), SYNCS_PER_STEP)) if with_syncs else set()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(seqs)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        calls_per_step = calls_per_step or state["calls"]
        if s >= 2:
            (synced if with_syncs else plain).append((dt, seqs))

    def med(xs):
        return round(statistics.median(xs), 1) if xs else None

    # Pair each synced step with plain steps of the same shapes where there are any: the
    # sequence lengths move a step's time far more than a few synchronisations do.
    extra = []
    for dt, seqs in synced:
        same = [p for p, q in plain if sorted(q) == sorted(seqs)]
        if same:
            extra.append((dt - statistics.median(same)) * 1e6 / SYNCS_PER_STEP)
    out = {
        "what": "synchronisation under load",
        "model": "llama 1024x12, checkpointed training, bf16 autocast",
        "syncs_per_step": SYNCS_PER_STEP,
        "hook_calls_per_step": calls_per_step,
        "plain_steps": len(plain),
        "synced_steps": len(synced),
        "paired_steps": len(extra),
        "plain_step_median_ms": med([p * 1e3 for p, _ in plain]),
        "wait_us": {k: {"n": len(v), "median": med(v), "mean": round(statistics.fmean(v), 1) if v else None,
                        "p90": round(sorted(v)[int(0.9 * (len(v) - 1))], 1) if v else None} for k, v in waits.items()},
        "cost_per_sync_us": {"median": med(extra), "mean": round(statistics.fmean(extra), 1) if extra else None},
    }
    print(json.dumps(out))
    ok = plain and synced and extra and all(waits.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
