// native.h: policy `native`, a model of PyTorch 2.11's CUDACachingAllocator (default backend).
//
// The rules it reproduces, with PyTorch's defaults:
//   * requests round up to 512 bytes (or to a power-of-two division: roundup_power2_divisions);
//   * requests up to 1 MiB use the small pool, carved from 2 MiB device reservations; larger ones
//     use the large pool: 20 MiB reservations for requests under 10 MiB, the request rounded up
//     to 2 MiB above that;
//   * free blocks live in per-stream, best-fit ordered sets (stream, size, address); a block is
//     split when the remainder is worth keeping (small pool: >= 512 B; large pool: > 1 MiB and
//     the request below max_split_size); neighbours coalesce on free;
//   * when no cached block fits: garbage collection (garbage_collection_threshold), a new
//     reservation, then "release oversize cached blocks and retry", then "release every unsplit
//     cached block and retry", then failure (an empty Block: the front end raises OutOfMemory);
//   * expandable_segments:True grows one address range per (stream, pool) in 2 MiB / 20 MiB
//     pages through the backend's VirtualMemory half, and unmaps free pages on release.
// Cross-stream reuse is the front end's job (allocator.h, Note [Cross-stream frees]): a block
// reaches deallocate() only once no other stream can still touch it.
//
// Settings (CACHEALLOC_CONF, PyTorch's syntax and validation):
//   max_split_size_mb, max_non_split_rounding_mb, roundup_power2_divisions (N or
//   [256:1,512:2,>:4]), garbage_collection_threshold, expandable_segments.
#pragma once

#include <cachealloc/backend.h>
#include <cachealloc/config.h>
#include <cachealloc/policy.h>
#include <cachealloc/types.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string_view>
#include <utility>
#include <vector>

namespace cachealloc {

/// The settings of the native policy, with PyTorch's defaults.
struct NativeSettings {
  static constexpr std::size_t kUnlimited = std::numeric_limits<std::size_t>::max();
  /// Number of roundup_power2_divisions intervals: [1 MiB, 2 MiB), ..., [32 GiB, 64 GiB) and up.
  static constexpr std::size_t kDivisionIntervals = 16;

  /// Blocks of this size or more are never split, and serve only requests of this size or more.
  std::size_t max_split_size = kUnlimited;
  /// An oversize block serves a request only if it is less than this much larger.
  std::size_t max_non_split_rounding_size = 20 * kMiB;
  /// Divisions per power-of-two interval, indexed by floor(log2(size)) - 20, clamped to [0, 15].
  /// 0 or 1: plain 512-byte rounding.
  std::array<std::size_t, kDivisionIntervals> roundup_power2_divisions{};
  /// Fraction in (0, 1) of the usable memory above which cached blocks are garbage-collected;
  /// 0 disables garbage collection.
  double garbage_collection_threshold = 0.0;
  bool expandable_segments = false;

  /// Takes the native keys from `config` (throws ConfigError, naming the key, on a bad value).
  static NativeSettings from_config(Config& config);
};

/// PyTorch's round_size(): what a request of `bytes` sets aside under `settings`.
[[nodiscard]] std::size_t native_round_size(std::size_t bytes, const NativeSettings& settings);
/// PyTorch's get_allocation_size(): the device reservation made for a rounded size.
[[nodiscard]] std::size_t native_allocation_size(std::size_t rounded_bytes) noexcept;

/// One device reservation change, in the order the policy made them (for fidelity checks against
/// a PyTorch trace's segment_alloc / segment_free / segment_map / segment_unmap entries).
struct SegmentEvent {
  enum Kind : std::uint8_t { alloc, free, map, unmap };
  Kind kind;
  std::uint64_t size;
  std::uint64_t addr;
  StreamId stream;
};

/// Counters specific to the native policy (the front end keeps the general statistics).
struct NativeCounters {
  std::uint64_t segment_allocs = 0;     ///< device reservations made (cudaMalloc)
  std::uint64_t segment_frees = 0;      ///< device reservations released (cudaFree)
  std::uint64_t maps = 0;               ///< expandable-segment growth steps (segment_map)
  std::uint64_t unmaps = 0;             ///< expandable-segment shrink steps (segment_unmap)
  std::uint64_t gc_runs = 0;            ///< garbage collections that released something
  std::uint64_t oversize_releases = 0;  ///< successful "release oversize blocks" retry steps
  std::uint64_t full_releases = 0;      ///< "release all cached blocks" steps
  std::uint64_t alloc_retries =
      0;  ///< allocations that reached the last retry (PyTorch's num_alloc_retries)
  std::uint64_t failures = 0;     ///< allocations that found no memory at all
  std::uint64_t events_lost = 0;  ///< segment events not recorded for lack of memory
};

namespace native_detail {
class Core;
}

class NativePolicy {
 public:
  static constexpr std::string_view kName = "native";
  static std::vector<std::string_view> config_keys();

  NativePolicy(DeviceBackend& backend, Config& config);
  NativePolicy(DeviceBackend& backend, const NativeSettings& settings);
  ~NativePolicy();
  NativePolicy(const NativePolicy&) = delete;
  NativePolicy& operator=(const NativePolicy&) = delete;

  /// PyTorch's malloc(): a cached block, else a new reservation through the retry chain; an empty
  /// Block when the device has no room even after releasing the cache.
  [[nodiscard]] Block allocate(std::size_t bytes, StreamId stream);
  /// PyTorch's free_block(): back to the stream's pool, merged with free neighbours.
  void deallocate(const Block& block, StreamId stream) noexcept;
  /// PyTorch's release_cached_blocks() (torch.cuda.empty_cache()): frees every unsplit cached
  /// reservation and unmaps every free expandable page. Returns the bytes given back.
  std::size_t release_cached();
  /// Device bytes held: reservations plus mapped expandable pages. O(1).
  [[nodiscard]] std::size_t reserved_bytes() const noexcept;
  /// Throws InvariantError on broken bookkeeping (see native.cpp for the list).
  void check_invariants() const;

  template <class F>
  void visit_segments(F&& visitor) const {
    visit_segments_impl(std::function<void(const SegmentView&)>(std::forward<F>(visitor)));
  }

  static std::string_view oom_hint();

  [[nodiscard]] const NativeSettings& settings() const noexcept;
  [[nodiscard]] const NativeCounters& counters() const noexcept;
  /// Bytes held in free cached blocks (reserved but not handed out).
  [[nodiscard]] std::size_t cached_bytes() const noexcept;
  /// Live device reservations (cudaMalloc segments) plus live expandable address ranges.
  [[nodiscard]] std::size_t segment_count() const noexcept;

  /// Records every reservation change into segment_events() from now on (off by default).
  void set_record_segments(bool on);
  [[nodiscard]] const std::vector<SegmentEvent>& segment_events() const noexcept;
  void clear_segment_events() noexcept;

 private:
  void visit_segments_impl(const std::function<void(const SegmentView&)>& visitor) const;

  std::unique_ptr<native_detail::Core> core_;
};

static_assert(Policy<NativePolicy>);

}  // namespace cachealloc
