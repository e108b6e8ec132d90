#!/usr/bin/env bash
# run_fuzz.sh: builds the libFuzzer targets (if needed) and runs each for a while.
#
#   tests/fuzz/run_fuzz.sh [seconds-per-target] [target...]     (default: 30 s, all targets)
#
# Environment: BUILD_DIR (default <repo>/build-fuzz), JOBS (build parallelism, default 2),
# FUZZ_RUNS (if set, -runs=N instead of a time limit), FUZZ_EXTRA (more libFuzzer flags).
# Each target first runs every stored input (regressions/<target>, corpus/<target>) once, whole,
# then fuzzes a COPY of them inside the build directory; the repository is never written.
# Crash inputs land in $BUILD_DIR/fuzz-out/<target>/artifacts/. Prints executions, exec/s and
# coverage per target; exits 1 when a stored input fails or any target found a crash (or
# failed to run). CI (tools/run_tests.sh) runs it for CACHEALLOC_FUZZ_SECONDS per target.
set -euo pipefail

SECONDS_PER_TARGET="${1:-30}"
shift || true
TARGETS=("$@")
if [ ${#TARGETS[@]} -eq 0 ]; then
  TARGETS=(snapshot config replay)
fi

FUZZ_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$FUZZ_DIR/../.." && pwd)"
BUILD_DIR="${BUILD_DIR:-$REPO/build-fuzz}"
JOBS="${JOBS:-2}"

if [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then
  cmake -S "$REPO" -B "$BUILD_DIR" -DCMAKE_CXX_COMPILER=clang++-14 -DCMAKE_C_COMPILER=clang-14 \
    -DCACHEALLOC_FUZZ=ON -DCACHEALLOC_SANITIZER=address -DCACHEALLOC_WITH_CUDA=OFF \
    -DCACHEALLOC_WITH_TORCH=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo
fi
build_targets=()
for t in "${TARGETS[@]}"; do build_targets+=("fuzz_$t"); done
cmake --build "$BUILD_DIR" -j "$JOBS" --target "${build_targets[@]}"

# ASan (with leak checking) and UBSan errors are fatal and end the run with a crash artifact.
if [ -z "${ASAN_SYMBOLIZER_PATH:-}" ] && [ -x /usr/lib/llvm-14/bin/llvm-symbolizer ]; then
  export ASAN_SYMBOLIZER_PATH=/usr/lib/llvm-14/bin/llvm-symbolizer
fi
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:symbolize=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"

status=0
summary=()
for t in "${TARGETS[@]}"; do
  out="$BUILD_DIR/fuzz-out/$t"
  rm -rf "$out"
  mkdir -p "$out/corpus" "$out/artifacts"
  cp "$FUZZ_DIR/corpus/$t/"* "$out/corpus/" 2>/dev/null || true
  cp "$FUZZ_DIR/regressions/$t/"* "$out/corpus/" 2>/dev/null || true
  # -max_len: see Note [Work per fuzz input] in fuzz_entry.h.
  dict=()
  case "$t" in
    config) dict=(-dict="$FUZZ_DIR/config.dict" -max_len=512) ;;
    snapshot) dict=(-dict="$FUZZ_DIR/snapshot.dict" -max_len=16384) ;;
    replay) dict=(-dict="$FUZZ_DIR/snapshot.dict" -max_len=32768) ;;
  esac
  # Every stored input first, each as a whole file (no -max_len truncation): a regression that
  # is back fails here before any fuzzing.
  stored=()
  for f in "$FUZZ_DIR/regressions/$t/"* "$FUZZ_DIR/corpus/$t/"*; do
    case "$f" in *.md | *"*") ;; *) stored+=("$f") ;; esac
  done
  if [ ${#stored[@]} -ne 0 ] && ! "$BUILD_DIR/tests/fuzz/fuzz_$t" -timeout=10 -rss_limit_mb=2048 \
      "${stored[@]}" >"$out/stored.txt" 2>&1; then
    tail -60 "$out/stored.txt"
    line="fuzz_$t: a stored input (regressions/$t or corpus/$t) FAILS, see $out/stored.txt"
    echo "$line"
    summary+=("$line")
    status=1
    continue
  fi
  limit=(-max_total_time="$SECONDS_PER_TARGET")
  if [ -n "${FUZZ_RUNS:-}" ]; then limit=(-runs="$FUZZ_RUNS"); fi
  echo "== fuzz_$t: ${limit[*]}"
  rc=0
  # shellcheck disable=SC2086  # FUZZ_EXTRA is a list of flags
  "$BUILD_DIR/tests/fuzz/fuzz_$t" "$out/corpus" "${limit[@]}" "${dict[@]}" \
    -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$out/artifacts/" ${FUZZ_EXTRA:-} >"$out/log.txt" 2>&1 || rc=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$out/log.txt" | tail -1)
  speed=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$out/log.txt" | tail -1)
  cov=$(grep -oE 'cov: [0-9]+ ft: [0-9]+' "$out/log.txt" | tail -1 || true)
  crashes=$(find "$out/artifacts" -type f | wc -l)
  result="ok"
  if [ "$rc" -ne 0 ] || [ "$crashes" -ne 0 ]; then
    result="CRASH (rc $rc, artifacts in $out/artifacts)"
    status=1
    tail -60 "$out/log.txt"
  fi
  line="fuzz_$t: executions ${execs:-?}, exec/s ${speed:-?}, ${cov:-cov ?}, $result"
  echo "$line"
  summary+=("$line")
done
echo "== summary"
printf '%s\n' "${summary[@]}"
exit "$status"
