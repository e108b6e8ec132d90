#!/usr/bin/env bash
# quickstart.sh: installs what is missing, builds, and replays a bundled real trace (GPT-2
# training recorded on an H200) on every policy, side by side with what PyTorch reserved.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install_deps.sh
prefix=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)' 2>/dev/null || true)
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release ${prefix:+-DCMAKE_PREFIX_PATH=$prefix} >/dev/null
cmake --build build -j"$(nproc)" --target cachealloc-replay
./build/bench/replay/cachealloc-replay tests/data/traces/gpt2_train_varlen.pickle.xz \
  --json build/gpt2_train_varlen.json --plot build/gpt2_train_varlen.svg "$@"
