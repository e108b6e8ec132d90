#!/usr/bin/env bash
# make_gpu_bundle.sh: builds (with LibTorch and CUDA) and gathers what tools/gpu_session.sh runs on
# the GPU machine into gpu-bundle/ (git-ignored; carried to the device with carry: ["gpu-bundle"]).
#
#   BUILD=build-gpu JOBS=2 bash tools/make_gpu_bundle.sh
#
# Gathers: cachealloc_gpu_tests, libcachealloc_plugin.so, libcachealloc_capi.so,
# cachealloc-replay, cachealloc-micro, cachealloc-micro-cuda, the LibTorch adapter
# (libcachealloc_torch.so, its tests, the sample app), the e2e call timer (libcuda_call_timer.so),
# and the shared libraries they link
# that the device image lacks (Google Benchmark's libbenchmark.so.*, found with ldd). Files are
# staged first and then copied over their namesakes: anything else in gpu-bundle/ (the lead's
# or another engineer's files, e.g. the LibTorch adapter) stays. Build with the same PyTorch
# (2.11, CUDA 13) as the device, so that the plugin links the same libtorch/libc10.
#
# SLIM=1 also packs what the e2e and suite scripts need (the GPU tests, the LibTorch adapter and
# its tests, the plugin, the call timer), stripped, into gpu-bundle-slim/gb.tar.xz (about 1.4 MB)
# with COMMIT beside it; the scripts in gpu-bundle-slim/ unpack it. A device call carries at most
# 64 MiB with the tracked tree: in session 51 (58 MiB) gpu-bundle/ (22 MB) no longer fitted; since
# session 52 bench/results keeps its JSON compressed (tree 24 MB), but the slim bundle stays the
# cheaper one to carry.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build-gpu}
JOBS=${JOBS:-$(nproc)}
TARGETS=(cachealloc_gpu_tests cachealloc_plugin cachealloc_capi cachealloc-replay cachealloc-micro cachealloc-micro-cuda cachealloc-cold-replay cachealloc-vmm-probe
         cachealloc_torch cachealloc_torch_tests cachealloc_libtorch_app cuda_call_timer)
prefix=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_CUDA_ARCHITECTURES=90 >/dev/null
cmake --build "$BUILD" -j"$JOBS" --target "${TARGETS[@]}"

stage=$(mktemp -d "${TMPDIR:-/tmp}/gpu-bundle-stage.XXXXXX")
trap 'rm -rf "$stage"' EXIT
for f in tests/gpu/cachealloc_gpu_tests allocator/plugin/libcachealloc_plugin.so allocator/plugin/libcachealloc_capi.so \
         bench/replay/cachealloc-replay bench/micro/cachealloc-micro bench/micro/cachealloc-micro-cuda \
         bench/micro/cachealloc-cold-replay bench/micro/cachealloc-vmm-probe \
         allocator/torch/libcachealloc_torch.so allocator/torch/cachealloc_torch_tests \
         bench/libtorch_app/cachealloc_libtorch_app bench/libcuda_call_timer.so; do
  [[ -f $BUILD/$f ]] || { echo "make_gpu_bundle: $BUILD/$f was not built" >&2; exit 1; }
  cp -f "$BUILD/$f" "$stage/"
done
# Shared libraries the device image does not have: Google Benchmark (libbenchmark.so.1debian on
# Debian/Ubuntu), copied under the name the binaries ask for (the soname), symlinks resolved.
for bin in "$stage"/cachealloc-micro "$stage"/cachealloc-micro-cuda "$stage"/cachealloc-replay "$stage"/cachealloc-cold-replay "$stage"/cachealloc_gpu_tests; do
  ldd "$bin" | awk '$2 == "=>" && $1 ~ /^libbenchmark/ {print $1, $3}' | while read -r soname path; do
    cp -fL "$path" "$stage/$soname"
  done
done
mkdir -p gpu-bundle
cp -f "$stage"/* gpu-bundle/
# The commit the binaries were built from (the device's checkout may report another: its .git
# is not always the current one), read back by bench/run_gpu_bench.sh.
{ git rev-parse --short HEAD 2>/dev/null || echo unknown; } | tr -d '\n' >gpu-bundle/COMMIT
git diff --quiet HEAD -- 2>/dev/null || printf ' + uncommitted changes' >>gpu-bundle/COMMIT
echo >>gpu-bundle/COMMIT
ls -la gpu-bundle
du -sh gpu-bundle
if [[ ${SLIM:-0} == 1 ]]; then
  slim=$(mktemp -d "${TMPDIR:-/tmp}/gpu-bundle-slim.XXXXXX")
  files=(cachealloc_gpu_tests cachealloc_torch_tests libcachealloc_plugin.so libcachealloc_torch.so libcuda_call_timer.so)
  for f in "${files[@]}" COMMIT; do cp -f "gpu-bundle/$f" "$slim/"; done
  (cd "$slim" && strip --strip-unneeded "${files[@]}" && tar cJf gb.tar.xz "${files[@]}" COMMIT)
  mkdir -p gpu-bundle-slim
  cp -f "$slim/gb.tar.xz" gpu-bundle/COMMIT gpu-bundle-slim/
  rm -rf "$slim"
  ls -la gpu-bundle-slim/gb.tar.xz
fi
