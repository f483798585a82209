#!/usr/bin/env bash
# The wheel as a user installs it, on a GPU machine without Rust: a fresh virtual environment
# that sees the system's torch (--system-site-packages), the bundle's wheel installed into it
# with pip (no dependencies, no index), and a smoke test run from a temporary folder with no
# VRAM_LEDGER_LIB, PYTHONPATH or VRAM_LEDGER_DRIVER: install(), a tagged forward of a small
# nn.Linear stack, a profile and the budget contract it arms, statistics and metrics, sleep and
# wake of the weights (offloaded) and of a KV tensor (discarded). Prints the wheel, where the
# package was imported from, one RESULT line per check, and exits 1 on any miss.
#
#   tests/python/h200_wheel.sh [WHEEL]
#
# WHEEL: default the one wheel in the bundle's wheel/ folder (scripts/gpu-bundle.sh puts it
# there). PYTHON: the interpreter (default python3.12, which must import torch with CUDA).
# MODE: the segment mode, remap (default) or expandable (sleep needs a virtual-memory mode).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bundle="$(cd "$here/../.." && pwd)"
python="${PYTHON:-python3.12}"
# Where the machine's torch is, as its interpreter finds it (a venv sees the system's
# site-packages, not a user site or a PYTHONPATH the machine sets): found before that
# environment is cleared, and handed to the venv as a path file.
torch_dir="$(cd / && "$python" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))' 2>/dev/null || true)"
# What run-all.sh exports points into the bundle: the package must come from the wheel alone.
unset VRAM_LEDGER_LIB PYTHONPATH VRAM_LEDGER_DRIVER VRAM_LEDGER_BIN
mode="${MODE:-remap}"

wheel="${1:-}"
if [ -z "$wheel" ]; then
    shopt -s nullglob
    found=("$bundle"/wheel/vram_ledger-*.whl)
    if [ ${#found[@]} -ne 1 ]; then
        echo "h200_wheel: expected one wheel in $bundle/wheel, found ${#found[@]}; name it as the argument" >&2
        exit 1
    fi
    wheel="${found[0]}"
fi
wheel="$(cd "$(dirname "$wheel")" && pwd)/$(basename "$wheel")"
[ -f "$wheel" ] || { echo "h200_wheel: no wheel at $wheel" >&2; exit 1; }
command -v "$python" >/dev/null || { echo "h200_wheel: $python is not on PATH; set PYTHON" >&2; exit 1; }
case "$mode" in remap | expandable) ;; *) echo "h200_wheel: MODE must be remap or expandable, not $mode" >&2; exit 1 ;; esac

scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
"$python" -m venv --system-site-packages "$scratch/venv"
if [ -n "$torch_dir" ] && [ ! -e "$torch_dir/vram_ledger" ]; then
    site="$("$scratch/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    echo "$torch_dir" >"$site/machine-torch.pth"
    echo "torch from: $torch_dir"
fi
# --ignore-installed: a vram-ledger in the system's site-packages must not stand in for it.
"$scratch/venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-index --no-deps \
    --ignore-installed "$wheel"
echo "wheel: $wheel"

cat >"$scratch/smoke.py" <<'PY'
"""The installed wheel on a GPU: every check prints a RESULT line; exit 1 on any miss."""

import json
import os
import sys
from pathlib import Path

failed = []


def check(name, ok, **seen):
    print("RESULT " + json.dumps({"check": name, "ok": bool(ok), **seen}, default=str), flush=True)
    if not ok:
        failed.append(name)


