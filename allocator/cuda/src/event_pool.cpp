// event_pool.cpp: reusable cudaEventDisableTiming events (see event_pool.h).
#include <cachealloc/backend.h>
#include <cachealloc/cuda/event_pool.h>
#include <cachealloc/cuda/streams.h>

#include <cachealloc/errors.h>

#include "cuda_check.h"
#include "driver_api.h"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <string_view>
#include <thread>
#include <utility>

namespace cachealloc {

CudaEventPool::CudaEventPool(int device, EventThread mode) noexcept
    : device_(device),
      thread_wanted_(mode != EventThread::off),
      thread_watches_(mode == EventThread::poll) {}

CudaEventPool::~CudaEventPool() {
  thread_.reset();  // records what is queued, then joins: nothing uses the events after this
  if (!slots_.empty()) {
    try {
      CudaDeviceGuard guard(device_);
      for (const auto& slot : slots_) {
        CACHEALLOC_CUDA_WARN(cudaEventDestroy(to_event(slot->event)));
      }
    } catch (const std::exception& e) {
      cuda_detail::warn_exception("cudaEventDestroy: device guard", e);
    }
  }
  if (counters_ != nullptr) {
    try {
      CudaDeviceGuard guard(device_);
      bool outstanding = false;
      for (std::size_t slot = 0; slot < issued_.size(); ++slot) {
        outstanding = outstanding || __atomic_load_n(&counters_[slot], __ATOMIC_ACQUIRE) < issued_[slot];
      }
      if (outstanding) {  // the GPU must not write into freed host memory
        CACHEALLOC_CUDA_WARN(cudaDeviceSynchronize());
      }
      CACHEALLOC_CUDA_WARN(cudaFreeHost(counters_));
    } catch (const std::exception& e) {
      cuda_detail::warn_exception("cudaFreeHost: device guard", e);
    }
  }
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

bool CudaEventPool::init_fences() noexcept {
  // Opt-in (Note [Host fences instead of events]): fewer µs in event calls, but longer steps on
  // three of five workloads in session 44.
  if (const char* v = std::getenv("CACHEALLOC_HOST_FENCES"); v == nullptr || std::string_view(v) != "1") {
    return false;
  }
  try {
    const cuda_detail::DriverApi& api = cuda_detail::driver_api();
    if (api.stream_write_value64 == nullptr) {
      return false;
    }
    CUdevice dev = 0;
    int supported = 0;
    if (api.device_get(&dev, device_) != CUDA_SUCCESS ||
        api.device_get_attribute(&supported, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, dev) !=
            CUDA_SUCCESS ||
        supported == 0) {
      return false;
    }
    CudaDeviceGuard guard(device_);
    void* host = nullptr;
    if (cudaHostAlloc(&host, kFenceSlots * sizeof(std::uint64_t), cudaHostAllocMapped | cudaHostAllocPortable) !=
        cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    void* device = nullptr;
    if (cudaHostGetDevicePointer(&device, host, 0) != cudaSuccess) {
      (void)cudaGetLastError();
      CACHEALLOC_CUDA_WARN(cudaFreeHost(host));
      return false;
    }
    std::memset(host, 0, kFenceSlots * sizeof(std::uint64_t));
    fence_streams_.reserve(kFenceSlots);
    issued_.reserve(kFenceSlots);
    counters_ = static_cast<std::uint64_t*>(host);
    counters_device_ = reinterpret_cast<std::uintptr_t>(device);
    return true;
  } catch (...) {  // no driver API, or out of host memory: events then
    return false;
  }
}

std::size_t CudaEventPool::fence_slot(StreamId stream) {
  for (std::size_t slot = 0; slot < fence_streams_.size(); ++slot) {
    if (fence_streams_[slot] == stream) {
      return slot;
    }
  }
  if (fence_streams_.size() == kFenceSlots) {
    return kFenceSlots;
  }
  fence_streams_.push_back(stream);  // capacity reserved in init_fences: cannot throw
  issued_.push_back(0);
  return fence_streams_.size() - 1;
}

bool CudaEventPool::fence_reached(EventId id) const noexcept {
  const std::size_t slot = (id & ~kFenceBit) >> kSlotShift;
  return __atomic_load_n(&counters_[slot], __ATOMIC_ACQUIRE) >= (id & kSequenceMask);
}

void CudaEventPool::wait_fence(EventId id) {
  for (std::uint64_t round = 0;; ++round) {
    if (fence_reached(id)) {
      return;
    }
    if (round < 64) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    if (round % 1024 == 1023) {
      // A device that failed never writes the counter: any runtime call reports the error.
      CudaDeviceGuard guard(device_);
      std::size_t free_bytes = 0;
      std::size_t total_bytes = 0;
      CACHEALLOC_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    }
  }
}

EventId CudaEventPool::record(StreamId stream) {
  if (fences_ == FenceMode::unknown) {
    fences_ = init_fences() ? FenceMode::on : FenceMode::off;
  }
  if (fences_ == FenceMode::on) {
    const std::size_t slot = fence_slot(stream);
    if (slot < kFenceSlots) {
      CudaDeviceGuard guard(device_);  // the legacy default stream (0) is per device
      const cuda_detail::DriverApi& api = cuda_detail::driver_api();
      // The runtime binds its context to a thread lazily, at that thread's first runtime call
      // that needs one; the driver API needs it bound already. PyTorch's autograd threads
      // reached us with none (CUDA_ERROR_INVALID_CONTEXT on the H200): bind it then.
      CUcontext current = nullptr;
      if (api.ctx_get_current(&current) != CUDA_SUCCESS || current == nullptr) {
        CACHEALLOC_CUDA_CHECK(cudaSetDevice(device_));
      }
      const std::uint64_t sequence = issued_[slot] + 1;
      const CUresult status = api.stream_write_value64(
          reinterpret_cast<CUstream>(to_cuda_stream(stream)), counters_device_ + slot * sizeof(std::uint64_t),
          sequence, CU_STREAM_WRITE_VALUE_DEFAULT);
      if (status == CUDA_SUCCESS) {
        issued_[slot] = sequence;
        return kFenceBit | (EventId{slot} << kSlotShift) | sequence;
      }
      if (status != CUDA_ERROR_NOT_SUPPORTED) {
        cuda_detail::throw_driver_error(status, "cuStreamWriteValue64", __FILE__, __LINE__);
      }
      fences_ = FenceMode::off;  // not on this device after all: events from now on
    }
  }
  if (thread_wanted_) {  // Note [Event records on a thread of their own] (record_thread.h)
    RecordThread::Slot& slot = take_slot();
    thread_->submit(slot, stream);
    if (slot.state.load(std::memory_order_acquire) == RecordThread::Slot::kFailed) {
      idle_slots_.push_back(&slot);  // capacity reserved in take_slot(): cannot throw
      check_recorded(slot);
    }
    return kPostedBit | static_cast<EventId>(reinterpret_cast<std::uintptr_t>(&slot));
  }
  return record_event(stream);
}

RecordThread::Slot& CudaEventPool::take_slot() {
  if (!idle_slots_.empty()) {
    RecordThread::Slot* slot = idle_slots_.back();
    idle_slots_.pop_back();
    return *slot;
  }
  if (!thread_) {
    const int device = device_;
    RecordThread::QueryFn query;
    if (thread_watches_) {  // the worker's thread has the device current (backend_thread_init)
      query = [](std::uintptr_t event) -> int {
        const cudaError_t status = cudaEventQuery(to_event(event));
        if (status == cudaSuccess) {
          return 1;
        }
        (void)cudaGetLastError();  // not ready, or a failure the caller sees when it asks itself
        return status == cudaErrorNotReady ? 0 : -1;
      };
    }
    thread_ = std::make_unique<RecordThread>(
        [device](std::uintptr_t event, StreamId stream) -> int {
          CudaDeviceGuard guard(device);  // the legacy default stream (0) is per device
          const cudaError_t status = cudaEventRecord(to_event(event), to_cuda_stream(stream));
          if (status != cudaSuccess) {
            (void)cudaGetLastError();  // reported through the slot, not as this thread's last error
          }
          return static_cast<int>(status);
        },
        cuda_detail::backend_thread_init(device), RecordThread::Timing{}, std::move(query));
  }
  // Grow both lists first, so that give_back() (noexcept) always finds room in idle_slots_.
  if (slots_.size() == slots_.capacity()) {
    slots_.reserve(slots_.empty() ? 16 : 2 * slots_.size());
  }
  idle_slots_.reserve(slots_.capacity());
  auto slot = std::make_unique<RecordThread::Slot>();
  CudaDeviceGuard guard(device_);
  cudaEvent_t ev = nullptr;
  CACHEALLOC_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  slot->event = reinterpret_cast<std::uintptr_t>(ev);
  slots_.push_back(std::move(slot));
  return *slots_.back();
}

cudaEvent_t CudaEventPool::record_posted_now(EventId id) {
  RecordThread::Slot& slot = slot_of(id);
  thread_->record_now(slot);
  check_recorded(slot);
  return to_event(slot.event);
}

void CudaEventPool::check_recorded(const RecordThread::Slot& slot) {
  if (slot.state.load(std::memory_order_acquire) == RecordThread::Slot::kFailed) {
    const auto status = static_cast<cudaError_t>(slot.error);
    throw DeviceError(std::string("cudaEventRecord (on the record thread): ") +
                      (slot.error < 0 ? "failed" : cudaGetErrorName(status)) +
                      (slot.error < 0 ? "" : std::string(" (") + cudaGetErrorString(status) + ")"));
  }
}

EventId CudaEventPool::record_event(StreamId stream) {
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

bool CudaEventPool::stream_wait(StreamId stream, EventId event) {
  if (is_posted(event)) {  // a wait on an event not recorded yet would not wait at all
    const cudaEvent_t recorded = record_posted_now(event);
    CudaDeviceGuard guard(device_);
    CACHEALLOC_CUDA_CHECK(cudaStreamWaitEvent(to_cuda_stream(stream), recorded, 0));
    return true;
  }
  if (is_fence(event)) {
    // A host fence (Note [Host fences instead of events]): the stream waits on the device until
    // the fence's counter reached its sequence. The write was enqueued on its stream before this
    // wait, so they cannot deadlock. The driver API needs the context bound to this thread.
    const cuda_detail::DriverApi& api = cuda_detail::driver_api();
    if (api.stream_wait_value64 == nullptr) {
      return false;
    }
    CudaDeviceGuard guard(device_, /*force=*/true);
    const CUresult status = api.stream_wait_value64(reinterpret_cast<CUstream>(to_cuda_stream(stream)),
                                                    fence_address(event), fence_sequence(event),
                                                    CU_STREAM_WAIT_VALUE_GEQ);
    if (status == CUDA_ERROR_NOT_SUPPORTED) {
      return false;
    }
    if (status != CUDA_SUCCESS) {
      cuda_detail::throw_driver_error(status, "cuStreamWaitValue64", __FILE__, __LINE__);
    }
    return true;
  }
  CudaDeviceGuard guard(device_);
  CACHEALLOC_CUDA_CHECK(cudaStreamWaitEvent(to_cuda_stream(stream), to_event(event), 0));
  return true;
}

bool CudaEventPool::query(EventId event) {
  if (is_fence(event)) {
    return fence_reached(event);
  }
  RecordThread::Slot* posted = nullptr;
  if (is_posted(event)) {
    posted = &slot_of(event);
    const std::uint32_t state = posted->state.load(std::memory_order_acquire);
    if (state != RecordThread::Slot::kRecorded) {
      check_recorded(*posted);
      return false;  // queued, or being recorded: nothing fences the work before the free yet
    }
    switch (posted->completion()) {  // Note [The record thread watches its events]
      case RecordThread::Slot::kDone:
        return true;
      case RecordThread::Slot::kWatched:
        return false;  // not complete at the worker's last look
      case RecordThread::Slot::kUnwatched:
        break;
    }
    event = to_id(to_event(posted->event));
  }
  const cudaError_t status = cudaEventQuery(to_event(event));
  if (status == cudaSuccess) {
    if (posted != nullptr) {
      posted->mark_done();  // later queries need not ask again
    }
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
  if (is_fence(event)) {
    wait_fence(event);
    return;
  }
  if (is_posted(event)) {
    RecordThread::Slot& slot = slot_of(event);
    CACHEALLOC_CUDA_CHECK(cudaEventSynchronize(record_posted_now(event)));
    slot.mark_done();  // a later query must say so without waiting for the worker's next look
    return;
  }
  CACHEALLOC_CUDA_CHECK(cudaEventSynchronize(to_event(event)));
}

void CudaEventPool::give_back(EventId event) noexcept {
  if (event == 0 || is_fence(event)) {
    return;
  }
  if (is_posted(event)) {
    RecordThread::Slot& slot = slot_of(event);
    RecordThread::abandon(slot);
    idle_slots_.push_back(&slot);  // capacity reserved in take_slot()
    return;
  }
  // idle_ has capacity for every event ever created (reserved in record()).
  idle_.push_back(to_event(event));
}

EventId record_counted(CudaEventPool& pool, DeviceBackend& backend, StreamId stream) {
  const detail::TimedCall timed(backend, backend.mutable_counters().event_ns);
  ++backend.mutable_counters().events_recorded;
  return pool.record(stream);
}

bool query_counted(CudaEventPool& pool, DeviceBackend& backend, EventId event) {
  const detail::TimedCall timed(backend, backend.mutable_counters().event_ns);
  ++backend.mutable_counters().event_queries;
  return pool.query(event);
}

}  // namespace cachealloc
