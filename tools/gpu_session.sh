#!/usr/bin/env bash
# gpu_session.sh: everything that needs the GPU, in one run on the H200 device machine.
#   tools/gpu_session.sh [suite|e2e|all]   (logs and results under $OUT)
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
if [[ $what == e2e || $what == all ]]; then
  timeout 560 python3 bench/e2e/run_e2e.py --out-dir "$OUT" --time-budget-s ${E2E_BUDGET:-480} ${E2E_ARGS:-} \
    2>&1 | tee "$OUT/e2e.log" | tail -60
fi
