"""Builds the Rust library with cargo and puts it inside the package, so that
`pip install ./python` gives a working package with no environment variable to set. The
wheel is platform-specific: it carries a native library."""

import os
import shutil
import subprocess
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent.parent


class BuildWithLibrary(build_py):
    def run(self) -> None:
        super().run()
        if shutil.which("cargo") is None:
            raise RuntimeError("building vram-ledger needs Rust's cargo on PATH (https://rustup.rs)")
        subprocess.check_call(["cargo", "build", "--release", "--lib", "--locked"], cwd=ROOT)
        target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
        if not target.is_absolute():
            target = ROOT / target
        dest = Path(self.build_lib) / "vram_ledger"
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(target / "release" / "libvram_ledger.so", dest / "libvram_ledger.so")


class BinaryDistribution(Distribution):
    def has_ext_modules(self) -> bool:
        return True


setup(cmdclass={"build_py": BuildWithLibrary}, distclass=BinaryDistribution)
