// event_pool.cpp: reusable cudaEventDisableTiming events (see event_pool.h).
#include <cachealloc/cuda/event_pool.h>
#include <cachealloc/cuda/streams.h>

#include "cuda_check.h"

#include <exception>

namespace cachealloc {

CudaEventPool::~CudaEventPool() {
  if (all_.empty()) {
    return;
  }
  try {
    CudaDeviceGuard guard(device_);
    for (cudaEvent_t ev : all_) {
      CACHEALLOC_CUDA_WARN(cudaEventDestroy(ev));
    }
  } catch (const std::exception& e) {  // the runtime is gone (process exit): nothing to free
    cuda_detail::warn_exception("cudaEventDestroy: device guard", e);
  }
}

EventId CudaEventPool::record(StreamId stream) {
  // The legacy default stream (0) is per device: record under the pool's device.
  CudaDeviceGuard guard(device_);
  cudaEvent_t ev = nullptr;
  if (idle_.empty()) {
    // Grow both lists before the create, so that nothing after it can throw, and so that
    // give_back() (noexcept) always finds room in idle_.
    if (all_.size() == all_.capacity()) {
      all_.reserve(all_.empty() ? 16 : 2 * all_.size());
    }
    idle_.reserve(all_.capacity());
    CACHEALLOC_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    all_.push_back(ev);
  } else {
    ev = idle_.back();
    idle_.pop_back();
  }
  const cudaError_t status = cudaEventRecord(ev, to_cuda_stream(stream));
  if (status != cudaSuccess) {
    idle_.push_back(ev);  // capacity reserved above: cannot throw
    CACHEALLOC_CUDA_CHECK(status);
  }
  return to_id(ev);
}

bool CudaEventPool::query(EventId event) {
  const cudaError_t status = cudaEventQuery(to_event(event));
  if (status == cudaSuccess) {
    return true;
  }
  if (status == cudaErrorNotReady) {
    (void)cudaGetLastError();  // cudaErrorNotReady is reported as the last error too
    return false;
  }
  CACHEALLOC_CUDA_CHECK(status);
  return false;
}

void CudaEventPool::synchronize(EventId event) {
  CACHEALLOC_CUDA_CHECK(cudaEventSynchronize(to_event(event)));
}

void CudaEventPool::give_back(EventId event) noexcept {
  if (event == 0) {
    return;
  }
  // idle_ has capacity for every event ever created (reserved in record()).
  idle_.push_back(to_event(event));
}

}  // namespace cachealloc
