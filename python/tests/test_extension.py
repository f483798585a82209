"""install(extension=True) against the stand-in torch, with a stand-in for the built extension
(`csrc/torch_allocator.cpp` itself is built and run on a GPU machine, tests/python/h200_torch.py
and PyTorch's own test_cuda.py): what install() hands it, that a failed build changes nothing,
and the package's side of the history the extension records (compile contexts, stacks that
C++'s recorder gathered)."""

from test_torch_stand_in import STAND_IN, run_on_sim

# The built module, as `_extension.module()` returns it: records what it is handed, and plays
# the C++ side (a context source that names ids with CPP_ID, compile contexts, resolve).
EXTENSION = """
import ctypes
from vram_ledger import _frames
region = [""]
cpp = {"next": 1, "ids": {}, "history": None, "kept": None}
def cpp_source(kind):
    # As the extension's: a stack for allocations (context "alloc"), a free only its region.
    if kind == 1 and not region[0]:
        return 0
    i = _frames.CPP_ID | cpp["next"]
    cpp["next"] += 1
    stack = [{"filename": "model.cpp", "line": 7, "name": "at::rand"}] if kind == 0 else []
    cpp["ids"][i] = (stack, kind == 0, region[0])
    return i
CPP_SOURCE = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_int)(cpp_source)
class Extension:
    def install(self, *args):
        calls.append(["extension_install", *args[:6]])
        self.record, self.raw_snapshot, self.checkpoint, self.restore = args[6:10]
    def set_compile_contexts(self, on): calls.append(["compile_contexts", on])
    def compile_context(self): return region[0]
    def stopped(self, forget):
        calls.append(["stopped", forget])
        if forget:
            cpp["ids"].clear()
    def set_history_enabled(self, on): cpp["history"] = on
    def keep(self, ids):
        cpp["kept"] = list(ids)
        for i in [i for i in cpp["ids"] if i not in ids]:
            del cpp["ids"][i]
    def resolve(self, ids): return [cpp["ids"].get(i) for i in ids]
ext = Extension()
def load(**kwargs):
    calls.append(["build", kwargs["name"], kwargs["with_cuda"]])
    if build_fails:
        raise RuntimeError("Ninja is required to load C++ extensions")
    return ext
torch.__version__ = "2.11.0+cu130"
cpp_extension = types.ModuleType("torch.utils.cpp_extension")
cpp_extension.load = load
torch.utils = types.ModuleType("torch.utils")
torch.utils.cpp_extension = cpp_extension
sys.modules.update({"torch.utils": torch.utils, "torch.utils.cpp_extension": cpp_extension})
memory._get_current_allocator = lambda: "current"
"""


def with_extension(code: str, build_fails: bool = False) -> dict:
    return run_on_sim(STAND_IN + f"build_fails = {build_fails}\n" + EXTENSION + code)


def installed(code: str) -> dict:
    """`code` run after install(extension=True) has built the stand-in, with CUDA initialised and
    `source` the stand-in's C++ context source."""
    prelude = 'vl.install(mode="remap", extension=True)\nstate["initialized"] = True\n'
    return with_extension(prelude + "source = ctypes.cast(CPP_SOURCE, ctypes.c_void_p).value\n" + code)


def test_install_with_the_extension_hands_it_the_librarys_hooks_in_place_of_the_pluggable_allocator():
    r = with_extension(
        """
got = vl.install(mode="remap", extension=True)
fns = ["vram_ledger_malloc_or_throw", "vram_ledger_free", "vram_ledger_init", "vram_ledger_reset",
       "vram_ledger_memory_fraction", "vram_ledger_record_stream"]
print(json.dumps({"calls": calls, "want": [address(f) for f in fns], "got": got,
                  "record": ext.record.__name__, "snapshot": ext.raw_snapshot.__name__,
                  "checkpoint": [ext.checkpoint.__name__, ext.restore.__name__],
                  "trees": inductor.config.triton.cudagraph_trees}))
"""
    )
    names = [c[0] for c in r["calls"]]
    assert names[:2] == ["build", "extension_install"], r["calls"]
    assert r["calls"][0][1:] == ["vram_ledger_extension_2_11_0_cu130", True], "named for torch's version, built with CUDA"
    assert r["calls"][1][1:] == r["want"], "the extension gets the library's own hooks"
    assert "plug" not in names and "change" not in names, "PyTorch's plain pluggable allocator is not installed"
    assert r["got"] == "current", "install() returns PyTorch's current allocator, the extension's"
    assert (r["record"], r["snapshot"]) == ("record_from_cpp", "raw_snapshot"), r
    assert r["checkpoint"] == ["checkpoint", "restore"], r
    assert r["trees"] is True, "the extension answers the trees' checkpoints: inductor keeps them"


