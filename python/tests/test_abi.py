"""The package binds the library from the library's own description (vram_ledger_abi_json):
signatures, tags and modes; and its public surface is what __all__ says, typed and documented."""

import ast
import ctypes
import inspect
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
from test_pure import child_env

import vram_ledger as vl
from vram_ledger import _lib

PACKAGE = Path(vl.__file__).resolve().parent


def described() -> dict:
    """The library's description, read through a handle of its own (binding it changes
    nothing for the package's handle)."""
    lib = ctypes.CDLL(vl.library_path())
    return _lib._read_abi(lib, vl.library_path())


def test_tags_and_modes_are_the_librarys():
    d = described()
    assert vl.TAGS == tuple(s for t in d["tags"] for s in [t["name"], *t["aliases"]])
    assert vl.MODES == tuple(m["name"] for m in d["modes"]) == ("native", "expandable", "compact", "remap")
    assert {"kv", "kv_cache", "activations"} <= set(vl.TAGS)
    bits = _lib.abi().tag_bits
    names = [t["name"] for t in d["tags"]]
    assert sorted(bits[n] for n in names) == [1 << i for i in range(len(names))]
    assert bits["kv"] == bits["kv_cache"] and bits["activations"] == bits["activation"]
    assert _lib.abi().virtual_modes == {"expandable", "compact", "remap"}


def test_every_entry_point_is_bound_with_the_librarys_signature():
    lib = vl._lib.load()
    functions = described()["functions"]
    assert {f["name"] for f in functions} >= set(_lib.USED)
    for f in functions:
        bound = getattr(lib, f["name"])
        assert bound.restype is _lib._CTYPES[f["returns"]], f
        assert tuple(bound.argtypes) == tuple(_lib._CTYPES[t] for t in f["args"]), f
    assert tuple(lib.vram_ledger_set_cap.argtypes) == (ctypes.c_int, ctypes.c_int64)
    assert lib.vram_ledger_malloc.restype is ctypes.c_void_p
    assert lib.vram_ledger_current_tag.restype is ctypes.c_char_p


def used_in_package() -> set:
    """Every library function the package's code names (as an attribute or a string), read
    from its syntax trees: docstrings and metric names do not count."""
    names = set()
    for source in PACKAGE.glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Attribute):
                name = node.attr
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                name = node.value
            else:
                continue
            if name.startswith("vram_ledger_") and name.isidentifier() and not name.startswith("vram_ledger_extension"):
                names.add(name)
    return names


def test_the_load_check_covers_every_function_the_package_calls():
    used = used_in_package()
    assert "vram_ledger_malloc_or_throw" in used and "vram_ledger_sleep" in used
    assert used == set(_lib.USED), "USED in _lib.py must list exactly what the package calls"


def test_a_library_lacking_functions_the_package_calls_is_refused_by_name():
    d = described()
    d["functions"] = [f for f in d["functions"] if f["name"] not in ("vram_ledger_sleep", "vram_ledger_wake")]
    with pytest.raises(vl.VramLedgerError, match="lacks vram_ledger_sleep, vram_ledger_wake, which this package calls"):
        _lib._bind(ctypes.CDLL(vl.library_path()), "lib.so", d)
    # Described but not exported is missing too.
    exported_nothing = types.SimpleNamespace()
    with pytest.raises(vl.VramLedgerError, match="lacks vram_ledger_abi_json, "):
        _lib._bind(exported_nothing, "lib.so", described())


def test_a_c_type_without_a_ctypes_type_is_refused_only_where_the_package_needs_it():
    d = described()
    for f in d["functions"]:
        if f["name"] == "vram_ledger_cap":
            f["returns"] = "__int128"
    with pytest.raises(vl.VramLedgerError, match="no ctypes type for the C types of vram_ledger_cap \\(__int128\\)"):
        _lib._bind(ctypes.CDLL(vl.library_path()), "lib.so", d)
    # A newer library's function the package does not call may have types it does not know.
    d = described()
    d["functions"].append({"name": "vram_ledger_set_tag", "returns": "int", "args": ["struct future *"]})
    d["functions"].append({"name": "vram_ledger_from_the_future", "returns": "void", "args": []})
    abi = _lib._bind(ctypes.CDLL(vl.library_path()), "lib.so", d)
    assert abi.modes == vl.MODES


def test_a_garbled_description_is_a_clear_error():
    d = described()
    del d["tags"]
    with pytest.raises(vl.VramLedgerError, match="description of itself lacks or garbles 'tags'"):
        _lib._bind(ctypes.CDLL(vl.library_path()), "lib.so", d)


def test_a_library_that_does_not_describe_itself_is_refused_at_load():
    import _ctypes

    other = getattr(_ctypes, "__file__", None)
    if not other or not Path(other).is_file():
        pytest.skip("no shared object to stand in for an old library")
    code = "import vram_ledger as vl\ntry:\n    vl.stats(0)\nexcept vl.VramLedgerError as e:\n    print(e)\n"
    out = subprocess.run([sys.executable, "-c", code], env=child_env(VRAM_LEDGER_LIB=other), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert f"{other} does not export vram_ledger_abi_json" in out.stdout, out.stdout


def test_all_lists_every_public_name_and_nothing_else():
    public = {
        n
        for n, v in vars(vl).items()
        if not n.startswith("_") and not isinstance(v, types.ModuleType) and n != "annotations"
    }
    assert public | {"TAGS", "MODES"} == set(vl.__all__)
    assert len(vl.__all__) == len(set(vl.__all__))
    for name in ("sleep", "wake", "set_retain_host", "VramLedgerError", "library_path", "TAGS", "MODES"):
        assert name in vl.__all__
    code = "import json\nfrom vram_ledger import *\nprint(json.dumps(sorted(k for k in dir() if k not in ('json',) and not k.startswith('__'))))"
    out = subprocess.run([sys.executable, "-c", code], env=child_env(VRAM_LEDGER_LIB=vl.library_path()), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == sorted(vl.__all__)


def test_public_functions_have_full_type_hints():
    for name in vl.__all__:
        obj = getattr(vl, name)
        if not inspect.isfunction(obj):
            continue
        sig = inspect.signature(obj)
        assert sig.return_annotation is not inspect.Signature.empty, name
        for p in sig.parameters.values():
            assert p.annotation is not inspect.Parameter.empty, f"{name}({p.name})"


def test_every_public_name_is_documented():
    doc = PACKAGE.parent.parent / "docs" / "python.md"
    if not doc.is_file():
        pytest.skip("the documentation is not beside this copy of the package")
    text = doc.read_text()
    for name in vl.__all__:
        assert f"`{name}" in text, f"{name} is not in docs/python.md"
