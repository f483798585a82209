"""Settings take effect whenever they are given, or are refused: configuration after a device is
in use, sleep settings before one is, a profiling scope opened inside another, and PyTorch's
memory fraction of 0."""

import textwrap

from test_pure import run_on_sim
from test_torch_stand_in import STAND_IN


def test_configuration_after_a_device_is_in_use_is_refused_and_install_says_so():
    r = run_on_sim(
        STAND_IN
        + textwrap.dedent(
            """
        seen = {"stats": vl.stats(0)["reserved_bytes"]["current"]}
        seen["same"] = lib.vram_ledger_configure(b"native")
        seen["other"] = lib.vram_ledger_configure(b"remap")
        seen["message"] = vl._lib._last_error()
        try:
            vl.install(mode="remap", sleep=True)
            seen["install"] = "accepted"
        except vl.VramLedgerError as e:
            seen["install"] = str(e)
        seen["calls"] = [c[0] for c in calls]
        print(json.dumps(seen))
        """
        )
    )
    assert r["same"] == 0, "setting what is already set changes nothing and is accepted"
    assert r["other"] == -1 and "a device is in use already" in r["message"], r
    assert "a device is in use already" in r["install"], r
    assert "change" not in r["calls"], "a refused install leaves PyTorch's allocator alone"


def test_sleep_settings_given_before_any_device_is_used_apply_to_it():
    r = run_on_sim(
        """
        assert lib.vram_ledger_configure(b"remap") == 0 and lib.vram_ledger_separate_tags(1) == 0
        vl.set_retain_host(True)
        vl.set_zero_discarded(False)
        with vl.tag("weights"):
            lib.vram_ledger_malloc(64 << 20, 0, None)
        with vl.tag("kv"):
            lib.vram_ledger_malloc(64 << 20, 0, None)
        vl.sleep(offload="weights", discard="kv", device=0)
        woke = vl.wake(device=0)[0]
        # Device 1, first used after the settings too.
        with vl.tag("kv"):
            lib.vram_ledger_malloc(64 << 20, 1, None)
        vl.sleep(discard="kv", device=1)
        woke1 = vl.wake(device=1)[1]
        print(json.dumps({"host_after": woke["host_bytes_after"], "zeroed": woke["zeroed_bytes"], "zeroed1": woke1["zeroed_bytes"]}))
        """
    )
    assert r["host_after"] > 0, "retain_host reached the device used after it was set"
    assert r["zeroed"] == 0 and r["zeroed1"] == 0, r


def test_a_profiling_scope_inside_another_is_refused_and_the_outer_one_stands():
    r = run_on_sim(
        """
        seen = {}
        with vl.profile(0.5, device=0) as outer:
            with vl.tag("weights"):
                lib.vram_ledger_malloc(1 << 30, 0, None)
            try:
                with vl.profile(0.25, device=0):
                    pass
                seen["inner"] = "accepted"
            except vl.VramLedgerError as e:
                seen["inner"] = str(e)
        seen["outer"] = outer.result["requested"]
        print(json.dumps(seen))
        """
    )
    assert "a profiling scope is open already on device 0" in r["inner"], r
    assert r["outer"] > 0, r


def test_a_memory_fraction_of_zero_holds_nothing():
    r = run_on_sim(
        """
        lib.vram_ledger_memory_fraction(0.0, 0)
        seen = {"zero": lib.vram_ledger_malloc(1 << 20, 0, None) or 0}
        lib.vram_ledger_memory_fraction(1.0, 0)
        seen["one"] = lib.vram_ledger_malloc(1 << 20, 0, None) or 0
        print(json.dumps(seen))
        """
    )
    assert r["zero"] == 0 and r["one"] != 0, r
