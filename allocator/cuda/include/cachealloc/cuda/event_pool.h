// event_pool.h: reusable CUDA events for one device, shared by every CUDA backend.
//
// Note [Why a pool of events]
// The front end records an event per other stream on every cross-stream free, and policies
// record one per stream epoch. cudaEventCreate costs a few microseconds and takes a driver
// lock; a recorded-and-completed event can simply be recorded again. So events are created on
// first need (cudaEventDisableTiming: timing events are slower to record), handed out as
// EventId (the cudaEvent_t's address), and returned to an idle list by give_back(); they are
// destroyed only with the pool. The pool never shrinks: its size is the peak number of events
// in flight, typically a few dozen.
#pragma once

#include <cachealloc/types.h>

#include <cstddef>
#include <vector>

#include <cuda_runtime_api.h>

namespace cachealloc {

/// Pool of cudaEventDisableTiming events on one device. Not thread-safe (the backend's caller
/// serialises calls, see backend.h).
class CudaEventPool {
 public:
  explicit CudaEventPool(int device) noexcept : device_(device) {}
  ~CudaEventPool();
  CudaEventPool(const CudaEventPool&) = delete;
  CudaEventPool& operator=(const CudaEventPool&) = delete;

  /// An idle (or new) event recorded on `stream`. Throws DeviceError.
  [[nodiscard]] EventId record(StreamId stream);
  /// True when the work before the event finished (cudaEventQuery). Throws DeviceError.
  [[nodiscard]] bool query(EventId event);
  /// Blocks until the event completed (cudaEventSynchronize). Throws DeviceError.
  void synchronize(EventId event);
  /// Makes the event available again. The event need not have completed: re-recording an
  /// event only changes what later queries see, never work already queued.
  void give_back(EventId event) noexcept;

  /// Events created so far (live in the pool, idle or handed out).
  [[nodiscard]] std::size_t created() const noexcept { return all_.size(); }
  /// Events ready to be handed out without a cudaEventCreate.
  [[nodiscard]] std::size_t idle() const noexcept { return idle_.size(); }

  [[nodiscard]] static cudaEvent_t to_event(EventId id) noexcept {
    return reinterpret_cast<cudaEvent_t>(static_cast<std::uintptr_t>(id));
  }
  [[nodiscard]] static EventId to_id(cudaEvent_t event) noexcept {
    return static_cast<EventId>(reinterpret_cast<std::uintptr_t>(event));
  }

 private:
  int device_;
  std::vector<cudaEvent_t> all_;
  std::vector<cudaEvent_t> idle_;
};

}  // namespace cachealloc
