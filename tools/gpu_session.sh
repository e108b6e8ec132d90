#!/usr/bin/env bash
# gpu_session.sh: everything that needs the GPU, as two stages of one device session. Each stage
# fits one device call of at most 9.5 minutes and never loses its logs.
#
#   bash tools/gpu_session.sh gpu   # GPU suite + memcheck, pytest tools/tests (plugin, async stats),
#                                   # OOM recovery per policy, recording -> memory_viz -> replay,
#                                   # racecheck, micro benchmarks + GPU replays (issue 8),
#                                   # then the file named by EXTRA_GPU_STEPS, if any   (~6-8 min)
#   bash tools/gpu_session.sh e2e   # bench/e2e/run_e2e.py, 5 interleaved repetitions (~8-9 min)
#   bash tools/gpu_session.sh closing  # the GPU suite, memcheck on its record_stream tests, then
#                                      # the e2e run (~8-9 min)
#   bash tools/gpu_session.sh last     # the GPU suite, then the micro benchmarks and an e2e subset
#                                      # (E2E_ARGS) on cores 0-3 beside a fuzz campaign on 4-15
#   bash tools/gpu_session.sh bench    # the GPU suite, then the micro benchmarks and GPU replays
#                                      # alone on the machine, then an e2e subset (E2E_ARGS)
#   bash tools/gpu_session.sh check    # pytest (plugin, async stats, adapter), OOM recovery per
#                                      # policy, racecheck: the gpu stage without its benchmarks
#   bash tools/gpu_session.sh probe    # the GPU suite (PROBE_MEMCHECK=full: under memcheck),
#                                      # the driver probe (cachealloc-vmm-probe), PYTEST_SELECT
#                                      # (if set) under PROBE_ENV, the GPU micro benchmarks
#                                      # matching MICRO_FILTER (if set), the e2e
#                                      # workloads recorded as snapshots ($OUT/traces), then an e2e
#                                      # subset (E2E_ARGS, E2E_REPS)
#   bash tools/gpu_session.sh fuzz  # the three 10M-execution fuzz campaigns side by side (carry
#                                   # fuzz-bundle), and the e2e workloads recorded as snapshots
#                                   # in $OUT/traces (tools/scripts/record_e2e_traces.py) (~9 min);
#                                   # FUZZ_TARGETS="replay:16" RECORD_E2E=0: one target on every core
#
# Device calls (binaries prebuilt here by tools/make_gpu_bundle.sh, carried; no device time goes
# to compiling):
#   run(command="bash tools/gpu_session.sh gpu", carry=["gpu-bundle"], timeout_s=590)
#   run(command="bash tools/gpu_session.sh e2e", carry=["gpu-bundle"], timeout_s=590)
#
# Time: the stage ends by STAGE_BUDGET_S seconds (default 555) after it starts. Every step runs
# under `timeout`, capped at what is left of the budget minus a reserve for packing the logs; a
# step with less than 20 s left is skipped and says so. Steps run in order of importance.
#
# Output, all under $OUT (the device returns at most 8 files, no deeper than two folders):
#   summary.txt            one line per step: name, exit code, seconds, key figure
#   <stage>_logs.tar.gz    every log of the stage, re-packed after each step (so a call cut
#                          short still returns everything up to the last finished step)
#   gpu_bench.md           (gpu) micro benchmark medians, RATIO lines, replay tables
#   pytest.log             (gpu) the pytest run, whole
#   e2e_<date>.md / .json  (e2e) the end-to-end tables and every run, rewritten after each run
#
# EXTRA_GPU_STEPS=path/to/file (relative to the repository root) is sourced last in the gpu
# stage, under the remaining budget. It may call `step NAME CAP_S FIGURE FUNCTION` itself (define
# FUNCTION and `export -f` it; FIGURE is a shell snippet that reads the step's log as "$L"), or
# run commands directly (their output lands in extra_gpu_steps.log).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
stage=${1:-}
case $stage in gpu | e2e | final | fuzz | closing | last | bench | check | probe) ;; *) echo "usage: $0 gpu|e2e|final|fuzz|closing|last|bench|check|probe" >&2; exit 2 ;; esac

export OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
T0=$(date +%s)
export T0 BUDGET=${STAGE_BUDGET_S:-555} RESERVE=15
export WORK
WORK=$(mktemp -d "/tmp/gpu_session_${stage}.XXXXXX")
export SUMMARY=$OUT/summary.txt STAGE=$stage
export B=$PWD/gpu-bundle
export PYTHONUNBUFFERED=1
export CACHEALLOC_LIBRARY=$B/libcachealloc_plugin.so
export CACHEALLOC_TORCH_LIBRARY=$B/libcachealloc_torch.so
TORCH_LIB=$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))' 2>/dev/null)
export LD_LIBRARY_PATH=$B${TORCH_LIB:+:$TORCH_LIB}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
SAN=$(command -v compute-sanitizer || { [ -x /usr/local/cuda/bin/compute-sanitizer ] && echo /usr/local/cuda/bin/compute-sanitizer; })
export SAN
: >"$SUMMARY"

# Packs every log of the stage (files under 12 MiB) into $OUT, replacing the previous pack.
pack() {
  (cd "$WORK" && find . -type f -size -12M -print0 | tar --null -czf "$OUT/.${STAGE}_logs.tar.gz" -T - 2>/dev/null) &&
    mv -f "$OUT/.${STAGE}_logs.tar.gz" "$OUT/${STAGE}_logs.tar.gz"
}

# step NAME CAP_S FIGURE FUNCTION: runs FUNCTION (exported) under timeout, its output in
# $WORK/NAME.log, then appends "NAME exit RC SECONDS FIGURE" to summary.txt and re-packs the logs.
step() {
  local name=$1 cap=$2 figure=$3 fn=$4
  local left=$((BUDGET - RESERVE - ($(date +%s) - T0)))
  if ((left < 20)); then
    printf '%-24s skipped: %ss left of the %ss stage budget\n' "$name" "$left" "$BUDGET" | tee -a "$SUMMARY"
    return 0
  fi
  local t=$((cap < left ? cap : left)) start rc fig
  start=$(date +%s)
  export L=$WORK/$name.log
  echo "== $name (timeout ${t}s)"
  timeout -k 10 "$t" bash -c "$fn" >"$L" 2>&1
  rc=$?
  [[ $rc -eq 124 || $rc -eq 137 ]] && echo "TIMED OUT after ${t}s" >>"$L"
  fig=$(eval "$figure" 2>/dev/null | tr '\n' ' ' | tr -s ' ' | cut -c1-240)
  printf '%-24s exit %-3s %4ss  %s\n' "$name" "$rc" "$(($(date +%s) - start))" "$fig" | tee -a "$SUMMARY"
  pack
  return 0
}
export -f step pack

# ---- steps ---------------------------------------------------------------------------------

