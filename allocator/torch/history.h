// history.h: torch.cuda.memory._record_memory_history() for the LibTorch adapter.
//
// Keeps c10 TraceEntry records per device (alloc, free_requested, free_completed, oom, from the
// front end's observer), the newest `max_entries` of each, with the Python stack that PyTorch's
// context recorder gathers (on alloc for RecordContext::ALLOC, on free too for ALL), and feeds
// attached AllocatorTraceTrackers. Times are wall-clock microseconds (TraceEntry::time_.t_),
// what PyTorch's snapshot code reads. Segment events are not recorded (memory_viz draws its
// timelines from alloc/free events; the segments come from the allocator's state at snapshot).
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>

#include <cachealloc/allocator.h>
#include <cachealloc/types.h>

#include <atomic>
#include <cstddef>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace cachealloc::torch_adapter {

namespace cca = c10::cuda::CUDACachingAllocator;

class History {
 public:
  History();

  /// CUDAAllocator::recordHistory. Throws c10::Error for an unknown action in `skip_actions`.
  void configure(bool enabled, cca::CreateContextFn context_recorder, std::size_t max_entries,
                 cca::RecordContext when, bool clear, const std::vector<std::string>& skip_actions);
  void attach_tracker(cca::AllocatorTraceTracker tracker);

  [[nodiscard]] bool enabled() const noexcept { return enabled_.load(std::memory_order_acquire); }
  /// The stack to attach to an allocation (alloc) or a free (free = true), or nullptr. Call it
  /// outside the allocator's locks: it may take the GIL.
  [[nodiscard]] std::shared_ptr<c10::GatheredContext> gather(bool free) const;

  /// Records one front-end event (from the allocator observer, under the allocator's lock).
  /// `context` is what gather() returned on this thread for the call in progress.
  void record(int device, AllocatorEvent event, std::uintptr_t addr, std::size_t size, StreamId stream,
              c10::MempoolId_t pool, const std::shared_ptr<c10::GatheredContext>& context) noexcept;

  /// A copy of every device's entries (at least `device_count` lists).
  [[nodiscard]] std::vector<std::vector<cca::TraceEntry>> traces(std::size_t device_count) const;

 private:
  std::atomic<bool> enabled_{false};
  std::atomic<bool> has_trackers_{false};
  mutable std::mutex mutex_;
  cca::CreateContextFn context_recorder_ = nullptr;
  cca::RecordContext when_ = cca::RecordContext::NEVER;
  std::size_t max_entries_ = 0;
  std::vector<bool> skipped_;  // by TraceEntry::Action
  std::vector<std::deque<cca::TraceEntry>> per_device_;
  std::vector<cca::AllocatorTraceTracker> trackers_;
};

}  // namespace cachealloc::torch_adapter
