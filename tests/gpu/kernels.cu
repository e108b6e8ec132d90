// kernels.cu: the GPU test kernels: pattern fill/verify, a spin, and the record_stream probe.
#include "kernels.h"
#include "pattern.h"

#include <algorithm>

namespace cachealloc::gpu_test {
namespace {

constexpr int kThreads = 256;
constexpr std::size_t kMaxBlocks = 4096;

int blocks_for(std::size_t items) {
  const std::size_t b = (items + kThreads - 1) / kThreads;
  return static_cast<int>(std::max<std::size_t>(1, std::min(b, kMaxBlocks)));
}

__device__ std::uint8_t tail_byte(std::uint64_t id, std::uint64_t seed, std::size_t byte_index) {
  return static_cast<std::uint8_t>(pattern_word(id, seed, byte_index / 4 + (std::uint64_t{1} << 62)));
}

__global__ void fill_kernel(std::uint32_t* words, std::size_t n_words, std::size_t bytes,
                            std::uint64_t id, std::uint64_t seed) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n_words;
       i += stride) {
    words[i] = pattern_word(id, seed, i);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    auto* bytes_ptr = reinterpret_cast<std::uint8_t*>(words);
    for (std::size_t b = n_words * 4; b < bytes; ++b) {
      bytes_ptr[b] = tail_byte(id, seed, b);
    }
  }
}

__global__ void verify_kernel(const std::uint32_t* words, std::size_t n_words, std::size_t bytes,
                              std::uint64_t id, std::uint64_t seed, unsigned long long* mismatches) {
  unsigned long long bad = 0;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n_words;
       i += stride) {
    bad += __ldcg(words + i) != pattern_word(id, seed, i) ? 1 : 0;
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    const auto* bytes_ptr = reinterpret_cast<const std::uint8_t*>(words);
    for (std::size_t b = n_words * 4; b < bytes; ++b) {
      bad += bytes_ptr[b] != tail_byte(id, seed, b) ? 1 : 0;
    }
  }
  if (bad != 0) {
    atomicAdd(mismatches, bad);
  }
}

__device__ void spin_cycles(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

__global__ void spin_kernel(long long cycles) {
  if (threadIdx.x == 0) {
    spin_cycles(cycles);
  }
}

__global__ void hold_and_check_kernel(std::uint32_t* words, std::size_t n_words, std::uint64_t id,
                                      std::uint64_t seed, long long cycles,
                                      unsigned long long* mismatches, unsigned long long* checksum) {
  const std::size_t share = (n_words + gridDim.x - 1) / gridDim.x;
  const std::size_t begin = blockIdx.x * share;
  const std::size_t end = begin + share < n_words ? begin + share : n_words;
  for (std::size_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    words[i] = pattern_word(id, seed, i);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    spin_cycles(cycles);
  }
  __syncthreads();
  unsigned long long bad = 0;
  unsigned long long sum = 0;
  for (std::size_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const std::uint32_t w = __ldcg(words + i);  // L2: sees other streams' writes
    bad += w != pattern_word(id, seed, i) ? 1 : 0;
    sum += w;
  }
  if (bad != 0) {
    atomicAdd(mismatches, bad);
  }
  atomicAdd(checksum, sum);
}

}  // namespace

cudaError_t launch_fill(void* ptr, std::size_t bytes, std::uint64_t id, std::uint64_t seed,
                        cudaStream_t stream) {
  const std::size_t n_words = bytes / 4;
  fill_kernel<<<blocks_for(n_words), kThreads, 0, stream>>>(static_cast<std::uint32_t*>(ptr), n_words,
                                                            bytes, id, seed);
  return cudaGetLastError();
}

cudaError_t launch_verify(const void* ptr, std::size_t bytes, std::uint64_t id, std::uint64_t seed,
                          unsigned long long* mismatches, cudaStream_t stream) {
  const std::size_t n_words = bytes / 4;
  verify_kernel<<<blocks_for(n_words), kThreads, 0, stream>>>(
      static_cast<const std::uint32_t*>(ptr), n_words, bytes, id, seed, mismatches);
  return cudaGetLastError();
}

cudaError_t launch_spin(long long cycles, cudaStream_t stream) {
  spin_kernel<<<1, 32, 0, stream>>>(cycles);
  return cudaGetLastError();
}

cudaError_t launch_hold_and_check(void* ptr, std::size_t bytes, std::uint64_t id, std::uint64_t seed,
                                  long long cycles, int blocks, unsigned long long* mismatches,
                                  unsigned long long* checksum, cudaStream_t stream) {
  hold_and_check_kernel<<<std::max(blocks, 1), kThreads, 0, stream>>>(
      static_cast<std::uint32_t*>(ptr), bytes / 4, id, seed, cycles, mismatches, checksum);
  return cudaGetLastError();
}

unsigned long long expected_checksum(std::size_t bytes, std::uint64_t id, std::uint64_t seed) {
  unsigned long long sum = 0;
  for (std::size_t i = 0; i < bytes / 4; ++i) {
    sum += pattern_word(id, seed, i);
  }
  return sum;
}

}  // namespace cachealloc::gpu_test