setup() {
  date -u
  nvidia-smi -L
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
  command -v python3
  python3 -c 'import torch;print("torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name(0))'
  git rev-parse --short HEAD 2>/dev/null || true
  echo "compute-sanitizer: ${SAN:-missing}"
  ls -la "$B"
  local bad=0
  for f in "$B"/*; do
    [[ -f $f && -x $f ]] || continue
    if ldd "$f" 2>/dev/null | grep -q "not found"; then
      echo "MISSING LIBRARIES for $f:"; ldd "$f" | grep "not found"; bad=1
    fi
  done
  if [[ $STAGE == gpu || $STAGE == check ]]; then
    python3 -m pip install -q --no-deps --no-build-isolation --no-index ./tools && echo "pip install ./tools: ok"
  fi
  PYTHONPATH=tools python3 -c 'import cachealloc; print("policies:", " ".join(p["name"] for p in cachealloc.policies() if not p.get("replay_only")))'
  return $bad
}

gpu_suite_memcheck() {
  # The Catch2 GPU suite (every registered policy, async included, over its real backend), then
  # the same suite under compute-sanitizer memcheck: tests/gpu/run_on_h200.sh writes its own
  # summary.txt, so it gets a folder of its own.
  OUT=$WORK/gpu_suite bash tests/gpu/run_on_h200.sh "$B/cachealloc_gpu_tests"
  local rc=$?
  cat "$WORK/gpu_suite/summary.txt"
  return $rc
}

# Starts the LibTorch adapter's pytest (issue 7) in the background, in four groups split by policy
# (a fresh process per check; the GPU has room for all, and none measures device-wide memory).
start_adapter_pytest() {
  local adapter=(env CACHEALLOC_TORCH_LIBRARY="$B/libcachealloc_torch.so"
                 CACHEALLOC_LIBTORCH_APP="$B/cachealloc_libtorch_app"
                 python3 -m pytest -v -rs -p no:cacheprovider tools/tests/test_torch_adapter.py)
  "${adapter[@]}" -k "native" >"$WORK/pytest_adapter_native.log" 2>&1 &
  "${adapter[@]}" -k "size_class" >"$WORK/pytest_adapter_size_class.log" 2>&1 &
  "${adapter[@]}" -k "defrag" >"$WORK/pytest_adapter_defrag.log" 2>&1 &
  "${adapter[@]}" -k "not (native or size_class or defrag)" >"$WORK/pytest_adapter_rest.log" 2>&1 &
}

pytest_tools() {
  # Every pytest of tools/tests at once: the plugin and async-stats tests (issues 4, 6) beside the
  # adapter's groups. Then the adapter's Catch2 tests and the sample LibTorch app under each policy.
  # PYTEST_SELECT=path: only that pytest file (no adapter groups, no LibTorch app).
  if [[ -n ${PYTEST_SELECT:-} ]]; then
    python3 -m pytest -v -rfEs -p no:cacheprovider $PYTEST_SELECT >"$WORK/pytest_select.log" 2>&1
    cp "$WORK/pytest_select.log" "$OUT/pytest.log"
    tail -5 "$WORK/pytest_select.log"
    ! pytest_failed "$WORK/pytest_select.log"
    return
  fi
  python3 -m pytest -v -rfEs -p no:cacheprovider --ignore=tools/tests/test_torch_adapter.py tools/tests \
    >"$WORK/pytest_plugin.log" 2>&1 &
  start_adapter_pytest
  wait
  cat "$WORK"/pytest_plugin.log "$WORK"/pytest_adapter_*.log >"$OUT/pytest.log"
  grep -hE "^(FAILED|ERROR)|passed|failed" "$WORK"/pytest_*.log | grep -vE "^tools/" | tail -20
  echo "== cachealloc_torch_tests"
  "$B/cachealloc_torch_tests" 2>&1 | tail -5
  local rc=0
  for p in native size_class defrag async; do
    CACHEALLOC_CONF=policy:$p timeout 120 "$B/cachealloc_libtorch_app" >"$WORK/libtorch_app_$p.log" 2>&1
    r=$?; echo "libtorch_app policy:$p exit $r: $(tail -2 "$WORK/libtorch_app_$p.log" | tr '\n' ' ')"; ((r == 0)) || rc=1
  done
  ! pytest_failed "$WORK"/pytest_*.log && ((rc == 0))
}
pytest_failed() {
  # A failure shows as a "FAILED ..." summary line (-rfEs) and in the "N failed" count line.
  grep -qhE "^(FAILED|ERROR) |[0-9]+ (failed|error)" "$@"
}

oom_recovery() {
  # Out-of-memory on purpose in a training loop: PyTorch's own allocator (CACHEALLOC_CONF unset),
  # then every registered policy. One JSON line each; exit 0 only if every one recovered.
  local policies rc=0 r
  policies=$(python3 -c 'import cachealloc; print(" ".join(p["name"] for p in cachealloc.policies() if not p.get("replay_only")))' 2>/dev/null)
  [[ -n $policies ]] || policies="native size_class defrag async"
  env -u CACHEALLOC_CONF -u PYTORCH_CUDA_ALLOC_CONF timeout 60 python3 tools/scripts/oom_recovery.py
  r=$?; echo "oom_recovery pytorch-native: exit $r"; ((r == 0)) || rc=1
  for p in $policies; do
    CACHEALLOC_CONF=policy:$p timeout 60 python3 tools/scripts/oom_recovery.py
    r=$?; echo "oom_recovery policy:$p: exit $r"; ((r == 0)) || rc=1
  done
  return $rc
}

recording() {
  # A recording of a real run opens with PyTorch's memory_viz and replays with cachealloc-replay.
  local rec=$WORK/recording_size_class.pickle rc=0
  CACHEALLOC_CONF=policy:size_class,record:$rec timeout 90 \
    python3 tools/scripts/train_example.py --steps 100 --hidden 2048 --batch 512 || rc=1
  echo "recording: $(stat -c %s "$rec" 2>/dev/null || echo 0) bytes"
  timeout 90 python3 -m torch.cuda._memory_viz trace_plot "$rec" -o "$WORK/recording_trace_plot.html" || rc=1
  echo "trace_plot: $(stat -c %s "$WORK/recording_trace_plot.html" 2>/dev/null || echo 0) bytes"
  timeout 90 "$B/cachealloc-replay" "$rec" -q || rc=1
  return $rc
}

racecheck() {
  # compute-sanitizer racecheck on the GPU suite (every policy in every test case), smaller stress.
  [[ -n $SAN ]] || { echo "compute-sanitizer not found"; return 3; }
  CACHEALLOC_GPU_STRESS_OPS=200 CACHEALLOC_GPU_STRESS_MAX_MB=8 "$SAN" --tool racecheck --error-exitcode 1 \
    --report-api-errors no "$B/cachealloc_gpu_tests" "~[oom]"
}

gpu_bench() {
  # Issue 8: cachealloc-micro-cuda (RATIO lines: torch native / our fastest policy), the bundled
  # traces replayed on the GPU, the simulated-backend micro benchmarks. ~2-3 minutes.
  BUNDLE=$B OUT=$WORK/gpu_bench bash bench/run_gpu_bench.sh
  local rc=$?
  cp -f "$WORK/gpu_bench/gpu_bench.md" "$OUT/gpu_bench.md" 2>/dev/null
  return $rc
}

pytest_adapter() {
  # The LibTorch adapter's pytest alone (stage final).
  start_adapter_pytest
  wait
  cat "$WORK"/pytest_adapter_*.log >"$OUT/pytest_adapter.log"
  ! grep -qhE "^(FAILED|ERROR) " "$WORK"/pytest_adapter_*.log
}

extra_gpu_steps() {
  # shellcheck disable=SC1090
  source "$EXTRA_GPU_STEPS"
}

e2e() {
  # Issue 4: 3 workloads x 7 configurations x 5 interleaved repetitions, a fresh CUDA process per
  # run (fork server). It fits its steps to the time left; results are rewritten after every run.
  local left=$((BUDGET - RESERVE - ($(date +%s) - T0)))
  python3 bench/e2e/run_e2e.py --out-dir "$OUT" --reps "${E2E_REPS:-5}" --time-budget-s $((left - 20)) ${E2E_ARGS:-}
}
fuzz_campaigns() {
  # Issue 10: libFuzzer campaigns side by side, FUZZ_TARGETS="target:workers ..." (default
  # "snapshot:9 config:6", 15 of the 16 cores, sized by their speed per worker: Note [Work per
  # fuzz input]), from the bundle made here by tests/fuzz/make_bundle.sh (carried as
  # fuzz-bundle); each stops at FUZZ_EXECUTIONS (10M) or at the stage's budget. Meanwhile one core
  # records the e2e workloads on the GPU (record_e2e_traces).
  local left=$((BUDGET - RESERVE - ($(date +%s) - T0) - 30)) spec t pids=() names=()
  [[ -x fuzz-bundle/run_campaign.sh ]] || { echo "fuzz-bundle/ missing: run tests/fuzz/make_bundle.sh and carry it"; return 2; }
  for spec in ${FUZZ_TARGETS:-snapshot:9 config:6}; do
    t=${spec%%:*}
    names+=("$t")
    (cd fuzz-bundle && OUT_DIR=/tmp/campaign WORKERS=${spec##*:} MAX_SECONDS=$left \
      ./run_campaign.sh "${FUZZ_EXECUTIONS:-10000000}" "$t" >"$WORK/campaign_$t.log" 2>&1) &
    pids+=($!)
  done
  local rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  for t in "${names[@]}"; do tail -3 "$WORK/campaign_$t.log"; done
  # Crash reproducers, if any, travel back in the logs (the grown corpora stay: thousands of files).
  mkdir -p "$WORK/artifacts" && cp -r /tmp/campaign/*/artifacts "$WORK/artifacts/" 2>/dev/null
  return $rc
}
gpu_suite_quick() {
  # The Catch2 GPU suite once, without the sanitizer, then memcheck on the record_stream tests
  # alone (the cross-stream free paths): for a session whose policy changes need the GPU's word
  # but whose device time is short.
  "$B/cachealloc_gpu_tests" --reporter compact
  local rc=$?
  if [[ -n $SAN ]]; then
    "$SAN" --tool memcheck --error-exitcode 3 "$B/cachealloc_gpu_tests" --reporter compact "[record_stream]" || rc=$?
  else
    echo "memcheck: compute-sanitizer missing"
  fi
  return $rc
}
record_e2e_traces() {
  python3 tools/scripts/record_e2e_traces.py --out-dir "$OUT/traces"
}
export -f pytest_failed fuzz_campaigns record_e2e_traces gpu_suite_quick setup gpu_suite_memcheck start_adapter_pytest pytest_tools pytest_adapter oom_recovery recording racecheck gpu_bench extra_gpu_steps e2e

