#!/usr/bin/env bash
# gpu_session.sh: everything that needs the GPU, in one run on the H200 device machine.
#   tools/gpu_session.sh [suite|reliability|e2e|all]   (logs and results under $OUT)
# Binaries come prebuilt in gpu-bundle/ (built on the CPU machine with the same PyTorch 2.11
# and CUDA 13 as the device: tools/make_gpu_bundle.sh), so no device time goes to compiling.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
what=${1:-all}
B=$PWD/gpu-bundle
TORCH_LIB=$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))')
export LD_LIBRARY_PATH=$TORCH_LIB:$B:${LD_LIBRARY_PATH:-}
export CACHEALLOC_LIBRARY=$B/libcachealloc_plugin.so
export PYTHONUNBUFFERED=1
{ date -u; nvidia-smi -L; python3 -c 'import torch;print("torch", torch.__version__, torch.version.cuda)'; } | tee "$OUT/env.txt"
python3 -m pip install -q --no-deps --no-build-isolation --no-index ./tools >"$OUT/pip.log" 2>&1 \
  && echo "pip install ./tools: ok" || { echo "pip install ./tools FAILED"; tail -5 "$OUT/pip.log"; }
if [[ $what == suite || $what == all ]]; then
  OUT=$OUT bash tests/gpu/run_on_h200.sh "$B/cachealloc_gpu_tests"
  echo "gpu suite + memcheck: exit $?"
  timeout 300 python3 -m pytest -v -rs tools/tests 2>&1 | tee "$OUT/pytest.log" | tail -40
fi
if [[ $what == reliability || $what == all ]]; then
  # compute-sanitizer racecheck and memcheck on the GPU suite (every policy runs in every test).
  for tool in racecheck memcheck; do
    CACHEALLOC_GPU_STRESS_OPS=200 CACHEALLOC_GPU_STRESS_MAX_MB=8 timeout 240 compute-sanitizer --tool $tool \
      --error-exitcode 1 --report-api-errors no "$B/cachealloc_gpu_tests" "~[oom]" >"$OUT/$tool.log" 2>&1
    echo "compute-sanitizer $tool: exit $? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/$tool.log" | tail -1)"
    grep -E "test cases" "$OUT/$tool.log" | tail -1
  done
  # Out-of-memory on purpose in a training loop, for PyTorch's allocator and each policy.
  for conf in "" policy:native policy:size_class policy:defrag; do
    CACHEALLOC_CONF=$conf timeout 120 python3 tools/scripts/oom_recovery.py 2>>"$OUT/oom_recovery.err" \
      | tee -a "$OUT/oom_recovery.jsonl"
    echo "oom_recovery ${conf:-pytorch-native}: exit ${PIPESTATUS[0]}"
  done
  # A recording of a real run opens with PyTorch's memory_viz and replays with cachealloc-replay.
  CACHEALLOC_CONF=policy:size_class,record:$OUT/recording_size_class.pickle timeout 120 \
    python3 tools/scripts/train_example.py --steps 100 --hidden 2048 --batch 512 >"$OUT/recording_train.log" 2>&1
  echo "recorded training: exit $? ($(stat -c %s "$OUT/recording_size_class.pickle" 2>/dev/null) bytes)"
  timeout 120 python3 -m torch.cuda._memory_viz trace_plot "$OUT/recording_size_class.pickle" \
    -o "$OUT/recording_trace_plot.html" >"$OUT/memory_viz.log" 2>&1
  echo "memory_viz trace_plot: exit $? ($(stat -c %s "$OUT/recording_trace_plot.html" 2>/dev/null) bytes)"
  timeout 120 "$B/cachealloc-replay" "$OUT/recording_size_class.pickle" -q 2>&1 | tee "$OUT/recording_replay.txt"
fi
if [[ $what == e2e || $what == all ]]; then
  timeout 560 python3 bench/e2e/run_e2e.py --out-dir "$OUT" --time-budget-s ${E2E_BUDGET:-480} ${E2E_ARGS:-} \
    2>&1 | tee "$OUT/e2e.log" | tail -60
fi
