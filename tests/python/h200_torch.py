"""vram-ledger under PyTorch on a real GPU. Each part runs in its own process (installing the
allocator is permanent for a process); the parent prints one JSON object per part.

    python3 tests/python/h200_torch.py [part ...]

Every part checks its marks (`marks.py`; a missing reading misses) and the script exits 1 when
any part misses one, prints nothing or fails: the weights tag holds exactly the model's
parameters and buffers, the KV tag the cache's tensors (and its bookkeeping, under 4 KiB); a
captured graph replays equal to eager; beside a 70% tenant, the profiled engine's NVML usage
with its KV budget allocated stays within its request; `torch.empty(1 MiB)` + `del` is no
slower installed than with PyTorch's allocator (within 5%, `LATENCY_TOLERANCE`); a MemPool
routes the KV tensors to the library and torch's statistics work; out of memory raises and the
process goes on.
"""

import json
import os
import subprocess
import sys
import time

from marks import Marks

PARTS = ["llama", "graphs", "seed", "latency_ours", "latency_mempool", "latency_native", "mempool", "oom"]
G = 1 << 30


def emit(marks=None, **kv):
    if marks is not None:
        kv.update(ok=marks.ok, marks=marks.met, missed=marks.missed())
    print("RESULT " + json.dumps(kv), flush=True)


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
    )


def nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def warm_up():
    """The first matmul makes cuBLAS allocate its workspace through the allocator: do it before
    anything is tagged, so that it lands under untracked."""
    import torch

    a = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()