def test_a_pools_checkpoint_is_restored_through_the_functions_the_extension_calls():
    r = installed(
        """
from vram_ledger._lib import VramLedgerError
pool = (0, 7)
assert lib.vram_ledger_pool_hold(0, *pool, None, None, 0) == 0
def in_pool(n):
    assert lib.vram_ledger_pool_begin(0, *pool) == 0
    p = lib.vram_ledger_malloc(n, 0, None)
    assert lib.vram_ledger_pool_end(0, *pool) == 0
    return p
x, y = in_pool(1 << 20), in_pool(3000)
text, live = ext.checkpoint(0, pool)
lib.vram_ledger_free(y, 3000, 0, None)
z = in_pool(5000)
errors = []
for bad in ["{", '{"blocks": [{"addr": 1}]}', json.dumps({"blocks": [{"addr": x, "size": 512, "requested": 9, "tag": "weights"}, {"addr": x + 8, "size": 512, "requested": 9, "tag": "weights"}]})]:
    try:
        ext.restore(0, pool, bad)
    except VramLedgerError as e:
        errors.append(str(e))
unchanged = ext.checkpoint(0, pool)[1]
freed, made = ext.restore(0, pool, text)
after = ext.checkpoint(0, pool)
try:
    ext.checkpoint(0, (5, 5))
    unknown = None
except VramLedgerError as e:
    unknown = str(e)
# As a captured graph's private pool: the library's id until the capture ends, then PyTorch's
# name for it (graph.pool()) in snapshots and checkpoints.
segs = lambda: [tuple(s["segment_pool_id"]) for s in ext.raw_snapshot(0, (0, 0), False)["segments"]]
before_alias = segs()
vl._torch._POOL_ALIASES[(31, 0)] = pool
named = [segs(), ext.checkpoint(0, (31, 0))[1]]
print(json.dumps({"xyz": [x, y, z], "live": live, "errors": errors, "unchanged": unchanged,
                  "freed": freed, "made": made, "after": after, "text": text, "unknown": unknown,
                  "before_alias": before_alias, "named": named}))
"""
    )
    x, y, z = r["xyz"]
    assert r["live"] == sorted([x, y]), r
    assert len(r["errors"]) == 3 and "malformed checkpoint" in r["errors"][0] and "overlap" in r["errors"][2], r["errors"]
    assert r["unchanged"] == sorted([x, z]), "a refused restore changed the pool"
    assert sorted(r["freed"]) == sorted([x, z]) and r["made"] == sorted([x, y]), r
    assert r["after"] == [r["text"], sorted([x, y])], "the pool holds what the checkpoint recorded"
    assert "graph pool" in r["unknown"], r["unknown"]
    assert [0, 7] in r["before_alias"] and [31, 0] not in r["before_alias"], r["before_alias"]
    assert [31, 0] in r["named"][0] and [0, 7] not in r["named"][0], "the snapshot names the pool as PyTorch does"
    assert r["named"][1] == sorted([x, y]), "a checkpoint of PyTorch's name is the library pool's"


def test_a_failed_build_raises_and_changes_nothing():
    r = with_extension(
        """
try:
    vl.install(mode="compact", extension=True)
    error = None
except RuntimeError as e:
    error = str(e)
p = lib.vram_ledger_malloc(1 << 20, 0, None)
import pickle, tempfile, os
path = tempfile.mktemp()
vl.dump_snapshot(path, 0)
mode = pickle.load(open(path, "rb"))["allocator_settings"]["vram_ledger_mode"]
os.unlink(path)
lib.vram_ledger_free(p, 1 << 20, 0, None)
print(json.dumps({"error": error, "calls": calls, "mode": mode, "installed": "allocator" in vl._torch._INSTALLED}))
""",
        build_fails=True,
    )
    assert r["error"] == "Ninja is required to load C++ extensions", r
    assert [c[0] for c in r["calls"]] == ["build"], "nothing is handed to PyTorch after a failed build"
    assert r["mode"] != "compact", "the mode is not configured before the build succeeds"
    assert r["installed"] is False, r


def test_graph_trees_asked_for_without_the_extension_are_refused_before_anything_changes():
    r = with_extension(
        """
errors = []
for kwargs in [dict(cudagraph_trees=True), dict(cudagraph_trees=True, extension=False)]:
    try:
        vl.install(mode="compact", **kwargs)
    except ValueError as e:
        errors.append(str(e))
off = vl.install(mode="expandable", cudagraph_trees=False, extension=True) is not None
print(json.dumps({"errors": errors, "calls": [c[0] for c in calls], "trees": inductor.config.triton.cudagraph_trees, "off": off}))
"""
    )
    assert len(r["errors"]) == 2 and all("cudagraph_trees=True needs install(extension=True)" in e for e in r["errors"]), r
    assert r["calls"][:2] == ["build", "extension_install"], "the refused calls built and installed nothing"
    assert r["off"] and r["trees"] is False, "cudagraph_trees=False turns the trees off with the extension too"


