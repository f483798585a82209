"""Hand-made memory-snapshot events for the tests of the bound scripts."""

MIB = 1 << 20


def trace(*ops):
    """Events from (action, name, MiB): alloc and free_completed of named blocks, each at its own
    address, timed by its index."""
    addr = {}
    out = []
    for action, name, mib in ops:
        addr.setdefault(name, 0x1000 * (len(addr) + 1))
        out.append({"action": action, "addr": addr[name], "size": mib * MIB, "time_us": len(out)})
    return out


def step(tag, first, second):
    """A micro-batch: two blocks live at once, the second freed first."""
    return [("alloc", f"{tag}a", first), ("alloc", f"{tag}b", second),
            ("free_completed", f"{tag}b", second), ("free_completed", f"{tag}a", first)]
