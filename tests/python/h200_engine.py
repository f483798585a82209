"""The budget contract in the order engines work, on a real GPU: load weights, profile, reserve
the KV cache, capture CUDA graphs of several batch sizes against it, commit the KV cache, serve,
commit it again from what serving reserved, serve a mix in another order.
One process per engine (installing the allocator is permanent for a process); one JSON line per
engine; exit 1 when any engine misses a mark (a missing reading is a miss).

    python3 tests/python/h200_engine.py [torch] [alone] [hold] [churn] [together] [resize]

The engine is small but does what a paged engine does with memory: a transformers model's
forward (random bf16 weights) whose last hidden states are written into, and read back from, a
paged KV tensor by block table, inside each captured decode graph (so the graphs read and write
the KV cache at fixed addresses). Marks, per engine:
- peak usage (this process's NVML usage, polled every 2 ms from a thread, through NVML directly)
  within [99.5%, 100%] of the requested memory;
- no forward refused while serving (prefills of other shapes, graph replays);
- every graph replay as close to the eager step as with PyTorch's own allocator (the `torch`
  case measures that, in the same run; without it, the replay must equal eager exactly);
- no poll unanswered by NVML once the process was listed (a lost reading may be the peak);
- resize: the KV cache grew at the same base, and the peak before the cap was raised stayed
  within the first request.
Every engine asked for must report (a misspelt scenario fails). `VRAM_LEDGER_TIGHTEN=MARK`
makes the named mark miss in every engine (`marks.py`), to see the script fail.
Scenarios: alone; beside a process holding 70% of the device (hold); beside one that takes and
frees 10 GiB every 30 ms (churn); three different engines started together; and resize: two
engines share the GPU, one exits, the other's cap is raised and its KV cache grows in place.
Every mode runs the same flow (the KV cache's range is reserved in native mode too).
"""

import contextlib
import json
import os
import subprocess
import sys
import time

from marks import Marks
from nvml import Poller
import tenants

MODES = ["native", "expandable", "compact", "remap"]
BATCHES = [1, 2, 4, 8]
BLOCK_TOKENS = 16

# (transformers class, config, largest prefill, other prefill shapes).
MODELS = {
    "llama": ("Llama", dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                            num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=2048),
              (8, 512), [(4, 256), (2, 512), (8, 384), (1, 512), (8, 512), (6, 300), (3, 100)]),
    "qwen2": ("Qwen2", dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=16,
                            num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=4096),
              (4, 1024), [(2, 1024), (4, 512), (1, 1000), (4, 1024), (3, 700), (8, 128), (4, 1000)]),
}
MODELS["llama4"] = ("Llama", dict(MODELS["llama"][1], num_hidden_layers=4), (16, 256),
                    [(8, 256), (16, 200), (4, 512), (16, 256), (2, 64), (12, 300), (1, 1000)])


def emit(**kv):
    print("RESULT " + json.dumps(kv), flush=True)


def build(name):
    import torch
    import transformers

    kind, cfg, _, _ = MODELS[name]
    config = getattr(transformers, kind + "Config")(**cfg)
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = getattr(transformers, kind + "ForCausalLM")(config).to(dtype=torch.bfloat16).eval()
    return m


