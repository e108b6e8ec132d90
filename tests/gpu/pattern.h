// pattern.h: the fill pattern shared by the kernels (device) and the tests (host).
//
// Word i of block `id` filled with `seed` is pattern_word(id, seed, i): a 64-bit mix folded to
// 32 bits, so two different blocks, or one block filled twice with different seeds, never share
// a pattern. Trailing bytes (a size not a multiple of 4) take the low byte of the next word.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define CACHEALLOC_HOST_DEVICE __host__ __device__
#else
#define CACHEALLOC_HOST_DEVICE
#endif

namespace cachealloc::gpu_test {

CACHEALLOC_HOST_DEVICE inline std::uint64_t mix64(std::uint64_t x) {
  // splitmix64's finaliser
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

CACHEALLOC_HOST_DEVICE inline std::uint32_t pattern_word(std::uint64_t id, std::uint64_t seed,
                                                         std::uint64_t index) {
  const std::uint64_t h = mix64(mix64(id * 0x9e3779b97f4a7c15ULL ^ seed) + index);
  return static_cast<std::uint32_t>(h ^ (h >> 32));
}

}  // namespace cachealloc::gpu_test
