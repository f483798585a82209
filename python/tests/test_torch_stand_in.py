"""install() and mempool() against a stand-in for the few parts of PyTorch they touch, on a
simulated device: what they hand PyTorch and what they patch, where PyTorch is not installed."""

import textwrap

import pytest

from test_pure import run_on_sim

STAND_IN = """
import contextlib, ctypes
calls = []

class Raw:
    def set_init_fn(self, f): calls.append(["init", f])
    def set_reset_fn(self, f): calls.append(["reset", f])
    def set_memory_fraction_fn(self, f): calls.append(["memory_fraction", f])
    def set_record_stream_fn(self, f): calls.append(["record_stream", f])

class Plug:
    def __init__(self, path, alloc, free):
        calls.append(["plug", path, alloc, free])
        self.raw = Raw()
    def allocator(self): return self.raw

class Graph:
    def capture_begin(self, pool=None): calls.append(["capture_begin", pool])
    def capture_end(self): calls.append(["capture_end"])
    def reset(self): calls.append(["graph_reset"])
    def pool(self): return (7, 8)

# As torch.cuda.use_mem_pool: the routing calls through torch.cuda.memory's names for them
# (which fail under the pluggable allocator until install() replaces them).
@contextlib.contextmanager
def use_mem_pool(pool, device=None):
    calls.append(["use_mem_pool", pool if isinstance(pool, list) else "MemPool"])
    d = 0 if device is None else device
    if isinstance(pool, list):
        yield
        return
    memory._cuda_beginAllocateCurrentThreadToPool(d, pool.id)
    try:
        yield
    finally:
        memory._cuda_endAllocateToPool(d, pool.id)
        memory._cuda_releasePool(d, pool.id)

torch = types.ModuleType("torch")
state = {"initialized": False}
def pluggable_refuses(what):
    def f(*args):
        raise RuntimeError("pluggable does not yet support " + what)
    return f
memory = types.SimpleNamespace(
    CUDAPluggableAllocator=Plug, change_current_allocator=lambda a: calls.append(["change"]),
    _cuda_beginAllocateCurrentThreadToPool=pluggable_refuses("beginAllocateToPool"),
    _cuda_endAllocateToPool=pluggable_refuses("endAllocateToPool"), _cuda_releasePool=pluggable_refuses("releasePool"),
)
pool_ids = iter(range(1, 1 << 30))
torch.cuda = types.SimpleNamespace(
    is_initialized=lambda: state["initialized"], memory=memory, CUDAGraph=Graph, current_device=lambda: 0,
    current_stream=lambda d: types.SimpleNamespace(cuda_stream=0), MemPool=lambda raw: ["pool"], use_mem_pool=use_mem_pool,
    graph_pool_handle=lambda: (0, next(pool_ids)),
    # As torch 2.11 asks: the pool id's two parts ((0, 0): every pool) and include_traces.
    memory_snapshot=lambda mempool_id=None: torch._C._cuda_memorySnapshot((*(mempool_id or (0, 0)), True))["segments"],
)
utils = types.ModuleType("torch.cuda._utils")
utils._get_device_index = lambda d, optional: 0 if d is None else d
inductor = types.ModuleType("torch._inductor")
inductor.config = types.ModuleType("torch._inductor.config")
inductor.config.triton = types.SimpleNamespace(cudagraph_trees=True)
torch._inductor = inductor
# torch._C's entry points that install() replaces: the originals fail as the pluggable
# allocator's do, except the memory fraction's setter, which PyTorch passes on to the hook.
def unsupported(what):
    def f(*args):
        raise RuntimeError("CUDAPluggableAllocator does not yet support " + what)
    return f
torch._C = types.SimpleNamespace(
    _cuda_beginAllocateCurrentThreadToPool=unsupported("beginAllocateToPool"),
    _cuda_endAllocateToPool=unsupported("endAllocateToPool"),
    _cuda_releasePool=unsupported("releasePool"),
    _cuda_record_memory_history=unsupported("recordHistory"),
    _cuda_record_memory_history_legacy=unsupported("recordHistory"),
    _cuda_memorySnapshot=unsupported("snapshot"),
    _cuda_isHistoryEnabled=unsupported("recordHistory"),
    _cuda_setMemoryFraction=lambda fraction, device: calls.append(["set_fraction", fraction, device]),
    _cuda_getMemoryFraction=unsupported("getMemoryFraction"),
    _accelerator_getDeviceStats=unsupported("getDeviceStats"),
    _accelerator_resetPeakStats=unsupported("resetPeakStats"),
    _cuda_attach_out_of_memory_observer=unsupported("attachOutOfMemoryObserver"),
    _cuda_resetAccumulatedMemoryStats=unsupported("resetAccumulatedStats"),
    _accelerator_resetAccumulatedStats=unsupported("resetAccumulatedStats"),
    # What torch.accelerator asks: PyTorch's own caching allocator, never initialised.
    _accelerator_isAllocatorInitialized=lambda: False,
    # What the pluggable allocator does with history metadata: nothing.
    _cuda_setMemoryMetadata=lambda m: None,
    _cuda_getMemoryMetadata=lambda: "",
    _accelerator_emptyCache=lambda: calls.append(["native_empty_cache"]),
)
sys.modules.update({"torch": torch, "torch.cuda": torch.cuda, "torch.cuda._utils": utils,
                    "torch._inductor": inductor, "torch._inductor.config": inductor.config})
address = lambda name: ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
"""


