// runtime_backend.h: backend `cuda_runtime`: cudaMalloc/cudaFree and pooled events on one device.
//
// Note [Out of memory from cudaMalloc]
// cudaErrorMemoryAllocation is not sticky, but it stays the thread's "last error" until read.
// do_reserve() reads it (cudaGetLastError) and returns nullptr, so the front end's retry chain
// runs and a later, unrelated cudaGetLastError() (PyTorch calls one after every kernel launch)
// does not report a stale out-of-memory. Every other failure throws DeviceError naming the
// error, the call and the source line.
#pragma once

#include <cachealloc/backend.h>
#include <cachealloc/cuda/event_pool.h>
#include <cachealloc/cuda/event_thread.h>

#include <cstddef>
#include <string_view>

namespace cachealloc {

class CudaRuntimeBackend : public DeviceBackend {
 public:
  /// Initialises the runtime on `device` (primary context). Throws DeviceError when the device
  /// does not exist or the driver is unusable. `events`: who records and watches its events
  /// (event_thread.h).
  explicit CudaRuntimeBackend(int device, EventThread events = EventThread::off);
  ~CudaRuntimeBackend() override;

  [[nodiscard]] std::string_view name() const noexcept override { return "cuda_runtime"; }
  [[nodiscard]] int device() const noexcept override { return device_; }

  /// cudaMemGetInfo's total (read once: it never changes).
  [[nodiscard]] std::size_t total_memory() const override { return total_memory_; }
  /// cudaMemGetInfo's free, read now.
  [[nodiscard]] std::size_t free_memory() const override;

  [[nodiscard]] EventId record_event(StreamId stream) override;
  [[nodiscard]] bool query_event(EventId event) override;
  void synchronize_event(EventId event) override;
  [[nodiscard]] bool stream_wait_event(StreamId stream, EventId event) override;
  void destroy_event(EventId event) noexcept override;

  [[nodiscard]] const CudaEventPool& event_pool() const noexcept { return events_; }
  /// The event pool's record thread, when it has one (event_thread records or poll).
  [[nodiscard]] BackgroundWork background_work() const noexcept override {
    return events_.thread_work();
  }

 protected:
  [[nodiscard]] void* do_reserve(std::size_t bytes) override;
  void do_release(void* ptr, std::size_t bytes) noexcept override;

 private:
  int device_;
  std::size_t total_memory_ = 0;
  CudaEventPool events_;
};

}  // namespace cachealloc