# ---- the stages ----------------------------------------------------------------------------

# The key figures of the steps that several stages run (read from the step's log, "$L").
E2E_FIGURE='grep -E "^run_e2e: (round 1|measured steps|[0-9]+ runs)" "$L"; grep -c FAILED "$L" | sed "s/$/ failed runs/"'
MEMCHECK_FIGURE='grep -E "^gpu_suite:|^memcheck:|All tests passed|failed|ERROR SUMMARY" "$L" | head -5'
SUITE_FIGURE='grep -E "^(All tests passed|test cases)|ERROR SUMMARY|Failed" "$L" | tr -s " " | head -4'
BENCH_FIGURE='grep -E "^RATIO" "$OUT/gpu_bench.md" | head -8; grep -E "^total:" "$OUT/gpu_bench.md"'
PYTEST_FIGURE='grep -hE "[0-9]+ (passed|failed)" "$WORK"/pytest_*.log | tr "\n" " "; grep -c "exit 0" "$L" | sed "s/$/ apps ok/"'
OOM_FIGURE='grep -c "\"ok\": true" "$L" | sed "s/$/ recovered/"; grep -E "exit [1-9]" "$L"'
RACECHECK_FIGURE='grep -E "RACECHECK SUMMARY|All tests passed|test cases" "$L" | tail -2'

