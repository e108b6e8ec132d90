// stream_ordered.h: the stream-ordered memory contract (cudaMallocAsync semantics) that a
// backend may offer besides its DeviceBackend half; reached through DeviceBackend::stream_ordered().
//
// Implementations: CudaAsyncBackend (a private cudaMemPool_t, cuda/async_backend.h) and
// SimStreamPool (sim_stream_pool.h, a model of the driver's pool for CPU tests and replays).
//
// A derived pool must supply:
//   1. allocate_async / free_async: stream-ordered allocation. A block freed on stream S is
//      reusable at once by later work on S; by another stream T only when the reuse rules
//      (StreamOrderedOptions) allow it. free_async never throws.
//   2. make_stream_wait: work queued on `waiter` from now on waits for `event` (an event of the
//      same backend, from DeviceBackend::record_event); the pool may follow that dependency.
//   3. trim_to: gives unused reservation back to the device until at most `keep_bytes` stay;
//      wait_for_frees: waits, visibly to the pool, until a stream's frees completed.
//   4. The four pool attributes (reserved/used, current/high) and reset_high_watermarks().
//
// Note [Why a second interface and not more DeviceBackend methods]
// Only one backend kind can implement these calls; the others would have to throw. A separate
// interface, reached through one virtual that returns nullptr by default, lets a policy check
// once in its constructor (ConfigError when absent) and keeps DeviceBackend unchanged for the
// policies that reserve whole segments.
#pragma once

#include <cachealloc/types.h>

#include <cstddef>
#include <cstdint>
#include <limits>

namespace cachealloc {

/// The pool settings CACHEALLOC_CONF may change (the driver's cudaMemPoolAttr* of the same names).
///   async_release_threshold                  release_threshold (bytes; default: keep everything)
///   async_reuse_follow_event_dependencies    reuse_follow_event_dependencies
///   async_reuse_allow_opportunistic          reuse_allow_opportunistic
///   async_reuse_allow_internal_dependencies  reuse_allow_internal_dependencies
struct StreamOrderedOptions {
  /// Unused bytes the pool keeps when it releases memory at a synchronisation point.
  std::uint64_t release_threshold = std::numeric_limits<std::uint64_t>::max();
  /// A block freed on S is reusable by T once T waited on an event recorded on S after the free.
  bool reuse_follow_event_dependencies = true;
  /// A block freed on S is reusable by any stream once the free is known to have completed.
  bool reuse_allow_opportunistic = true;
  /// The pool may make T wait on S itself to hand T a block freed on S.
  bool reuse_allow_internal_dependencies = true;
};

/// Stream-ordered allocation from one device's pool. Not thread-safe (the front end serialises).
class StreamOrderedMemory {
 public:
  virtual ~StreamOrderedMemory() = default;

  /// `bytes` usable on `stream` in stream order; nullptr when the device is out of memory or
  /// the backend's limit would be exceeded. Throws DeviceError on other failures.
  [[nodiscard]] virtual void* allocate_async(std::size_t bytes, StreamId stream) = 0;
  /// Frees `ptr` (from allocate_async) in stream order on `stream`.
  virtual void free_async(void* ptr, StreamId stream) noexcept = 0;
  /// Work queued on `waiter` from now on waits for `event` (cudaStreamWaitEvent).
  virtual void make_stream_wait(StreamId waiter, EventId event) = 0;
  /// Returns once the frees queued on `stream` so far completed, in a way the pool sees (a
  /// CUDA event and cudaEventSynchronize: a host fence would not tell the driver, Note [Host
  /// fences instead of events]), so that trim_to can give their memory back.
  virtual void wait_for_frees(StreamId stream) = 0;
  /// Releases unused reservation until at most `keep_bytes` stay reserved (cudaMemPoolTrimTo).
  /// Memory whose free has not been seen to complete counts as used.
  virtual void trim_to(std::size_t keep_bytes) = 0;

  [[nodiscard]] virtual std::size_t reserved_current() const = 0;  ///< ReservedMemCurrent
  [[nodiscard]] virtual std::size_t reserved_high() const = 0;     ///< ReservedMemHigh
  [[nodiscard]] virtual std::size_t used_current() const = 0;      ///< UsedMemCurrent
  [[nodiscard]] virtual std::size_t used_high() const = 0;         ///< UsedMemHigh
  /// Resets both high watermarks to the current values.
  virtual void reset_high_watermarks() = 0;
  /// The alignment of every pointer allocate_async returns (sizes are best rounded to it).
  [[nodiscard]] virtual std::size_t granularity() const noexcept = 0;

  [[nodiscard]] virtual StreamOrderedOptions pool_options() const = 0;
  /// Applies new reuse rules and release threshold (from then on). Throws DeviceError.
  virtual void set_pool_options(const StreamOrderedOptions& options) = 0;

  /// Throws InvariantError when the pool's own state is inconsistent (a model can check; the
  /// driver's pool cannot be inspected, so the default checks nothing).
  virtual void check_invariants() const {}
};

}  // namespace cachealloc
