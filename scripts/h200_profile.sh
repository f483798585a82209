#!/usr/bin/env bash
# Profiling on a real GPU, with other processes on it (run from a bundle: bin/profile_engine).
#  1. A holds 70% of the GPU with raw cuMemAlloc; B starts at utilization 0.2.
#  2. Three engines started together at 0.3 each.
# Writes one JSON per engine to $1 and prints a table.
#
# Exits 1 when any engine fails (each PID is waited on and its status checked; an engine fails
# when its peak usage passes its request or NVML gives no reading), when the holder fails
# before it is stopped, or when an engine's result is missing or misses `within_request`
# (VRAM_LEDGER_TIGHTEN=within_request makes every one miss); the table is printed from
# whatever finished either way.
set -u
out="${1:-profile-out}"
mkdir -p "$out"
bin="$(dirname "$0")/../bin/profile_engine"
failures=0
fail() {
    echo "FAILED: $*" >&2
    failures=$((failures + 1))
}

rm -f "$out/ready"
"$bin" hold 0.7 60 "$out/ready" > "$out/hold.log" 2>&1 &
holder=$!
for _ in $(seq 600); do
    [ -f "$out/ready" ] && break
    kill -0 "$holder" 2>/dev/null || break
    sleep 0.1
done
[ -f "$out/ready" ] || fail "the holder never became ready: $(tail -3 "$out/hold.log")"
"$bin" engine 0.2 8 6 256 "$out/seed.json" > "$out/seed.log" 2>&1 \
    || fail "seed engine (exit $?): $(tail -3 "$out/seed.log")"
# Stopped by us, the holder's status is the signal's; only an exit of its own is checked.
if kill "$holder" 2>/dev/null; then
    wait "$holder" 2>/dev/null
else
    wait "$holder" || fail "holder (exit $?): $(tail -3 "$out/hold.log")"
fi

pids=()
for i in 1 2 3; do
    "$bin" engine 0.3 $((4 * i)) $((2 + i)) $((128 * i)) "$out/together-$i.json" > "$out/together-$i.log" 2>&1 &
    pids+=($!)
done
for i in 1 2 3; do
    wait "${pids[$((i - 1))]}" || fail "engine together-$i (exit $?): $(tail -3 "$out/together-$i.log")"
done

python3 - "$out" <<'PY'
import json, sys, glob, os
G = 1 << 30
print(f"{'run':<12} {'requested':>10} {'ours':>10} {'device-wide':>12} {'truth':>10} {'err ours':>9} {'err dev-wide':>12} {'peak<=req':>9}")
missed = []
for name in ["seed", "together-1", "together-2", "together-3"]:
    f = os.path.join(sys.argv[1], name + ".json")
    if not os.path.exists(f):
        missed.append(f"{name}: no result")
        continue
    r = json.load(open(f))
    print(f"{name:<12} {r['requested']/G:>9.2f}G {r['kv_budget']/G:>9.2f}G {r['device_wide_kv_budget']/G:>11.2f}G "
          f"{r['ground_truth_budget']/G:>9.2f}G {100*r['error_ours']:>8.3f}% {100*r['error_device_wide']:>11.2f}% {str(r['within_request']):>9}")
    if r["within_request"] is not True or "within_request" in os.environ.get("VRAM_LEDGER_TIGHTEN", "").split(","):
        missed.append(f"{name}: within_request")
for m in missed:
    print(f"missed: {m}", file=sys.stderr)
sys.exit(1 if missed else 0)
PY
[ $? -eq 0 ] || fail "a mark was missed, or the table could not be made"
[ "$failures" -eq 0 ] || { echo "$failures failure(s)" >&2; exit 1; }
