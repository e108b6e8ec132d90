#!/usr/bin/env bash
# run_tests.sh: builds the whole tree and runs every test suite (the README's second command).
#   CACHEALLOC_SANITIZERS=address   also builds and runs the ASan+UBSan flavour of the CPU suite
#                                   (the default when CI is set)
#   CACHEALLOC_SANITIZERS=all       ASan+UBSan and TSan (TSan is not in CI yet: only its thread
#                                   tests have been run clean so far)
#   CACHEALLOC_SANITIZERS=0         neither
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)
prefix=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)' 2>/dev/null || true)
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DCACHEALLOC_WERROR=ON \
  ${prefix:+-DCMAKE_PREFIX_PATH=$prefix}
cmake --build build -j"$jobs"
ctest --test-dir build --output-on-failure -j"$jobs"
if [[ -f tools/tests/test_cpu.py ]] && python3 -c 'import pytest' 2>/dev/null; then
  python3 -m pytest -q tools/tests || { rc=$?; [[ $rc == 5 ]] || exit $rc; }
fi
sanitizers=${CACHEALLOC_SANITIZERS:-$([[ "${CI:-}" == true ]] && echo address || echo 0)}
case $sanitizers in
  0) flavours=() ;;
  all|1) flavours=(address thread) ;;
  *) flavours=($sanitizers) ;;
esac
if ((${#flavours[@]})); then
  for flavour in "${flavours[@]}"; do
    cmake -S . -B "build-$flavour" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DCACHEALLOC_SANITIZER=$flavour -DCACHEALLOC_WITH_CUDA=OFF -DCACHEALLOC_BUILD_BENCH=ON \
      -DCACHEALLOC_WERROR=OFF  # GCC 12 + sanitizers: false -Wmaybe-uninitialized in Catch2's std::regex
    cmake --build "build-$flavour" -j"$jobs"
    CACHEALLOC_RANDOM_OPS=${CACHEALLOC_SANITIZER_OPS:-200000} \
      ctest --test-dir "build-$flavour" --output-on-failure -j"$jobs"
  done
fi