def test_install_hands_pytorch_the_hooks_and_patches_its_statistics_graphs_and_inductor():
    r = run_on_sim(
        STAND_IN
        + textwrap.dedent(
            """
        alloc = vl.install(mode="expandable", sleep=True)
        seen = {"same": vl.install() is alloc, "calls": calls[:], "trees": inductor.config.triton.cudagraph_trees}
        seen["hooks"] = {k: address("vram_ledger_" + k) for k in ("init", "reset", "memory_fraction", "record_stream")}
        seen["library"] = vl.library_path()
        seen["before_cuda"] = dict(torch.cuda.memory_stats(0))
        state["initialized"] = True
        with vl.tag("weights"):
            p = lib.vram_ledger_malloc(3 << 20, 0, None)
        seen["patched"] = torch.cuda.memory_stats(0) == dict(sorted(vl.memory_stats(0).items()))
        seen["allocated"] = torch.cuda.memory.memory_stats()["allocated_bytes.all.current"]
        seen["maps"] = vl.stats(0)["driver_calls"]["map"]
        del calls[:]
        # The simulated stream is not capturing: the graph pool is refused, and the patch ends
        # the capture it began before raising the library's error.
        try:
            Graph().capture_begin()
        except vl.VramLedgerError as e:
            seen["graph_error"] = str(e)
        seen["graph"] = calls[:]
        seen["slept"] = vl.sleep(offload="weights", device=0)[0]["tags"]
        vl.wake(device=0)
        print(json.dumps(seen))
        """
        )
    )
    plug, change = r["calls"][0], r["calls"][-1]
    assert plug == ["plug", r["library"], "vram_ledger_malloc_or_throw", "vram_ledger_free"], r
    assert change == ["change"], r
    assert {c[0]: c[1] for c in r["calls"][1:-1]} == r["hooks"], r
    assert r["same"] and r["trees"] is False, r
    assert r["before_cuda"] == {}, "nothing asked of the library before CUDA is initialised"
    assert r["patched"] and r["allocated"] == 3 << 20, r
    assert r["maps"] > 0, "install's mode reached the library"
    assert "is not capturing a CUDA graph" in r["graph_error"], r
    assert r["graph"] == [["capture_begin", None], ["capture_end"]], r
    assert r["slept"] == ["weights"], "install's sleep=True kept the tags apart"


def test_mempool_allocates_under_its_tag():
    r = run_on_sim(
        STAND_IN
        + textwrap.dedent(
            """
        pool = vl.mempool("kv")
        with pool:
            inside = vl.current_tag()
        print(json.dumps({"inside": inside, "after": vl.current_tag(), "calls": calls, "tag": pool.tag}))
        """
        )
    )
    assert r["inside"] == "kv_cache" and r["after"] == "untracked", r
    assert r["calls"][0] == ["plug", r["calls"][0][1], "vram_ledger_malloc", "vram_ledger_free"], r
    assert r["calls"][1] == ["use_mem_pool", ["pool"]] and r["tag"] == "kv", r