echo "gpu_session $stage: budget ${BUDGET}s, logs in $WORK -> $OUT/${stage}_logs.tar.gz"
step setup 90 'grep -E "^torch|NVIDIA|MISSING|pip install" "$L" | head -4' setup
if [[ $stage == gpu ]]; then
  step gpu_suite_memcheck 280 "$MEMCHECK_FIGURE" gpu_suite_memcheck
  step gpu_bench 300 'grep -c "^RATIO" "$OUT/gpu_bench.md" | sed "s/$/ RATIO lines/"; grep -E "^total:" "$OUT/gpu_bench.md"' gpu_bench
  step pytest 240 "$PYTEST_FIGURE" pytest_tools
  step oom_recovery 150 "$OOM_FIGURE" oom_recovery
  step recording 120 'grep -E "^recording:|^trace_plot:|fidelity" "$L"' recording
  step racecheck 150 "$RACECHECK_FIGURE" racecheck
  if [[ -n ${EXTRA_GPU_STEPS:-} ]]; then
    if [[ -f $EXTRA_GPU_STEPS ]]; then
      export EXTRA_GPU_STEPS
      step extra_gpu_steps 600 'tail -2 "$L"' extra_gpu_steps
    else
      echo "extra_gpu_steps          skipped: EXTRA_GPU_STEPS=$EXTRA_GPU_STEPS is not a file" | tee -a "$SUMMARY"
    fi
  fi
