"""The PyTorch package on a real GPU, one process per mode and part: torch's own statistics
answer with the ledger, snapshots open in PyTorch's memory_viz and replay with the CLI, and
torch.compile(mode="reduce-overhead") matches eager. Prints one JSON object per case and exits
1 if any case failed.

    python3 tests/python/h200_package.py [PART[:MODE] ...]

Parts: stats, snapshot, compile (as install() leaves inductor: CUDA-graph trees off), and
compile-trees (trees on, which needs PyTorch's own allocator's pool checkpoints). The mode
"torch" runs PyTorch's own allocator.
Without a mode a part runs in every mode. VRAM_LEDGER_BIN names the CLI for the snapshot part.
"""

import json
import os
import subprocess
import tempfile

import cases
from cases import emit
from marks import Marks

MODES = ["native", "expandable", "compact", "remap"]
PARTS = ["stats", "snapshot", "compile"]


def model():
    """A small Llama with random weights, made under the weights tag."""
    import torch
    import vram_ledger as vl
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    with vl.tag("weights"):
        m = LlamaForCausalLM(cfg).to(dtype=torch.bfloat16, device="cuda").eval()
    return m


def part_stats(mode):
    import torch
    import vram_ledger as vl

    vl.install(mode=mode)
    m = model()
    params = sum(p.numel() * p.element_size() for p in m.parameters())
    ids = torch.randint(0, 32000, (4, 512), device="cuda")
    with torch.no_grad(), vl.tag("activation"):
        logits = m(ids).logits
    torch.cuda.synchronize()
    s = vl.stats()
    tags = s["per_tag"]
    tag_current = sum(t["allocated_bytes"]["current"] for t in tags.values())
    tag_peak_weights = tags["weights"]["allocated_bytes"]["peak"]
    checks = {
        # PyTorch's functions against the ledger's per-tag figures and against the tensors.
        "memory_allocated_is_tag_sum": torch.cuda.memory_allocated() == tag_current,
        "max_allocated_at_least_weights_and_logits": torch.cuda.max_memory_allocated()
        >= tag_peak_weights + logits.numel() * logits.element_size(),
        "weights_tag_holds_parameters": tags["weights"]["requested_bytes"]["current"] >= params,
        "memory_reserved_is_ledger": torch.cuda.memory_reserved() == s["reserved_bytes"]["current"],
        "max_reserved_is_ledger": torch.cuda.max_memory_reserved() == s["reserved_bytes"]["peak"],
        "reserved_covers_allocated": torch.cuda.memory_reserved() >= torch.cuda.memory_allocated(),
    }
    before_reset = torch.cuda.max_memory_allocated()
    del logits
    torch.cuda.reset_peak_memory_stats()
    checks["reset_peak_drops_to_current"] = torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated() < before_reset
    summary = torch.cuda.memory_summary()
    row = next(l for l in summary.splitlines() if l.startswith("| Allocated memory"))
    checks["memory_summary_has_figures"] = row.split("|")[2].strip() not in ("", "0 B")
    m = Marks.of(checks)
    emit(part="stats", mode=mode, ok=m.ok, checks=m.met, missed=m.missed(), params=params,
         allocated=torch.cuda.memory_allocated(), max_allocated=before_reset, reserved=torch.cuda.memory_reserved(),
         summary_head=summary.splitlines()[:12])


