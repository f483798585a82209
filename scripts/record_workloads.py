"""Record real PyTorch workloads with PyTorch's own allocator (no vram-ledger), as the memory
snapshots `vram-ledger replay` reads: kinds the shared traces lack, each run for a few steps.

    python3 scripts/record_workloads.py OUT_DIR [NAME ...] [--seed N] [--device cpu] [--timeout S]
                                        [--no-frames] [--max-entries N]

NAMES (default: all):
  serve-dyncache  continuous batching on a Llama (random weights, 2048 hidden, 8 layers) with
                  HF's DynamicCache: 24 requests of 64 to 3000 prompt tokens arrive, decode 16
                  to 187 tokens each and finish; one cache per request (every layer's cache
                  grows by a copy each step, so the trace holds about a million events)
  ckpt-train      a Llama trained with activation checkpointing on every layer, gradient
                  accumulation over 4 micro-batches, AdamW
  conv-train      a ResNet-style convolutional network (bottleneck blocks, channels_last, bf16
                  autocast) trained with SGD
  moe-train       a transformer whose feed-forward layers are 8 experts with top-2 routing
                  (tokens per expert change every step), trained with AdamW
  side-stream     training fed by a side stream that copies each batch from pinned host memory
                  and hands it over with `record_stream`

Each workload writes OUT_DIR/NAME-sSEED.pickle.gz (PyTorch's `_dump_snapshot`, gzipped) and
prints one JSON line: its steps, PyTorch's own peak reserved and peak allocated bytes and their
ratio, and the file's size. `--device cpu` runs the same code with tiny sizes and no recording
(a check of the workloads themselves, on a machine without a GPU). A different `--seed` gives
other request lengths, batch sizes and routing: traces to hold out of any tuning. `--timeout S`
gives each workload's process S seconds (it is then reported as failed). `--no-frames` records
no stack frames (replay reads only the events; a trace of millions of events then stays small
enough to move), and `--max-entries N` sizes the history (5,000,000 by default). A history that
filled up holds a trace cut short: the workload is then reported as failed, its file kept.

`WORKLOAD_STEPS=N` in the environment runs each training workload for N steps instead of its
own count (the traces in tests/data were recorded with their own counts).
"""

from __future__ import annotations

import gzip
import json
import os
import pickle
import random
import subprocess
import sys
import time


def autocast(torch, dev, small):
    """bf16 autocast on the GPU (the workloads' own precision), none in the CPU check."""
    return torch.autocast(device_type=dev.split(":")[0], dtype=torch.bfloat16, enabled=not small)


def training_steps(default):
    """A training workload's steps on the GPU: `default` (the recorded traces' count), or
    `WORKLOAD_STEPS` from the environment, for runs with more warm steps to time (the same
    seed then draws the same first steps)."""
    n = int(os.environ.get("WORKLOAD_STEPS") or default)
    if n < 1:
        raise ValueError(f"WORKLOAD_STEPS must be at least 1, not {n}")
    return n


def step(opt, loss):
    """One optimiser step on `loss`, gradients freed after it as training loops do."""
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def no_tick():
    """Each workload calls its `tick` at the end of a step (of a training loop; of an iteration
    of a serving loop), for a caller that times steps; recording times none."""


def llama(torch, hidden, layers, heads, vocab, device, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), vocab_size=vocab,
                      max_position_embeddings=4096)
    with torch.device(device):
        m = LlamaForCausalLM(cfg).to(dtype)
    return m


