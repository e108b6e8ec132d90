// recorder.cpp: per-device trace lists for `record:PATH` (see recorder.h).
#include "recorder.h"

#include <chrono>

namespace cachealloc::plugin {

Recorder::Recorder(std::size_t device_count, std::size_t max_entries)
    : device_count_(device_count),
      max_entries_(max_entries),
      devices_(std::make_unique<PerDevice[]>(device_count)) {}

void Recorder::record(trace::Action action, int device, std::uint64_t addr, std::uint64_t size,
                      StreamId stream) noexcept {
  if (device < 0 || static_cast<std::size_t>(device) >= device_count_) {
    return;
  }
  const auto now = std::chrono::system_clock::now().time_since_epoch();
  trace::TraceEvent event;
  event.action = action;
  event.device = device;
  event.addr = addr;
  event.size = size;
  event.stream = stream;
  event.time_us = std::chrono::duration_cast<std::chrono::microseconds>(now).count();
  PerDevice& d = devices_[static_cast<std::size_t>(device)];
  std::lock_guard lock(d.mutex);
  try {
    if (max_entries_ != 0 && d.events.size() >= max_entries_) {
      d.events.pop_front();
      ++d.dropped;
    }
    d.events.push_back(event);
  } catch (...) {  // std::bad_alloc: the trace loses an event, the program goes on
    ++d.dropped;
  }
}

std::vector<trace::TraceEvent> Recorder::events() const {
  std::vector<trace::TraceEvent> out;
  for (std::size_t i = 0; i < device_count_; ++i) {
    std::lock_guard lock(devices_[i].mutex);
    out.insert(out.end(), devices_[i].events.begin(), devices_[i].events.end());
  }
  return out;
}

std::uint64_t Recorder::dropped() const {
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < device_count_; ++i) {
    std::lock_guard lock(devices_[i].mutex);
    total += devices_[i].dropped;
  }
  return total;
}

}  // namespace cachealloc::plugin