def part_snapshot(mode):
    import torch
    import vram_ledger as vl
    from torch.cuda import _memory_viz

    vl.install(mode=mode)
    vl.record_history(True, max_entries=200_000)
    m = model()
    ids = torch.randint(0, 32000, (2, 256), device="cuda")
    with torch.no_grad(), vl.tag("activation"):
        for _ in range(3):
            m(ids)
    torch.cuda.synchronize()
    s = vl.stats()
    path = os.path.join(tempfile.mkdtemp(), "snapshot.pickle")
    vl.dump_snapshot(path)
    import pickle

    with open(path, "rb") as f:
        snap = pickle.load(f)
    trace = snap["device_traces"][0]
    tags = sorted({e.get("user_metadata") for e in trace if e["action"] == "alloc"} - {None, ""})
    # PyTorch's own viewers: the segment and trace pages, and the text summaries.
    views = {}
    for name in ("segment_plot", "trace_plot", "segsum", "trace"):
        fn = getattr(_memory_viz, name, None)
        if fn is None:
            views[name] = "missing"
            continue
        try:
            out = fn(snap)
            views[name] = len(out)
        except Exception as e:  # noqa: BLE001 - reported, and fails the case
            views[name] = f"error: {type(e).__name__}: {e}"[:300]
    cli = os.environ.get("VRAM_LEDGER_BIN", "vram-ledger")
    r = subprocess.run([cli, "replay", path, "--mode", mode, "--json"], capture_output=True, text=True, timeout=300)
    replay = None
    try:
        replay = json.loads(r.stdout)
    except ValueError:
        pass
    # Replaying our own recording in our mode must reserve what we reserved.
    same_peak = isinstance(replay, dict) and replay.get("peak_reserved") == s["reserved_bytes"]["peak"]
    m = Marks.of({
        "replay_reproduces_peak": same_peak,
        "viewers_draw": all(isinstance(v, int) and v > 0 for v in views.values()),
        "weights_tag_recorded": "weights" in tags,
    })
    emit(part="snapshot", mode=mode, entries=len(trace), tags=tags, views=views, ours_peak_reserved=s["reserved_bytes"]["peak"],
         replay_rc=r.returncode, replay_reproduces_peak=same_peak, replay=replay if replay is not None else r.stdout[-800:],
         replay_err=r.stderr[-800:], marks=m.met, missed=m.missed(), ok=m.ok)


def part_compile(mode, trees):
    import torch
    import vram_ledger as vl

    if mode != "torch":
        vl.install(mode=mode)
    if trees is not None:
        torch._inductor.config.triton.cudagraph_trees = trees
    m = model()
    results = {}
    with torch.no_grad():
        compiled = torch.compile(m, mode="reduce-overhead")
        for batch, seq in ((2, 128), (4, 64), (2, 128)):
            ids = torch.randint(0, 32000, (batch, seq), device="cuda", generator=torch.Generator("cuda").manual_seed(batch * seq))
            eager = m(ids).logits.float()
            outs = [compiled(ids).logits.float().clone() for _ in range(4)]  # warm-up, capture, replays
            # Replays must agree with each other exactly, and with eager up to bf16 fusion error.
            results[f"{batch}x{seq}"] = {
                "replays_identical": all(torch.equal(outs[1], o) for o in outs[2:]),
                "max_abs_vs_eager": (outs[-1] - eager).abs().max().item(),
                "eager_scale": eager.abs().max().item(),
            }
    torch.cuda.synchronize()
    graph = vl.stats()["graph_reserved_bytes"]["current"] if mode != "torch" else None
    checks = {
        "replays_identical": all(r["replays_identical"] for r in results.values()),
        "near_eager": all(r["max_abs_vs_eager"] <= 0.05 * r["eager_scale"] for r in results.values()),
    }
    if mode != "torch":
        # The captured graphs' memory is held in graph pools, not in the eager cache.
        checks["graph_pools_held"] = graph is not None and graph > 0
    m = Marks.of(checks)
    emit(part="compile" + ("" if trees is None else f"-trees={trees}"), mode=mode, ok=m.ok, marks=m.met, missed=m.missed(),
         shapes=results, graph_reserved=graph, cudagraph_trees=torch._inductor.config.triton.cudagraph_trees)


def run_part(name, mode):
    if name == "stats":
        return part_stats(mode)
    if name == "snapshot":
        return part_snapshot(mode)
    if name == "compile":
        return part_compile(mode, None)  # as install() leaves inductor
    if name == "compile-trees":
        return part_compile(mode, True)
    raise SystemExit(f"unknown part {name}")


if __name__ == "__main__":
    cases.main(__file__, run_part, PARTS, MODES)
