// async_backend.cpp: backend `cuda_async`, a private cudaMemPool_t (see async_backend.h).
#include <cachealloc/cuda/async_backend.h>
#include <cachealloc/cuda/streams.h>
#include <cachealloc/errors.h>

#include "cuda_check.h"
#include "driver_api.h"

#include <string>

namespace cachealloc {

CudaAsyncOptions CudaAsyncOptions::from_config(Config& config) {
  CudaAsyncOptions o;
  if (auto v = config.take_bytes("async_release_threshold")) {
    o.release_threshold = *v;
  }
  if (auto v = config.take_bool("async_reuse_follow_event_dependencies")) {
    o.reuse_follow_event_dependencies = *v;
  }
  if (auto v = config.take_bool("async_reuse_allow_opportunistic")) {
    o.reuse_allow_opportunistic = *v;
  }
  if (auto v = config.take_bool("async_reuse_allow_internal_dependencies")) {
    o.reuse_allow_internal_dependencies = *v;
  }
  o.event_thread = take_event_thread(config, o.event_thread);
  return o;
}

std::vector<std::string_view> CudaAsyncBackend::config_keys() {
  return {"async_release_threshold", "async_reuse_follow_event_dependencies",
          "async_reuse_allow_opportunistic", "async_reuse_allow_internal_dependencies", "event_thread"};
}

CudaAsyncBackend::CudaAsyncBackend(int device, CudaAsyncOptions options)
    : device_(device), options_(options), events_(device, options.event_thread) {
  cuda_detail::initialise_device(device);
  total_memory_ = cuda_detail::memory_info(device).total_bytes;
  CudaDeviceGuard guard(device);
  int supported = 0;
  CACHEALLOC_CUDA_CHECK(cudaDeviceGetAttribute(&supported, cudaDevAttrMemoryPoolsSupported, device));
  if (supported == 0) {
    throw DeviceError("CUDA device " + std::to_string(device) +
                      " does not support memory pools (cudaMallocAsync); the stream-ordered "
                      "policy needs CUDA >= 11.2 on a device and driver that support them");
  }
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;
  props.handleTypes = cudaMemHandleTypeNone;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = device;
  CACHEALLOC_CUDA_CHECK(cudaMemPoolCreate(&pool_, &props));
  try {
    std::uint64_t threshold = options_.release_threshold;
    CACHEALLOC_CUDA_CHECK(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &threshold));
    int follow = options_.reuse_follow_event_dependencies ? 1 : 0;
    int opportunistic = options_.reuse_allow_opportunistic ? 1 : 0;
    int internal = options_.reuse_allow_internal_dependencies ? 1 : 0;
    CACHEALLOC_CUDA_CHECK(
        cudaMemPoolSetAttribute(pool_, cudaMemPoolReuseFollowEventDependencies, &follow));
    CACHEALLOC_CUDA_CHECK(
        cudaMemPoolSetAttribute(pool_, cudaMemPoolReuseAllowOpportunistic, &opportunistic));
    CACHEALLOC_CUDA_CHECK(
        cudaMemPoolSetAttribute(pool_, cudaMemPoolReuseAllowInternalDependencies, &internal));
  } catch (...) {
    CACHEALLOC_CUDA_WARN(cudaMemPoolDestroy(pool_));
    throw;
  }
}

CudaAsyncBackend::~CudaAsyncBackend() {
  // Allocations still live keep the pool's memory until they are freed (cudaMemPoolDestroy
  // returns at once and the driver releases the rest later), so this is safe at any time.
  try {
    CudaDeviceGuard guard(device_);
    CACHEALLOC_CUDA_WARN(cudaMemPoolDestroy(pool_));
  } catch (const Error& e) {
    cuda_detail::warn_exception("cudaMemPoolDestroy", e);
  }
}

std::size_t CudaAsyncBackend::free_memory() const { return cuda_detail::memory_info(device_).free_bytes; }

void* CudaAsyncBackend::allocate_async(std::size_t bytes, StreamId stream) {
  if (limit() != kNoLimit) {
    // The pool's used bytes include reserve() allocations, so this is the whole footprint.
    const std::uint64_t used = used_current();
    if (used > limit() || bytes > limit() - used) {
      ++mutable_counters().failed_reserves;
      return nullptr;
    }
  }
  CudaDeviceGuard guard(device_);
  void* ptr = nullptr;
  const cudaError_t status = cudaMallocFromPoolAsync(&ptr, bytes, pool_, to_cuda_stream(stream));
  if (status == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();  // Note [Out of memory from cudaMalloc] in runtime_backend.h
    ++mutable_counters().failed_reserves;
    return nullptr;
  }
  CACHEALLOC_CUDA_CHECK(status);
  ++async_allocations_;
  return ptr;
}

void CudaAsyncBackend::free_async(void* ptr, StreamId stream) noexcept {
  if (ptr == nullptr) {
    return;
  }
  try {
    CudaDeviceGuard guard(device_);
    const cudaError_t status = cudaFreeAsync(ptr, to_cuda_stream(stream));
    if (status == cudaSuccess) {
      ++async_frees_;
    } else {
      cuda_detail::warn_cuda_error(status, "cudaFreeAsync(ptr, stream)", __FILE__, __LINE__);
    }
  } catch (const Error& e) {
    cuda_detail::warn_exception("cudaFreeAsync: device guard", e);
  }
}

