"""torch.compile(mode="reduce-overhead") under install(extension=True, cudagraph_trees=True), on
a real GPU, one process per configuration: inductor's CUDA-graph trees record graph after graph
into one pool and put the pool back to a checkpoint between recordings (getCheckpointState,
setCheckpointPoolState), which the extension's allocator does with the library. Prints one JSON
object per configuration; exits 1 when any misses a mark.

    python3 tests/python/h200_graph_trees.py [torch|native|expandable|compact|remap ...]

Each configuration trains a small MLP for steps at batch 8, then 16, then 8 again (a new shape
after replays makes the trees record while they execute, the case that restores a checkpoint),
with a second function (inference under no_grad) recorded in between; the same steps run
eagerly from the same weights. Marks, per configuration:
- equal: every compiled loss and the final weights equal the eager ones (within the tolerance
  that PyTorch's allocator's run shows; the kernels are the same, the memory is not);
- graphs: the trees recorded graphs (nodes of the tree manager's trees: at least two) and
  skipped none (inductor's cudagraph_skips counters);
- restored (vram-ledger's modes): the library restored at least one checkpoint, and every
  restore left the pool holding exactly the checkpoint's blocks (checked by the library's own
  checkpoint read right after);
- the ledger (vram-ledger's modes): graph memory is released to 0 once the compiled function
  and its trees are gone and the cache emptied.
"""

import gc
import json
import subprocess
import sys

from marks import Marks

MODES = ["native", "expandable", "compact", "remap"]
STEPS = [(8, 4), (16, 4), (8, 3)]


def emit(**kv):
    print("RESULT " + json.dumps(kv), flush=True)


def case(config):
    import torch

    counts = {"checkpoints": 0, "restores": 0, "restore_exact": True}
    if config != "torch":
        import vram_ledger as vl
        from vram_ledger import _checkpoint

        checkpoint, restore = _checkpoint.checkpoint, _checkpoint.restore

        def counted_checkpoint(device, pool):
            counts["checkpoints"] += 1
            return checkpoint(device, pool)

        def counted_restore(device, pool, text):
            counts["restores"] += 1
            freed, made = restore(device, pool, text)
            # What the library holds now must be the checkpoint's blocks, no more.
            live = checkpoint(device, pool)[1]
            want = sorted(int(b["addr"]) for b in json.loads(text)["blocks"])
            counts["restore_exact"] = counts["restore_exact"] and sorted(made) == want and live == want
            return freed, made

        # Handed to the extension at install: the counting ones are what C++ calls.
        _checkpoint.checkpoint, _checkpoint.restore = counted_checkpoint, counted_restore
        vl.install(mode=config, extension=True, cudagraph_trees=True)

    import torch._inductor.config as inductor

    assert inductor.triton.cudagraph_trees, "the trees are on"
    torch.manual_seed(0)
    width = 1024

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
        ).cuda()

    eager, compiled = make(), make()
    opt_e = torch.optim.SGD(eager.parameters(), lr=1e-2)
    opt_c = torch.optim.SGD(compiled.parameters(), lr=1e-2)

    def loss_fn(model, x):
        return model(x).pow(2).mean()

    step = torch.compile(loss_fn, mode="reduce-overhead")
    infer = torch.compile(lambda model, x: model(x).sum(), mode="reduce-overhead")
    gen = torch.Generator(device="cuda").manual_seed(1)
    losses, worst = [], 0.0
    for batch, n in STEPS:
        for _ in range(n):
            x = torch.randn(batch, width, device="cuda", generator=gen)
            torch.compiler.cudagraph_mark_step_begin()
            lc = step(compiled, x)
            lc.backward()
            opt_c.step()
            opt_c.zero_grad(set_to_none=True)
            le = loss_fn(eager, x)
            le.backward()
            opt_e.step()
            opt_e.zero_grad(set_to_none=True)
            worst = max(worst, abs(lc.item() - le.item()) / max(abs(le.item()), 1e-12))
            losses.append(lc.item())
            with torch.no_grad():
                torch.compiler.cudagraph_mark_step_begin()
                ic = infer(compiled, x).item()
                ie = eager(x).sum().item()
            worst = max(worst, abs(ic - ie) / max(abs(ie), 1e-12))
    weights = max(
        ((pc - pe).abs().max() / pe.abs().max().clamp_min(1e-12)).item()
        for pc, pe in zip(compiled.parameters(), eager.parameters())
    )
    from torch._dynamo.utils import counters
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_container(torch.cuda.current_device()).tree_manager
    stack = [n for nodes in manager.roots.values() for n in nodes] if manager is not None else []
    recorded = 0
    while stack:
        node = stack.pop()
        recorded += 1
        stack.extend(c for children in node.children.values() for c in children)
    out = {
        "config": config,
        "relative_loss_error": worst,
        "relative_weight_error": weights,
        "graphs_recorded": recorded,
        "cudagraph_skips": sum(counters["inductor"].get(k, 0) for k in counters["inductor"] if "cudagraph_skip" in k),
        **counts,
    }
    if config != "torch":
        del step, infer
        torch._dynamo.reset()
        cudagraph_trees.reset_cudagraph_trees()
        gc.collect()
        torch.cuda.synchronize()
        vl.empty_cache()
        out["graph_reserved_after"] = vl.stats()["graph_reserved_bytes"]["current"]
    emit(**out)


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "_case":
        return case(sys.argv[2])
    configs = sys.argv[1:] or ["torch"] + MODES
    # One process per configuration, all at once (each compiles for a minute; the GPU has room).
    procs = {c: subprocess.Popen([sys.executable, __file__, "_case", c], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in configs}
    results = {}
    for c, p in procs.items():
        try:
            stdout, stderr = p.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
        lines = [l[7:] for l in stdout.splitlines() if l.startswith("RESULT ")]
        if p.returncode != 0 or not lines:
            print(json.dumps({"config": c, "failed": True, "rc": p.returncode, "stderr": stderr[-3000:]}), flush=True)
            results[c] = None
            continue
        print(lines[-1], flush=True)
        results[c] = json.loads(lines[-1])
    marks = Marks()
    # The tolerance: what PyTorch's allocator's run shows, doubled, and never below 1e-5 (the
    # same kernels on the same inputs; only the memory they run in differs).
    base = results.get("torch")
    tol = max(1e-5, 2 * max(base["relative_loss_error"], base["relative_weight_error"])) if base else 1e-5
    marks.true("torch:ran", base is not None)
    for c, r in results.items():
        marks.true(f"{c}:ran", r is not None)
        if r is None:
            continue
        marks.at_most(f"{c}:equal_loss", r["relative_loss_error"], tol, -1.0)
        marks.at_most(f"{c}:equal_weights", r["relative_weight_error"], tol, -1.0)
        marks.at_least(f"{c}:graphs_recorded", r["graphs_recorded"], 2, 10**9)
        marks.at_most(f"{c}:no_cudagraph_skips", r["cudagraph_skips"], 0, -1)
        if c != "torch":
            marks.at_least(f"{c}:restored", r["restores"], 1, 10**9)
            marks.true(f"{c}:restore_exact", r["restore_exact"])
            marks.at_most(f"{c}:graph_memory_released", r["graph_reserved_after"], 0, -1)
    summary = {"summary": "graph_trees", "tolerance": tol, "missed": marks.missed(), "ok": marks.ok}
    print(json.dumps(summary), flush=True)
    sys.exit(0 if marks.ok else 1)


if __name__ == "__main__":
    main()
