"""The marks a GPU script checks: each a named reading against its goal. A reading that is
missing (None: NVML did not list the process, a part printed nothing) misses its mark; it is
never taken as 0.

`VRAM_LEDGER_TIGHTEN=NAME[,NAME...]` replaces the goal of each named mark by its tightened
goal (one no real run can meet), to show that the script fails when that mark is missed.
"""

import os

TIGHTEN = {n for n in os.environ.get("VRAM_LEDGER_TIGHTEN", "").split(",") if n}


class Marks:
    def __init__(self):
        self.met = {}

    @classmethod
    def of(cls, checks):
        """Marks of true/false `checks` (name -> value), each through `Marks.true`."""
        m = cls()
        for name, value in checks.items():
            m.true(name, bool(value))
        return m

    def true(self, name, value):
        """`value` must be True itself: a missing reading (None) or a count is not. Tightened,
        a true mark is never met."""
        self.met[name] = value is True and name not in TIGHTEN
        return self.met[name]

    def at_most(self, name, value, goal, tightened):
        return self._compare(name, value, tightened if name in TIGHTEN else goal, lambda v, g: v <= g)

    def at_least(self, name, value, goal, tightened):
        return self._compare(name, value, tightened if name in TIGHTEN else goal, lambda v, g: v >= g)

    def _compare(self, name, value, goal, ok):
        self.met[name] = value is not None and ok(value, goal)
        return self.met[name]

    @property
    def ok(self):
        return bool(self.met) and all(self.met.values())

    def missed(self):
        return sorted(n for n, v in self.met.items() if not v)
