// history.cpp: the adapter's allocation history (history.h).
#include "history.h"

#include <algorithm>
#include <chrono>
#include <utility>

namespace cachealloc::torch_adapter {
namespace {

cca::TraceEntry::Action to_action(AllocatorEvent event) noexcept {
  switch (event) {
    case AllocatorEvent::alloc: return cca::TraceEntry::ALLOC;
    case AllocatorEvent::free_requested: return cca::TraceEntry::FREE_REQUESTED;
    case AllocatorEvent::free_completed: return cca::TraceEntry::FREE_COMPLETED;
    case AllocatorEvent::oom: return cca::TraceEntry::OOM;
  }
  return cca::TraceEntry::SNAPSHOT;
}

constexpr std::size_t kActionCount = static_cast<std::size_t>(cca::TraceEntry::OOM) + 1;

}  // namespace

History::History() : skipped_(kActionCount, false) {}

void History::configure(bool enabled, cca::CreateContextFn context_recorder, std::size_t max_entries,
                        cca::RecordContext when, bool clear, const std::vector<std::string>& skip_actions) {
  std::vector<bool> skipped(kActionCount, false);
  for (const std::string& name : skip_actions) {
    skipped[static_cast<std::size_t>(c10::CachingDeviceAllocator::parseTraceEntryAction(name))] = true;
  }
  std::lock_guard lock(mutex_);
  context_recorder_ = enabled ? context_recorder : nullptr;
  when_ = enabled ? when : cca::RecordContext::NEVER;
  max_entries_ = max_entries;
  skipped_ = std::move(skipped);
  for (auto& entries : per_device_) {
    if (clear) {
      entries.clear();
    }
    while (max_entries_ != 0 && entries.size() > max_entries_) {
      entries.pop_front();
    }
  }
  enabled_.store(enabled, std::memory_order_release);
}

void History::attach_tracker(cca::AllocatorTraceTracker tracker) {
  std::lock_guard lock(mutex_);
  trackers_.push_back(std::move(tracker));
  has_trackers_.store(true, std::memory_order_release);
}

std::shared_ptr<c10::GatheredContext> History::gather(bool free) const {
  if (!enabled()) {
    return nullptr;
  }
  cca::CreateContextFn fn = nullptr;
  {
    std::lock_guard lock(mutex_);
    const bool wanted = free ? when_ == cca::RecordContext::ALL
                             : (when_ == cca::RecordContext::ALLOC || when_ == cca::RecordContext::ALL);
    fn = wanted ? context_recorder_ : nullptr;
  }
  return fn != nullptr ? fn() : nullptr;
}

void History::record(int device, AllocatorEvent event, std::uintptr_t addr, std::size_t size, StreamId stream,
                     c10::MempoolId_t pool, const std::shared_ptr<c10::GatheredContext>& context) noexcept {
  if (!enabled() && !has_trackers_.load(std::memory_order_acquire)) {
    return;
  }
  try {
    const auto now_us = std::chrono::duration_cast<std::chrono::microseconds>(
                            std::chrono::system_clock::now().time_since_epoch())
                            .count();
    cca::TraceEntry entry(to_action(event), static_cast<c10::DeviceIndex>(device), addr, size,
                          reinterpret_cast<void*>(static_cast<std::uintptr_t>(stream)), pool, 0, context);
    entry.time_.t_ = static_cast<time_t>(now_us);  // what PyTorch's snapshot code reads
    std::lock_guard lock(mutex_);
    for (const auto& tracker : trackers_) {
      tracker(entry);
    }
    if (!enabled() || skipped_[static_cast<std::size_t>(entry.action_)] || device < 0) {
      return;
    }
    if (static_cast<std::size_t>(device) >= per_device_.size()) {
      per_device_.resize(static_cast<std::size_t>(device) + 1);
    }
    auto& entries = per_device_[static_cast<std::size_t>(device)];
    if (max_entries_ != 0 && entries.size() >= max_entries_) {
      entries.pop_front();
    }
    entries.push_back(std::move(entry));
  } catch (...) {  // NOLINT(bugprone-empty-catch): out of host memory or a failing tracker: the entry is lost
  }
}

std::vector<std::vector<cca::TraceEntry>> History::traces(std::size_t device_count) const {
  std::lock_guard lock(mutex_);
  std::vector<std::vector<cca::TraceEntry>> out;
  out.reserve(std::max(device_count, per_device_.size()));
  for (const auto& entries : per_device_) {
    out.emplace_back(entries.begin(), entries.end());
  }
  out.resize(std::max(device_count, per_device_.size()));
  return out;
}

}  // namespace cachealloc::torch_adapter