class Engine:
    """The model, its paged KV geometry, and one decode step that reads and writes the cache."""

    def __init__(self, name):
        import torch

        _, cfg, self.largest, self.shapes = MODELS[name]
        self.name, self.vocab = name, cfg["vocab_size"]
        self.layers = cfg["num_hidden_layers"]
        self.heads = cfg["num_key_value_heads"]
        self.head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
        # One block: K and V of every layer for BLOCK_TOKENS tokens.
        self.block_shape = (2, self.layers, BLOCK_TOKENS, self.heads, self.head_dim)
        self.block_bytes = 2 * self.layers * BLOCK_TOKENS * self.heads * self.head_dim * 2
        self.m = build(name)
        self.torch = torch

    def step(self, cache, ids, table, slot):
        """One decode token per sequence: the model's forward, its last hidden state written as
        this token's K and V into the sequence's block (`table`) at `slot` of every layer, and the
        sequence's cached entries read back into the result."""
        torch = self.torch
        out = self.m(input_ids=ids, output_hidden_states=True, use_cache=False)
        h = out.hidden_states[-1][:, -1]  # (B, hidden)
        kv = h[:, : self.heads * self.head_dim].reshape(-1, 1, self.heads, self.head_dim).to(torch.bfloat16)
        for layer in range(self.layers):
            cache[table, 0, layer, slot] = kv[:, 0]
            cache[table, 1, layer, slot] = kv[:, 0] * 0.5
        read = cache[table, :, :, : BLOCK_TOKENS].float().sum(dim=(1, 2, 3, 4, 5))
        return out.logits[:, -1].float() + read[:, None]

    def prefill(self, shape):
        ids = self.torch.randint(0, self.vocab, shape, device="cuda")
        return float(self.m(ids).logits[:, -1].float().sum().item())

    def capture(self, cache, blocks):
        """A graph per batch size, with static inputs; blocks `blocks[b]` for batch `b`."""
        torch = self.torch
        graphs = {}
        pool = None
        for b in BATCHES:
            ids = torch.randint(0, self.vocab, (b, 1), device="cuda")
            table = torch.tensor(blocks[b], device="cuda")
            slot = 3  # a Python int: a tensor index would be read back to the host, in a capture
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    self.step(cache, ids, table, slot)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                out = self.step(cache, ids, table, slot)
            pool = g.pool()
            graphs[b] = (g, ids, table, slot, out)
        return graphs


