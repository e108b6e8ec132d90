// factory.cpp: the CUDA backends by name, and device queries (see factory.h).
#include <cachealloc/cuda/async_backend.h>
#include <cachealloc/cuda/factory.h>
#include <cachealloc/cuda/runtime_backend.h>
#include <cachealloc/cuda/vmm_backend.h>
#include <cachealloc/errors.h>

#include "cuda_check.h"

#include <cuda_runtime_api.h>

namespace cachealloc {

std::vector<std::string_view> cuda_backend_kinds() {
  return {"runtime", "virtual_memory", "stream_ordered"};
}

std::vector<std::string_view> cuda_backend_config_keys(std::string_view kind) {
  if (kind == "stream_ordered") {
    return CudaAsyncBackend::config_keys();
  }
  if (kind == "virtual_memory") {
    return CudaVmmBackend::config_keys();
  }
  return {};
}

std::unique_ptr<DeviceBackend> make_cuda_backend(std::string_view kind, int device, Config& config) {
  if (kind == "runtime") {
    return std::make_unique<CudaRuntimeBackend>(device);
  }
  if (kind == "virtual_memory") {
    return std::make_unique<CudaVmmBackend>(device, CudaVmmOptions::from_config(config));
  }
  if (kind == "stream_ordered") {
    return std::make_unique<CudaAsyncBackend>(device, CudaAsyncOptions::from_config(config));
  }
  throw ConfigError("unknown CUDA backend kind '" + std::string(kind) +
                    "'; valid kinds: runtime, virtual_memory, stream_ordered");
}

int cuda_device_count() noexcept {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // cudaErrorNoDevice / cudaErrorInsufficientDriver: no GPU here
    return 0;
  }
  return count;
}

std::string cuda_device_name(int device) {
  cudaDeviceProp prop{};
  CACHEALLOC_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  return prop.name;
}

}  // namespace cachealloc