def test_one_mempool_entered_nested_and_from_two_threads_keeps_each_blocks_tag():
    r = run_on_sim(
        STAND_IN
        + textwrap.dedent(
            """
        import threading
        pool = vl.mempool("kv")
        seen = {}
        with pool:
            with pool:
                pass
            seen["outer_after_inner"] = vl.current_tag()
        seen["after"] = vl.current_tag()
        # A enters first and leaves while B is still inside: A's exit must not end B's block.
        a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
        def a():
            try:
                with pool:
                    a_in.set()
                    b_in.wait()
            except Exception as e:
                seen["a_error"] = repr(e)
            a_out.set()
        def b():
            a_in.wait()
            try:
                with pool:
                    b_in.set()
                    a_out.wait()
                    seen["b_inside_after_a_left"] = vl.current_tag()
                seen["b_after"] = vl.current_tag()
            except Exception as e:
                seen["b_error"] = repr(e)
        ts = [threading.Thread(target=a), threading.Thread(target=b)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        print(json.dumps(seen))
        """
        )
    )
    assert r == {
        "outer_after_inner": "kv_cache",
        "after": "untracked",
        "b_inside_after_a_left": "kv_cache",
        "b_after": "untracked",
    }, r


def installed(code: str) -> dict:
    """`code` run on the simulated device after install(mode="remap"), against the stand-in."""
    return run_on_sim(STAND_IN + 'vl.install(mode="remap")\n' + textwrap.dedent(code))


FRAMES = """
state["initialized"] = True
C = torch._C
record = lambda context, skip=(): C._cuda_record_memory_history("all", context, "python", sys.maxsize, False, False, False, list(skip))
def thealloc():
    return lib.vram_ledger_malloc(4096, 0, None)
def thefree(p):
    lib.vram_ledger_free(p, 4096, 0, None)
def text():
    return json.dumps(C._cuda_memorySnapshot(None), default=str)
def live_frames():
    snap = C._cuda_memorySnapshot(None)
    return [b["frames"] for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
seen = {}
for context in ["alloc", "all", "state"]:
    record(context)
    thefree(thealloc())
    t = text()
    seen[context] = ["thealloc" in t, "thefree" in t]
    C._cuda_record_memory_history(None)
# "state": a live block shows its allocation's stack, however many entries came after it.
C._cuda_record_memory_history("all", "state", "python", 4, False, False, False, [])
def keep():
    return lib.vram_ledger_malloc(1 << 20, 0, None)
kept = keep()
for _ in range(10):
    thefree(thealloc())
seen["state_live"] = [f[0]["name"] for f in live_frames() if f]
seen["inner_file"] = [f[0]["filename"] for f in live_frames() if f]
lib.vram_ledger_free(kept, 1 << 20, 0, None)
C._cuda_record_memory_history(None)
def should_capture1():
    return lib.vram_ledger_malloc(1 << 20, 0, None)
def should_not_capture():
    return lib.vram_ledger_malloc(1 << 20, 0, None)
def should_capture2():
    return lib.vram_ledger_malloc(1 << 20, 0, None)
record("all")
kept = [should_capture1()]
record(None)
kept.append(should_not_capture())
record("all")
kept.append(should_capture2())
t = text()
seen["history_context"] = ["should_capture1" in t, "should_not_capture" in t, "should_capture2" in t]
seen["block_frames"] = sorted(f[0]["name"] for f in live_frames() if f)
seen["leftover_keys"] = "vram-ledger:context" in text()
for p in kept:
    lib.vram_ledger_free(p, 1 << 20, 0, None)
C._cuda_record_memory_history(None)
record("all", ["alloc"])
thefree(thealloc())
seen["skipped"] = sorted({e["action"] for e in C._cuda_memorySnapshot(None)["device_traces"][0]})
C._cuda_record_memory_history(None)
seen["torch_gathered"] = ["gather"] in calls
# Symbolized together, per snapshot: no stack summarized on its own.
seen["symbolized_one_at_a_time"] = ["summary"] in calls
# As test_cuda.py's test_memory_plots_metadata: every event while it is set carries it.
C._cuda_record_memory_history("all", "alloc", "python", sys.maxsize, False, False, False, [])
C._cuda_setMemoryMetadata("metadata test")
thefree(thealloc())
lib.vram_ledger_empty_cache(0)
seen["metadata_get"] = C._cuda_getMemoryMetadata()
C._cuda_setMemoryMetadata("")
events = C._cuda_memorySnapshot(None)["device_traces"][0]
seen["metadata"] = sorted({e["user_metadata"] for e in events})
thefree(thealloc())
seen["metadata_after"] = C._cuda_memorySnapshot(None)["device_traces"][0][-1]["user_metadata"]
C._cuda_record_memory_history(None)
seen["metadata_refused"] = []
for bad in [5, "a\\0b"]:
    try:
        C._cuda_setMemoryMetadata(bad)
    except (TypeError, ValueError) as e:
        seen["metadata_refused"].append(type(e).__name__)
print(json.dumps(seen))
"""