def main(mode):
    import vram_ledger as vl

    package = Path(vl.__file__).resolve().parent
    library = Path(vl.library_path()).resolve()
    print(f"vram_ledger imported from {package}", flush=True)
    print(f"library {library}", flush=True)
    check("package_is_the_venvs", package.is_relative_to(Path(sys.prefix).resolve()), package=package, prefix=sys.prefix)
    check("library_is_the_wheels", library.parent == package, library=library)
    check("extension_source_in_the_wheel", (package / "csrc" / "torch_allocator.cpp").is_file(), package=package)
    check("no_override", not any(os.environ.get(v) for v in ("VRAM_LEDGER_LIB", "PYTHONPATH", "VRAM_LEDGER_DRIVER")))

    import torch

    check("cuda", torch.cuda.is_available(), torch=torch.__version__)
    if not torch.cuda.is_available():
        return
    vl.install(mode=mode, sleep=True)
    torch.manual_seed(0)
    hidden, layers, batch = 4096, 8, 64
    with vl.tag("weights"):
        model = torch.nn.Sequential(
            *[m for _ in range(layers) for m in (torch.nn.Linear(hidden, hidden), torch.nn.GELU())]
        ).to(device="cuda", dtype=torch.float16)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    with torch.no_grad(), vl.tag("activation"):
        x = torch.randn(batch, hidden, device="cuda", dtype=torch.float16)
        before = model(x)
    torch.cuda.synchronize()
    s = vl.stats()
    weights = s["per_tag"]["weights"]
    check("weights_tag_holds_the_parameters", params <= weights["requested_bytes"]["current"] <= params + (4 << 20),
          params=params, requested=weights["requested_bytes"]["current"])
    check("activation_tag_saw_the_forward",
          s["per_tag"]["activation"]["allocated_bytes"]["peak"] >= 2 * batch * hidden * 2,
          peak=s["per_tag"]["activation"]["allocated_bytes"]["peak"])
    check("torch_reads_the_ledger", torch.cuda.memory_allocated() == s["all"]["allocated_bytes"]["current"],
          torch=torch.cuda.memory_allocated(), ledger=s["all"]["allocated_bytes"]["current"])

    total = torch.cuda.mem_get_info()[1]
    with vl.profile(utilization=0.9) as p:
        with torch.no_grad(), vl.tag("activation"):
            model(torch.randn(4 * batch, hidden, device="cuda", dtype=torch.float16))
    r = p.result
    check("profile_requests_ceil_of_total_times_utilization", abs(r["requested"] - total * 0.9) <= 1,
          requested=r["requested"], total=total)
    check("profile_counts_the_weights", r["weights"] >= params, weights=r["weights"], params=params)
    check("profile_counts_the_pass", r["activation_peak"] >= 4 * batch * hidden * 2, activation_peak=r["activation_peak"])
    left = r["requested"] - r["non_kv"] - r["margin"]
    check("kv_budget_is_what_is_left", 0 < p.kv_budget == left // (2 << 20) * (2 << 20), kv_budget=p.kv_budget, left=left)
    check("contract_armed", vl.cap() == r["requested"], cap=vl.cap())

    text = vl.metrics()
    line = f'vram_ledger_allocated_bytes{{device="0",tag="weights"}} {vl.stats()["per_tag"]["weights"]["allocated_bytes"]["current"]}'
    check("metrics_by_tag", line in text.splitlines(), line=line)

    with vl.tag("kv"):
        kv = torch.ones(32 << 20, device="cuda", dtype=torch.float16)  # 64 MiB standing in for a KV cache
    torch.cuda.synchronize()
    addresses = [t.data_ptr() for t in [*model.parameters(), kv]]
    slept = vl.sleep(offload="weights", discard="kv")[0]
    check("sleep_offloads_the_weights", slept["offloaded_bytes"] >= params, report=slept)
    check("sleep_discards_the_kv_tensor", slept["discarded_bytes"] >= kv.numel() * 2, report=slept)
    woken = vl.wake()[0]
    torch.cuda.synchronize()
    check("wake_restores_what_was_offloaded", woken["restored_bytes"] == slept["offloaded_bytes"], report=woken)
    check("addresses_kept", [t.data_ptr() for t in [*model.parameters(), kv]] == addresses)
    with torch.no_grad(), vl.tag("activation"):
        after = model(x)
    check("forward_after_wake_is_bit_identical", torch.equal(before, after))
    kv.fill_(3.0)  # the discarded memory is usable again
    check("discarded_memory_usable_after_wake", bool(torch.all(kv == 3.0)))


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except Exception as e:  # noqa: BLE001 - reported as a miss, with what raised
        check("ran_to_the_end", False, error=f"{type(e).__name__}: {e}")
        raise
    finally:
        print(f"h200_wheel: {'all checks passed' if not failed else 'FAILED: ' + ', '.join(failed)}", flush=True)
    sys.exit(1 if failed else 0)
PY

cd "$scratch"
"$scratch/venv/bin/python" smoke.py "$mode"
