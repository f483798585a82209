#!/usr/bin/env bash
# Plant each bug of src/allocator/planted.rs in turn and show that the property tests
# (tests/model.rs) catch it with a minimal failing sequence. Fails if any bug goes unnoticed.
set -uo pipefail
cd "$(dirname "$0")/.."
export VRAM_LEDGER_CASES="${VRAM_LEDGER_CASES:-1000}"
missed=0
for bug in split_off_by_512 missed_merge segment_count remap_spare first_fit limit_ignored unmap_unsynced retire_early; do
    log=$(VRAM_LEDGER_PLANT=$bug cargo test --release --features planted-bugs --test model 2>&1)
    status=$?
    if [ $status -ne 0 ] && grep -q "minimal failing input" <<<"$log"; then
        echo "planted bug $bug: caught"
        grep -m1 -B1 -A12 "minimal failing input" <<<"$log" | sed 's/^/    /'
    else
        echo "planted bug $bug: NOT caught (exit $status)"
        tail -20 <<<"$log"
        missed=$((missed + 1))
    fi
done
if [ $missed -ne 0 ]; then
    echo "$missed planted bug(s) went unnoticed"
    exit 1
fi
echo "every planted bug was caught"