def test_the_environment_names_the_default_and_a_bad_value_is_refused():
    r = with_extension(
        """
import os
from vram_ledger import _extension
seen = {}
for value in ["", "0", "off", "1", "yes", "maybe"]:
    os.environ[_extension.ENV] = value
    try:
        seen[value] = _extension.wanted(None)
    except ValueError as e:
        seen[value] = str(e)
seen["named"] = _extension.wanted(False)
print(json.dumps(seen))
"""
    )
    assert r[""] is False and r["0"] is False and r["off"] is False, r
    assert r["1"] is True and r["yes"] is True and r["named"] is False, r
    assert "VRAM_LEDGER_TORCH_EXTENSION must be 1 or 0" in r["maybe"] and "'maybe'" in r["maybe"], r


def test_compile_contexts_are_recorded_on_each_history_entry():
    # As test_cuda.py's test_memory_compile_regions reads them: "N/A" outside a compiled region.
    r = installed(
        """
C = torch._C
seen = {}
for context in ["all", None]:
    C._cuda_record_memory_history("all", context, "python", sys.maxsize, True, True, False, [])
    region[0] = "Torch-Compiled Region: 0/0"
    p = lib.vram_ledger_malloc(1 << 20, 0, None)
    region[0] = ""
    q = lib.vram_ledger_malloc(2 << 20, 0, None)
    region[0] = "Torch-Compiled Region: 1/0"
    lib.vram_ledger_free(p, 1 << 20, 0, None)
    region[0] = ""
    lib.vram_ledger_free(q, 2 << 20, 0, None)
    trace = C._cuda_memorySnapshot(None)["device_traces"][0]
    seen[str(context)] = [[e["action"], e["size"], e["compile_context"], bool(e.get("frames"))]
                          for e in trace if e["action"] in ("alloc", "free_requested")]
C._cuda_record_memory_history(None)
seen["calls"] = [c for c in calls if c[0] == "compile_contexts"]
print(json.dumps(seen))
"""
    )
    region = "Torch-Compiled Region: 0/0"
    assert r["all"] == [
        ["alloc", 1 << 20, region, True],
        ["alloc", 2 << 20, "N/A", True],
        ["free_requested", 1 << 20, "Torch-Compiled Region: 1/0", True],
        ["free_requested", 2 << 20, "N/A", True],
    ], r["all"]
    # With context None no stack is gathered, but allocations still name their region.
    assert r["None"][:2] == [["alloc", 1 << 20, region, False], ["alloc", 2 << 20, "N/A", False]], r["None"]
    assert r["calls"][-1] == ["compile_contexts", False], "stopping the history stops the callbacks"
    assert ["compile_contexts", True] in r["calls"], r["calls"]


def test_a_history_recorded_from_cpp_shows_the_stacks_its_recorder_gathered():
    r = installed(
        """
# What the extension's recordHistory calls: torch::cuda::_record_memory_history(True, ctx, 10, ctx, ctx).
ext.record(True, 10, "alloc", False, [], source)
region[0] = "Torch-Compiled Region: 0/0"
p = lib.vram_ledger_malloc(311 * 411 * 4, 0, None)
region[0] = ""
raw = ext.raw_snapshot(0, (0, 0), True)
key = raw["context_key"]
raw_ids = [e.get(key, 0) for e in raw["device_traces"][0] if e["action"] == "alloc"]
snap = torch._C._cuda_memorySnapshot(None)
alloc = [e for e in snap["device_traces"][0] if e["action"] == "alloc"][-1]
block = [b for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"][0]
no_traces = ext.raw_snapshot(0, (0, 0), False)["device_traces"]
lib.vram_ledger_free(p, 311 * 411 * 4, 0, None)
ext.record(False, 1, None, False, [], source)
after = lib.vram_ledger_malloc(1 << 20, 0, None)
stopped = [e["size"] for e in torch._C._cuda_memorySnapshot(None)["device_traces"][0] if e["action"] == "alloc"]
print(json.dumps({"raw_ids": raw_ids, "alloc": alloc, "block": block, "no_traces": no_traces, "stopped": stopped,
                  "expandable": raw["expandable_segments"], "cpp_id": _frames.CPP_ID}))
"""
    )
    assert len(r["raw_ids"]) == 1 and r["raw_ids"][0] & r["cpp_id"], "C++ names the entry, unresolved in the raw snapshot"
    assert r["alloc"]["frames"] == [{"filename": "model.cpp", "line": 7, "name": "at::rand"}], r["alloc"]
    assert r["alloc"]["compile_context"] == "Torch-Compiled Region: 0/0", r["alloc"]
    assert r["block"]["frames"] == r["alloc"]["frames"] and r["block"]["requested_size"] == 311 * 411 * 4, r["block"]
    assert all(t == [] for t in r["no_traces"]), "include_traces false leaves the history out"
    assert r["stopped"] == [311 * 411 * 4], "recordHistory(false) from C++ stops the history"
    assert r["expandable"] is True, "remap maps segments as they grow"


