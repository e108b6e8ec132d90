// support.h: helpers shared by the CPU tests (policy lists, sim allocators, a shadow model).
#pragma once

#include <cachealloc/allocator.h>
#include <cachealloc/policies/registry.h>
#include <cachealloc/sim_backend.h>

#include <catch2/catch.hpp>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace cachealloc::test {

inline std::vector<std::string> policy_names() {
  std::vector<std::string> names;
  for (const PolicyInfo& p : registered_policies()) {
    if (p.backend != BackendNeed::stream_ordered || true) {
      names.emplace_back(p.name);
    }
  }
  return names;
}

/// A counter of Stats::policy_counters by name ("defrag.pages_moved", "memo.served", ...), -1
/// when the allocator does not report it.
inline std::int64_t policy_counter(const Stats& s, const std::string& name) {
  for (const auto& [k, v] : s.policy_counters) {
    if (k == name) {
      return v;
    }
  }
  return -1;
}

/// Every figure of two Stat agrees: current, peak and the cumulative increases and decreases.
inline void check_same_stat(const char* what, const Stat& a, const Stat& b) {
  INFO(what);
  CHECK(a.current == b.current);
  CHECK(a.peak == b.peak);
  CHECK(a.allocated == b.allocated);
  CHECK(a.freed == b.freed);
}

/// Every Stat of two Stats and their call counts agree (what two allocators that saw the same
/// calls, or one allocator before and after a rejected call, must show).
inline void check_same_stats(const Stats& a, const Stats& b) {
  check_same_stat("allocated_bytes", a.allocated_bytes, b.allocated_bytes);
  check_same_stat("requested_bytes", a.requested_bytes, b.requested_bytes);
  check_same_stat("active_bytes", a.active_bytes, b.active_bytes);
  check_same_stat("reserved_bytes", a.reserved_bytes, b.reserved_bytes);
  check_same_stat("allocation", a.allocation, b.allocation);
  check_same_stat("active", a.active, b.active);
  CHECK(a.alloc_calls == b.alloc_calls);
  CHECK(a.free_calls == b.free_calls);
}

struct SimAllocator {
  SimBackend* sim = nullptr;  // owned by the allocator
  std::unique_ptr<DeviceAllocator> allocator;
};

inline SimAllocator make_sim_allocator(const std::string& policy, SimOptions options = {},
                                       const std::string& conf = "") {
  auto backend = std::make_unique<SimBackend>(options);
  SimBackend* raw = backend.get();
  Config config = Config::parse(conf);
  auto allocator = make_allocator(policy, std::move(backend), config);
  return {raw, std::move(allocator)};
}

/// Checks that live blocks never overlap (a shadow interval map kept by the test).
class OverlapTracker {
 public:
  /// Returns false when [ptr, ptr+size) overlaps a live block.
  bool add(void* ptr, std::size_t size) {
    const auto a = reinterpret_cast<std::uintptr_t>(ptr);
    auto next = live_.lower_bound(a);
    if (next != live_.end() && next->first < a + size) {
      return false;
    }
    if (next != live_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second > a) {
        return false;
      }
    }
    live_.emplace(a, size);
    return true;
  }
  void remove(void* ptr) { live_.erase(reinterpret_cast<std::uintptr_t>(ptr)); }
  [[nodiscard]] std::size_t size() const { return live_.size(); }

 private:
  std::map<std::uintptr_t, std::size_t> live_;
};

}  // namespace cachealloc::test