elif [[ $stage == check ]]; then
  # After a policy change, the gpu stage's checks of behaviour without its benchmarks: pytest
  # (plugin, async stats against the pool's attributes, the LibTorch adapter), OOM recovery per
  # policy, racecheck on the GPU suite. pytest gets 320 s: at 220 its plugin group was cut short
  # on the H200 in session 17 (oom_recovery and racecheck took 51 and 45 s after it).
  step pytest 320 "$PYTEST_FIGURE" pytest_tools
  if [[ -z ${PYTEST_SELECT:-} ]]; then
    step oom_recovery 150 "$OOM_FIGURE" oom_recovery
    step racecheck 150 "$RACECHECK_FIGURE" racecheck
  fi
elif [[ $stage == bench ]]; then
  # The GPU suite, then the micro benchmarks and GPU replays on a quiet machine, then an e2e
  # subset (E2E_ARGS, E2E_REPS).
  step gpu_suite_quick 150 "$SUITE_FIGURE" gpu_suite_quick
  step gpu_bench 300 "$BENCH_FIGURE" gpu_bench
  step e2e 600 "$E2E_FIGURE" e2e
elif [[ $stage == probe ]]; then
  # A change that needs the GPU's word and fresh data: the GPU suite, one pytest file under extra
  # environment (PROBE_ENV="NAME=VALUE ..."), the e2e workloads recorded as snapshots for
  # replays here, then an e2e subset. PROBE_MEMCHECK=full: the whole suite under memcheck instead
  # of the plain suite (as CLOSING_MEMCHECK=full in the closing stage).
  if [[ ${PROBE_MEMCHECK:-} == full ]]; then
    step gpu_suite_memcheck 200 "$MEMCHECK_FIGURE" gpu_suite_memcheck
  else
    step gpu_suite_quick 150 "$SUITE_FIGURE" gpu_suite_quick
  fi
  # What cuMemMap / cuMemUnmap accept (offsets into a handle, aliases, sub-ranges): one line each.
  if [[ -x $B/cachealloc-vmm-probe ]]; then
    step vmm_probe 30 'grep -E "^PROBE" "$L" | sed -E "s/^PROBE //; s/ \(CUDA_ERROR_[A-Z_]+\)//; s/ over [0-9]+.*//" | tr "\n" ";"' \
      '"$B/cachealloc-vmm-probe"'
  fi
  if [[ -n ${PYTEST_SELECT:-} ]]; then
    step pytest 120 'grep -hE "[0-9]+ (passed|failed)" "$WORK"/pytest_*.log' "env ${PROBE_ENV:-} bash -c pytest_tools"
  fi
  if [[ -n ${MICRO_FILTER:-} ]]; then
    step micro_filter 120 'grep -E "^\| (vmm_|pool_)" "$WORK/micro_filter.md" | tr -d " " | tr "\n" " "' \
      '"$B/cachealloc-micro-cuda" --benchmark_filter="$MICRO_FILTER" --summary-md="$WORK/micro_filter.md"'
  fi
  if [[ ${RECORD_E2E:-1} != 0 ]]; then
    step record_e2e_traces 150 'grep -E "^(gpt2|resnet50|pipeline):" "$L" | cut -c1-90' record_e2e_traces
  fi
  step e2e 600 "$E2E_FIGURE" e2e
  tail -40 "$WORK/e2e.log"
