"""Arguments are checked before ctypes converts them: ctypes would wrap an integer too large for
its C type (device 2**32 would be device 0, a cap of 2**64 + 5 bytes a cap of 5) and cut a string
at a NUL. Checks that need a device run on simulated ones, in a child process (see test_pure)."""

import pytest
from test_pure import run_on_sim

import vram_ledger as vl
from vram_ledger import _args

TOO_LARGE_FOR_INT = (2**31, 2**32, 2**32 + 1, 2**64)
TOO_LARGE_FOR_INT64 = (2**63, 2**64, 2**64 + 5)
NOT_INTS = (1.0, True, False, "1", None)

# Every public entry point that takes a device, called with `device=d`.
WITH_DEVICE = {
    "stats": lambda d: vl.stats(d),
    "memory_stats": lambda d: vl.memory_stats(d),
    "reset_peak_memory_stats": lambda d: vl.reset_peak_memory_stats(d),
    "empty_cache": lambda d: vl.empty_cache(d),
    "cap": lambda d: vl.cap(d),
    "set_cap": lambda d: vl.set_cap(1 << 30, device=d),
    "record_history": lambda d: vl.record_history(True, 10, device=d),
    "dump_snapshot": lambda d: vl.dump_snapshot("unwritten.pickle", device=d),
    "report": lambda d: vl.report(d),
    "profile": lambda d: vl.profile(0.5, device=d).__enter__(),
    "sleep": lambda d: vl.sleep(offload="weights", device=d),
    "wake": lambda d: vl.wake(device=d),
    "set_retain_host": lambda d: vl.set_retain_host(True, device=d),
    "set_sleep_file": lambda d: vl.set_sleep_file("/tmp/unmade", device=d),
    "set_zero_discarded": lambda d: vl.set_zero_discarded(False, device=d),
}


@pytest.mark.parametrize("entry", sorted(WITH_DEVICE))
def test_every_device_argument_is_checked(entry):
    call = WITH_DEVICE[entry]
    for d in TOO_LARGE_FOR_INT:
        with pytest.raises(OverflowError, match="too large for its C type int"):
            call(d)
    with pytest.raises(ValueError, match="device -1 is not a device ordinal"):
        call(-1)
    for bad in (1.0, True, "0", b"0"):
        with pytest.raises(TypeError, match="device must be an int"):
            call(bad)


def test_the_sleep_files_path_is_checked():
    for bad in (5, 1.0, [b"x"]):
        with pytest.raises(TypeError, match="sleep file's path"):
            vl.set_sleep_file(bad)
    for bad in ("", "a\0b"):
        with pytest.raises(ValueError, match="non-empty path"):
            vl.set_sleep_file(bad)


def test_a_negative_device_is_still_a_library_error_as_before():
    with pytest.raises(vl.VramLedgerError):
        vl.stats(-3)


def test_a_wrapped_device_would_have_reached_device_0_and_does_not():
    r = run_on_sim(
        """
        seen = {}
        for name, call in [("cap", lambda: vl.set_cap(1 << 30, device=2**32)),
                           ("history", lambda: vl.record_history(True, 5, device=2**32)),
                           ("retain", lambda: vl.set_retain_host(True, device=2**32))]:
            try:
                call()
            except OverflowError as e:
                seen[name] = str(e)
        seen["cap0"] = vl.cap(0)
        # A device past the count is refused by name (also a VramLedgerError, as the library's).
        try:
            vl.stats(2)
        except vl.VramLedgerError as e:
            seen["past"] = [str(e), isinstance(e, ValueError)]
        print(json.dumps(seen))
        """
    )
    assert set(r) == {"cap", "history", "retain", "cap0", "past"}, r
    assert r["cap0"] is None, "device 0 was not capped"
    assert r["past"] == ["no device with ordinal 2: 2 device(s) available", True], r


def test_set_cap_is_checked_against_int64():
    for bytes_ in TOO_LARGE_FOR_INT64:
        with pytest.raises(OverflowError, match="bytes .* too large for its C type int64_t"):
            vl.set_cap(bytes_)
    for bad in (-1, -(2**63)):
        with pytest.raises(ValueError, match="bytes must be at least 0"):
            vl.set_cap(bad)
    for bad in (1.5, True, "1G", b"1"):
        with pytest.raises(TypeError, match="bytes must be an int or None"):
            vl.set_cap(bad)


