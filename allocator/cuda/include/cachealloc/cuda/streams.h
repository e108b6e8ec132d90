// streams.h: StreamId <-> cudaStream_t, and a guard that makes a device current for a scope.
#pragma once

#include <cachealloc/types.h>

#include <cstdint>

#include <cuda_runtime_api.h>

namespace cachealloc {

/// The StreamId of a CUDA stream (types.h: the cudaStream_t as an integer, 0 = legacy default).
[[nodiscard]] inline StreamId to_stream_id(cudaStream_t stream) noexcept {
  return static_cast<StreamId>(reinterpret_cast<std::uintptr_t>(stream));
}
[[nodiscard]] inline cudaStream_t to_cuda_stream(StreamId stream) noexcept {
  return reinterpret_cast<cudaStream_t>(static_cast<std::uintptr_t>(stream));
}

/// Makes `device` current for the scope and restores the previous current device after (as
/// c10::cuda::CUDAGuard). Cheap when the device is already current: one cudaGetDevice.
/// `force` always calls cudaSetDevice, which (CUDA >= 12) also makes the device's primary
/// context current for the thread: needed before driver-API calls on a thread that has made no
/// runtime call yet. Throws DeviceError when the device cannot be made current.
class CudaDeviceGuard {
 public:
  explicit CudaDeviceGuard(int device, bool force = false);
  ~CudaDeviceGuard();
  CudaDeviceGuard(const CudaDeviceGuard&) = delete;
  CudaDeviceGuard& operator=(const CudaDeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace cachealloc