# torch's traceback capture, as PyTorch has it: gather_traceback (C++, no Python frame of its
# own) wrapped in CapturedTraceback, whose summary() lists frames outermost first.
TRACEBACK = """
import traceback
tb_module = types.ModuleType("torch.utils._traceback")
class CapturedTraceback:
    def __init__(self, tb, skip=0):
        self.tb, self.skip = tb, skip
    def summary(self):
        calls.append(["summary"])
        return _extract_symbolized_tb(symbolize_tracebacks([self.tb])[0], self.skip)
def symbolize_tracebacks(tbs):
    calls.append(["symbolize", len(tbs)])
    return tbs
def _extract_symbolized_tb(tb, skip):
    return traceback.StackSummary.from_list(tb)
tb_module.CapturedTraceback = CapturedTraceback
tb_module._extract_symbolized_tb = _extract_symbolized_tb
torch.utils = types.ModuleType("torch.utils")
torch.utils._traceback = tb_module
sys.modules.update({"torch.utils": torch.utils, "torch.utils._traceback": tb_module})
def gather_traceback(python, script, cpp):
    calls.append(["gather"])
    return traceback.extract_stack()[:-1]
torch._C._profiler = types.SimpleNamespace(gather_traceback=gather_traceback, symbolize_tracebacks=symbolize_tracebacks)
"""


def check_frames(r, torch_gathered):
    assert r["torch_gathered"] is torch_gathered, r
    assert r["symbolized_one_at_a_time"] is False, r
    assert r["metadata"] == ["metadata test"] and r["metadata_get"] == "metadata test", r
    assert r["metadata_after"] == "", "cleared: the entry shows its tag again (untracked)"
    assert r["metadata_refused"] == ["ArgumentTypeError", "ValueError"], r
    # alloc: allocations' stacks in the history; all: frees' too; state: only live blocks'.
    assert r["alloc"] == [True, False], r
    assert r["all"] == [True, True], r
    assert r["state"] == [False, False], r
    assert r["state_live"] == ["keep"], "a live block keeps its stack past the history's bound"
    assert r["inner_file"] == ["<string>"], "innermost first, without the package's own frames"
    assert r["history_context"] == [True, False, True], "recording again goes on, with the new context"
    assert r["block_frames"] == ["should_capture1", "should_capture2"], "live blocks show their allocation's stack"
    assert r["leftover_keys"] is False
    assert "alloc" not in r["skipped"] and "free_requested" in r["skipped"], r


def test_history_records_stack_frames_as_pytorchs_context_says():
    # As test_cuda.py's test_memory_plots_free_stack, test_memory_plots_history_context,
    # test_memory_snapshot and test_memory_snapshot_skip_actions ask of PyTorch's allocator;
    # with Python's own frames (a torch without its traceback capture).
    check_frames(installed(FRAMES), False)


def test_history_stack_frames_come_from_torchs_traceback_capture_where_torch_has_it():
    check_frames(installed(TRACEBACK + FRAMES), True)