def test_a_free_shows_its_allocations_stack_and_region_unless_frees_are_recorded():
    # With context "alloc" a free's entry carries its allocation's identifier (PyTorch shows the
    # allocation's stack there too); its region is then the allocation's, where PyTorch would
    # name the one the free ran in (documented).
    r = installed(
        """
C = torch._C
C._cuda_record_memory_history("all", "alloc", "python", sys.maxsize, True, True, False, [])
region[0] = "Torch-Compiled Region: 0/0"
p = lib.vram_ledger_malloc(1 << 20, 0, None)
region[0] = "Torch-Compiled Region: 1/0"
lib.vram_ledger_free(p, 1 << 20, 0, None)
region[0] = ""
trace = C._cuda_memorySnapshot(None)["device_traces"][0]
print(json.dumps([[e["action"], e["size"], e["compile_context"], bool(e.get("frames"))]
                  for e in trace if e["action"] in ("alloc", "free_requested")]))
"""
    )
    assert r == [
        ["alloc", 1 << 20, "Torch-Compiled Region: 0/0", True],
        ["free_requested", 1 << 20, "Torch-Compiled Region: 0/0", True],
    ], r


def test_whether_a_history_is_recorded_is_known_however_it_was_started():
    # inductor's CUDA-graph trees ask torch._C._cuda_isHistoryEnabled() before they record.
    r = installed(
        """
C = torch._C
seen = [[C._cuda_isHistoryEnabled(), cpp["history"]]]
C._cuda_record_memory_history("all", "all", "python", sys.maxsize, False, False, False, [])
seen.append([C._cuda_isHistoryEnabled(), cpp["history"]])
C._cuda_record_memory_history(None)
seen.append([C._cuda_isHistoryEnabled(), cpp["history"]])
ext.record(True, 10, "alloc", False, [], source)
seen.append([C._cuda_isHistoryEnabled(), cpp["history"]])
ext.record(False, 1, None, False, [], source)
seen.append([C._cuda_isHistoryEnabled(), cpp["history"]])
print(json.dumps(seen))
"""
    )
    assert r == [[False, None], [True, True], [False, False], [True, True], [False, False]], r


def test_python_going_on_with_a_cpp_history_keeps_its_stacks_until_it_clears():
    r = installed(
        """
C = torch._C
ext.record(True, 100, "alloc", False, [], source)
p = lib.vram_ledger_malloc(1 << 20, 0, None)
C._cuda_record_memory_history("all", "alloc", "python", sys.maxsize, False, False, False, [])
def first_alloc():
    trace = C._cuda_memorySnapshot(None)["device_traces"][0]
    return [e["frames"] for e in trace if e["action"] == "alloc"][:1]
kept = first_alloc()
C._cuda_record_memory_history("all", "alloc", "python", sys.maxsize, True, False, False, [])
lib.vram_ledger_free(p, 1 << 20, 0, None)
print(json.dumps({"kept": kept, "stopped": [c for c in calls if c[0] == "stopped"], "ids": len(cpp["ids"])}))
"""
    )
    assert r["kept"] == [[{"filename": "model.cpp", "line": 7, "name": "at::rand"}]], r
    assert r["stopped"] == [["stopped", False], ["stopped", True]], r
    assert r["ids"] == 0, "cleared: the stacks C++ gathered are forgotten"


def test_a_cpp_snapshot_lets_the_extension_forget_what_the_ring_dropped():
    r = installed(
        """
ext.record(True, 2, "alloc", False, [], source)
ptrs = [lib.vram_ledger_malloc(1 << 20, 0, None) for _ in range(4)]
for p in ptrs[1:]:
    lib.vram_ledger_free(p, 1 << 20, 0, None)
before = len(cpp["ids"])
raw = ext.raw_snapshot(0, (0, 0), True)
key = raw["context_key"]
named = {e.get(key, 0) for e in raw["device_traces"][0]} | {b.get(key, 0) for s in raw["segments"] for b in s["blocks"]}
print(json.dumps({"before": before, "kept": sorted(cpp["kept"]), "named": sorted(i for i in named if i),
                  "left": len(cpp["ids"])}))
lib.vram_ledger_free(ptrs[0], 1 << 20, 0, None)
"""
    )
    assert r["before"] == 4, r
    # The live block's stack (the first allocation) and those the two kept entries name.
    assert r["kept"] == r["named"] and r["left"] == len(r["kept"]) < 4, r
