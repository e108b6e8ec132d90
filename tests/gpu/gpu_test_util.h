// gpu_test_util.h: shared helpers of the GPU test suite (streams, device buffers, policies).
#pragma once

#include <cachealloc/allocator.h>
#include <cachealloc/config.h>
#include <cachealloc/cuda/factory.h>
#include <cachealloc/cuda/streams.h>
#include <cachealloc/policies/registry.h>

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <cuda_runtime_api.h>

/// REQUIRE that a CUDA call succeeded, showing the error's name when it did not.
#define GPU_REQUIRE_OK(call)                                                          \
  do {                                                                                \
    const cudaError_t gpu_test_status_ = (call);                                      \
    INFO(#call << " -> " << cudaGetErrorName(gpu_test_status_));                      \
    REQUIRE(gpu_test_status_ == cudaSuccess);                                         \
  } while (false)

namespace cachealloc::gpu_test {

/// The device the suite runs on (CACHEALLOC_GPU_TEST_DEVICE, default 0).
int test_device();

/// An integer from the environment (for scaling the stress test), or `fallback`.
long env_or(const char* name, long fallback);

/// Every registered policy (the suite runs each on the backend it needs).
std::vector<std::string> gpu_policy_names();
/// The registered policies that need `need`.
std::vector<std::string> gpu_policy_names(BackendNeed need);

/// The front end for `policy` over the real backend it needs, on test_device(); `conf` is
/// CACHEALLOC_CONF text for the policy and the backend.
std::unique_ptr<DeviceAllocator> make_gpu_allocator(const std::string& policy,
                                                    std::string_view conf = "");

/// A non-blocking CUDA stream on test_device(), destroyed with the object.
class TestStream {
 public:
  TestStream();
  ~TestStream();
  TestStream(const TestStream&) = delete;
  TestStream& operator=(const TestStream&) = delete;
  [[nodiscard]] cudaStream_t get() const noexcept { return stream_; }
  [[nodiscard]] StreamId id() const noexcept { return to_stream_id(stream_); }

 private:
  cudaStream_t stream_ = nullptr;
};

/// One device counter (unsigned long long) allocated with plain cudaMalloc, outside any allocator.
class DeviceCounter {
 public:
  DeviceCounter();
  ~DeviceCounter();
  DeviceCounter(const DeviceCounter&) = delete;
  DeviceCounter& operator=(const DeviceCounter&) = delete;
  [[nodiscard]] unsigned long long* get() const noexcept { return ptr_; }
  /// Copies the value back (synchronous).
  [[nodiscard]] unsigned long long read() const;
  void reset();

 private:
  unsigned long long* ptr_ = nullptr;
};

/// Clock cycles (cudaDevAttrClockRate) that take about `ms` milliseconds at the peak SM clock.
long long cycles_for_ms(double ms);
/// Number of multiprocessors of test_device().
int multiprocessor_count();

}  // namespace cachealloc::gpu_test