def test_history_snapshots_fraction_and_accelerator_statistics_answer_under_install():
    r = installed(
        """
        state["initialized"] = True
        C = torch._C
        C._cuda_record_memory_history("all", "all", "all", sys.maxsize, False, False, False, [])
        with vl.tag("weights"):
            p = lib.vram_ledger_malloc(3 << 20, 0, None)
        snap = C._cuda_memorySnapshot(None)
        trace = snap["device_traces"][0]
        seen = {
            "segments": len(snap["segments"]),
            "allocs": [[e["size"], e["user_metadata"]] for e in trace if e["action"] == "alloc"],
            "stats": C._accelerator_getDeviceStats(0)["allocated_bytes"]["all"],
        }
        lib.vram_ledger_free(p, 3 << 20, 0, None)
        C._accelerator_resetPeakStats(0)
        seen["after_reset"] = C._accelerator_getDeviceStats(0)["allocated_bytes"]["all"]
        seen["accelerator_initialized"] = C._accelerator_isAllocatorInitialized()
        seen["cached_before"] = vl.stats(0)["cached_bytes"]
        C._accelerator_emptyCache()
        seen["cached_after"] = vl.stats(0)["cached_bytes"]
        seen["native_empty_cache"] = ["native_empty_cache"] in calls
        C._cuda_record_memory_history_legacy(False)
        q = lib.vram_ledger_malloc(1 << 20, 0, None)
        later = C._cuda_memorySnapshot(None)["device_traces"][0]
        seen["stopped"] = [e["size"] for e in later if e["action"] == "alloc"]
        lib.vram_ledger_free(q, 1 << 20, 0, None)
        C._cuda_record_memory_history(None)
        C._cuda_setMemoryFraction(0.5, 0)
        seen["fraction"] = [C._cuda_getMemoryFraction(0), C._cuda_getMemoryFraction(1)]
        seen["set"] = calls[-1]
        print(json.dumps(seen))
        """
    )
    assert r["segments"] >= 1, r
    assert r["allocs"] == [[3 << 20, "weights"]], "the history, each allocation with its tag"
    assert r["stats"]["current"] == 3 << 20 and r["stats"]["peak"] == 3 << 20, r
    assert r["after_reset"]["current"] == 0 and r["after_reset"]["peak"] == 0, r
    assert r["accelerator_initialized"] is True, "torch.accelerator.memory_stats is not empty"
    assert r["cached_before"] > 0 and r["cached_after"] == 0, "torch.accelerator.empty_cache: ours"
    assert r["native_empty_cache"] is False, r
    assert r["stopped"] == [3 << 20], "recording stopped: the later allocation is not in the history"
    assert r["fraction"] == [0.5, 1.0], r
    assert r["set"] == ["set_fraction", 0.5, 0], "the setter still reaches PyTorch and the hook"


def test_out_of_memory_observers_are_called_under_install():
    r = installed(
        """
        state["initialized"] = True
        seen = []
        def failing(*args):
            raise ValueError("an observer's own error")
        torch._C._cuda_attach_out_of_memory_observer(failing)
        torch._C._cuda_attach_out_of_memory_observer(lambda *args: seen.append(list(args)))
        with vl.tag("weights"):
            p = lib.vram_ledger_malloc(3 << 20, 0, None)
        refused = lib.vram_ledger_malloc(1 << 50, 0, None)
        total = vl.stats(0)["all"]["allocated_bytes"]["current"]
        print(json.dumps({"seen": seen, "refused": refused, "allocated": total}))
        """
    )
    assert r["refused"] is None, r
    assert len(r["seen"]) == 1, "one call per out of memory, past an observer that failed"
    device, size, allocated, free = r["seen"][0]
    assert (device, size, allocated) == (0, 1 << 50, r["allocated"]), r
    assert 0 < free < 1 << 50, r