def serve_dyncache(torch, rng, dev, small, tick=no_tick):
    from transformers.cache_utils import DynamicCache

    # 8 layers, not a 1.1B model's 22: each layer's cache is copied to grow at every step of
    # every request, and with 22 layers and 41 requests the history filled 5,000,000 entries.
    m = llama(torch, 256 if small else 2048, 2 if small else 8, 4 if small else 32, 1000 if small else 32000,
              dev, torch.float32 if small else torch.bfloat16).eval()
    vocab = m.config.vocab_size
    n_requests = 6 if small else 24
    lo, hi = (8, 40) if small else (64, 3000)
    arrivals = sorted(rng.randrange(0, 20 if small else 120) for _ in range(n_requests))
    active, step, served = [], 0, 0
    with torch.no_grad():
        while served < n_requests or active:
            while served < n_requests and arrivals[served] <= step:
                prompt = rng.randint(lo, hi)
                ids = torch.randint(0, vocab, (1, prompt), device=dev)
                cache = DynamicCache()
                out = m(ids, past_key_values=cache, use_cache=True)
                active.append([out.logits[:, -1:].argmax(-1), cache, rng.randint(lo // 4, hi // 16)])
                served += 1
            for r in active:
                out = m(r[0], past_key_values=r[1], use_cache=True)
                r[0] = out.logits[:, -1:].argmax(-1)
                r[2] -= 1
            active = [r for r in active if r[2] > 0]
            step += 1
            tick()
    return step


def ckpt_train(torch, rng, dev, small, tick=no_tick):
    from torch.utils.checkpoint import checkpoint

    m = llama(torch, 256 if small else 1536, 2 if small else 24, 4 if small else 16, 1000 if small else 32000,
              dev, torch.float32)
    layers = m.model.layers
    for layer in layers:
        forward = layer.forward
        layer.forward = (lambda f: lambda *a, **k: checkpoint(f, *a, use_reentrant=False, **k))(forward)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    steps = 3 if small else training_steps(6)
    for _ in range(steps):
        for _ in range(4):
            seq = rng.choice([64, 96, 128]) if small else rng.choice([1024, 1536, 2048])
            ids = torch.randint(0, m.config.vocab_size, (2 if small else 4, seq), device=dev)
            with autocast(torch, dev, small):
                loss = m(ids, labels=ids).loss / 4
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        tick()
    return steps


def conv_net(torch, width, blocks):
    nn = torch.nn

    class Bottleneck(nn.Module):
        def __init__(self, cin, mid, stride):
            super().__init__()
            cout = mid * 4
            self.body = nn.Sequential(
                nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(inplace=True),
                nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(inplace=True),
                nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout))
            self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else nn.Identity())

        def forward(self, x):
            return torch.relu(self.body(x) + self.skip(x))

    layers = [nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
    cin = width
    for stage, n in enumerate(blocks):
        mid = width * 2 ** stage
        for b in range(n):
            layers.append(Bottleneck(cin, mid, 2 if b == 0 and stage > 0 else 1))
            cin = mid * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 1000)]
    return nn.Sequential(*layers)


def conv_train(torch, rng, dev, small, tick=no_tick):
    m = conv_net(torch, 8 if small else 64, [1, 1, 1, 1] if small else [3, 4, 6, 3]).to(dev)
    m = m.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    steps = 3 if small else training_steps(8)
    for _ in range(steps):
        batch = 4 if small else rng.choice([48, 64])
        side = 64 if small else 224
        x = torch.randn(batch, 3, side, side, device=dev).to(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (batch,), device=dev)
        with autocast(torch, dev, small):
            loss = torch.nn.functional.cross_entropy(m(x), y)
        step(opt, loss)
        tick()
    return steps


def moe_train(torch, rng, dev, small, tick=no_tick):
    nn = torch.nn
    d, experts, layers = (64, 4, 2) if small else (1024, 8, 8)

    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(d, experts, bias=False)
            self.w1 = nn.ModuleList(nn.Linear(d, 4 * d) for _ in range(experts))
            self.w2 = nn.ModuleList(nn.Linear(4 * d, d) for _ in range(experts))

        def forward(self, x):
            flat = x.reshape(-1, d)
            weight, which = torch.topk(torch.softmax(self.gate(flat), -1), 2, dim=-1)
            out = torch.zeros_like(flat)
            for e in range(experts):
                rows, slot = torch.nonzero(which == e, as_tuple=True)
                if rows.numel():
                    h = self.w2[e](torch.relu(self.w1[e](flat[rows])))
                    out.index_add_(0, rows, h * weight[rows, slot].unsqueeze(-1))
            return x + out.reshape(x.shape)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(d, 4 if small else 16, batch_first=True)
            self.moe = MoE()
            self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)

        def forward(self, x):
            h = self.n1(x)
            x = x + self.attn(h, h, h, need_weights=False)[0]
            return self.moe(self.n2(x))

    m = nn.Sequential(*[Block() for _ in range(layers)]).to(dev)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    steps = 3 if small else training_steps(8)
    for _ in range(steps):
        batch, seq = (2, rng.choice([16, 32])) if small else (rng.choice([4, 8]), rng.choice([512, 1024, 2048]))
        x = torch.randn(batch, seq, d, device=dev)
        with autocast(torch, dev, small):
            loss = m(x).float().pow(2).mean()
        step(opt, loss)
        tick()
    return steps