def test_set_cap_of_2_64_plus_5_and_2_63_leave_the_cap_alone_and_the_largest_cap_is_kept():
    r = run_on_sim(
        """
        vl.set_cap(1 << 30, device=1)
        seen = {}
        for name, value in [("wrapped", 2**64 + 5), ("negative", 2**63)]:
            try:
                vl.set_cap(value, device=1)
            except OverflowError:
                seen[name] = vl.cap(1)
        vl.set_cap(2**63 - 1, device=1)
        seen["largest"] = vl.cap(1)
        print(json.dumps(seen))
        """
    )
    # Before the check, 2**64 + 5 became a 5-byte cap and 2**63 (-1 in int64) lifted the cap.
    assert r == {"wrapped": 1 << 30, "negative": 1 << 30, "largest": 2**63 - 1}, r


def test_record_history_max_entries_is_checked():
    for n in TOO_LARGE_FOR_INT64:
        with pytest.raises(OverflowError, match="max_entries .* too large"):
            vl.record_history(True, n)
    for n in (0, -1, -(2**70)):
        with pytest.raises(ValueError, match="max_entries must be at least 1"):
            vl.record_history(True, n)
    for bad in NOT_INTS:
        with pytest.raises(TypeError, match="max_entries must be an int"):
            vl.record_history(True, bad)


def test_profile_margin_bytes_and_utilization_are_checked():
    for margin in TOO_LARGE_FOR_INT64:
        with pytest.raises(OverflowError, match="margin_bytes .* too large"):
            with vl.profile(0.5, margin_bytes=margin):
                pass
    with pytest.raises(ValueError, match="margin_bytes must be at least 0"):
        with vl.profile(0.5, margin_bytes=-1):
            pass
    for bad in (1.0, True, "1"):
        with pytest.raises(TypeError, match="margin_bytes must be an int or None"):
            with vl.profile(0.5, margin_bytes=bad):
                pass
    for bad in (True, "0.9", None, [0.5]):
        with pytest.raises(TypeError, match="utilization"):
            with vl.profile(bad):
                pass
    for bad in (0, 1.5, -0.1, float("nan"), float("inf"), 2**64):
        with pytest.raises(ValueError, match="utilization"):
            with vl.profile(bad):
                pass


def test_a_margin_too_large_opens_no_profiling_scope():
    r = run_on_sim(
        """
        try:
            with vl.profile(0.5, device=0, margin_bytes=2**64 + 1):
                pass
        except OverflowError:
            pass
        print(json.dumps({"open": bool(lib.vram_ledger_profile_end(0)), "error": vl._lib._last_error()}))
        """
    )
    assert r == {"open": False, "error": "no profiling scope is open on this device"}, r


def test_wrong_types_are_still_value_errors_for_code_written_before_the_checks():
    # These arguments raised ValueError for a wrong type; the TypeError they raise now is one too.
    for call in (lambda: vl.set_cap(1.5), lambda: vl.record_history(True, 1.0), lambda: vl.install(mode=3)):
        with pytest.raises(TypeError) as info:
            call()
        assert isinstance(info.value, ValueError)


def test_unknown_tag_names_are_refused_before_the_library_sees_them():
    for bad in ("weight", "", "KV", "weights\0", "kv_cache "):
        with pytest.raises(ValueError, match="unknown tag .*expected one of weights, activation"):
            with vl.tag(bad):
                pass
    for bad in (b"weights", None, 3):
        with pytest.raises(TypeError, match="tag name must be a str"):
            with vl.tag(bad):
                pass
    assert vl.current_tag() == "untracked"
    assert vl._lib.load().vram_ledger_pop_tag() == -1, "nothing was pushed"


def test_every_spelling_the_library_accepts_is_a_tag():
    for spelling in vl.TAGS:
        with vl.tag(spelling):
            assert vl.current_tag() in ("weights", "activation", "kv_cache", "untracked")
    with vl.tag("activations"):
        assert vl.current_tag() == "activation"


