// async_backend.h: backend `cuda_async`: stream-ordered allocation from a private cudaMemPool_t
// (cudaMallocFromPoolAsync / cudaFreeAsync) for the stream-ordered policy.
//
// The pool is ours (cudaMemPoolCreate), never the device's default pool, so other libraries
// calling cudaMallocAsync neither see nor trim our memory, and our settings do not change
// theirs. By default the pool keeps everything it ever reserved (release threshold UINT64_MAX,
// as PyTorch's cudaMallocAsync backend) and allows every kind of reuse.
//
// The stream-ordered entry points (allocate_async, free_async, make_stream_wait, trim_to and
// the pool attributes) are what the stream-ordered policy uses; the DeviceBackend half
// (reserve/release, events) exists so that any policy can run on this backend too:
// reserve() allocates on the legacy default stream and waits for it.
//
// Limits: set_limit() (the memory fraction) applies to allocate_async as well: an allocation
// that would take the pool's used bytes past the limit returns nullptr (as out-of-memory).
#pragma once

#include <cachealloc/backend.h>
#include <cachealloc/config.h>
#include <cachealloc/stream_ordered.h>
#include <cachealloc/cuda/event_pool.h>
#include <cachealloc/cuda/event_thread.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string_view>
#include <vector>

#include <cuda_runtime_api.h>

namespace cachealloc {

/// Settings of the private pool; `from_config` reads them from CACHEALLOC_CONF.
struct CudaAsyncOptions {
  /// cudaMemPoolAttrReleaseThreshold: bytes the pool keeps when a stream synchronises.
  std::uint64_t release_threshold = std::numeric_limits<std::uint64_t>::max();
  bool reuse_follow_event_dependencies = true;    ///< cudaMemPoolReuseFollowEventDependencies
  bool reuse_allow_opportunistic = true;          ///< cudaMemPoolReuseAllowOpportunistic
  bool reuse_allow_internal_dependencies = true;  ///< cudaMemPoolReuseAllowInternalDependencies
  /// event_thread:off|records|poll (event_thread.h; default off: not measured on this backend).
  EventThread event_thread = EventThread::off;

  /// Takes async_release_threshold, async_reuse_follow_event_dependencies,
  /// async_reuse_allow_opportunistic, async_reuse_allow_internal_dependencies and event_thread.
  static CudaAsyncOptions from_config(Config& config);
};

class CudaAsyncBackend final : public DeviceBackend, public StreamOrderedMemory {
 public:
  /// Creates the pool on `device`. Throws DeviceError when the device has no memory-pool support.
  CudaAsyncBackend(int device, CudaAsyncOptions options = {});
  ~CudaAsyncBackend() override;

  /// The CACHEALLOC_CONF keys this backend takes (see CudaAsyncOptions::from_config).
  static std::vector<std::string_view> config_keys();

  [[nodiscard]] std::string_view name() const noexcept override { return "cuda_async"; }
  [[nodiscard]] int device() const noexcept override { return device_; }
  [[nodiscard]] std::size_t total_memory() const override { return total_memory_; }
  [[nodiscard]] std::size_t free_memory() const override;

  [[nodiscard]] EventId record_event(StreamId stream) override;
  [[nodiscard]] bool query_event(EventId event) override;
  void synchronize_event(EventId event) override;
  [[nodiscard]] bool stream_wait_event(StreamId stream, EventId event) override;
  void destroy_event(EventId event) noexcept override;
  [[nodiscard]] StreamOrderedMemory* stream_ordered() noexcept override { return this; }

  // ---- stream-ordered allocation ----
  /// `bytes` from the pool, usable on `stream` in stream order. nullptr when the device is out
  /// of memory or the limit would be exceeded; throws DeviceError on other failures.
  [[nodiscard]] void* allocate_async(std::size_t bytes, StreamId stream) override;
  /// Frees `ptr` in stream order on `stream` (cudaFreeAsync). Reports failures on stderr.
  void free_async(void* ptr, StreamId stream) noexcept override;
  /// Work queued on `waiter` from now on waits for `event` (cudaStreamWaitEvent).
  void make_stream_wait(StreamId waiter, EventId event) override;
  void wait_for_frees(StreamId stream) override;
  /// Releases unused pool memory until at most `keep_bytes` stay reserved (cudaMemPoolTrimTo).
  /// Memory freed with free_async counts as unused once the free's stream reached it.
  void trim_to(std::size_t keep_bytes) override;

  // ---- pool attributes ----
  [[nodiscard]] std::size_t reserved_current() const override;  ///< cudaMemPoolAttrReservedMemCurrent
  [[nodiscard]] std::size_t reserved_high() const override;     ///< cudaMemPoolAttrReservedMemHigh
  [[nodiscard]] std::size_t used_current() const override;      ///< cudaMemPoolAttrUsedMemCurrent
  [[nodiscard]] std::size_t used_high() const override;         ///< cudaMemPoolAttrUsedMemHigh
  /// Resets both high watermarks to the current values.
  void reset_high_watermarks() override;
  /// 256 B: the alignment CUDA guarantees for every device allocation.
  [[nodiscard]] std::size_t granularity() const noexcept override { return 256; }
  [[nodiscard]] StreamOrderedOptions pool_options() const override;
  /// Sets the pool's release threshold and reuse attributes (cudaMemPoolSetAttribute).
  void set_pool_options(const StreamOrderedOptions& options) override;

  [[nodiscard]] const CudaAsyncOptions& options() const noexcept { return options_; }
  [[nodiscard]] cudaMemPool_t pool() const noexcept { return pool_; }
  [[nodiscard]] const CudaEventPool& event_pool() const noexcept { return events_; }
  /// The event pool's record thread, when it has one (event_thread records or poll).
  [[nodiscard]] BackgroundWork background_work() const noexcept override {
    return events_.thread_work();
  }
  /// Successful allocate_async / free_async calls so far.
  [[nodiscard]] std::uint64_t async_allocations() const noexcept { return async_allocations_; }
  [[nodiscard]] std::uint64_t async_frees() const noexcept { return async_frees_; }

 protected:
  [[nodiscard]] void* do_reserve(std::size_t bytes) override;
  void do_release(void* ptr, std::size_t bytes) noexcept override;

 private:
  [[nodiscard]] std::uint64_t attribute(cudaMemPoolAttr attr) const;

  int device_;
  CudaAsyncOptions options_;
  std::size_t total_memory_ = 0;
  cudaMemPool_t pool_ = nullptr;
  CudaEventPool events_;
  std::uint64_t async_allocations_ = 0;
  std::uint64_t async_frees_ = 0;
};

}  // namespace cachealloc
