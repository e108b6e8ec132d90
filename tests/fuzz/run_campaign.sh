#!/usr/bin/env bash
# run_campaign.sh: a fixed-execution libFuzzer campaign per target, N workers in parallel, and a
# summary table (executions, wall time, exec/s, coverage, crashes) per target.
#
#   tests/fuzz/run_campaign.sh [executions-per-target] [target...]
#       (default: 10000000 executions; all targets: snapshot config replay)
#
# Environment:
#   WORKERS       parallel fuzzing processes per target (default: nproc)
#   MAX_SECONDS   also stop each target after this many seconds (default: none); the table
#                 then shows how many executions were reached
#   FUZZ_BIN_DIR  where fuzz_<target> live (default: the bundle's bin/ when run from a bundle
#                 made by make_bundle.sh, else $BUILD_DIR/tests/fuzz; BUILD_DIR defaults to
#                 <repo>/build-fuzz and is built with run_fuzz.sh's configuration if needed)
#   OUT_DIR       work directory (default: <bundle or build dir>/campaign)
#   NICE          nice level of the fuzzers (default 19: builds on the same machine go first)
#
# Each target starts from a copy of corpus/<target> + regressions/<target>, shared by its
# workers (libFuzzer -jobs/-workers; each worker reloads what the others found every second),
# and each worker runs ceil(executions / WORKERS) inputs. ASan/UBSan findings, fuzz findings
# (fuzz_entry.cpp aborts), timeouts (> 10 s) and RSS > 2 GiB count as crashes; the reproducer
# lands in $OUT_DIR/<target>/artifacts/ (minimise it with `fuzz_<target> -minimize_crash=1
# -runs=100000 <file>`, then add it to tests/fuzz/regressions/<target>/). A worker that crashes
# stops early, so a target with crashes may show fewer executions than asked for.
# Exit status: 1 when any target crashed or a worker failed, else 0.
set -euo pipefail

EXECUTIONS="${1:-10000000}"
shift || true
TARGETS=("$@")
if [ ${#TARGETS[@]} -eq 0 ]; then
  TARGETS=(snapshot config replay)
fi

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
WORKERS="${WORKERS:-$(nproc)}"
NICE="${NICE:-19}"
if [ -d "$HERE/bin" ] && [ -z "${FUZZ_BIN_DIR:-}" ]; then
  # Running from a bundle (make_bundle.sh): bin/, corpus/, regressions/, *.dict side by side.
  FUZZ_BIN_DIR="$HERE/bin"
  DATA_DIR="$HERE"
  OUT_DIR="${OUT_DIR:-$HERE/campaign}"
else
  REPO="$(cd "$HERE/../.." && pwd)"
  BUILD_DIR="${BUILD_DIR:-$REPO/build-fuzz}"
  DATA_DIR="$HERE"
  if [ -z "${FUZZ_BIN_DIR:-}" ]; then
    FUZZ_BIN_DIR="$BUILD_DIR/tests/fuzz"
    # run_fuzz.sh configures and builds; -runs=1 keeps its own run short.
    FUZZ_RUNS=1 BUILD_DIR="$BUILD_DIR" bash "$HERE/run_fuzz.sh" 0 "${TARGETS[@]}" >/dev/null
  fi
  OUT_DIR="${OUT_DIR:-$BUILD_DIR/campaign}"
fi

export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:symbolize=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"

per_worker=$(((EXECUTIONS + WORKERS - 1) / WORKERS))
status=0
rows=()
for t in "${TARGETS[@]}"; do
  bin="$FUZZ_BIN_DIR/fuzz_$t"
  if [ ! -x "$bin" ]; then
    echo "run_campaign: $bin missing" >&2
    exit 2
  fi
  out="$OUT_DIR/$t"
  rm -rf "$out"
  mkdir -p "$out/corpus" "$out/artifacts" "$out/logs"
  cp "$DATA_DIR/corpus/$t/"* "$out/corpus/" 2>/dev/null || true
  cp "$DATA_DIR/regressions/$t/"* "$out/corpus/" 2>/dev/null || true
  rm -f "$out/corpus/README.md"
  # -max_len: Note [Work per fuzz input] in fuzz_entry.h.
  case "$t" in
    config) flags=(-dict="$DATA_DIR/config.dict" -max_len=512) ;;
    snapshot) flags=(-dict="$DATA_DIR/snapshot.dict" -max_len=16384) ;;
    *) flags=(-dict="$DATA_DIR/snapshot.dict" -max_len=32768) ;;
  esac
  if [ -n "${MAX_SECONDS:-}" ]; then flags+=(-max_total_time="$MAX_SECONDS"); fi
  echo "== fuzz_$t: $WORKERS workers x $per_worker executions${MAX_SECONDS:+, at most $MAX_SECONDS s} ($(date -u +%H:%M:%S) UTC)"
  start=$(date +%s)
  rc=0
  # libFuzzer writes fuzz-<job>.log into the working directory.
  (cd "$out/logs" && nice -n "$NICE" "$bin" "$out/corpus" -jobs="$WORKERS" -workers="$WORKERS" \
    -runs="$per_worker" "${flags[@]}" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$out/artifacts/" ${FUZZ_EXTRA:-} >"$out/driver.log" 2>&1) || rc=$?
  seconds=$(($(date +%s) - start))
  execs=0
  for log in "$out"/logs/fuzz-*.log; do
    [ -f "$log" ] || continue
    n=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    if [ -z "$n" ]; then
      # A worker that crashed prints no final stats: take its last status line.
      n=$(grep -oE '^#[0-9]+' "$log" | tail -1 | tr -d '#')
    fi
    execs=$((execs + ${n:-0}))
  done
  cov=$(cat "$out"/logs/fuzz-*.log 2>/dev/null | grep -oE 'cov: [0-9]+ ft: [0-9]+' |
    sort -t' ' -k2,2n -k4,4n | tail -1 || true)
  crashes=$(find "$out/artifacts" -type f | wc -l)
  corpus=$(find "$out/corpus" -type f | wc -l)
  speed=$((seconds > 0 ? execs / seconds : execs))
  result=ok
  if [ "$crashes" -ne 0 ] || [ "$rc" -ne 0 ]; then
    result="CRASH/FAIL (rc $rc, $crashes artifacts in $out/artifacts)"
    status=1
  fi
  rows+=("$(printf '%-13s %12s %8s %9s %-22s %7s %s' "fuzz_$t" "$execs" "$seconds" "$speed" \
    "${cov:-cov ?}" "$corpus" "$result")")
  echo "${rows[-1]}"
done
echo "== summary ($WORKERS workers per target, asked for $EXECUTIONS executions per target)"
printf '%-13s %12s %8s %9s %-22s %7s %s\n' target executions seconds exec/s coverage corpus result
printf '%s\n' "${rows[@]}"
exit "$status"
