"""The budget contract and CUDA graphs under install(), on a real GPU, one process per case
(installing the allocator is permanent for a process). Prints one JSON object per case.

    python3 tests/python/h200_contract.py [capture|oom|serve ...]

- capture: every segment mode; a transformers Llama's forward is captured into a CUDA graph
  and replayed with new inputs while eager tensors are alive; outputs compared with eager.
- oom: out of memory under install() is a torch.OutOfMemoryError whose message starts as
  PyTorch's does ("CUDA out of memory. Tried to allocate X. GPU N has a total capacity of Y of
  which Z is free."), and the process goes on (a smaller allocation, a kernel).
- serve: every segment mode; profile a dummy forward at the largest shape with the decode
  graph captured inside the profile block, allocate the KV budget, then serve other shapes
  (never more tokens) and replay the graph, while a thread polls this process's NVML usage
  every 2 ms; peak usage against the requested memory.

Every case checks its marks (`marks.py`; a missing reading misses) and the script exits 1 when
any case misses one: capture, replays equal to eager (as with PyTorch's allocator, whose case
sets the reference) and eager tensors intact; oom, a torch.OutOfMemoryError worded as
PyTorch's that names the tags, and a kernel running after it; serve, NVML read (no poll
unanswered), peak usage within the request, and no forward refused.
"""

import json
import os
import re
import subprocess
import sys

from marks import Marks
from nvml import NvmlUsage, Poller
import tenants

MODES = ["native", "expandable", "compact", "remap"]


def emit(marks=None, **kv):
    if marks is not None:
        kv.update(ok=marks.ok, marks=marks.met, missed=marks.missed())
    print("RESULT " + json.dumps(kv), flush=True)


# The served models: (transformers class, config, vocabulary, largest shape, other shapes).
MODELS = {
    # A Llama of 2048 hidden, 8 layers, a 32k vocabulary.
    "llama": ("Llama", dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                            num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=2048),
              (8, 512), [(4, 256), (2, 512), (8, 384), (1, 512), (8, 512), (6, 300), (3, 100)]),
    # A Qwen2 of 1536 hidden, 16 layers and a 152k vocabulary: other layer shapes, fewer heads,
    # and logits five times as wide.
    "qwen2": ("Qwen2", dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=16,
                            num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=4096),
              (4, 1024), [(2, 1024), (4, 512), (1, 1000), (4, 1024), (3, 700), (8, 128), (4, 1000)]),
}
# A third engine for the "started together" scenario: the Llama with 4 layers and other shapes.
MODELS["llama4"] = ("Llama", dict(MODELS["llama"][1], num_hidden_layers=4), (16, 256),
                    [(8, 256), (16, 200), (4, 512), (16, 256), (2, 64), (12, 300), (1, 1000)])


def model(name="llama", layers=None):
    import torch
    import transformers

    kind, cfg, _, _ = MODELS[name]
    cfg = dict(cfg)
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    config = getattr(transformers, kind + "Config")(**cfg)
    torch.manual_seed(0)
    return getattr(transformers, kind + "ForCausalLM")(config).to(device="cuda", dtype=torch.bfloat16).eval()


