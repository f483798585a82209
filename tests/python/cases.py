"""Running a GPU script's cases, one process each (installing the allocator is permanent for a
process): `NAME[:MODE]` arguments, a case's `RESULT {json}` lines passed through, and exit 1
when any case failed or printed no result."""

import json
import subprocess
import sys


def emit(**kv):
    print("RESULT " + json.dumps(kv), flush=True)


def main(script, run_case, default_names, modes, timeout=900):
    """`script _case NAME MODE` runs `run_case(NAME, MODE)`; otherwise every requested case
    (every mode where none is given) runs in its own interpreter."""
    if len(sys.argv) > 1 and sys.argv[1] == "_case":
        return run_case(sys.argv[2], sys.argv[3])
    cases = []
    for arg in sys.argv[1:] or default_names:
        name, _, mode = arg.partition(":")
        cases += [(name, m) for m in ([mode] if mode else modes)]
    failed = 0
    for name, mode in cases:
        r = subprocess.run([sys.executable, script, "_case", name, mode], capture_output=True, text=True, timeout=timeout)
        lines = [l[7:] for l in r.stdout.splitlines() if l.startswith("RESULT ")]
        ok = r.returncode == 0 and lines and all(json.loads(l).get("ok") for l in lines)
        failed += not ok
        for l in lines:
            print(l)
        if r.returncode != 0 or not lines:
            print(json.dumps({"case": name, "mode": mode, "ok": False, "returncode": r.returncode, "stderr": r.stderr[-2500:]}))
        sys.stdout.flush()
    sys.exit(1 if failed else 0)


def install(vl, config, **kw):
    """`vl.install` for a configuration named `MODE` or `MODE+later` (remap's moves without a
    wait, `install(unmap_later=True)`)."""
    mode, plus, option = config.partition("+")
    if plus and option != "later":
        raise ValueError(f"unknown configuration {config!r}: MODE or MODE+later")
    return vl.install(mode=mode, unmap_later=bool(plus), **kw)
