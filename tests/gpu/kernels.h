// kernels.h: host entry points of the GPU test kernels (kernels.cu, built by nvcc).
//
// Every launcher only enqueues work on `stream` and returns the launch status (cudaSuccess or
// the error cudaGetLastError reported); none synchronises. Sizes are in bytes and may be any
// value; pointers must be 4-byte aligned (every allocator pointer is 512-byte aligned).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

namespace cachealloc::gpu_test {

/// Writes pattern (id, seed) over [ptr, ptr + bytes).
cudaError_t launch_fill(void* ptr, std::size_t bytes, std::uint64_t id, std::uint64_t seed,
                        cudaStream_t stream);

/// Adds to *mismatches the number of words (and trailing bytes) of [ptr, ptr + bytes) that
/// differ from pattern (id, seed).
cudaError_t launch_verify(const void* ptr, std::size_t bytes, std::uint64_t id, std::uint64_t seed,
                          unsigned long long* mismatches, cudaStream_t stream);

/// Busy-waits about `cycles` SM clock cycles (clock64) in one thread block.
cudaError_t launch_spin(long long cycles, cudaStream_t stream);

/// The record_stream probe: `blocks` thread blocks (launch no more than fit on the device at
/// once, e.g. one per SM) each write their share of [ptr, ptr + bytes) with pattern (id, seed),
/// spin `cycles` clock cycles, then re-read their share bypassing L1 (so writes by kernels on
/// other streams are seen), add the words that changed to *mismatches and the sum of the words
/// read to *checksum. With nobody else touching the memory, *mismatches stays 0 and *checksum
/// is expected_checksum(bytes, id, seed).
cudaError_t launch_hold_and_check(void* ptr, std::size_t bytes, std::uint64_t id, std::uint64_t seed,
                                  long long cycles, int blocks, unsigned long long* mismatches,
                                  unsigned long long* checksum, cudaStream_t stream);

/// The checksum launch_hold_and_check computes on untouched memory (host-side).
unsigned long long expected_checksum(std::size_t bytes, std::uint64_t id, std::uint64_t seed);

}  // namespace cachealloc::gpu_test
