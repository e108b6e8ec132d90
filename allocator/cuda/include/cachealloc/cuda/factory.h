// factory.h: the CUDA backends by name, and device queries that never need a GPU to call.
//
//   kind               backend             used by policies whose registry entry says
//   "runtime"          CudaRuntimeBackend  BackendNeed::runtime
//   "virtual_memory"   CudaVmmBackend      BackendNeed::virtual_memory
//   "stream_ordered"   CudaAsyncBackend    BackendNeed::stream_ordered
//
// (The names match registry.h's BackendNeed; this layer may not include the policies layer.)
#pragma once

#include <cachealloc/backend.h>
#include <cachealloc/config.h>

#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace cachealloc {

/// Builds the backend of `kind` for `device`; each backend takes its keys
/// (cuda_backend_config_keys) from `config`. Throws ConfigError for an unknown kind or a bad
/// value, DeviceError when the device or driver cannot provide the backend.
[[nodiscard]] std::unique_ptr<DeviceBackend> make_cuda_backend(std::string_view kind, int device,
                                                               Config& config);

/// Takes the keys of the backend of `kind` from `config` and checks their values, as
/// make_cuda_backend would, without a device (the plugin's validation). Throws ConfigError for an
/// unknown kind or a bad value.
void check_cuda_backend_config(std::string_view kind, Config& config);

/// The CACHEALLOC_CONF keys the backend of `kind` takes (every kind: event_thread, event_thread.h).
[[nodiscard]] std::vector<std::string_view> cuda_backend_config_keys(std::string_view kind);

/// The backend kinds make_cuda_backend understands.
[[nodiscard]] std::vector<std::string_view> cuda_backend_kinds();

/// Number of CUDA devices; 0 when there is no driver, no GPU, or any error. Never throws.
[[nodiscard]] int cuda_device_count() noexcept;

/// The device's name (cudaDeviceProp::name), e.g. "NVIDIA H200". Throws DeviceError.
[[nodiscard]] std::string cuda_device_name(int device);

}  // namespace cachealloc
