#!/usr/bin/env bash
# install_deps.sh: installs what cachealloc needs on a fresh Debian 12 machine (run as root).
# Debian packages: compilers, CMake, spdlog, Catch2 v2, Google Benchmark, nlohmann-json, CLI11,
# liblzma; clang-14 with its compiler-rt (libFuzzer and the sanitizer runtimes: the fuzz stage of
# run_tests.sh) and llvm-14 (llvm-symbolizer, for readable sanitizer reports); and, unless CACHEALLOC_SKIP_TORCH=1, PyTorch 2.11 from PyPI (its LibTorch headers and
# CMake config build the PyTorch plugin and adapter). The CUDA toolkit is expected at
# /usr/local/cuda (without it the CUDA parts are skipped and everything else builds).
set -euo pipefail
need=()
for pkg in build-essential cmake libspdlog-dev catch2 libbenchmark-dev nlohmann-json3-dev \
           libcli11-dev liblzma-dev xz-utils clang-14 libclang-rt-14-dev llvm-14; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if ((${#need[@]})); then
  echo "install_deps: installing ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
if [[ "${CACHEALLOC_SKIP_TORCH:-0}" != 1 ]]; then
  if ! python3 -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.11.0") else 1)' 2>/dev/null; then
    echo "install_deps: installing torch==2.11.0 from PyPI (LibTorch headers for the plugin)"
    python3 -m pip install -q torch==2.11.0
  fi
fi
python3 -c 'import pytest' 2>/dev/null || python3 -m pip install -q pytest
echo "install_deps: done"
