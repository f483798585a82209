"""A KvCache handle acts on its own cache only: the library keeps one KV cache per device and
its calls name only the device, so a released handle must not reach the next cache."""

from test_pure import run_on_sim


def test_a_released_handle_refuses_and_leaves_the_next_cache_alone():
    r = run_on_sim(
        """
        assert lib.vram_ledger_configure(b"remap") == 0
        with vl.profile(0.25, device=0):
            pass
        kv1 = vl.kv_reserve(3 << 20, initial_blocks=8, device=0)
        other = vl.kv_cache(0)
        kv1.release()
        kv2 = vl.kv_reserve(1 << 20, initial_blocks=4, device=0)
        seen = {}
        for name, handle in (("released", kv1), ("other_handle", other)):
            for call in ("resize", "commit", "release"):
                try:
                    handle.resize(2) if call == "resize" else getattr(handle, call)()
                    seen[name + "_" + call] = "accepted"
                except vl.VramLedgerError as e:
                    seen[name + "_" + call] = str(e)
        now = vl.kv_cache(0)
        seen["kv2"] = [now.base == kv2.base, now.block_bytes, now.usable_blocks]
        seen["kv2_resize"] = kv2.resize(6).usable_blocks
        print(json.dumps(seen))
        """
    )
    for name in ("released", "other_handle"):
        for call in ("resize", "commit", "release"):
            assert "was released" in r[f"{name}_{call}"], (name, call, r)
    assert r["kv2"] == [True, 1 << 20, 4], r
    assert r["kv2_resize"] == 6, r