def test_accumulated_statistics_reset_under_install():
    r = installed(
        """
        state["initialized"] = True
        for _ in range(3):
            lib.vram_ledger_free(lib.vram_ledger_malloc(1 << 20, 0, None), 1 << 20, 0, None)
        lib.vram_ledger_malloc(1 << 50, 0, None)
        before = torch.cuda.memory_stats(0)
        torch._C._cuda_resetAccumulatedMemoryStats(0)
        p = lib.vram_ledger_malloc(1 << 20, 0, None)
        after = torch.cuda.memory_stats(0)
        torch._C._accelerator_resetAccumulatedStats(0)
        again = torch.cuda.memory_stats(0)
        keys = ["allocation.all.allocated", "allocation.all.freed", "num_ooms", "allocation.all.current"]
        print(json.dumps({n: {k: d[k] for k in keys} for n, d in [("before", before), ("after", after), ("again", again)]}))
        """
    )
    assert r["before"] == {"allocation.all.allocated": 3, "allocation.all.freed": 3, "num_ooms": 1, "allocation.all.current": 0}, r
    assert r["after"] == {"allocation.all.allocated": 1, "allocation.all.freed": 0, "num_ooms": 0, "allocation.all.current": 1}, r
    assert r["again"]["allocation.all.allocated"] == 0 and r["again"]["allocation.all.current"] == 1, r


@pytest.mark.parametrize("mode", ["native", "expandable", "remap", "compact"])
def test_mempool_no_split_gives_each_allocation_a_segment_of_its_own(mode):
    # PyTorch's test_mempool_no_split, on the stand-in: 4 MiB twice in each pool.
    r = run_on_sim(
        STAND_IN
        + f'vl.install(mode="{mode}")\n'
        + textwrap.dedent(
            """
            state["initialized"] = True
            M, use = torch.cuda.MemPool, torch.cuda.use_mem_pool
            split, whole = M(), M(no_split=True)
            held = []
            for _ in range(2):
                for pool in (split, whole):
                    with use(pool):
                        held.append(lib.vram_ledger_malloc(4 << 20, 0, None))
            shape = lambda p: [[b["size"] for b in s["blocks"]] for s in p.snapshot()]
            try:
                M(no_split=1)
                refused = None
            except TypeError as e:
                refused = str(e)
            print(json.dumps({"split": shape(split), "whole": shape(whole), "refused": refused}))
            """
        )
    )
    assert r["whole"] == [[20 << 20], [20 << 20]], r
    assert len(r["split"]) < len(r["whole"]), r
    if mode == "compact":
        # Compact maps exactly what the allocations use: no free tail for PyTorch's test to count.
        assert r["split"] == [[4 << 20, 4 << 20]], r
    else:
        assert sum(map(len, r["split"])) > sum(map(len, r["whole"])), r
    assert r["refused"] and "no_split" in r["refused"], r


