// recorder.h: the trace the plugin records when CACHEALLOC_CONF has `record:PATH`.
//
// One list of trace::TraceEvent per device (alloc, free_requested, free_completed, oom from the
// front end's observer; segment_alloc/segment_free/segment_map/segment_unmap from
// RecordingBackend), each behind its own mutex. Events arrive while the device's allocator
// mutex is held, so within a device they are in the allocator's own order. With
// `record_max_entries:N` only the newest N events per device are kept (like PyTorch's
// alloc_trace_max_entries); the count of dropped ones is kept too.
#pragma once

#include <cachealloc/trace/snapshot.h>
#include <cachealloc/types.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <vector>

namespace cachealloc::plugin {

class Recorder {
 public:
  /// `max_entries` == 0: keep everything.
  Recorder(std::size_t device_count, std::size_t max_entries);

  /// Appends one event, stamped with the wall-clock time in microseconds (PyTorch's time_us).
  /// Never throws: an event that cannot be stored is counted as dropped.
  void record(trace::Action action, int device, std::uint64_t addr, std::uint64_t size,
              StreamId stream) noexcept;

  /// A copy of every device's events, device 0 first.
  [[nodiscard]] std::vector<trace::TraceEvent> events() const;
  /// Events not kept (record_max_entries reached, or out of host memory).
  [[nodiscard]] std::uint64_t dropped() const;
  [[nodiscard]] std::size_t device_count() const noexcept { return device_count_; }

 private:
  struct PerDevice {
    mutable std::mutex mutex;
    std::deque<trace::TraceEvent> events;
    std::uint64_t dropped = 0;
  };

  std::size_t device_count_;
  std::size_t max_entries_;
  std::unique_ptr<PerDevice[]> devices_;
};

}  // namespace cachealloc::plugin