def case_capture(mode):
    import vram_ledger as vl

    if mode != "torch":  # "torch": PyTorch's own allocator, for the same comparison
        vl.install(mode=mode)
    import torch

    with torch.no_grad():
        m = model(layers=4)
        ids = torch.randint(0, 32000, (4, 64), device="cuda")
        eager_keep = m(ids).logits  # eager tensors alive across the capture and replay
        static = torch.randint(0, 32000, (4, 64), device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                m(static)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = m(static).logits
        diffs = []
        for _ in range(3):
            new = torch.randint(0, 32000, (4, 64), device="cuda")
            static.copy_(new)
            g.replay()
            ref = m(new).logits
            torch.cuda.synchronize()
            diffs.append(float((out.float() - ref.float()).abs().max()))
        m = Marks()
        # The reference: PyTorch's own allocator gives the same difference (bf16 logits of a
        # captured forward against an eager one), set by the "torch" case before the others.
        reference = float(os.environ.get("CAPTURE_REFERENCE", "inf"))
        m.at_most("replay_as_with_torch", max(diffs), reference, -1.0)
        m.true("eager_alive", bool(torch.isfinite(eager_keep).all()))
        emit(m, case="capture", mode=mode, max_abs_diff=max(diffs), equal=max(diffs) == 0.0,
             eager_alive=bool(torch.isfinite(eager_keep).all()), reference=reference)


def case_oom():
    import vram_ledger as vl

    vl.install()
    import torch

    try:
        torch.empty(1 << 40, dtype=torch.uint8, device="cuda")
        m = Marks()
        m.true("raised", False)
        emit(m, case="oom", raised=False)
        return
    except Exception as e:  # noqa: BLE001 - the type is part of what is measured
        kind, msg = type(e).__name__, str(e)
        torch_oom = isinstance(e, torch.OutOfMemoryError)
    x = torch.ones(1 << 20, device="cuda")
    after = float(x.sum().item())
    m = Marks()
    m.true("raised", True)
    m.true("starts_with_cuda_oom", msg.startswith("CUDA out of memory."))
    # What tools that retry with a smaller batch catch, worded as PyTorch words it.
    m.true("torch_out_of_memory_error", torch_oom)
    m.true("pytorch_wording", re.match(r"CUDA out of memory\. Tried to allocate [\d.]+ [KMGT]?i?B\. GPU \d+ has a total "
                                       r"capacity of [\d.]+ [KMGT]?i?B of which [\d.]+ [KMGT]?i?B is free\.", msg) is not None)
    m.true("names_the_tags", "Allocated by tag" in msg)
    m.true("kernel_after", after == float(1 << 20))
    emit(m, case="oom", raised=True, type=kind, torch_out_of_memory_error=torch_oom, starts_with_cuda_oom=msg.startswith("CUDA out of memory."),
         has_breakdown="Allocated by tag" in msg, message=msg[:300], kernel_after=after == float(1 << 20))


def case_serve(mode, utilization="0.2", name="llama"):
    utilization = float(utilization)
    import vram_ledger as vl

    vl.install(mode=mode)
    import torch

    usage = NvmlUsage()

    def outside():
        return usage.read() - vl.stats()["reserved_bytes"]["current"]

    _, cfg, largest, shapes = MODELS[name]
    vocab = cfg["vocab_size"]
    torch.randn(64, 64, device="cuda").matmul(torch.randn(64, 64, device="cuda"))
    with torch.no_grad():
        with vl.tag("weights"):
            m = model(name)
        big = torch.randint(0, vocab, largest, device="cuda")
        dec = torch.randint(0, vocab, (largest[0], 1), device="cuda")
        g = torch.cuda.CUDAGraph()
        with vl.profile(utilization) as p:
            with vl.tag("activation"):
                m(big)
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    for _ in range(2):
                        m(dec)
                torch.cuda.current_stream().wait_stream(s)
                with torch.cuda.graph(g):
                    dec_out = m(dec).logits
        requested = p.result["requested"]
        outside_at_profile = outside()
        with vl.tag("kv"):
            kv = torch.empty(p.kv_budget, dtype=torch.uint8, device="cuda")
        poll = Poller()
        poll.start()
        failures, outside_max, refused = 0, outside(), []
        for shape in shapes:
            ids = torch.randint(0, vocab, shape, device="cuda")
            try:
                with vl.tag("activation"):
                    # The same work as the profiled pass, at another shape.
                    m(ids).logits[:, -1].float().sum().item()
            except RuntimeError as e:
                failures += 1
                refused.append(list(shape))
                last = str(e)[:300]
            g.replay()
            torch.cuda.synchronize()
            outside_max = max(outside_max, outside())
        poll.finish()
        m = Marks()
        peak = poll.peak if poll.samples else None
        m.at_least("peak_read", poll.samples, 1, 1 << 60)
        m.at_most("within", peak, requested, requested // 2)
        m.at_most("no_forward_refused", failures, 0, -1)
        # Started after the CUDA context exists: any poll NVML did not answer lost a reading.
        m.at_most("no_reading_missed", poll.misses, 0, -1)
        emit(m, case="serve", model=name, mode=mode, utilization=utilization, requested=requested,
             outside_at_profile=outside_at_profile, outside_max_serving=outside_max, refused=refused,
             graph_pools=p.result.get("graph_pools"), graph_outside=p.result.get("graph_outside"), kv_budget=p.kv_budget, peak_usage=poll.peak,
             peak_over_requested=poll.peak / requested, within=poll.peak <= requested, samples=poll.samples,
             nvml_misses=poll.misses,
             failures=failures, device_wide_kv_budget=p.result.get("device_wide_kv_budget"),
             cap=vl.cap(), kv=int(kv.numel()), report=p.report, last_failure=locals().get("last"))


# The last result `run` printed (the capture case's reference comes from it).
last_result = {}


def run(name, args, together=1, each=None):
    """One process per case; `together` copies, or one per argument list of `each`, started at
    the same instant."""
    each = each or [args] * together
    procs = [subprocess.Popen([sys.executable, __file__, "_case", name, *a], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for a in each]
    together = len(each)
    failed = 0
    for p in procs:
        out, err = p.communicate(timeout=300)
        lines = [l[7:] for l in out.splitlines() if l.startswith("RESULT ")]
        if p.returncode != 0 or not lines:
            failed += 1
            print(json.dumps({"case": name, "args": args, "failed": True, "returncode": p.returncode,
                              "stderr": err[-1500:]}), flush=True)
        for l in lines:
            r = json.loads(l)
            r["together"] = together
            failed += not r.get("ok")
            last_result.clear()
            last_result.update(r)
            print(json.dumps(r), flush=True)
    return failed


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "_case":
        name, args = sys.argv[2], sys.argv[3:]
        return {"capture": case_capture, "oom": case_oom, "serve": case_serve}[name](*args)
    cases = sys.argv[1:] or ["capture", "oom", "serve"]
    models = os.environ.get("SERVE_MODELS", "llama,qwen2").split(",")
    failed = 0
    for c in cases:
        if c == "capture":
            failed += run(c, ["torch"])
            os.environ["CAPTURE_REFERENCE"] = str(last_result.get("max_abs_diff", "nan"))
            for m in MODES:
                failed += run(c, [m])
        elif c == "oom":
            failed += run(c, [])
        elif c == "serve":
            for name in models:
                for m in MODES:
                    failed += run(c, [m, "0.2", name])
        elif c in ("serve_hold", "serve_churn"):
            with tenants.beside(c.split("_")[1]):
                for name in models:
                    for m in MODES:
                        failed += run("serve", [m, "0.2", name])
        elif c == "serve_together":
            # Three different engines, started at the same instant.
            for m in MODES:
                failed += run("serve", [], each=[[m, "0.25", "llama"], [m, "0.25", "qwen2"], [m, "0.25", "llama4"]])
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
