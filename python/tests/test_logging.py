"""Each failure reaches the user once: an error the package raises is not logged as well, and a
failure of a call that returns nothing (a free) is logged, since no exception can carry it."""

import logging

import vram_ledger as vl


def test_a_failure_with_a_result_to_check_is_not_logged_as_well(caplog):
    lib = vl._lib.load()
    with caplog.at_level(logging.DEBUG, logger="vram_ledger"):
        assert lib.vram_ledger_pop_tag() != 0  # nothing was pushed
    assert "without a matching push_tag" in vl._lib._last_error()
    assert not [r for r in caplog.records if "push_tag" in r.getMessage()], caplog.text


def test_a_failure_of_a_call_that_returns_nothing_is_logged_once(caplog):
    lib = vl._lib.load()
    with caplog.at_level(logging.WARNING, logger="vram_ledger"):
        lib.vram_ledger_free(0x3039, 0, 0, None)
    mine = [r for r in caplog.records if r.name == "vram_ledger" and r.levelno == logging.WARNING]
    assert len(mine) == 1, caplog.text
    assert mine[0].getMessage() == vl._lib._last_error(), caplog.text
