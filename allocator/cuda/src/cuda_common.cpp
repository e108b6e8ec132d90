// cuda_common.cpp: error reporting, the device guard and device queries shared by the backends.
#include "cuda_check.h"

#include <cachealloc/cuda/streams.h>
#include <cachealloc/errors.h>

#include <cstdio>
#include <string>

namespace cachealloc::cuda_detail {

namespace {
std::string describe(cudaError_t error, const char* call, const char* file, int line) {
  const char* name = cudaGetErrorName(error);
  const char* text = cudaGetErrorString(error);
  return std::string("CUDA error ") + (name != nullptr ? name : "?") + " (" +
         (text != nullptr ? text : "?") + ") in " + call + " at " + file + ":" +
         std::to_string(line);
}
}  // namespace

void throw_cuda_error(cudaError_t error, const char* call, const char* file, int line) {
  (void)cudaGetLastError();  // clear a non-sticky error so it does not resurface elsewhere
  throw DeviceError(describe(error, call, file, line), static_cast<int>(error));
}

void warn_cuda_error(cudaError_t error, const char* call, const char* file, int line) noexcept {
  (void)cudaGetLastError();
  // At process exit the runtime may already be gone; freeing then is moot, not an error.
  if (error == cudaErrorCudartUnloading) {
    return;
  }
  try {
    std::fprintf(stderr, "cachealloc: %s (ignored: this path cannot throw)\n",
                 describe(error, call, file, line).c_str());
  } catch (...) {  // NOLINT(bugprone-empty-catch): out of host memory while reporting
  }
}

void warn_exception(const char* where, const std::exception& e) noexcept {
  const auto* device_error = dynamic_cast<const DeviceError*>(&e);
  if (device_error != nullptr && device_error->code() == static_cast<int>(cudaErrorCudartUnloading)) {
    return;  // process exit (cudaErrorCudartUnloading == CUDA_ERROR_DEINITIALIZED == 4)
  }
  std::fprintf(stderr, "cachealloc: %s: %s (ignored: this path cannot throw)\n", where, e.what());
}

MemoryInfo memory_info(int device) {
  CudaDeviceGuard guard(device);
  MemoryInfo info{0, 0};
  CACHEALLOC_CUDA_CHECK(cudaMemGetInfo(&info.free_bytes, &info.total_bytes));
  return info;
}

std::function<void()> backend_thread_init(int device) {
  return [device] {
    CACHEALLOC_CUDA_CHECK(cudaSetDevice(device));
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    CACHEALLOC_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
  };
}

void initialise_device(int device) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    // No driver, a stub driver, no GPU, or a driver older than this runtime.
    (void)cudaGetLastError();
    throw DeviceError(std::string("no usable CUDA device: cudaGetDeviceCount failed with ") +
                          cudaGetErrorName(status) + " (" + cudaGetErrorString(status) +
                          "); cachealloc's CUDA backends need an NVIDIA GPU and its driver (use "
                          "the simulated backend without one)",
                      static_cast<int>(status));
  }
  if (device < 0 || device >= count) {
    throw DeviceError("CUDA device " + std::to_string(device) + " does not exist (this process sees " +
                      std::to_string(count) + " device(s); check CUDA_VISIBLE_DEVICES)");
  }
  CudaDeviceGuard guard(device, /*force=*/true);
  CACHEALLOC_CUDA_CHECK(cudaFree(nullptr));  // creates the primary context if needed
}

}  // namespace cachealloc::cuda_detail

namespace cachealloc {

CudaDeviceGuard::CudaDeviceGuard(int device, bool force) {
  int current = -1;
  CACHEALLOC_CUDA_CHECK(cudaGetDevice(&current));
  if (current != device) {
    CACHEALLOC_CUDA_CHECK(cudaSetDevice(device));
    previous_ = current;
  } else if (force) {
    CACHEALLOC_CUDA_CHECK(cudaSetDevice(device));
  }
}

CudaDeviceGuard::~CudaDeviceGuard() {
  if (previous_ >= 0) {
    CACHEALLOC_CUDA_WARN(cudaSetDevice(previous_));
  }
}

}  // namespace cachealloc
