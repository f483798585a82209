"""CUDA graphs under install(), on a real GPU, one process per case: memory freed inside a
capture must never reach code outside the graph while the graph can replay. Prints one JSON
object per case.

    python3 tests/python/h200_graphs.py [MODE ...]

For each segment mode (and "torch", PyTorch's own allocator, for reference), a graph is
captured whose intermediates are freed inside the capture; then
- eager: eager code on the capture stream allocates the intermediates' size and fills it
  with a sentinel; the graph replays; the sentinel must survive;
- second: a second graph, captured on the same stream into its own pool, keeps an output of
  that size; the first graph replays; the second's output must still equal its eager value;
- shared: two graphs captured into one pool (`graph_pool_handle()`, as vLLM does) replay in
  order with the right outputs;
- pools: the captures' memory was held in graph pools (more than 0 bytes), destroying the
  graphs gives their free memory back and `empty_cache` the rest (vram-ledger's figures).
"unpatched-MODE" runs vram-ledger without its graph pools (torch.cuda.CUDAGraph's methods put
back): the checks above must then catch the corruption (wrong results, or an illegal memory
access), or they prove nothing; a control that fails in any other way fails the script.
Exits 1 on any case that does not come out as expected.
"""

import gc
import json
import sys

MODES = ["native", "expandable", "compact", "remap"]
N = 4096  # rows: an intermediate of N x N fp32 = 64 MiB


def emit(**kv):
    print("RESULT " + json.dumps(kv), flush=True)


def case(mode):
    import torch

    unpatched = mode.startswith("unpatched-")
    if mode != "torch":
        import vram_ledger as vl

        G = torch.cuda.CUDAGraph
        original = (G.capture_begin, G.capture_end, G.reset)
        vl.install(mode=mode.removeprefix("unpatched-"))
        if unpatched:
            G.capture_begin, G.capture_end, G.reset = original
    torch.manual_seed(0)
    w = torch.randn(N, N, device="cuda")
    x = torch.randn(N, N, device="cuda")

    def f(x):
        # Intermediates of N x N fp32, freed inside the capture; a small output kept.
        y = (x @ w).relu()
        z = y * 2.0 + 1.0
        return z.sum(1)

    def h(x):
        return (x @ w) - 3.0  # an N x N output, kept

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            f(x), h(x)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    out = {}

    g1 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g1, stream=s):
        y1 = f(x)
    ref1 = f(x)
    # eager: the capture stream's own eager work after the capture.
    with torch.cuda.stream(s):
        sentinel = torch.full((N, N), 7.0, device="cuda")
        sentinel2 = torch.full((N, N), 7.0, device="cuda")
    torch.cuda.synchronize()
    g1.replay()
    torch.cuda.synchronize()
    out["eager_kept"] = bool((sentinel == 7.0).all() and (sentinel2 == 7.0).all())
    out["graph1_right"] = bool(torch.allclose(y1, ref1))
    del sentinel, sentinel2

    # second: another graph on the same stream, its own pool, an output kept.
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2, stream=s):
        y2 = h(x)
    g2.replay()
    g1.replay()
    torch.cuda.synchronize()
    out["second_kept"] = bool(torch.allclose(y2, h(x)))

    # shared: two graphs in one pool, replayed in capture order.
    pool = torch.cuda.graph_pool_handle()
    g3, g4 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g3, pool=pool, stream=s):
        y3 = f(x)
    with torch.cuda.graph(g4, pool=pool, stream=s):
        y4 = h(x)
    x.copy_(torch.randn(N, N, device="cuda"))
    g3.replay()
    g4.replay()
    torch.cuda.synchronize()
    out["shared_right"] = bool(torch.allclose(y3, f(x)) and torch.allclose(y4, h(x)))
    # shared by PyTorch's name for another graph's pool (`pool=g.pool()`).
    g5 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g5, pool=g1.pool(), stream=s):
        y5 = h(x)
    g1.replay()
    g5.replay()
    torch.cuda.synchronize()
    out["shared_right"] = out["shared_right"] and bool(torch.allclose(y5, h(x)))

    if mode != "torch":
        st = vl.stats()
        out["graph_reserved"] = st["graph_reserved_bytes"]["current"]
        out["graph_outside"] = st["graph_outside_bytes"]
        del g1, g2, g3, g4, g5, y1, y2, y3, y4, y5
        gc.collect()
        torch.cuda.synchronize()
        # Released pools give back their free memory at once, the rest when the cache is.
        out["graph_reserved_after_release"] = vl.stats()["graph_reserved_bytes"]["current"]
        vl.empty_cache()
        out["graph_reserved_after_empty_cache"] = vl.stats()["graph_reserved_bytes"]["current"]
    keys = ("eager_kept", "graph1_right", "second_kept", "shared_right")
    out["all_right"] = all(out[k] for k in keys)
    if mode != "torch" and not unpatched:
        # The captures' memory was held in graph pools, and given back as they went.
        out["all_right"] = (out["all_right"] and out["graph_reserved"] > 0
                            and out["graph_reserved_after_release"] <= out["graph_reserved"]
                            and out["graph_reserved_after_empty_cache"] == 0)
    emit(case="graphs", mode=mode, **out)


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "_case":
        return case(sys.argv[2])
    import subprocess

    modes = sys.argv[1:] or ["torch"] + MODES + ["unpatched-" + m for m in MODES]
    failed = 0
    for m in modes:
        p = subprocess.run([sys.executable, __file__, "_case", m], capture_output=True, text=True, timeout=300)
        lines = [l[7:] for l in p.stdout.splitlines() if l.startswith("RESULT ")]
        for l in lines:
            print(l, flush=True)
        ok = p.returncode == 0 and lines and json.loads(lines[-1])["all_right"]
        expected = not m.startswith("unpatched-")
        if p.returncode != 0 or not lines:
            print(json.dumps({"case": "graphs", "mode": m, "failed": True, "stderr": p.stderr[-1500:]}), flush=True)
        # Without graph pools the control must go wrong the way captures without them do: wrong
        # results, or a kernel reading memory freed under it. Any other crash (an import, a typo)
        # is no evidence and fails the script.
        crashed_as_expected = p.returncode != 0 and "illegal memory access" in p.stderr
        if bool(ok) != expected and not (m.startswith("unpatched-") and crashed_as_expected):
            failed += 1
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