def test_sleep_and_wake_refuse_unknown_tags_and_wrong_types():
    for kwargs in ({"offload": "fast"}, {"discard": ["weights", "nope"]}, {"offload": ["weights\0"]}):
        with pytest.raises(ValueError, match="unknown tag"):
            vl.sleep(**kwargs)
    for kwargs in ({"offload": [3]}, {"offload": 5}, {"discard": b"kv"}, {"discard": [None]}):
        with pytest.raises(TypeError):
            vl.sleep(**kwargs)
    with pytest.raises(ValueError, match="tags: unknown tag 'everything'"):
        vl.wake("everything")
    with pytest.raises(TypeError):
        vl.wake(["kv", None])
    with pytest.raises(TypeError):
        vl.wake(7)


def test_sleep_masks_take_the_librarys_aliases():
    r = run_on_sim(
        """
        assert lib.vram_ledger_configure(b"expandable") == 0
        assert lib.vram_ledger_separate_tags(1) == 0
        with vl.tag("activations"):
            lib.vram_ledger_malloc(8 << 20, 0, None)
        with vl.tag("kv"):
            lib.vram_ledger_malloc(8 << 20, 0, None)
        slept = vl.sleep(offload="activations", discard=["kv"], device=0)
        woke = vl.wake(("kv_cache", "activations"), device=0)
        print(json.dumps({"slept": slept[0], "woke": woke[0]}))
        """
    )
    assert r["slept"]["tags"] == r["woke"]["tags"] == ["activation", "kv_cache"], r
    assert r["slept"]["offloaded_bytes"] > 0 and r["slept"]["discarded_bytes"] > 0, r


def test_unknown_modes_and_tags_are_refused_by_install_and_mempool_before_torch_is_needed():
    for bad in ("fast", "Native", "", "native\0"):
        with pytest.raises(ValueError, match="mode must be one of native, expandable, compact, remap"):
            vl.install(mode=bad)
    for bad in (3, b"native", True):
        with pytest.raises(TypeError, match="mode must be a str or None"):
            vl.install(mode=bad)
    with pytest.raises(ValueError, match="needs a virtual-memory mode: mode='expandable', or compact, or remap"):
        vl.install(mode="native", sleep=True)
    with pytest.raises(ValueError, match="tag must be one of weights, activation, activations, kv_cache, kv, untracked"):
        vl.mempool("weight")
    with pytest.raises(TypeError, match="tag must be a str or None"):
        vl.mempool(1)


def test_dump_snapshot_refuses_a_path_that_c_would_cut_short(tmp_path):
    with pytest.raises(ValueError, match="NUL"):
        vl.dump_snapshot(str(tmp_path / "a\0b"))
    with pytest.raises(TypeError):
        vl.dump_snapshot(3)
    assert list(tmp_path.iterdir()) == []


def test_the_helpers_accept_every_value_in_range():
    assert _args.integer(0, "n") == 0
    assert _args.integer(2**63 - 1, "n") == 2**63 - 1
    assert _args.integer(5, "n", minimum=5) == 5
    assert _args.optional_integer(None, "n") is None
    assert _args.devices(None) == -1
    assert _args.device(None) == 0
    assert _args.mode(None) is None and _args.mode("remap") == "remap"
    assert _args.tag_mask(None, "t") == 0 and _args.tag_mask((), "t") == 0
    bits = vl._lib.abi().tag_bits
    assert _args.tag_mask(["weights", "kv"], "t") == bits["weights"] | bits["kv_cache"]
    assert _args.utilization(1) == 1.0
    assert _args.path("snap.pickle") == b"snap.pickle"


def test_the_helpers_refuse_every_value_out_of_range():
    with pytest.raises(ValueError):
        _args.integer(4, "n", minimum=5)
    with pytest.raises(OverflowError, match="too large for its C type int \\(at most 7\\)"):
        _args.integer(8, "n", maximum=7, c_type="int")
    with pytest.raises(OverflowError):
        _args.device(2**31)
    with pytest.raises(ValueError):
        _args.device(-1)
    with pytest.raises(OverflowError):
        _args.devices(2**32)


def test_the_budget_read_inside_the_profile_block_is_an_error_not_a_key_error():
    r = run_on_sim("""
        with vl.profile(0.5) as p:
            try:
                p.kv_budget
                inside = None
            except vl.VramLedgerError as e:
                inside = str(e)
        print(json.dumps({"inside": inside, "after": p.kv_budget}))
    """)
    assert "once the profile() block has ended" in r["inside"], r
    assert r["after"] > 0, r
