// driver_api.h (private): the few CUDA driver-API entry points the VMM backend (and the event
// pool's host fences) need, loaded at
// run time so that nothing links libcuda (see allocator/cuda/CMakeLists.txt).
//
// Note [Loading the driver API]
// dlopen("libcuda.so.1") (the name the driver installs; the toolkit's stub is libcuda.so and is
// only for linking), then cuGetProcAddress_v2 for each symbol at the ABI version we compiled
// against (12.0: every call below has kept its signature since 10.2), falling back to dlsym for
// old drivers. The runtime has already loaded the same library for itself, so dlopen only
// takes a reference. The table is loaded once per process; a failure is remembered and
// rethrown, with the reason, by every later call.
#pragma once

#include <cuda.h>

#include <string>

namespace cachealloc::cuda_detail {

struct DriverApi {
  CUresult (*init)(unsigned int flags) = nullptr;
  CUresult (*device_get)(CUdevice* device, int ordinal) = nullptr;
  CUresult (*device_get_attribute)(int* value, CUdevice_attribute attribute, CUdevice device) = nullptr;
  CUresult (*ctx_get_current)(CUcontext* context) = nullptr;
  CUresult (*get_error_name)(CUresult error, const char** text) = nullptr;
  CUresult (*get_error_string)(CUresult error, const char** text) = nullptr;
  CUresult (*mem_address_reserve)(CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                  unsigned long long flags) = nullptr;
  CUresult (*mem_address_free)(CUdeviceptr ptr, size_t size) = nullptr;
  CUresult (*mem_create)(CUmemGenericAllocationHandle* handle, size_t size,
                         const CUmemAllocationProp* prop, unsigned long long flags) = nullptr;
  CUresult (*mem_release)(CUmemGenericAllocationHandle handle) = nullptr;
  CUresult (*mem_map)(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                      unsigned long long flags) = nullptr;
  CUresult (*mem_unmap)(CUdeviceptr ptr, size_t size) = nullptr;
  CUresult (*mem_set_access)(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc,
                             size_t count) = nullptr;
  CUresult (*mem_get_allocation_granularity)(size_t* granularity, const CUmemAllocationProp* prop,
                                             CUmemAllocationGranularity_flags option) = nullptr;
  // Optional (nullptr when the driver lacks them): stream memory operations, for host fences
  // (Note [Host fences instead of events], event_pool.h).
  CUresult (*stream_write_value64)(CUstream stream, CUdeviceptr addr, cuuint64_t value,
                                   unsigned int flags) = nullptr;
  CUresult (*stream_wait_value64)(CUstream stream, CUdeviceptr addr, cuuint64_t value,
                                  unsigned int flags) = nullptr;
};

/// The loaded table (cuInit already called). Throws DeviceError("CUDA driver API not available:
/// ...") when the library or a symbol is missing, or cuInit fails.
const DriverApi& driver_api();

/// "CUDA_ERROR_X (text) in call at file:line".
std::string describe_driver_error(CUresult error, const char* call, const char* file, int line);
[[noreturn]] void throw_driver_error(CUresult error, const char* call, const char* file, int line);
void warn_driver_error(CUresult error, const char* call, const char* file, int line) noexcept;

}  // namespace cachealloc::cuda_detail

#define CACHEALLOC_CU_CHECK(call)                                                         \
  do {                                                                                    \
    const CUresult cachealloc_cu_status_ = (call);                                        \
    if (cachealloc_cu_status_ != CUDA_SUCCESS) {                                          \
      ::cachealloc::cuda_detail::throw_driver_error(cachealloc_cu_status_, #call, __FILE__, \
                                                    __LINE__);                            \
    }                                                                                     \
  } while (false)

#define CACHEALLOC_CU_WARN(call)                                                          \
  do {                                                                                    \
    const CUresult cachealloc_cu_status_ = (call);                                        \
    if (cachealloc_cu_status_ != CUDA_SUCCESS) {                                          \
      ::cachealloc::cuda_detail::warn_driver_error(cachealloc_cu_status_, #call, __FILE__,  \
                                                   __LINE__);                             \
    }                                                                                     \
  } while (false)
