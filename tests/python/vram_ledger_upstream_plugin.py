"""A pytest plugin for tests/python/upstream_tests.py: `vram_ledger.install(mode)` as pytest
starts, before the test file imports anything that touches CUDA, with the mode named by
VRAM_LEDGER_UPSTREAM_MODE."""

import os

import vram_ledger


def pytest_configure(config):
    vram_ledger.install(mode=os.environ["VRAM_LEDGER_UPSTREAM_MODE"])
