"""Running a GPU script's cases, one process each (installing the allocator is permanent for a
process): `NAME[:MODE]` arguments, a case's `RESULT {json}` lines passed through, and exit 1
when any case failed or printed no result; `run` is the one case's process, for scripts that
summarise their cases themselves; `options` reads a configuration's name (`remap+across@2M`)."""

import json
import re
import subprocess
import sys


def emit(**kv):
    print("RESULT " + json.dumps(kv), flush=True)


def run(script, args, timeout):
    """Run `script _case ARGS...` in its own interpreter: its `RESULT` lines as dicts, and what
    to report when it failed or printed none (else None); the caller adds which case it was."""
    r = subprocess.run([sys.executable, script, "_case", *args], capture_output=True, text=True, timeout=timeout)
    results = [json.loads(l[7:]) for l in r.stdout.splitlines() if l.startswith("RESULT ")]
    failure = None
    if r.returncode != 0 or not results:
        failure = {"ok": False, "returncode": r.returncode, "stderr": r.stderr[-2500:]}
    return results, failure


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
        results, failure = run(script, [name, mode], timeout)
        failed += failure is not None or not all(r.get("ok") for r in results)
        for r in results:
            print(json.dumps(r))
        if failure:
            print(json.dumps({"case": name, "mode": mode, **failure}))
        sys.stdout.flush()
    sys.exit(1 if failed else 0)


SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def options(config):
    """`MODE` and `install()`'s keyword arguments for a configuration `MODE[OPTION...]`, each
    option `+later` (remap's moves without a wait, unmap_later=True), `+across`
    (move_across_streams=True) or `@SIZE` (remap_piece: bytes, or with a K, M or G suffix):
    `remap+across@2M`."""
    mode, *rest = re.split(r"(?=[+@])", config)
    if not mode or (mode == "torch" and rest):
        raise ValueError(f"configuration {config!r}: a mode first, options only after a mode of vram-ledger's")
    kw = {}
    for option in rest:
        size = re.fullmatch(r"@([1-9][0-9]*)([KMG]?)", option)
        if option == "+later":
            key, value = "unmap_later", True
        elif option == "+across":
            key, value = "move_across_streams", True
        elif size:
            key, value = "remap_piece", int(size[1]) * SIZE_UNITS[size[2]]
        else:
            raise ValueError(f"unknown option {option!r} in configuration {config!r}: +later, +across or @SIZE")
        if key in kw:
            raise ValueError(f"option {option!r} given twice in configuration {config!r}")
        kw[key] = value
    return mode, kw


def mode_of(config):
    """The mode a configuration runs (`remap` for `remap+across@2M`)."""
    return options(config)[0]


def install(vl, config, **kw):
    """`vl.install` for a configuration (`options`)."""
    mode, extra = options(config)
    return vl.install(mode=mode, **extra, **kw)
