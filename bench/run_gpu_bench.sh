#!/usr/bin/env bash
# run_gpu_bench.sh: the GPU speed comparison of issue 8 in one go (about 2 minutes on an H200).
#
#   BUNDLE=gpu-bundle OUT=/some/dir bash bench/run_gpu_bench.sh
#
# BUNDLE (default: gpu-bundle) holds prebuilt cachealloc-replay, cachealloc-micro-cuda and
# cachealloc-micro (and any shared library they need that the machine lacks, e.g.
# libbenchmark.so.1debian: the folder is put on LD_LIBRARY_PATH). Torch's lib directory is added
# too (the binaries link libc10 and libc10_cuda). Run from the repository root (the traces are
# read from tests/data/traces/). Writes to $OUT:
#   gpu_bench.md                 the report: command, date, GPU, micro medians + RATIO lines,
#                                replay tables
#   micro_cuda.txt / .json / .md cachealloc-micro-cuda output (Google Benchmark JSON, summary)
#   micro_sim.txt / .json        cachealloc-micro (simulated backend) output
#   replay_<trace>.txt / .json   cachealloc-replay --device cuda, one per trace
set -uo pipefail

BUNDLE=${BUNDLE:-gpu-bundle}
OUT=${OUT:?set OUT to the output directory}
TRACES=${TRACES:-"gpt2_train_varlen resnet50_train mlp_two_streams"}
mkdir -p "$OUT"
BUNDLE=$(cd "$BUNDLE" && pwd)

TORCH_LIB=$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))' 2>/dev/null || true)
export LD_LIBRARY_PATH="$BUNDLE${TORCH_LIB:+:$TORCH_LIB}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

REPORT="$OUT/gpu_bench.md"
START=$(date +%s)
status=0
for bin in cachealloc-replay cachealloc-micro-cuda cachealloc-micro; do
  if [[ ! -x "$BUNDLE/$bin" ]]; then
    echo "run_gpu_bench: $BUNDLE/$bin is missing" >&2
    status=1
  elif ldd "$BUNDLE/$bin" | grep -q "not found"; then
    echo "run_gpu_bench: $bin lacks shared libraries (copy them into $BUNDLE):" >&2
    ldd "$BUNDLE/$bin" | grep "not found" >&2
    status=1
  fi
done
[[ $status -eq 0 ]] || exit 1

{
  echo "# cachealloc on the GPU: micro benchmarks and trace replays"
  echo
  echo "- command: \`BUNDLE=$BUNDLE OUT=$OUT bash bench/run_gpu_bench.sh\`"
  echo "- date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
  echo "- GPU: $(nvidia-smi -L 2>/dev/null | head -1)"
  echo "- driver: $(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)"
  echo "- PyTorch: $(python3 -c 'import torch;print(torch.__version__, "CUDA", torch.version.cuda)' 2>/dev/null)"
  echo "- binaries built from: $(cat "$BUNDLE/COMMIT" 2>/dev/null || echo "unknown (no $BUNDLE/COMMIT)")"
  echo "- git (the checkout this ran in): $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo
} > "$REPORT"

# 1. Micro benchmarks on the real backends (medians of 5, ratios vs PyTorch's allocator).
echo "== cachealloc-micro-cuda" >&2
timeout 150 "$BUNDLE/cachealloc-micro-cuda" --summary-md="$OUT/micro_cuda.md" \
  --benchmark_out="$OUT/micro_cuda.json" --benchmark_out_format=json > "$OUT/micro_cuda.txt" 2>&1
rc=$?
{
  echo "## Micro benchmarks on the GPU (cachealloc-micro-cuda, rc=$rc)"
  echo
  echo "\`$BUNDLE/cachealloc-micro-cuda --summary-md=micro_cuda.md --benchmark_out=micro_cuda.json\`"
  echo
  [[ -f "$OUT/micro_cuda.md" ]] && cat "$OUT/micro_cuda.md"
  echo
  echo '```'
  grep '^RATIO' "$OUT/micro_cuda.txt" || tail -20 "$OUT/micro_cuda.txt"
  echo '```'
  echo
} >> "$REPORT"
[[ $rc -eq 0 ]] || status=1

