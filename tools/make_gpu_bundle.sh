#!/usr/bin/env bash
# make_gpu_bundle.sh: builds (with LibTorch and CUDA) and gathers the binaries that
# tools/gpu_session.sh runs on the GPU machine into gpu-bundle/ (git-ignored, carried to the device).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build-gpu}
prefix=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_CUDA_ARCHITECTURES=90 >/dev/null
cmake --build "$BUILD" -j"$(nproc)" --target cachealloc_gpu_tests cachealloc_plugin cachealloc_capi cachealloc-replay cachealloc-micro \
  cachealloc_torch cachealloc_torch_tests cachealloc_libtorch_app
rm -rf gpu-bundle && mkdir -p gpu-bundle
cp "$BUILD"/tests/gpu/cachealloc_gpu_tests "$BUILD"/allocator/plugin/libcachealloc_plugin.so "$BUILD"/allocator/plugin/libcachealloc_capi.so \
   "$BUILD"/bench/replay/cachealloc-replay "$BUILD"/bench/micro/cachealloc-micro \
   "$BUILD"/allocator/torch/libcachealloc_torch.so "$BUILD"/allocator/torch/cachealloc_torch_tests \
   "$BUILD"/bench/libtorch_app/cachealloc_libtorch_app gpu-bundle/
ls -la gpu-bundle