void CudaAsyncBackend::make_stream_wait(StreamId waiter, EventId event) {
  // An event, or a host fence (Note [Host fences instead of events]) waited for on its counter;
  // the pool does not see a fence's dependency (cudaMemPoolReuseFollowEventDependencies follows
  // events only).
  if (!events_.stream_wait(waiter, event)) {
    throw DeviceError(
        "make_stream_wait on a host fence needs cuStreamWaitValue64, which this driver lacks or does not "
        "support on this device; unset CACHEALLOC_HOST_FENCES to use events");
  }
}

void CudaAsyncBackend::wait_for_frees(StreamId stream) {
  // A real event, not a host fence: cudaMemPoolTrimTo releases only frees the driver saw
  // complete, and a fence reached on the host tells the driver nothing (the GPU suite's
  // empty_cache checks failed with fences here: reserved stayed at 32-368 MiB).
  const EventId event = events_.record_event(stream);
  try {
    events_.synchronize(event);
  } catch (...) {
    events_.give_back(event);
    throw;
  }
  events_.give_back(event);
}

void CudaAsyncBackend::trim_to(std::size_t keep_bytes) {
  CudaDeviceGuard guard(device_);
  CACHEALLOC_CUDA_CHECK(cudaMemPoolTrimTo(pool_, keep_bytes));
}

std::uint64_t CudaAsyncBackend::attribute(cudaMemPoolAttr attr) const {
  std::uint64_t value = 0;
  CACHEALLOC_CUDA_CHECK(cudaMemPoolGetAttribute(pool_, attr, &value));
  return value;
}

std::size_t CudaAsyncBackend::reserved_current() const { return attribute(cudaMemPoolAttrReservedMemCurrent); }
std::size_t CudaAsyncBackend::reserved_high() const { return attribute(cudaMemPoolAttrReservedMemHigh); }
std::size_t CudaAsyncBackend::used_current() const { return attribute(cudaMemPoolAttrUsedMemCurrent); }
std::size_t CudaAsyncBackend::used_high() const { return attribute(cudaMemPoolAttrUsedMemHigh); }

StreamOrderedOptions CudaAsyncBackend::pool_options() const {
  return {options_.release_threshold, options_.reuse_follow_event_dependencies,
          options_.reuse_allow_opportunistic, options_.reuse_allow_internal_dependencies};
}

void CudaAsyncBackend::set_pool_options(const StreamOrderedOptions& options) {
  CudaDeviceGuard guard(device_);
  std::uint64_t threshold = options.release_threshold;
  int follow = options.reuse_follow_event_dependencies ? 1 : 0;
  int opportunistic = options.reuse_allow_opportunistic ? 1 : 0;
  int internal = options.reuse_allow_internal_dependencies ? 1 : 0;
  CACHEALLOC_CUDA_CHECK(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &threshold));
  CACHEALLOC_CUDA_CHECK(cudaMemPoolSetAttribute(pool_, cudaMemPoolReuseFollowEventDependencies, &follow));
  CACHEALLOC_CUDA_CHECK(cudaMemPoolSetAttribute(pool_, cudaMemPoolReuseAllowOpportunistic, &opportunistic));
  CACHEALLOC_CUDA_CHECK(
      cudaMemPoolSetAttribute(pool_, cudaMemPoolReuseAllowInternalDependencies, &internal));
  options_.release_threshold = options.release_threshold;
  options_.reuse_follow_event_dependencies = options.reuse_follow_event_dependencies;
  options_.reuse_allow_opportunistic = options.reuse_allow_opportunistic;
  options_.reuse_allow_internal_dependencies = options.reuse_allow_internal_dependencies;
}

void CudaAsyncBackend::reset_high_watermarks() {
  std::uint64_t zero = 0;  // the only value these attributes accept: resets to the current value
  CACHEALLOC_CUDA_CHECK(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReservedMemHigh, &zero));
  CACHEALLOC_CUDA_CHECK(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrUsedMemHigh, &zero));
}

// reserve()/release() have no stream: allocate on the legacy default stream and wait for it, so
// the memory is usable on any stream at once; release waits for the whole device first, as
// cudaFree would, then frees in stream order on the (now idle) legacy stream.
void* CudaAsyncBackend::do_reserve(std::size_t bytes) {
  CudaDeviceGuard guard(device_);
  void* ptr = nullptr;
  const cudaError_t status = cudaMallocFromPoolAsync(&ptr, bytes, pool_, cudaStreamLegacy);
  if (status == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    return nullptr;
  }
  CACHEALLOC_CUDA_CHECK(status);
  try {
    CACHEALLOC_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
  } catch (...) {
    CACHEALLOC_CUDA_WARN(cudaFreeAsync(ptr, cudaStreamLegacy));
    throw;
  }
  return ptr;
}

void CudaAsyncBackend::do_release(void* ptr, std::size_t /*bytes*/) noexcept {
  try {
    CudaDeviceGuard guard(device_);
    CACHEALLOC_CUDA_WARN(cudaDeviceSynchronize());
    CACHEALLOC_CUDA_WARN(cudaFreeAsync(ptr, cudaStreamLegacy));
    CACHEALLOC_CUDA_WARN(cudaStreamSynchronize(cudaStreamLegacy));
  } catch (const Error& e) {
    cuda_detail::warn_exception("cudaFreeAsync: device guard", e);
  }
}

EventId CudaAsyncBackend::record_event(StreamId stream) { return record_counted(events_, *this, stream); }
bool CudaAsyncBackend::query_event(EventId event) { return query_counted(events_, *this, event); }
void CudaAsyncBackend::synchronize_event(EventId event) { events_.synchronize(event); }
bool CudaAsyncBackend::stream_wait_event(StreamId stream, EventId event) { return events_.stream_wait(stream, event); }
void CudaAsyncBackend::destroy_event(EventId event) noexcept { events_.give_back(event); }

}  // namespace cachealloc
