"""A pytest plugin for tests/python/upstream_tests.py: `vram_ledger.install(mode)` as pytest
starts, before the test file imports anything that touches CUDA, with the configuration named
by VRAM_LEDGER_UPSTREAM_MODE (a mode, or `remap+later`)."""

import os

import cases
import vram_ledger


def pytest_configure(config):
    cases.install(vram_ledger, os.environ["VRAM_LEDGER_UPSTREAM_MODE"])