elif [[ $stage == fuzz ]]; then
  # Recording (GPU, one core) runs beside the campaigns (CPU): its timing does not matter.
  # RECORD_E2E=0 leaves it out (a campaign alone, on every core).
  if [[ ${RECORD_E2E:-1} != 0 ]]; then
    (step record_e2e_traces 300 'grep -E "^(gpt2|resnet50|pipeline):" "$L" | cut -c1-90' record_e2e_traces) &
  fi
  step fuzz_campaigns 600 'grep -hE "^fuzz_" "$WORK"/campaign_*.log | sort -u | tr -s " "' fuzz_campaigns
  wait
elif [[ $stage == last ]]; then
  # The GPU suite, then on cores 0-3 the micro benchmarks and an e2e subset (E2E_ARGS) while a
  # fuzz campaign (FUZZ_TARGETS, default replay on 12 workers) runs on cores 4-15 at nice 19.
  step gpu_suite_quick 150 "$SUITE_FIGURE" gpu_suite_quick
  cores=$(nproc)
  if ((cores >= 8)); then
    fuzz_pin="taskset -c 4-$((cores - 1))" bench_pin="taskset -c 0-3"
  else
    fuzz_pin="" bench_pin=""
  fi
  export FUZZ_TARGETS=${FUZZ_TARGETS:-replay:$((cores >= 8 ? cores - 4 : 1))}
  (step fuzz_campaigns 600 'grep -hE "^fuzz_" "$WORK"/campaign_*.log | sort -u | tr -s " "' "$fuzz_pin bash -c fuzz_campaigns") &
  step gpu_bench 280 "$BENCH_FIGURE" "$bench_pin bash -c gpu_bench"
  step e2e 200 "$E2E_FIGURE" "$bench_pin bash -c e2e"
  wait
  tail -30 "$WORK/e2e.log"
elif [[ $stage == closing ]]; then
  # The GPU suite (plain) and memcheck on the record_stream tests, then the end-to-end run.
  # CLOSING_MEMCHECK=full: the whole suite under memcheck instead (capped at 200 s).
  if [[ ${CLOSING_MEMCHECK:-} == full ]]; then
    step gpu_suite_memcheck 200 "$MEMCHECK_FIGURE" gpu_suite_memcheck
  else
    step gpu_suite_quick 150 "$SUITE_FIGURE" gpu_suite_quick
  fi
  step e2e 600 "$E2E_FIGURE" e2e
  tail -40 "$WORK/e2e.log"
elif [[ $stage == final ]]; then
  # The adapter's tests, then the end-to-end run with what is left (one device call).
  step pytest_adapter 200 'grep -hE "[0-9]+ (passed|failed)" "$WORK"/pytest_*.log | tr "\n" " "' pytest_adapter
  step e2e 600 "$E2E_FIGURE" e2e
  tail -40 "$WORK/e2e.log"
else
  step e2e 600 "$E2E_FIGURE" e2e
  tail -40 "$WORK/e2e.log"
fi
echo "total: $(($(date +%s) - T0))s of ${BUDGET}s" | tee -a "$SUMMARY"
pack
echo "== summary.txt"
cat "$SUMMARY"
