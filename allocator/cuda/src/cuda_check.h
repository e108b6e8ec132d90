// cuda_check.h (private): checking CUDA runtime calls, shared by the CUDA backends.
//
//   CACHEALLOC_CUDA_CHECK(cudaEventRecord(ev, s));   // throws DeviceError on failure
//   CACHEALLOC_CUDA_WARN(cudaFree(p));               // noexcept paths: reports on stderr
//
// A DeviceError's message names the error (cudaGetErrorName and cudaGetErrorString), the call
// as written and file:line; its code() is the cudaError_t. Before throwing, the thread's last
// error is read (cudaGetLastError) so that a non-sticky failure does not resurface later in
// someone else's error check.
#pragma once

#include <cstddef>
#include <exception>
#include <functional>

#include <cuda_runtime_api.h>

namespace cachealloc::cuda_detail {

[[noreturn]] void throw_cuda_error(cudaError_t error, const char* call, const char* file, int line);
void warn_cuda_error(cudaError_t error, const char* call, const char* file, int line) noexcept;
/// Reports an exception caught on a path that cannot throw (releases, destructors).
void warn_exception(const char* where, const std::exception& e) noexcept;

/// cudaMemGetInfo on `device` (under a device guard): {free, total}. Throws DeviceError.
struct MemoryInfo {
  std::size_t free_bytes;
  std::size_t total_bytes;
};
MemoryInfo memory_info(int device);

/// What the backends' own threads (the unmapper, the event pool's record thread) do first: the
/// device current, and the stream-capture mode relaxed, so that their calls never invalidate a
/// graph another thread captures in the default global mode (capture_guard_backend.h).
std::function<void()> backend_thread_init(int device);

/// Initialises the runtime's primary context on `device` (cudaSetDevice + cudaFree(nullptr))
/// and checks the device exists. Throws DeviceError.
void initialise_device(int device);

}  // namespace cachealloc::cuda_detail

#define CACHEALLOC_CUDA_CHECK(call)                                                    \
  do {                                                                                 \
    const cudaError_t cachealloc_cuda_status_ = (call);                                \
    if (cachealloc_cuda_status_ != cudaSuccess) {                                      \
      ::cachealloc::cuda_detail::throw_cuda_error(cachealloc_cuda_status_, #call, __FILE__, \
                                                  __LINE__);                           \
    }                                                                                  \
  } while (false)

#define CACHEALLOC_CUDA_WARN(call)                                                     \
  do {                                                                                 \
    const cudaError_t cachealloc_cuda_status_ = (call);                                \
    if (cachealloc_cuda_status_ != cudaSuccess) {                                      \
      ::cachealloc::cuda_detail::warn_cuda_error(cachealloc_cuda_status_, #call, __FILE__, \
                                                 __LINE__);                            \
    }                                                                                  \
  } while (false)
