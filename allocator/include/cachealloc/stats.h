// stats.h: the statistics the front end keeps, named as torch.cuda.memory_stats() names them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace cachealloc {

/// current / peak / cumulative, as one entry of PyTorch's stats ("allocated_bytes.all.*").
struct Stat {
  std::int64_t current = 0;
  std::int64_t peak = 0;
  std::int64_t allocated = 0;  ///< cumulative increases
  std::int64_t freed = 0;      ///< cumulative decreases

  void increase(std::int64_t n) noexcept {
    current += n;
    allocated += n;
    peak = std::max(peak, current);
  }
  void decrease(std::int64_t n) noexcept {
    current -= n;
    freed += n;
  }
  /// Sets current to `value`, counting the difference as an increase or a decrease.
  void set(std::int64_t value) noexcept {
    if (value >= current) {
      increase(value - current);
    } else {
      decrease(current - value);
    }
  }
  void reset_peak() noexcept { peak = current; }
  void reset_accumulated() noexcept { allocated = freed = 0; }
};

struct Stats {
  Stat allocated_bytes;  ///< bytes in blocks handed out (rounded, as the policy set aside)
  Stat requested_bytes;  ///< bytes the callers asked for
  Stat active_bytes;     ///< allocated + freed blocks still waiting for other streams
  Stat reserved_bytes;   ///< device memory held by the policy
  Stat allocation;       ///< number of live allocations
  Stat active;           ///< number of live + pending blocks

  std::uint64_t num_alloc_retries = 0;  ///< allocations that needed the retry chain
  std::uint64_t num_ooms = 0;           ///< allocations that failed with OutOfMemory
  std::uint64_t num_device_alloc = 0;   ///< device reservations (cudaMalloc / cuMemCreate)
  std::uint64_t num_device_free = 0;    ///< device releases (cudaFree / cuMemRelease)
  std::uint64_t num_maps = 0;           ///< cuMemMap calls
  std::uint64_t num_unmaps = 0;         ///< cuMemUnmap calls
  std::uint64_t bytes_mapped = 0;       ///< bytes mapped, cumulative
  std::uint64_t bytes_unmapped = 0;     ///< bytes unmapped, cumulative
  std::uint64_t num_sync_all_streams = 0;  ///< event waits forced by the retry chain / empty_cache
  std::uint64_t num_event_records = 0;  ///< events recorded (cross-stream frees, policy epochs)
  std::uint64_t num_event_queries = 0;  ///< events queried
  std::uint64_t event_ns = 0;           ///< time inside those records and queries (BackendCounters)
  /// Time inside the device's memory calls by kind (BackendCounters, Note [Time in device calls]):
  /// cudaMalloc, cudaFree, cuMemCreate, cuMemRelease, cuMemMap + cuMemSetAccess, cuMemUnmap.
  std::uint64_t reserve_ns = 0;
  std::uint64_t release_ns = 0;
  std::uint64_t create_ns = 0;
  std::uint64_t release_physical_ns = 0;
  std::uint64_t map_ns = 0;
  std::uint64_t unmap_ns = 0;
  /// Unmaps run by the backend's own thread (cuda_vmm with background_unmap: Note [Unmapping
  /// off the allocating thread], background_unmapper.h), the time that thread spent in them (not
  /// part of any allocator call), and the time allocator calls blocked waiting for them (part).
  std::uint64_t background_unmaps = 0;
  std::uint64_t background_unmap_ns = 0;
  std::uint64_t background_unmap_wait_ns = 0;
  /// Event records made by the backend's record thread instead of inside allocator calls, and
  /// that thread's time in them (event_thread records or poll: Note [Event records on a thread of
  /// their own], record_thread.h). num_event_records counts them too, event_ns does not.
  std::uint64_t background_event_records = 0;
  std::uint64_t background_event_ns = 0;
  /// The record thread's queries of the events it watches, and its time in them (Note [The record
  /// thread watches its events]). num_event_queries counts only the allocating thread's.
  std::uint64_t background_event_queries = 0;
  std::uint64_t background_event_query_ns = 0;
  std::uint64_t usage_errors = 0;       ///< rejected double frees / foreign pointers
  /// wait_parked_to_grow (Note [Waiting for frees in flight instead of growing], allocator.h):
  /// growths the policy held back, and the time spent waiting for parked frees instead.
  std::uint64_t parked_waits = 0;
  std::uint64_t parked_wait_ns = 0;
  /// reuse_parked (Note [Reusing a parked free on the stream it waits for], allocator.h): parked
  /// frees an allocation on a stream they waited for took at once, and their bytes.
  std::uint64_t parked_reuses = 0;
  std::uint64_t parked_reuse_bytes = 0;
  /// Of those, reuses that made the allocating stream wait for another stream's event on the
  /// device (stream_wait_event) instead of finding it complete.
  std::uint64_t parked_reuse_waits = 0;
  std::uint64_t alloc_ns = 0;           ///< time inside allocate() when timing is on
  std::uint64_t free_ns = 0;            ///< time inside deallocate() when timing is on
  std::uint64_t alloc_calls = 0;
  std::uint64_t free_calls = 0;

  /// A stream-ordered pool's own figures (cudaMemPoolAttr*), read under the allocator's lock
  /// together with the rest; present only for a policy that lives on such a pool (policy async).
  /// Note [Pool attributes in the stats] in allocator.h says how they relate to the figures above.
  struct PoolFigures {
    std::uint64_t reserved_mem_current = 0;  ///< cudaMemPoolAttrReservedMemCurrent
    std::uint64_t reserved_mem_high = 0;     ///< cudaMemPoolAttrReservedMemHigh
    std::uint64_t used_mem_current = 0;      ///< cudaMemPoolAttrUsedMemCurrent
    std::uint64_t used_mem_high = 0;         ///< cudaMemPoolAttrUsedMemHigh
    std::uint64_t front_cache_bytes = 0;     ///< freed blocks the policy keeps from the pool
    std::uint64_t pool_calls = 0;            ///< allocate_async + free_async calls (device calls)
    std::uint64_t pool_ns = 0;               ///< time inside those calls (the backend's clock)
  };
  std::optional<PoolFigures> pool;

  /// The policy's own counters, "<policy>.<name>" -> value, for a policy that has them (defrag:
  /// pages moved, stream waits, time spent moving, the slack in force...); to_map() adds them.
  std::vector<std::pair<std::string, std::int64_t>> policy_counters;

  /// Flat "key -> value" map with torch.cuda.memory_stats() key names (and, with a pool,
  /// pool.reserved_mem_current, pool.reserved_mem_high, pool.used_mem_current,
  /// pool.used_mem_high, pool.front_cache_bytes, pool.calls, pool.ns), and policy_counters.
  [[nodiscard]] std::map<std::string, std::int64_t> to_map() const;
};

}  // namespace cachealloc
