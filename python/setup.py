"""Puts libvram_ledger.so inside the package, so that an installed package needs no
environment variable and no Rust toolchain.

The package loads the library with ctypes and has no compiled Python extension (the source of
the optional one, `csrc/torch_allocator.cpp`, travels in the wheel and is built on first use by
install(extension=True)), so one wheel serves every CPython 3.9+: it is tagged `py3-none-<platform>`, the platform because it carries a native
library. scripts/build-wheel.sh builds the library once, hands it over in
VRAM_LEDGER_PREBUILT_LIB and gives the wheel its manylinux tag with auditwheel; without that
variable (`pip install ./python`) the library is built here with cargo."""

import os
import shutil
import subprocess
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent.parent


def library() -> Path:
    """The library to package: the prebuilt one named in VRAM_LEDGER_PREBUILT_LIB, else one
    built now with cargo."""
    prebuilt = os.environ.get("VRAM_LEDGER_PREBUILT_LIB")
    if prebuilt:
        path = Path(prebuilt)
        if not path.is_file():
            raise RuntimeError(f"VRAM_LEDGER_PREBUILT_LIB={prebuilt} does not name a file")
        return path
    if shutil.which("cargo") is None:
        raise RuntimeError("building vram-ledger needs Rust's cargo on PATH (https://rustup.rs), or a prebuilt library in VRAM_LEDGER_PREBUILT_LIB")
    subprocess.check_call(["cargo", "build", "--release", "--lib", "--locked"], cwd=ROOT)
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    if not target.is_absolute():
        target = ROOT / target
    return target / "release" / "libvram_ledger.so"


class BuildWithLibrary(build_py):
    def run(self) -> None:
        super().run()
        dest = Path(self.build_lib) / "vram_ledger"
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(library(), dest / "libvram_ledger.so")


class BinaryDistribution(Distribution):
    # The wheel holds a native library: counted as an extension, the package installs into
    # platlib (not purelib, which may be another folder) and the wheel is tagged for a platform.
    def has_ext_modules(self) -> bool:
        return True


class PlatformWheel(bdist_wheel):
    def get_tag(self) -> tuple:
        # An extension would tie the wheel to one CPython (cp311-cp311); this library is loaded
        # with ctypes and links no libpython, so any Python 3 takes it: py3-none-<platform>.
        _, _, platform = super().get_tag()
        return "py3", "none", platform


setup(cmdclass={"build_py": BuildWithLibrary, "bdist_wheel": PlatformWheel}, distclass=BinaryDistribution)
