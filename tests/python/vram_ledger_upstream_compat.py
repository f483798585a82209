"""A pytest plugin for tests/python/upstream_tests.py, loaded in every run (PyTorch's allocator
and each mode alike): a test file from PyTorch's tree may be a little newer or older than the
installed torch, and import a testing helper from a module of torch.testing._internal that
keeps it in another module in this torch. Each such name is found in its sibling modules and
set where the file looks for it, before the file is imported; the names set are printed.
A name found nowhere is left missing (the file's import then fails, in every run alike), except
TEST_CUDAMALLOCASYNC, whose meaning is fixed: PyTorch's allocator configured with its
cudaMallocAsync backend."""

import ast
import importlib
import os

import pytest

SIBLINGS = ["common_utils", "common_cuda", "common_device_type", "common_optimizers", "common_dtype"]
KNOWN = {
    "TEST_CUDAMALLOCASYNC": lambda: any(
        "backend:cudaMallocAsync" in os.environ.get(v, "") for v in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
    )
}


def wanted(path):
    """(module, name) for each `from torch.testing._internal.X import name` of the file."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.testing._internal."):
            for alias in node.names:
                yield node.module, alias.name


# Last: after the install plugin's configure, so that nothing imported here touches CUDA first.
@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    files = [p for p in (a.split("::")[0] for a in config.args) if p.endswith(".py") and os.path.exists(p)]
    done = []
    for path in files:
        for module_name, name in wanted(path):
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue  # a helper module this torch lacks: the file's own import says so
            if hasattr(module, name):
                continue
            for sibling in SIBLINGS:
                other = importlib.import_module(f"torch.testing._internal.{sibling}")
                if hasattr(other, name):
                    setattr(module, name, getattr(other, name))
                    done.append(f"{module_name}.{name} from {sibling}")
                    break
            else:
                if name in KNOWN:
                    setattr(module, name, KNOWN[name]())
                    done.append(f"{module_name}.{name} = {getattr(module, name)!r}")
    if done:
        print("upstream compat: " + "; ".join(done))