def part_llama():
    import vram_ledger as vl

    vl.install()
    import torch
    from transformers import LlamaForCausalLM
    from transformers.cache_utils import StaticCache

    cfg = llama_config()
    torch.manual_seed(0)
    warm_up()
    with vl.tag("weights"):
        model = LlamaForCausalLM(cfg).to(dtype=torch.bfloat16, device="cuda").eval()
    torch.cuda.synchronize()
    s = vl.stats()
    # Requested bytes are what the tensors asked for; allocated bytes add rounding and the
    # unsplit tails of large blocks.
    weights = s["per_tag"]["weights"]["requested_bytes"]["current"]
    expected_weights = nbytes(list(model.parameters()) + list(model.buffers()))
    batch, prompt, decode = 8, 512, 48
    with vl.tag("kv"):
        cache = StaticCache(config=cfg, max_cache_len=prompt + decode)
        # The cache allocates its tensors on first use: a one-token step under the kv tag.
        with torch.no_grad():
            model(torch.zeros(batch, 1, dtype=torch.long, device="cuda"), past_key_values=cache, use_cache=True)
        cache.reset()
    torch.cuda.synchronize()
    kv_tensors = []
    for layer in getattr(cache, "layers", []):
        kv_tensors += [t for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None]
    kv = vl.stats()["per_tag"]["kv_cache"]["requested_bytes"]["current"]
    vl.reset_peak_memory_stats()
    ids = torch.randint(0, cfg.vocab_size, (batch, prompt), device="cuda")
    t0 = time.perf_counter()
    with torch.no_grad(), vl.tag("activation"):
        out = model(ids, past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        for i in range(decode):
            out = model(tok, past_key_values=cache, use_cache=True, cache_position=torch.tensor([prompt + i], device="cuda"))
            tok = out.logits[:, -1:].argmax(-1)
    torch.cuda.synchronize()
    s = vl.stats()
    m = Marks()
    m.true("weights_match", weights == expected_weights)
    # The cache's K and V tensors, and its small bookkeeping tensors, allocated under the tag.
    m.at_least("kv_holds_the_cache", kv, nbytes(kv_tensors), 1 << 50)
    m.at_most("kv_holds_only_the_cache", kv - nbytes(kv_tensors), 4096, -1)
    m.at_least("activation_peak_read", s["per_tag"]["activation"]["allocated_bytes"]["peak"], 1, 1 << 50)
    emit(
        m,
        part="llama",
        weights_tagged=weights,
        weights_tensors=expected_weights,
        weights_match=weights == expected_weights,
        kv_tagged=kv,
        kv_tensors=nbytes(kv_tensors),
        kv_match=kv == nbytes(kv_tensors) and kv > 0,
        activation_peak=s["per_tag"]["activation"]["allocated_bytes"]["peak"],
        untracked_peak=s["per_tag"]["untracked"]["allocated_bytes"]["peak"],
        reserved_peak=s["reserved_bytes"]["peak"],
        seconds=round(time.perf_counter() - t0, 3),
        memory_stats_allocated=vl.memory_stats()["allocated_bytes.all.current"],
        report=vl.report(),
    )


def part_graphs():
    import vram_ledger as vl

    vl.install()
    import torch

    lin = torch.nn.Linear(1024, 1024, device="cuda")
    x = torch.randn(64, 1024, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            y = torch.relu(lin(x)) * 2
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = torch.relu(lin(x)) * 2
    x.copy_(torch.randn(64, 1024, device="cuda"))
    g.replay()
    torch.cuda.synchronize()
    eager = torch.relu(lin(x)) * 2
    diff = float((y - eager).abs().max())
    m = Marks()
    m.at_most("replay_matches_eager", diff, 0.0, -1.0)
    emit(m, part="graphs", replay_matches_eager=bool(torch.allclose(y, eager)), max_abs_diff=diff)


def part_seed_holder():
    import torch

    free, total = torch.cuda.mem_get_info()
    x = torch.empty(int(total * 0.7), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    print("READY", flush=True)
    sys.stdin.read()
    del x


def part_seed():
    holder = subprocess.Popen([sys.executable, __file__, "_holder"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "READY"
    try:
        import vram_ledger as vl

        vl.install()
        import torch
        from transformers import LlamaForCausalLM

        cfg = llama_config()
        with vl.tag("weights"):
            model = LlamaForCausalLM(cfg).to(dtype=torch.bfloat16, device="cuda").eval()
        ids = torch.randint(0, cfg.vocab_size, (16, 1024), device="cuda")
        with vl.profile(utilization=0.2) as p:
            with torch.no_grad(), vl.tag("activation"):
                model(ids)
        kv_bytes = p.kv_budget
        with vl.tag("kv"):
            kv = torch.empty(kv_bytes, dtype=torch.uint8, device="cuda")
        with torch.no_grad(), vl.tag("activation"):
            model(ids)
        torch.cuda.synchronize()
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        mine = [pr.usedGpuMemory for pr in pynvml.nvmlDeviceGetComputeRunningProcesses(h) if pr.pid == os.getpid()]
        usage = mine[0] if mine else None
        m = Marks()
        m.at_most("within_request", usage, p.result["requested"], p.result["requested"] // 2)
        m.at_least("kv_budget_positive", kv_bytes, 1, 1 << 50)
        emit(m, part="seed", requested=p.result["requested"], kv_budget=kv_bytes, usage_with_kv=usage,
             within_request=usage is not None and usage <= p.result["requested"], report=p.report,
             other_processes=p.result["other_processes"], device_wide_kv_budget=p.result["device_wide_kv_budget"])
        del kv
    finally:
        holder.stdin.close()
        holder.wait()


def latency(how):
    import contextlib

    import vram_ledger as vl

    if how == "ours":
        vl.install()
    import torch

    ctx = vl.mempool() if how == "mempool" else contextlib.nullcontext()
    with ctx:
        timed_empty(torch, how)


# How much slower than PyTorch's allocator an installed `torch.empty` + `del` may read and still
# count as no slower: more than PyTorch's own processes in one command were seen to differ (3.5%
# between its fastest and slowest of three, H100 machine), so that equal allocators do not miss
# by chance, and less than the step a real regression would add.
LATENCY_TOLERANCE = 0.05


def latency_compared(ours_runs, native_runs):
    """Installed, `torch.empty` + `del` is no slower than with PyTorch's allocator: the median
    of our processes at most `LATENCY_TOLERANCE` over the median of PyTorch's in the same
    command. A side with no reading misses. Returns (marks, our median, PyTorch's)."""
    def median(runs):
        runs = sorted(runs)
        return runs[len(runs) // 2] if runs else None

    ours, native = median(ours_runs), median(native_runs)
    m = Marks()
    goal = native * (1 + LATENCY_TOLERANCE) if native is not None else -1
    m.at_most("installed_not_slower", ours, goal, (native or 0) / 100)
    return m, ours, native


def timed_empty(torch, how):
    n = 1 << 20
    for _ in range(2000):
        x = torch.empty(n, dtype=torch.uint8, device="cuda")
        del x
    # The median of five timed batches: one batch on a shared host can be slowed by anything.
    iters, batches = 40_000, []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(iters):
            x = torch.empty(n, dtype=torch.uint8, device="cuda")
            del x
        batches.append((time.perf_counter() - t) / iters * 1e9)
    ns = round(sorted(batches)[2], 1)
    m = Marks()
    m.at_least("timed", ns, 0.0, 1e18)
    emit(m, part="latency_" + how, ns_per_pair=ns)


def part_mempool():
    import torch
    import vram_ledger as vl
    from transformers import LlamaForCausalLM

    cfg = llama_config()
    model = LlamaForCausalLM(cfg).to(dtype=torch.bfloat16, device="cuda").eval()
    layers, kv_heads, head_dim = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    with vl.mempool("kv") as pool:
        kv = [torch.empty(2, 8, kv_heads, 2048, head_dim, dtype=torch.bfloat16, device="cuda") for _ in range(layers)]
    torch.cuda.synchronize()
    torch_stats = torch.cuda.memory_stats()
    ours = vl.stats()
    kv_bytes = sum(t.numel() * t.element_size() for t in kv)
    m = Marks()
    m.true("torch_stats_work", "allocated_bytes.all.current" in torch_stats)
    m.at_least("kv_from_us", ours["per_tag"]["kv_cache"]["allocated_bytes"]["current"], kv_bytes, 1 << 50)
    emit(m, part="mempool", kv_tensors=kv_bytes, torch_stats_work="allocated_bytes.all.current" in torch_stats,
         torch_allocated=torch_stats["allocated_bytes.all.current"], ours_kv_tagged=ours["per_tag"]["kv_cache"]["allocated_bytes"]["current"],
         ours_reserved=ours["reserved_bytes"]["current"], kv_from_us=ours["per_tag"]["kv_cache"]["allocated_bytes"]["current"] >= kv_bytes)
    del kv, pool


def part_oom():
    code = (
        "import vram_ledger as vl; vl.install(); import torch\n"
        "try:\n"
        "    x = torch.empty(1 << 40, dtype=torch.uint8, device='cuda'); x.fill_(1); torch.cuda.synchronize(); print('NO ERROR')\n"
        "except Exception as e:\n"
        "    print('EXCEPTION', type(e).__name__, str(e)[:200])\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    m = Marks()
    m.true("raised", r.returncode == 0 and r.stdout.startswith("EXCEPTION"))
    m.true("message_is_cuda_oom", "CUDA out of memory." in r.stdout)
    emit(m, part="oom", returncode=r.returncode, stdout=r.stdout[-400:], stderr_has_breakdown="Tried to allocate" in r.stderr,
         stderr=r.stderr[-600:])


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "_holder":
        return part_seed_holder()
    if len(sys.argv) > 1 and sys.argv[1] == "_part":
        name = sys.argv[2]
        return {"llama": part_llama, "graphs": part_graphs, "seed": part_seed, "latency_ours": lambda: latency("ours"),
                "latency_mempool": lambda: latency("mempool"), "latency_native": lambda: latency("native"), "mempool": part_mempool, "oom": part_oom}[name]()
    parts = sys.argv[1:] or PARTS
    # Installed and native latency alternate, three processes each (`latency_compared`):
    # processes minutes apart on a shared host differ by more than the two allocators.
    if "latency_ours" in parts and "latency_native" in parts:
        rest = [p for p in parts if p not in ("latency_ours", "latency_native")]
        parts = rest + ["latency_ours", "latency_native"] * 3
    failed = 0
    results = {}
    for name in parts:
        r = subprocess.run([sys.executable, __file__, "_part", name], capture_output=True, text=True, timeout=600)
        lines = [l[7:] for l in r.stdout.splitlines() if l.startswith("RESULT ")]
        if r.returncode != 0 or not lines:
            failed += 1
            print(json.dumps({"part": name, "failed": True, "returncode": r.returncode, "stderr": r.stderr[-1500:]}))
        for l in lines:
            res = json.loads(l)
            results.setdefault(res["part"], []).append(res)
            failed += not res.get("ok")
            print(l)
        sys.stdout.flush()
    if "latency_ours" in parts and "latency_native" in parts:
        runs = {p: [r["ns_per_pair"] for r in results.get(p, []) if "ns_per_pair" in r]
                for p in ("latency_ours", "latency_native")}
        m, ours, native = latency_compared(runs["latency_ours"], runs["latency_native"])
        failed += not m.ok
        emit(m, part="latency_compared", ours_ns=ours, native_ns=native,
             ours_runs=runs["latency_ours"], native_runs=runs["latency_native"])
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
