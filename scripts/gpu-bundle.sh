#!/usr/bin/env bash
# Build everything a GPU machine without Rust needs into one folder, with a script that runs it
# all: the GPU test binaries, the CPU test and benchmark binaries, the CLI, the examples, the
# cdylib, the Python package, and its wheel (scripts/build-wheel.sh) in OUT/wheel/.
#
#   scripts/gpu-bundle.sh [OUT]        (default: gpu-bundle/; GPU_ONLY=1 leaves out the CPU
#                                      test binaries)
#   OUT/run-all.sh LOGDIR              (on the GPU machine; needs bash and python3, and
#                                      python3.12 with torch for the wheel; not Rust)
#
# run-all.sh runs every step even after a failure, memchecks every GPU test binary, prints
# which steps failed and exits 1 if any did.
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
    | while read -r name exe; do
        # GPU_ONLY=1 leaves the CPU test binaries out (for run-all.sh with SKIP_CPU_TESTS=1):
        # the bundle then fits beside the repository in what a GPU machine's call may carry.
        case "$name" in gpu_*) ;; *) [ -n "${GPU_ONLY:-}" ] && continue ;; esac
        cp "$exe" "$out/tests/$name"
    done
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
mkdir -p "$out/tests/python" && cp tests/python/*.py tests/python/*.sh "$out/tests/python/"
mkdir -p "$out/tests/data" && cp -r tests/data/* "$out/tests/data/"
# The C test (tests/c_abi.rs) builds tests/c against include/ from the bundle's root.
mkdir -p "$out/tests/c" && cp tests/c/* "$out/tests/c/" && cp -r include "$out/"
[ -d python ] && cp -r python "$out/"
strip "$out"/bin/* "$out"/tests/* "$out"/libvram_ledger.so 2>/dev/null || true
# PyTorch's own test file, when UPSTREAM_TESTS names it (PyTorch's wheel does not ship it; it
# is not part of this repository), for run-all.sh's upstream step.
if [ -n "${UPSTREAM_TESTS:-}" ]; then
    mkdir -p "$out/upstream" && cp "$UPSTREAM_TESTS" "$out/upstream/"
    # Its testing helpers import expecttest, which the GPU machine lacks (pure Python: put on
    # run-all.sh's PYTHONPATH from pylib/).
    mkdir -p "$out/pylib" "$out/wheels"
    pip download --quiet --no-deps --only-binary=:all: expecttest -d "$out/wheels" &&
        for w in "$out"/wheels/expecttest-*.whl; do python3 -m zipfile -e "$w" "$out/pylib"; done ||
        echo "gpu-bundle: expecttest not bundled: the upstream step will fail to import its file" >&2
fi
# What code the bundle was built from, for run-all.sh to print: the commit, and a digest of the
# tracked files the bundle is built or copied from (documentation left out), so that steps run
# from bundles of different commits are known to have run the same code when the digests agree.
code_paths=(Cargo.toml Cargo.lock build.rs benches csrc examples include kernels python scripts src tests)
{
    echo "commit $(git rev-parse HEAD)"
    echo "code $(git ls-tree -r HEAD -- "${code_paths[@]}" | git hash-object --stdin)"
    if [ -n "$(git status --porcelain --untracked-files=no -- "${code_paths[@]}")" ]; then
        echo "modified $(git diff HEAD -- "${code_paths[@]}" | git hash-object --stdin)"
    fi
} >"$out/CODE"
# The wheel as users get it, for tests/python/h200_wheel.sh: installed with pip, no Rust.
wheel=$(bash scripts/build-wheel.sh "$out/wheel")
echo "wheel: $wheel"

cat > "$out/run-all.sh" <<'RUN'
#!/usr/bin/env bash
# Run every test and benchmark of the bundle; logs go to $1 (default ./logs). Set
# SKIP_CPU_TESTS=1 to run only what needs the GPU. RUN_ONLY=REGEX runs only the steps whose
# names match (a whole run split over several machines or times: each prints the steps it ran).
#
# Every step runs even when an earlier one failed; the script ends with a summary of the
# failed steps and exits 1 if there is any. compute-sanitizer's memcheck runs over every GPU
# test binary and fails its step on any error or leak (MEMCHECK_TIMEOUT seconds each).
here="$(cd "$(dirname "$0")" && pwd)"
logs="$(mkdir -p "${1:-logs}" && cd "${1:-logs}" && pwd)"
export VRAM_LEDGER_LIB="$here/libvram_ledger.so" VRAM_LEDGER_BIN="$here/bin/vram-ledger" PYTHONPATH="$here/python:$here/pylib${PYTHONPATH:+:$PYTHONPATH}"
cd "$here"
failed=()
ran=()
# The code this bundle holds (gpu-bundle.sh): printed first and last, so that a run split over
# several machines or times can show that every part ran the same code.
code_stamp() { tr '\n' ' ' <CODE 2>/dev/null || printf 'no CODE file in the bundle'; echo; }
echo "bundle: $(code_stamp)"

# step NAME COMMAND...: run COMMAND (its own redirections, or its output into $logs/NAME.log)
# and remember NAME if it exits non-zero.
step() {
    local name=$1
    shift
    if [ -n "${RUN_ONLY:-}" ] && ! [[ $name =~ $RUN_ONLY ]]; then
        return 0
    fi
    ran+=("$name")
    local t0=$SECONDS
    "$@" >"$logs/$name.log" 2>&1
    local rc=$?
    echo "step $name: exit $rc, $((SECONDS - t0)) s"
    # The step's last lines (its summary, for most), so that its figures are in the run's
    # output even where its log files are not kept (TAIL_LINES=0 for none).
    local f
    for f in "$logs/$name.log" "$logs/$name.jsonl" "$logs/$name.txt"; do
        [ -s "$f" ] && break
    done
    [ -s "$f" ] && tail -n "${TAIL_LINES:-2}" "$f" | cut -c1-"${TAIL_CHARS:-600}" | sed "s/^/  $name| /"
    if [ "$rc" -ne 0 ]; then
        failed+=("$name (exit $rc, see $logs/$name.log)")
        echo "FAILED: $name (exit $rc)"
    fi
    return 0
}

# unskipped COMMAND...: COMMAND, failing where it says it skipped: this bundle runs on a machine
# with a GPU, where a GPU test or example that finds no driver or device has not run at all.
unskipped() {
    local out rc
    out=$("$@")
    rc=$?
    printf '%s\n' "$out"
    [ "$rc" -ne 0 ] && return "$rc"
    if grep -qE '(^|: )skipped: ' <<<"$out"; then
        echo "unskipped: $1 skipped on a machine meant to have a GPU"
        return 1
    fi
    return 0
}

gpu_tests=()
for t in tests/*; do
    [ -f "$t" ] || continue
    name=$(basename "$t")
    case "$name" in gpu_*) gpu_tests+=("$t") ;; *) [ -n "${SKIP_CPU_TESTS:-}" ] && continue ;; esac
    case "$name" in
        gpu_*) step "test-$name" unskipped "$t" --test-threads=1 --show-output ;;
        *) step "test-$name" "$t" --test-threads=1 --show-output ;;
    esac
    grep -sE "^test result|skipped:" "$logs/test-$name.log" | sed "s/^/$name: /"
done
[ ${#gpu_tests[@]} -gt 0 ] || failed+=("no GPU test binary in $here/tests")

# gpu_oom exhausts the device on purpose: the driver's out-of-memory answers it provokes are
# what it tests, not errors. Memory access errors and leaks are still reported there.
api_errors() { [ "$1" = gpu_oom ] && echo "--report-api-errors no"; }

if command -v compute-sanitizer >/dev/null; then
    for t in "${gpu_tests[@]}"; do
        name=$(basename "$t")
        step "memcheck-$name" timeout "${MEMCHECK_TIMEOUT:-900}" \
            compute-sanitizer --tool memcheck --leak-check full --error-exitcode 1 \
            $(api_errors "$name") "$t" --test-threads=1
        [ -f "$logs/memcheck-$name.log" ] &&
            echo "memcheck $name: $(grep -E 'ERROR SUMMARY|LEAK SUMMARY' "$logs/memcheck-$name.log" | tr '\n' ' ')"
    done
else
    # The results report every GPU test binary clean under memcheck: not running it is a miss.
    step memcheck-gpu_tests sh -c 'echo "compute-sanitizer is not on PATH"; exit 1'
fi

gpu_bench() { unskipped bin/gpu_bench >"$logs/gpu-bench.jsonl"; }
torch_bench() { python3 scripts/torch_alloc_bench.py >>"$logs/gpu-bench.jsonl"; }
profile() { scripts/h200_profile.sh "$logs/profile" >"$logs/profile.txt"; }
# Each GPU script exits 1 when any of its marks is missed (tests/python/marks.py).
script() { python3 "tests/python/$1.py" "${@:2}" >"$logs/$1.jsonl"; }
# script_as STEP SCRIPT ARGS...: one part of a script whose whole run is long (over 10
# minutes), so that a run can be split between invocations; its output under the step's name.
script_as() { python3 "tests/python/$2.py" "${@:3}" >"$logs/$1.jsonl"; }
step gpu-bench gpu_bench
step torch-bench torch_bench
# The cached path against PyTorch's allocator, from the two benchmarks just run.
step bench-marks python3 tests/python/bench_marks.py "$logs/gpu-bench.jsonl"
# A synchronisation's price in the middle of a training step, for the replay's cost model.
step sync-bench python3 scripts/sync_load_bench.py
step profile profile
step kv-engine unskipped bin/kv_engine
for s in h200_torch h200_contract h200_graphs h200_package h200_vllm_profile h200_graph_trees h200_step_cost; do
    step "$s" script "$s"
done
# The longer scripts in parts, each part well inside one command; together, every case of
# the script's default run.
step h200_sleep-bench-model script_as h200_sleep-bench-model h200_sleep bench model
step h200_sleep-graphs-two-disk-kv script_as h200_sleep-graphs-two-disk-kv h200_sleep graphs two disk kvregion
# One step a group: side-stream's figures are printed beside conv's marks (the README reports
# side-stream over the cost goal, so it has no mark of its own).
for group in serve-dyncache ckpt-train conv-train,side-stream moe-train; do
    cases=()
    for w in ${group//,/ }; do
        cases+=("$w:torch" "$w:compact+across" "$w:remap+across" "$w:torch")
    done
    step "h200_workloads-${group//,/-}" script_as "h200_workloads-${group//,/-}" h200_workloads "${cases[@]}"
done
# Each part runs the torch scenario first: the other scenarios compare their replays with it.
step h200_engine-native-expandable env ENGINE_MODES=native,expandable \
    python3 tests/python/h200_engine.py torch alone hold churn together
step h200_engine-compact-remap env ENGINE_MODES=compact,remap \
    python3 tests/python/h200_engine.py torch alone hold churn together resize
if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ]; then
    step two_gpus python3 tests/python/two_gpus.py
    step h200_sleep-devices script h200_sleep devices
else
    echo "two_gpus, h200_sleep devices: not run: one GPU"
fi
# PyTorch's test_cuda.py in every configuration, compared with the run of PyTorch's allocator
# (UPSTREAM_CONFIGS picks some; a mode run alone compares with a torch run kept in
# UPSTREAM_RESULTS). Its testing helpers need expecttest, which the machine may lack.
# The configurations run at once, one process each (the GPU has room for all five), then
# compared from what they kept; install() uses its C++ extension unless
# VRAM_LEDGER_TORCH_EXTENSION=0.
# The whole step is long (the shared runs about 430 s on the H100 machine, the retry up to
# minutes more), so it can run in two invocations: UPSTREAM_PHASE=shared runs the
# configurations and keeps their results (point UPSTREAM_RESULTS outside the logs, somewhere the
# machine keeps between invocations), UPSTREAM_PHASE=retry reruns what starved and compares.
# A subshell: the later steps (the wheel's) keep the environment they had.
upstream() (
    export UPSTREAM_RESULTS="${UPSTREAM_RESULTS:-$logs/upstream}" VRAM_LEDGER_TORCH_EXTENSION="${VRAM_LEDGER_TORCH_EXTENSION:-1}"
    if [ "${UPSTREAM_PHASE:-all}" != retry ]; then
        pids=()
        for c in ${UPSTREAM_CONFIGS:-torch native expandable compact remap}; do
            python3 tests/python/upstream_tests.py upstream/test_cuda.py "$c" -- --timeout=120 >"$logs/upstream-$c.jsonl" 2>&1 &
            pids+=($!)
        done
        wait "${pids[@]}" || true
    fi
    if [ "${UPSTREAM_PHASE:-all}" = shared ]; then
        # Not a verdict: the step fails until the retry phase has compared the runs.
        echo "upstream: shared runs kept in $UPSTREAM_RESULTS, not compared; UPSTREAM_PHASE=retry compares them"
        return 1
    fi
    # A test that skipped or ran out of memory while the others shared the GPU runs again alone.
    retried=0
    python3 tests/python/upstream_tests.py --retry-starved upstream/test_cuda.py \
        ${UPSTREAM_CONFIGS:-torch native expandable compact remap} -- --timeout=120 || retried=$?
    python3 tests/python/upstream_tests.py --saved ${UPSTREAM_CONFIGS:-torch native expandable compact remap} \
        && [ "$retried" -eq 0 ]
)
if [ -f upstream/test_cuda.py ]; then
    step upstream upstream
else
    echo "upstream: not run: no upstream/test_cuda.py in the bundle (UPSTREAM_TESTS=PATH at bundling)"
fi
# The bundle's wheel installed with pip into a fresh virtual environment (python3.12 with torch).
step wheel bash tests/python/h200_wheel.sh
grep -sE "^(wheel:|vram_ledger imported from|h200_wheel:)" "$logs/wheel.log"

# Each script once more, its cheapest case, with one of its marks tightened to a goal no run can
# meet (VRAM_LEDGER_TIGHTEN, tests/python/marks.py): it must exit non-zero and name that mark
# among what it missed. The passing runs above are evidence only if the same checks can fail.
# tightened MARK COMMAND...
tightened() {
    local mark=$1 out rc
    shift
    out=$(VRAM_LEDGER_TIGHTEN="$mark" "$@" 2>&1)
    rc=$?
    printf '%s\n' "$out"
    if [ "$rc" -eq 0 ]; then
        echo "tightened: exit 0 with $mark tightened"
        return 1
    fi
    if ! grep -qE "missed\"?: \[?[^]]*\b$mark\b" <<<"$out"; then
        echo "tightened: exit $rc, but $mark is not among what it missed"
        return 1
    fi
    echo "tightened: exit $rc, $mark missed"
}
py() { python3 "tests/python/$1.py" "${@:2}"; }
engine_alone() { ENGINE_MODES=remap ENGINE_MODELS=llama py h200_engine alone; }
step_cost_train() { STEP_COST_LOOPS=train py h200_step_cost torch remap; }
upstream_saved() { UPSTREAM_RESULTS="$logs/upstream" py upstream_tests --saved torch remap; }
step tightened-kv-engine tightened at_least_99_5 bin/kv_engine
step tightened-profile tightened within_request scripts/h200_profile.sh "$logs/profile-tightened"
if [ -s "$logs/gpu-bench.jsonl" ]; then
    step tightened-bench-marks tightened faster_than_torch_512B py bench_marks "$logs/gpu-bench.jsonl"
else
    echo "tightened-bench-marks: not run: no gpu-bench.jsonl in $logs (run gpu-bench and torch-bench first)"
fi
step tightened-h200_torch tightened replay_matches_eager py h200_torch graphs
step tightened-h200_contract tightened raised py h200_contract oom
step tightened-h200_package tightened memory_reserved_is_ledger py h200_package stats:remap
step tightened-h200_sleep tightened usage_fell_asleep py h200_sleep model:remap
step tightened-h200_vllm_profile tightened weights_exact py h200_vllm_profile remap
step tightened-h200_graph_trees tightened remap:graphs_recorded py h200_graph_trees torch remap
step tightened-h200_step_cost tightened train_first_within_1s step_cost_train
step tightened-h200_engine tightened at_least_99_5 engine_alone
step tightened-h200_workloads tightened conv-train_remap_warm_driver_within_1pct \
    py h200_workloads conv-train:torch conv-train:remap+across
step tightened-h200_workloads-ratio tightened conv-train_remap_ratio_as_replayed \
    py h200_workloads conv-train:torch conv-train:remap+across
if [ -s "$logs/upstream/torch.json" ]; then
    step tightened-upstream tightened passes_what_torch_passes upstream_saved
else
    echo "tightened-upstream: not run: no saved upstream results in $logs/upstream (run the upstream step first)"
fi
step cpu-bench bin/alloc-bench --bench --warm-up-time 1 --measurement-time 3

echo
echo "bundle: $(code_stamp)"
[ ${#ran[@]} -gt 0 ] || failed+=("no step matched RUN_ONLY=${RUN_ONLY:-}")
if [ ${#failed[@]} -eq 0 ]; then
    echo "all ${#ran[@]} steps run passed${RUN_ONLY:+ (RUN_ONLY=$RUN_ONLY)}"
    exit 0
fi
echo "${#failed[@]} step(s) failed:"
printf '  %s\n' "${failed[@]}"
exit 1
RUN
chmod +x "$out/run-all.sh"
du -sh "$out"
