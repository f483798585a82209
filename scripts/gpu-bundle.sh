#!/usr/bin/env bash
# Build everything a GPU machine without Rust needs into one folder, with a script that runs it
# all: the GPU test binaries, the CPU test and benchmark binaries, the CLI, the examples, the
# cdylib and the Python package.
#
#   scripts/gpu-bundle.sh [OUT]        (default: gpu-bundle/)
#   OUT/run-all.sh LOGDIR              (on the GPU machine)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu-bundle}"
rm -rf "$out"
mkdir -p "$out/bin" "$out/tests"

cargo build --release --bins --examples --lib
# Test and bench executables, found from cargo's own report of what it built.
cargo test --release --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        kind = m["target"]["kind"]
        if kind == ["test"]:
            print(m["target"]["name"], m["executable"])
        elif "lib" in kind or "rlib" in kind:
            print("unit", m["executable"])' \
    | while read -r name exe; do cp "$exe" "$out/tests/$name"; done
bench=$(cargo bench --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["bench"]:
        print(m["executable"])')
cp "$bench" "$out/bin/alloc-bench"
cp target/release/vram-ledger "$out/bin/"
for src in examples/*.rs; do
    cp "target/release/examples/$(basename "$src" .rs)" "$out/bin/"
done
cp target/release/libvram_ledger.so "$out/"
cp -r scripts kernels "$out/"
mkdir -p "$out/tests/python" && cp tests/python/*.py "$out/tests/python/"
mkdir -p "$out/tests/data" && cp tests/data/* "$out/tests/data/"
[ -d python ] && cp -r python "$out/"
strip "$out"/bin/* "$out"/tests/* "$out"/libvram_ledger.so 2>/dev/null || true

cat > "$out/run-all.sh" <<'RUN'
#!/usr/bin/env bash
# Run every test and benchmark of the bundle; logs go to $1 (default ./logs). Set
# SKIP_CPU_TESTS=1 to run only what needs the GPU.
here="$(cd "$(dirname "$0")" && pwd)"
logs="$(mkdir -p "${1:-logs}" && cd "${1:-logs}" && pwd)"
export VRAM_LEDGER_LIB="$here/libvram_ledger.so" VRAM_LEDGER_BIN="$here/bin/vram-ledger" PYTHONPATH="$here/python"
cd "$here"
status=0
for t in tests/*; do
    [ -f "$t" ] || continue
    name=$(basename "$t")
    case "$name" in gpu_*) ;; *) [ -n "${SKIP_CPU_TESTS:-}" ] && continue ;; esac
    "$t" --test-threads=1 --show-output >"$logs/test-$name.log" 2>&1 || { status=1; echo "FAILED: $name"; }
    grep -E "^test result" "$logs/test-$name.log" | sed "s/^/$name: /"
done
if command -v compute-sanitizer >/dev/null; then
    timeout 300 compute-sanitizer --tool memcheck --leak-check full tests/gpu_alloc --test-threads=1 >"$logs/memcheck.log" 2>&1
    echo "memcheck: $(grep -E 'ERROR SUMMARY|LEAK SUMMARY' "$logs/memcheck.log" | tr '\n' ' ')"
fi
bin/gpu_bench >"$logs/gpu-bench.jsonl" 2>&1 || status=1
python3 scripts/torch_alloc_bench.py >>"$logs/gpu-bench.jsonl" 2>"$logs/torch-bench.err" || status=1
scripts/h200_profile.sh "$logs/profile" >"$logs/profile.txt" 2>&1 || status=1
python3 tests/python/h200_torch.py >"$logs/torch.jsonl" 2>"$logs/torch.err" || status=1
bin/alloc-bench --bench --warm-up-time 1 --measurement-time 3 >"$logs/cpu-bench.log" 2>&1 || status=1
exit $status
RUN
chmod +x "$out/run-all.sh"
du -sh "$out"
