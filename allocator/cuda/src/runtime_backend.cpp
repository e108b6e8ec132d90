// runtime_backend.cpp: backend `cuda_runtime` (see runtime_backend.h).
#include <cachealloc/cuda/runtime_backend.h>
#include <cachealloc/cuda/streams.h>

#include "cuda_check.h"

#include <exception>

namespace cachealloc {

CudaRuntimeBackend::CudaRuntimeBackend(int device, EventThread events)
    : device_(device), events_(device, events) {
  cuda_detail::initialise_device(device);
  total_memory_ = cuda_detail::memory_info(device).total_bytes;
}

CudaRuntimeBackend::~CudaRuntimeBackend() = default;

std::size_t CudaRuntimeBackend::free_memory() const {
  return cuda_detail::memory_info(device_).free_bytes;
}

// Note [Out of memory from cudaMalloc] in runtime_backend.h.
void* CudaRuntimeBackend::do_reserve(std::size_t bytes) {
  CudaDeviceGuard guard(device_);
  void* ptr = nullptr;
  const cudaError_t status = cudaMalloc(&ptr, bytes);
  if (status == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    return nullptr;
  }
  CACHEALLOC_CUDA_CHECK(status);
  return ptr;
}

void CudaRuntimeBackend::do_release(void* ptr, std::size_t /*bytes*/) noexcept {
  try {
    CudaDeviceGuard guard(device_);
    CACHEALLOC_CUDA_WARN(cudaFree(ptr));  // waits for the device: see cudaFree's documentation
  } catch (const std::exception& e) {
    cuda_detail::warn_exception("cudaFree: device guard", e);
    // The guard could not switch devices: free from whatever device is current, which works
    // for memory of any device under unified addressing.
    CACHEALLOC_CUDA_WARN(cudaFree(ptr));
  }
}

EventId CudaRuntimeBackend::record_event(StreamId stream) { return record_counted(events_, *this, stream); }
bool CudaRuntimeBackend::query_event(EventId event) { return query_counted(events_, *this, event); }
void CudaRuntimeBackend::synchronize_event(EventId event) { events_.synchronize(event); }
bool CudaRuntimeBackend::stream_wait_event(StreamId stream, EventId event) { return events_.stream_wait(stream, event); }
void CudaRuntimeBackend::destroy_event(EventId event) noexcept { events_.give_back(event); }

}  // namespace cachealloc