def side_stream(torch, rng, dev, small, tick=no_tick):
    nn = torch.nn
    d = 64 if small else 4096
    m = nn.Sequential(*[nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(2 if small else 6)]).to(dev)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    cuda = dev.startswith("cuda")
    copier = torch.cuda.Stream() if cuda else None
    steps = 3 if small else training_steps(12)
    rows = [8, 16] if small else [2048, 4096, 6144]
    host = [torch.randn(r, d, pin_memory=cuda) for r in rows]
    for _ in range(steps):
        src = host[rng.randrange(len(host))]
        if cuda:
            with torch.cuda.stream(copier):
                x = src.to(dev, non_blocking=True)
            torch.cuda.current_stream().wait_stream(copier)
            x.record_stream(torch.cuda.current_stream())
        else:
            x = src.to(dev)
        loss = m(x).pow(2).mean()
        step(opt, loss)
        del x
        tick()
    return steps


WORKLOADS = {
    "serve-dyncache": serve_dyncache,
    "ckpt-train": ckpt_train,
    "conv-train": conv_train,
    "moe-train": moe_train,
    "side-stream": side_stream,
}


def main(argv):
    seed, device, timeout, frames, max_entries = 0, "cuda", None, True, 5_000_000
    args = []
    it = iter(argv)
    for a in it:
        if a == "--seed":
            seed = int(next(it))
        elif a == "--device":
            device = next(it)
        elif a == "--timeout":
            timeout = float(next(it))
        elif a == "--no-frames":
            frames = False
        elif a == "--max-entries":
            max_entries = int(next(it))
        else:
            args.append(a)
    if not args:
        print(__doc__)
        return 2
    out_dir, names = args[0], args[1:] or list(WORKLOADS)
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        print(f"unknown workload {unknown}: one of {list(WORKLOADS)}", file=sys.stderr)
        return 2
    os.makedirs(out_dir, exist_ok=True)
    if len(names) > 1:
        # One process per workload: each trace starts from an empty allocator, as the traces
        # replay assumes, whatever the workload before it left cached or loaded.
        rc = 0
        for name in names:
            extra = ["--seed", str(seed), "--device", device, "--max-entries", str(max_entries)]
            extra += [] if frames else ["--no-frames"]
            try:
                rc |= subprocess.run([sys.executable, os.path.abspath(__file__), out_dir, name, *extra],
                                     timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                print(json.dumps({"workload": name, "seed": seed, "ok": False, "error": f"over {timeout} s"}), flush=True)
                rc = 1
        return 1 if rc else 0
    import torch

    small = device == "cpu"
    failed = False
    for name in names:
        rng = random.Random(f"{name}-{seed}")
        torch.manual_seed(seed)
        record = device.startswith("cuda")
        if record:
            # Python frames only: C++ frames cost a symbolisation per allocation, and replay reads
            # only the events.
            torch.cuda.memory._record_memory_history(context="all" if frames else None, stacks="python",
                                                     max_entries=max_entries)
        t0 = time.perf_counter()
        try:
            steps = WORKLOADS[name](torch, rng, device, small)
        except Exception as e:  # noqa: BLE001 - reported, and the next workload still runs
            print(json.dumps({"workload": name, "seed": seed, "ok": False, "error": repr(e)[:500]}))
            failed = True
            if record:
                torch.cuda.memory._record_memory_history(enabled=None)
            continue
        line = {"workload": name, "seed": seed, "ok": True, "steps": steps, "seconds": round(time.perf_counter() - t0, 2)}
        if record:
            torch.cuda.synchronize()
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            path = os.path.join(out_dir, f"{name}-s{seed}.pickle.gz")
            with gzip.open(path, "wb") as f:
                pickle.dump(snap, f)
            reserved, allocated = torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()
            events = sum(len(t) for t in snap.get("device_traces", []))
            line.update(file=path, bytes=os.path.getsize(path), events=events, peak_reserved=reserved,
                        peak_allocated=allocated, pytorch_ratio=round(reserved / max(allocated, 1), 4))
            if events >= max_entries:
                line.update(ok=False, error=f"the history filled its {max_entries} entries: the trace is cut short")
                failed = True
        print(json.dumps(line), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
