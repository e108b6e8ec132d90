// allocator.cpp: the front end's messages and the shared helpers behind allocator.h / stats.h.
#include <cachealloc/allocator.h>
#include <cachealloc/stats.h>

#include <cstdio>
#include <string>

namespace cachealloc {

std::string format_bytes(std::uint64_t bytes) {
  char buf[64];
  const double b = static_cast<double>(bytes);
  if (bytes >= kGiB) {
    std::snprintf(buf, sizeof buf, "%.2f GiB", b / static_cast<double>(kGiB));
  } else if (bytes >= kMiB) {
    std::snprintf(buf, sizeof buf, "%.2f MiB", b / static_cast<double>(kMiB));
  } else if (bytes >= kKiB) {
    std::snprintf(buf, sizeof buf, "%.2f KiB", b / static_cast<double>(kKiB));
  } else {
    std::snprintf(buf, sizeof buf, "%llu bytes", static_cast<unsigned long long>(bytes));
  }
  return buf;
}

std::string out_of_memory_message(int device, std::string_view policy, std::size_t requested,
                                  const DeviceBackend& backend, const Stats& stats,
                                  std::string_view hint) {
  const auto allocated = static_cast<std::uint64_t>(stats.allocated_bytes.current);
  const auto reserved = static_cast<std::uint64_t>(stats.reserved_bytes.current);
  const std::uint64_t unused = reserved > allocated ? reserved - allocated : 0;
  std::string msg = "cachealloc (policy " + std::string(policy) + "): CUDA out of memory. Tried to allocate " +
                    format_bytes(requested) + " (" + std::to_string(requested) + " bytes) on device " +
                    std::to_string(device) + ". Device " + std::to_string(device) + " has a total capacity of " +
                    format_bytes(backend.total_memory()) + " of which " + format_bytes(backend.free_memory()) +
                    " is free.";
  if (backend.limit() != DeviceBackend::kNoLimit) {
    msg += " The allowed memory (set_memory_fraction) is " + format_bytes(backend.limit()) + ".";
  }
  msg += " Of the memory reserved by cachealloc, " + format_bytes(allocated) + " is allocated and " +
         format_bytes(unused) + " is reserved but unallocated.";
  if (!hint.empty()) {
    msg += " ";
    msg += hint;
  } else if (unused > requested / 4 && unused > 64 * kMiB) {
    msg += " Much memory is reserved but unallocated: CACHEALLOC_CONF=policy:defrag avoids this "
           "fragmentation.";
  }
  return msg;
}

std::string unknown_pointer_text(const void* ptr, std::string_view what, int device,
                                 std::string_view policy) {
  char addr[32];
  std::snprintf(addr, sizeof addr, "%p", ptr);
  return "cachealloc (policy " + std::string(policy) + ", device " + std::to_string(device) + "): " +
         std::string(what) + " of pointer " + addr +
         ", which is not a live allocation of this allocator: it was already freed (double free), "
         "belongs to another device, or was never allocated by cachealloc. Nothing was changed.";
}

std::map<std::string, std::int64_t> Stats::to_map() const {
  std::map<std::string, std::int64_t> m;
  auto put = [&](const std::string& name, const Stat& s) {
    // PyTorch reports the "all" pool and, for the small/large split, the same figures here.
    m[name + ".all.current"] = s.current;
    m[name + ".all.peak"] = s.peak;
    m[name + ".all.allocated"] = s.allocated;
    m[name + ".all.freed"] = s.freed;
  };
  put("allocated_bytes", allocated_bytes);
  put("requested_bytes", requested_bytes);
  put("active_bytes", active_bytes);
  put("reserved_bytes", reserved_bytes);
  put("allocation", allocation);
  put("active", active);
  put("inactive_split_bytes", Stat{});
  m["num_alloc_retries"] = static_cast<std::int64_t>(num_alloc_retries);
  m["num_ooms"] = static_cast<std::int64_t>(num_ooms);
  m["num_device_alloc"] = static_cast<std::int64_t>(num_device_alloc);
  m["num_device_free"] = static_cast<std::int64_t>(num_device_free);
  m["num_sync_all_streams"] = static_cast<std::int64_t>(num_sync_all_streams);
  m["num_event_records"] = static_cast<std::int64_t>(num_event_records);
  m["num_event_queries"] = static_cast<std::int64_t>(num_event_queries);
  m["event_ns"] = static_cast<std::int64_t>(event_ns);
  m["reserve_ns"] = static_cast<std::int64_t>(reserve_ns);
  m["release_ns"] = static_cast<std::int64_t>(release_ns);
  m["create_ns"] = static_cast<std::int64_t>(create_ns);
  m["release_physical_ns"] = static_cast<std::int64_t>(release_physical_ns);
  m["map_ns"] = static_cast<std::int64_t>(map_ns);
  m["unmap_ns"] = static_cast<std::int64_t>(unmap_ns);
  m["background_unmaps"] = static_cast<std::int64_t>(background_unmaps);
  m["background_unmap_ns"] = static_cast<std::int64_t>(background_unmap_ns);
  m["background_unmap_wait_ns"] = static_cast<std::int64_t>(background_unmap_wait_ns);
  m["background_event_records"] = static_cast<std::int64_t>(background_event_records);
  m["background_event_ns"] = static_cast<std::int64_t>(background_event_ns);
  m["background_event_queries"] = static_cast<std::int64_t>(background_event_queries);
  m["background_event_query_ns"] = static_cast<std::int64_t>(background_event_query_ns);
  m["num_maps"] = static_cast<std::int64_t>(num_maps);
  m["num_unmaps"] = static_cast<std::int64_t>(num_unmaps);
  m["bytes_mapped"] = static_cast<std::int64_t>(bytes_mapped);
  m["bytes_unmapped"] = static_cast<std::int64_t>(bytes_unmapped);
  m["usage_errors"] = static_cast<std::int64_t>(usage_errors);
  m["parked_waits"] = static_cast<std::int64_t>(parked_waits);
  m["parked_wait_ns"] = static_cast<std::int64_t>(parked_wait_ns);
  m["parked_reuses"] = static_cast<std::int64_t>(parked_reuses);
  m["parked_reuse_bytes"] = static_cast<std::int64_t>(parked_reuse_bytes);
  m["parked_reuse_waits"] = static_cast<std::int64_t>(parked_reuse_waits);
  m["alloc_calls"] = static_cast<std::int64_t>(alloc_calls);
  m["free_calls"] = static_cast<std::int64_t>(free_calls);
  m["allocator_ns"] = static_cast<std::int64_t>(alloc_ns + free_ns);
  if (pool) {
    m["pool.reserved_mem_current"] = static_cast<std::int64_t>(pool->reserved_mem_current);
    m["pool.reserved_mem_high"] = static_cast<std::int64_t>(pool->reserved_mem_high);
    m["pool.used_mem_current"] = static_cast<std::int64_t>(pool->used_mem_current);
    m["pool.used_mem_high"] = static_cast<std::int64_t>(pool->used_mem_high);
    m["pool.front_cache_bytes"] = static_cast<std::int64_t>(pool->front_cache_bytes);
    m["pool.calls"] = static_cast<std::int64_t>(pool->pool_calls);
    m["pool.ns"] = static_cast<std::int64_t>(pool->pool_ns);
  }
  for (const auto& [key, value] : policy_counters) {
    m[key] = value;
  }
  return m;
}

}  // namespace cachealloc