# 2. Replays of the bundled traces on the GPU.
for t in $TRACES; do
  echo "== cachealloc-replay --device cuda $t" >&2
  timeout 120 "$BUNDLE/cachealloc-replay" --device cuda -q "tests/data/traces/$t.pickle.xz" \
    --json "$OUT/replay_$t.json" > "$OUT/replay_$t.txt" 2>&1
  rc=$?
  {
    echo "## Replay of $t on the GPU (rc=$rc)"
    echo
    echo "\`$BUNDLE/cachealloc-replay --device cuda -q tests/data/traces/$t.pickle.xz --json replay_$t.json\`"
    echo
    python3 - "$OUT/replay_$t.json" <<'PY' 2>/dev/null || true
import json, sys
j = json.load(open(sys.argv[1]))
gib = 1 << 30
print(f"{j['events']:,} events; recorded peak reserved {j['recorded']['peak_reserved_bytes'] / gib:.2f} GiB; {j['gpu']}")
print()
print("| allocator | peak reserved (GiB) | peak device, cudaMemGetInfo (GiB) | ratio | device calls | failed "
      "| alloc p50 / p90 / p99 / max (us) | free p50 / p90 / p99 / max (us) | replay (s) |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
for p in j["policies"]:
    if "error" in p:
        print(f"| {p['name']} | failed: {p['error']} |||||||")
        continue
    lat = lambda l: " / ".join(f"{l[k] / 1e3:.2f}" for k in ("p50", "p90", "p99")) + f" / {l['max'] / 1e3:.0f}"
    print(f"| {p['name']} | {p['peak_reserved_bytes'] / gib:.2f} | {p['peak_device_used_bytes'] / gib:.2f} "
          f"| {p['ratio']:.3f} | {p['device_calls']} | {p['failed_allocations']} | {lat(p['alloc_latency_ns'])} "
          f"| {lat(p['free_latency_ns'])} | {p['replay_seconds']:.3f} |")
PY
    echo
    echo '```'
    cat "$OUT/replay_$t.txt"
    echo '```'
    echo
  } >> "$REPORT"
  [[ $rc -eq 0 ]] || status=1
done

# 3. Micro benchmarks of the allocator's own cost on the simulated backend (holes/ lives here).
echo "== cachealloc-micro (simulated backend)" >&2
timeout 90 "$BUNDLE/cachealloc-micro" --benchmark_min_time=0.02 --benchmark_repetitions=5 \
  --benchmark_report_aggregates_only=true --benchmark_out="$OUT/micro_sim.json" \
  --benchmark_out_format=json > "$OUT/micro_sim.txt" 2>&1
rc=$?
{
  echo "## Micro benchmarks on the simulated backend (cachealloc-micro, rc=$rc)"
  echo
  echo "\`$BUNDLE/cachealloc-micro --benchmark_min_time=0.02 --benchmark_repetitions=5 --benchmark_report_aggregates_only=true\`"
  echo
  python3 - "$OUT/micro_sim.json" <<'PY' 2>/dev/null || true
import json, sys
j = json.load(open(sys.argv[1]))
rows, allocs = {}, []
for b in j["benchmarks"]:
    if b.get("aggregate_name") != "median":
        continue
    name = b["run_name"].split("/")
    fam = "/".join([name[0]] + name[2:])
    rows.setdefault(fam, {})[name[1]] = b["real_time"]
    if name[1] not in allocs:
        allocs.append(name[1])
print("median ns per alloc+free pair (simulated backend: the allocator's own cost)")
print()
print("| benchmark | " + " | ".join(allocs) + " |")
print("|---|" + "---:|" * len(allocs))
for fam, r in rows.items():
    print(f"| {fam} | " + " | ".join(f"{r[a]:.1f}" if a in r else "-" for a in allocs) + " |")
PY
  echo
} >> "$REPORT"
[[ $rc -eq 0 ]] || status=1

echo "total: $(( $(date +%s) - START )) s, status $status" >> "$REPORT"
echo "run_gpu_bench: wrote $REPORT ($(( $(date +%s) - START )) s, status $status)" >&2
exit $status