def plan(first):
    """The blocks each batch size's graph reads and writes: spread over the first `first`
    blocks, the same in every run."""
    step = max(1, first // (2 * sum(BATCHES)))
    out, nxt = {}, 0
    for b in BATCHES:
        out[b] = [min(first - 1, (nxt + i) * step) for i in range(b)]
        nxt += b
    return out


# Blocks mapped for warm-up and capture, and spanned by the graphs' block tables.
FIRST_BLOCKS = 4 * sum(BATCHES)


def replay_diffs(engine, cache, graphs, rounds=2):
    """Each graph replayed with new inputs against the eager step on the same inputs, from a
    zeroed cache, with inputs from a seeded generator: the same computation in every run, so the
    largest difference is comparable across allocators."""
    torch = engine.torch
    gen = torch.Generator(device="cuda")
    gen.manual_seed(1234)
    cache[:FIRST_BLOCKS].zero_()
    worst = 0.0
    for _ in range(rounds):
        for b, (g, ids, table, slot, out) in graphs.items():
            ids.copy_(torch.randint(0, engine.vocab, ids.shape, device="cuda", generator=gen))
            g.replay()
            ref = engine.step(cache, ids, table, slot)
            torch.cuda.synchronize()
            worst = max(worst, float((out - ref).abs().max()))
    return worst


def case_torch(name):
    """The same engine under PyTorch's own allocator (a plain KV tensor): how close a replay is
    to the eager step with it."""
    import torch

    with torch.no_grad():
        e = Engine(name)
        cache = torch.zeros((FIRST_BLOCKS, *e.block_shape), dtype=torch.bfloat16, device="cuda")
        graphs = e.capture(cache, plan(FIRST_BLOCKS))
        before = replay_diffs(e, cache, graphs, rounds=1)
        after = replay_diffs(e, cache, graphs)
        emit(case="torch", model=name, max_abs_diff=max(before, after), ok=True)


def case_engine(mode, utilization, name, reference, grow_to=None):
    """One engine in the order engines work. `reference`: PyTorch's replay difference for this
    model (or "none": the replay must equal eager). `grow_to`: after serving, wait for a file
    that says the co-tenant left, raise the cap to that fraction of the device and grow the KV
    cache in place (the resize case)."""
    utilization = float(utilization)
    import vram_ledger as vl

    vl.install(mode=mode)
    import torch

    poll = Poller()
    poll.start()
    with torch.no_grad():
        with vl.tag("weights"):
            e = Engine(name)
        t_profile = time.time()
        big = e.largest
        with vl.profile(utilization) as p:
            with vl.tag("activation"):
                e.prefill(big)
        requested = p.result["requested"]
        # The KV cache: its whole range reserved, a prefix for warm-up and capture; the graphs'
        # blocks spread over it.
        with vl.tag("kv"):
            kv = vl.kv_reserve(e.block_bytes, initial_blocks=FIRST_BLOCKS)
            cache = kv.tensor(torch.bfloat16, e.block_shape)
        first = kv.usable_blocks
        graphs = e.capture(cache, plan(FIRST_BLOCKS))
        diff_before = replay_diffs(e, cache, graphs, rounds=1)
        c = kv.commit()
        t_commit = time.time()
        first_commit = kv.usable_blocks
        refused, last = [], None

        def serve(shapes, label):
            nonlocal last
            for shape in shapes:
                try:
                    with vl.tag("activation"):
                        e.prefill(shape)
                except RuntimeError as err:
                    refused.append([label, *shape])
                    last = str(err)[:300]

        serve(e.shapes, "first")
        # Serving writes the whole committed cache: every usable block is backed.
        cache[: kv.usable_blocks].fill_(1)
        torch.cuda.synchronize()
        diff_after = replay_diffs(e, cache, graphs)
        torch.cuda.synchronize()
        # Committed again now that serving has run its largest batches, then a mix in another
        # order (other cuts of the same segments) with every usable block written.
        c2 = kv.commit()
        cache[: kv.usable_blocks].fill_(3)
        torch.cuda.synchronize()
        serve(list(reversed(e.shapes)), "after recommit")
        diff_after = max(diff_after, replay_diffs(e, cache, graphs))
        torch.cuda.synchronize()
        grown = None
        if grow_to is not None:
            flag = os.environ["ENGINE_FLAG"]
            deadline = time.time() + 120
            while not os.path.exists(flag) and time.time() < deadline:
                time.sleep(0.05)
            before = kv.usable_blocks
            # The first request held until the cap is raised: its peak is checked against it.
            time.sleep(0.05)
            peak_before_growth = poll.snapshot()
            vl.set_cap(int(torch.cuda.get_device_properties(0).total_memory * float(grow_to)))
            g = kv.commit()
            cache[: kv.usable_blocks].fill_(2)  # more sequences' blocks in use, in place
            torch.cuda.synchronize()
            serve(e.shapes, "after growth")
            grown = dict(before=before, after=kv.usable_blocks, base_kept=g["kv"]["base"] == kv.base,
                         cap=vl.cap(), replay_diff=replay_diffs(e, cache, graphs),
                         requested_before=requested, peak_before_growth=peak_before_growth)
            requested = vl.cap()
    poll.finish()
    peak = poll.peak if poll.samples else None
    ratio = None if peak is None else peak / requested
    limit = None if reference == "none" else float(reference)
    worst = max(diff_before, diff_after, (grown or {}).get("replay_diff", 0.0))
    checks = {
        "peak_read": peak is not None,
        "within": peak is not None and peak <= requested,
        "at_least_99_5": ratio is not None and ratio >= 0.995,
        "no_forward_refused": not refused,
        "replay_as_with_torch": worst == 0.0 if limit is None else worst <= limit,
        # A poll NVML did not answer once the process was listed may have been the peak.
        "no_reading_missed": poll.samples > 0 and poll.misses_after_first == 0,
    }
    if grown is not None:
        checks["grew_in_place"] = grown["after"] > grown["before"] and grown["base_kept"]
        pb = grown["peak_before_growth"]
        checks["within_before_growth"] = pb is not None and pb <= grown["requested_before"]
    marks = Marks.of(checks)
    emit(case="engine", model=name, mode=mode, utilization=utilization, requested=requested,
         kv_blocks=kv.usable_blocks, kv_bytes=kv.usable_blocks * e.block_bytes, kv_first_blocks=first,
         kv_blocks_first_commit=first_commit, transient_after_serving=c2["room"]["transient"],
         served_rise=c2["room"]["served_rise"],
         graph_pools=c["room"]["graph_pools"], outside_at_commit=c["room"]["outside"],
         eager_now=c["room"]["eager_now"], transient=c["room"]["transient"], margin=c["room"]["margin"], peak_usage=peak,
         peak_over_requested=ratio, samples=poll.samples, nvml_misses=poll.misses,
         nvml_misses_after_first=poll.misses_after_first, refused=refused,
         last_refusal=last, replay_diff=worst, torch_replay_diff=limit, grown=grown,
         seconds_profile_to_commit=round(t_commit - t_profile, 2), marks=marks.met, missed=marks.missed(), ok=marks.ok)


def launch(args, env=None):
    return subprocess.Popen([sys.executable, __file__, "_case", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def collect(procs, scenario, results):
    failed = 0
    for args, p in procs:
        out, err = p.communicate(timeout=400)
        lines = [json.loads(l[7:]) for l in out.splitlines() if l.startswith("RESULT ")]
        if p.returncode != 0 or not lines:
            failed += 1
            print(json.dumps({"scenario": scenario, "args": args, "ok": False, "returncode": p.returncode,
                              "stderr": err[-2000:]}), flush=True)
        for r in lines:
            r["scenario"] = scenario
            failed += not r.get("ok")
            results.append(r)
            print(json.dumps(r), flush=True)
    return failed


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "_case":
        kind, args = sys.argv[2], sys.argv[3:]
        return {"torch": case_torch, "engine": case_engine}[kind](*args)
    scenarios = sys.argv[1:] or ["torch", "alone", "hold", "churn", "together", "resize"]
    modes = os.environ.get("ENGINE_MODES", ",".join(MODES)).split(",")
    models = os.environ.get("ENGINE_MODELS", "llama,qwen2").split(",")
    results, failed, reference, asked, unknown = [], 0, {}, 0, []
    for scenario in scenarios:
        if scenario == "torch":
            for name in sorted(set(models) | {"llama4"}):
                failed += collect([([name], launch(["torch", name]))], "torch", results)
                reference[name] = str(results[-1]["max_abs_diff"]) if results and results[-1].get("model") == name else "none"
            continue
        ref = lambda name: reference.get(name, "none")  # noqa: E731
        with tenants.beside(scenario) if scenario in tenants.KINDS else contextlib.nullcontext():
            if scenario in ("alone", "hold", "churn"):
                for name in models:
                    for m in modes:
                        args = ["engine", m, "0.2", name, ref(name)]
                        asked += 1
                        failed += collect([(args, launch(args))], scenario, results)
            elif scenario == "together":
                for m in modes:
                    runs = [["engine", m, "0.25", n, ref(n)] for n in ("llama", "qwen2", "llama4")]
                    asked += len(runs)
                    failed += collect([(a, launch(a)) for a in runs], scenario, results)
            elif scenario == "resize":
                flag = f"/tmp/engine-flag-{os.getpid()}"
                if os.path.exists(flag):
                    os.remove(flag)
                env = {**os.environ, "ENGINE_FLAG": flag}
                grower = ["engine", "remap", "0.3", "llama", ref("llama"), "0.6"]
                leaver = ["engine", "remap", "0.3", "qwen2", ref("qwen2")]
                asked += 2
                g, lv = launch(grower, env), launch(leaver)
                failed += collect([(leaver, lv)], scenario, results)
                open(flag, "w").close()
                failed += collect([(grower, g)], scenario, results)
            else:
                unknown.append(scenario)
    engines = len([r for r in results if r.get("case") == "engine"])
    # Every engine launched must have reported, and every scenario named must exist.
    failed += bool(unknown) + (engines != asked)
    print(json.dumps({"summary": True, "engines": engines, "asked": asked, "unknown_scenarios": unknown,
                      "failed": failed}), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