def test_mempool_under_install_is_the_librarys_pool():
    r = installed(
        """
        import threading
        state["initialized"] = True
        M, use = torch.cuda.MemPool, torch.cuda.use_mem_pool
        def pools_of(p):
            return [s["address"] for s in p.snapshot()]
        def inside(segments, ptr):
            return any(s["address"] <= ptr < s["address"] + s["total_size"] for s in segments)
        seen = {"same_class": M is torch.cuda.memory.MemPool}
        pool = M()
        seen["id"], seen["count_before"] = list(pool.id), pool.use_count()
        with use(pool):
            seen["count_inside"] = pool.use_count()
            x = lib.vram_ledger_malloc(4096, 0, None)
            lib.vram_ledger_free(x, 4096, 0, None)
            lib.vram_ledger_reset()  # torch.cuda.empty_cache's hook, inside the pool
        seen["count_after"] = pool.use_count()
        seen["segments_kept"] = len(pool.snapshot())
        seen["x_in_pool"] = inside(pool.snapshot(), x)
        outer, inner = M(), M()
        with use(outer):
            with use(inner):
                a = lib.vram_ledger_malloc(1 << 20, 0, None)
            b = lib.vram_ledger_malloc(1 << 20, 0, None)
        plain = lib.vram_ledger_malloc(1 << 20, 0, None)
        seen["nested"] = [inside(inner.snapshot(), a), inside(outer.snapshot(), b), inside(outer.snapshot(), a)]
        # As inductor's CUDA-graph trees route a thread: through torch._C's names.
        trees = M()
        torch._C._cuda_beginAllocateCurrentThreadToPool(0, trees.id)
        t = lib.vram_ledger_malloc(1 << 20, 0, None)
        torch._C._cuda_endAllocateToPool(0, trees.id)
        torch._C._cuda_releasePool(0, trees.id)
        seen["c_names_route"] = [inside(trees.snapshot(), t), trees.use_count()]
        lib.vram_ledger_free(t, 1 << 20, 0, None)
        seen["all_pools_listed"] = inside(torch.cuda.memory_snapshot(), a) and inside(torch.cuda.memory_snapshot(), plain)
        seen["plain_in_a_pool"] = any(inside(p.snapshot(), plain) for p in (pool, outer, inner))
        ids = []
        threads = [threading.Thread(target=lambda: ids.append(M().id)) for _ in range(4)]
        for t in threads: t.start()
        for t in threads: t.join()
        seen["thread_ids"] = len(set(ids))
        seen["refused"] = []
        for kw in [{"allocator": object()}, {"colour": "blue"}]:
            try:
                M(**kw)
            except vl.VramLedgerError as e:
                seen["refused"].append(str(e))
        # A pool with its own allocator: libc's valloc (page-aligned) and free stand in for a
        # CUDA allocator's (the simulated device never touches the memory; the extra arguments
        # are ignored).
        plug = torch.cuda.memory.CUDAPluggableAllocator("libc.so.6", "valloc", "free")
        own = M(plug.allocator(), use_on_oom=True)
        seen["own_allocator"] = own.allocator is plug.allocator()
        with use(own):
            o = lib.vram_ledger_malloc(1 << 20, 0, None)
        own_segments = own.snapshot()
        seen["own_segment"] = [inside(own_segments, o), len(own_segments)]
        # libc's large blocks are mapped near the top of the address space; the simulated
        # device's addresses start at 1 TiB.
        seen["own_from_malloc"] = o >= 1 << 45
        seen["own_reserved"] = vl.stats(0)["reserved_bytes"]["current"]
        lib.vram_ledger_free(o, 1 << 20, 0, None)
        del own
        import gc; gc.collect()
        lib.vram_ledger_reset()
        seen["own_given_back"] = vl.stats(0)["reserved_bytes"]["current"] - seen["own_reserved"]
        with vl.mempool("kv") as kv:
            seen["kv_tag"] = vl.current_tag()
            k = lib.vram_ledger_malloc(1 << 20, 0, None)
        seen["kv_in_its_pool"] = inside(kv.pool.snapshot(), k)
        # The last references go: the pools' free memory goes back, what is allocated stays.
        for p in (a, b, plain, k):
            lib.vram_ledger_free(p, 1 << 20, 0, None)
        key = tuple(pool.id)
        del pool, outer, inner, kv, trees
        import gc; gc.collect()
        lib.vram_ledger_reset()
        seen["left"] = [s["segment_pool_id"] for s in torch._C._cuda_memorySnapshot(None)["segments"] if tuple(s["segment_pool_id"]) != (0, 0)]
        seen["end_without_begin"] = None
        try:
            torch.cuda.memory._cuda_endAllocateToPool(0, key)
        except vl.VramLedgerError as e:
            seen["end_without_begin"] = str(e)
        print(json.dumps(seen))
        """
    )
    assert r["same_class"] and r["id"][0] == 0, r
    assert [r["count_before"], r["count_inside"], r["count_after"]] == [1, 2, 1], r
    assert r["segments_kept"] == 1 and r["x_in_pool"], "empty_cache inside the pool kept its segment"
    assert r["nested"] == [True, True, False] and not r["plain_in_a_pool"], r
    assert r["c_names_route"] == [True, 1], "torch._C's names route the thread to the pool and count as PyTorch does"
    assert r["all_pools_listed"], "memory_snapshot() lists every pool's segments and the rest"
    assert r["thread_ids"] == 4, r
    assert "CUDAPluggableAllocator(path, alloc_name, free_name) after install()" in r["refused"][0], r
    assert "colour=...) is not supported under vram_ledger.install()" in r["refused"][1], r
    assert r["own_allocator"] and r["own_segment"] == [True, 1] and r["own_from_malloc"], r
    assert r["own_given_back"] < -(1 << 20), "the pool's segment went back to its allocator"
    assert r["kv_tag"] == "kv_cache" and r["kv_in_its_pool"], r
    assert r["left"] == [], "every pool's memory went back with its last reference"
    assert r["end_without_begin"] and "pool" in r["end_without_begin"], r
