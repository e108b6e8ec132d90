#!/usr/bin/env bash
# run_on_h200.sh: runs the GPU suite, then the same suite under compute-sanitizer memcheck, on a
# machine with an NVIDIA GPU; logs go to $OUT (default ./gpu-out). Expected 1-3 minutes on an
# H200; the timeouts cap it at about 4.5 minutes.
#
#   tests/gpu/run_on_h200.sh [BINARY]
#
# BINARY defaults to build-gpu/tests/gpu/cachealloc_gpu_tests. When it is missing, the script
# configures and builds it with the root CMake project first (needs the build dependencies:
# CMake >= 3.24, the CUDA toolkit, Catch2 v2, spdlog, liblzma, nlohmann_json). On a machine
# without them, build on a machine that has them with
#   cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DCACHEALLOC_WITH_CUDA=ON \
#         -DCMAKE_CUDA_ARCHITECTURES=90
#   cmake --build build-gpu -j --target cachealloc_gpu_tests
# and bring build-gpu/tests/gpu/cachealloc_gpu_tests along (it needs glibc >= 2.34 and GCC >= 11's
# libstdc++ on the GPU machine, nothing else: the CUDA runtime is linked statically).
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
BIN=${1:-build-gpu/tests/gpu/cachealloc_gpu_tests}
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }

{ nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; } >"$OUT/device.txt" 2>&1
note "device: $(head -1 "$OUT/device.txt")"

if [ ! -x "$BIN" ]; then
  note "building $BIN (log: build.log)"
  if ! { cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DCACHEALLOC_WITH_CUDA=ON \
           -DCACHEALLOC_WITH_TORCH=OFF -DCACHEALLOC_BUILD_BENCH=OFF -DCMAKE_CUDA_ARCHITECTURES=90 &&
         cmake --build build-gpu -j "$(nproc)" --target cachealloc_gpu_tests; } >"$OUT/build.log" 2>&1; then
    note "BUILD FAILED"; tail -40 "$OUT/build.log"; exit 2
  fi
  BIN=build-gpu/tests/gpu/cachealloc_gpu_tests
fi

# 1. The whole suite at full size (target: < 60 s on an H200). -d yes: time per test case.
start=$(date +%s)
timeout 120 "$BIN" -d yes >"$OUT/gpu_suite.log" 2>&1
suite_rc=$?
note "gpu_suite: exit $suite_rc in $(( $(date +%s) - start )) s (log: gpu_suite.log)"
grep -E "^cuda_vmm on|^stress |^cachealloc GPU tests on" "$OUT/gpu_suite.log" | tee -a "$SUMMARY"
tail -4 "$OUT/gpu_suite.log" | tee -a "$SUMMARY"

# 2. memcheck, smaller stress, no out-of-memory cases (the tool needs device memory of its own).
if command -v compute-sanitizer >/dev/null 2>&1; then SAN=compute-sanitizer
elif [ -x /usr/local/cuda/bin/compute-sanitizer ]; then SAN=/usr/local/cuda/bin/compute-sanitizer
else SAN=""; fi
if [ -n "$SAN" ]; then
  start=$(date +%s)
  CACHEALLOC_GPU_STRESS_OPS=300 CACHEALLOC_GPU_STRESS_MAX_MB=8 \
    timeout 150 "$SAN" --tool memcheck --error-exitcode 1 --report-api-errors no \
    "$BIN" "~[oom]" >"$OUT/memcheck.log" 2>&1
  memcheck_rc=$?
  note "memcheck: exit $memcheck_rc in $(( $(date +%s) - start )) s (log: memcheck.log)"
  grep -E "ERROR SUMMARY|test cases" "$OUT/memcheck.log" | tail -3 | tee -a "$SUMMARY"
else
  memcheck_rc=0
  note "memcheck: compute-sanitizer not found, skipped"
fi

[ "$suite_rc" -eq 0 ] && [ "$memcheck_rc" -eq 0 ]
