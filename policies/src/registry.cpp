// registry.cpp: the policy table. Adding a policy = one include and one row.
#include <cachealloc/errors.h>
#include <cachealloc/policies/registry.h>
#include <cachealloc/policies/size_class.h>

#include <array>
#include <string>

#ifdef CACHEALLOC_HAS_NATIVE
#include <cachealloc/policies/native.h>
#endif
#ifdef CACHEALLOC_HAS_DEFRAG
#include <cachealloc/policies/defrag.h>
#endif
#ifdef CACHEALLOC_HAS_ASYNC
#include <cachealloc/policies/async.h>
#endif

namespace cachealloc {
namespace {

template <Policy P>
std::unique_ptr<DeviceAllocator> build(std::unique_ptr<DeviceBackend> backend, Config& config) {
  return std::make_unique<CachingAllocator<P>>(std::move(backend), config);
}

struct Row {
  PolicyInfo info;
  std::unique_ptr<DeviceAllocator> (*make)(std::unique_ptr<DeviceBackend>, Config&);
};

const std::vector<Row>& rows() {
  static const std::vector<Row> table = [] {
    std::vector<Row> t;
#ifdef CACHEALLOC_HAS_NATIVE
    t.push_back({{"native", "model of PyTorch 2.11's native caching allocator (the baseline)",
                  BackendNeed::runtime, true, &NativePolicy::config_keys},
                 &build<NativePolicy>});
#endif
    t.push_back({{"size_class", "size classes for small blocks, best-fit with splitting for large",
                  BackendNeed::runtime, false, &SizeClassPolicy::config_keys},
                 &build<SizeClassPolicy>});
#ifdef CACHEALLOC_HAS_DEFRAG
    t.push_back({{"defrag", "defragmenting best-fit on CUDA virtual memory",
                  BackendNeed::virtual_memory, false, &DefragPolicy::config_keys},
                 &build<DefragPolicy>});
#endif
#ifdef CACHEALLOC_HAS_ASYNC
    t.push_back({{"async", "per-stream front cache over a cudaMallocAsync pool (stream-ordered)",
                  BackendNeed::stream_ordered, false, &AsyncPolicy::config_keys},
                 &build<AsyncPolicy>});
#endif
    return t;
  }();
  return table;
}

std::vector<PolicyInfo> infos() {
  std::vector<PolicyInfo> out;
  for (const Row& r : rows()) {
    out.push_back(r.info);
  }
  return out;
}

}  // namespace

std::string_view backend_kind(BackendNeed need) noexcept {
  switch (need) {
    case BackendNeed::runtime: return "runtime";
    case BackendNeed::virtual_memory: return "virtual_memory";
    case BackendNeed::stream_ordered: return "stream_ordered";
  }
  return "runtime";
}

std::span<const PolicyInfo> registered_policies() {
  static const std::vector<PolicyInfo> all = infos();
  return all;
}

const PolicyInfo* find_policy(std::string_view name) {
  for (const PolicyInfo& p : registered_policies()) {
    if (p.name == name) {
      return &p;
    }
  }
  return nullptr;
}

std::vector<std::string_view> front_end_config_keys() {
  return {"policy",      "record",    "record_max_entries", "log_level",
          "timing",      "full",      "event_poll_interval", "step_memo",
          "wait_parked_to_grow", "share_events", "reuse_parked",
          "reuse_parked_waits", "defer_frees"};
}

std::unique_ptr<DeviceAllocator> make_allocator(std::string_view policy,
                                                std::unique_ptr<DeviceBackend> backend,
                                                Config& config) {
  for (const Row& r : rows()) {
    if (r.info.name == policy) {
      return r.make(std::move(backend), config);
    }
  }
  std::string valid;
  for (const PolicyInfo& p : registered_policies()) {
    valid += valid.empty() ? "" : ", ";
    valid += p.name;
  }
  throw ConfigError("CACHEALLOC_CONF: unknown policy '" + std::string(policy) +
                    "'; registered policies: " + valid);
}

}  // namespace cachealloc
