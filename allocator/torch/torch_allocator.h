// torch_allocator.h: c10::cuda::CUDACachingAllocator::CUDAAllocator over cachealloc.
//
// The default pool of each device is the plugin runtime's device allocator (runtime.h: config,
// per-device creation, timing, `record:` traces, out-of-memory advice), so the adapter and the
// pluggable plugin behave the same. On top of it the adapter adds what only a full CUDAAllocator
// can do: c10 statistics, snapshots and history, OOM observers, and private pools.
//
// Note [Private pools]
// CUDA graph capture and torch.cuda.MemPool route allocations to a pool named by a MempoolId_t
// (beginAllocateToPool with a stream filter; createOrIncrefPool / releasePool count its users).
// Each (device, pool id) gets its own DeviceAllocator, built by the runtime like a default one,
// over its own backend: its blocks can never be handed out by the default pool or another pool,
// which is what graph replay needs (a captured graph keeps using its addresses). The pool lives
// while its use count is > 0 or it still has live blocks; then it is destroyed, which returns its
// memory, at the first moment no capture is underway. Every pointer's owner is kept in one map,
// so frees, record_stream and getBaseAllocation find the right allocator.
//
// Note [No event calls during capture]
// `captures_underway_` counts routes begun and not ended (as PyTorch's allocator does). Every
// non-stream-ordered backend is wrapped in a CaptureGuardBackend that reads it
// (capture_guard_backend.h). The stream-ordered policy (policy:async) cannot be wrapped (its
// pool records and waits on events itself), so it refuses beginAllocateToPool: CUDA graphs and
// use_mem_pool are not available under policy:async.
#pragma once

#include "history.h"

#include <c10/cuda/CUDACachingAllocator.h>

#include <cachealloc/allocator.h>

#include <atomic>
#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace cachealloc::plugin {
class Runtime;
}

namespace cachealloc::torch_adapter {

/// cachealloc's per-device front end (inside TorchAllocator the bare name DeviceAllocator is
/// c10's base class).
using CoreAllocator = ::cachealloc::DeviceAllocator;

class TorchAllocator final : public cca::CUDAAllocator {
 public:
  explicit TorchAllocator(std::string conf_text);
  ~TorchAllocator() override;
  TorchAllocator(const TorchAllocator&) = delete;
  TorchAllocator& operator=(const TorchAllocator&) = delete;

  /// The installed adapter, or nullptr.
  static TorchAllocator* instance() noexcept;
  static void set_instance(TorchAllocator* allocator) noexcept;

  [[nodiscard]] const std::string& conf_text() const noexcept { return conf_text_; }
  [[nodiscard]] const std::atomic<int>& captures_underway() const noexcept { return captures_underway_; }
  /// The runtime observer's target (runtime.h: RuntimeHooks::observer).
  void on_event(int device, AllocatorEvent event, std::uintptr_t addr, std::size_t size, StreamId stream) noexcept;

  // ---- c10::Allocator ----
  c10::DataPtr allocate(size_t nbytes) override;
  [[nodiscard]] c10::DeleterFnPtr raw_deleter() const override;
  void copy_data(void* dest, const void* src, std::size_t count) const override;

  // ---- c10::DeviceAllocator ----
  bool initialized() override;
  void emptyCache(c10::MempoolId_t mempool_id) override;
  cca::DeviceStats getDeviceStats(c10::DeviceIndex device) override;
  void resetAccumulatedStats(c10::DeviceIndex device) override;
  void resetPeakStats(c10::DeviceIndex device) override;

  // ---- CUDAAllocator ----
  void* raw_alloc(size_t nbytes) override;
  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override;
  void raw_delete(void* ptr) override;
  void init(int device_count) override;
  double getMemoryFraction(c10::DeviceIndex device) override;
  void setMemoryFraction(double fraction, c10::DeviceIndex device) override;
  std::vector<cca::StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex device) override;
  void enable(bool value) override;
  bool isEnabled() const override;
  void cacheInfo(c10::DeviceIndex device, size_t* largest_block) override;
  void* getBaseAllocation(void* ptr, size_t* size) override;
  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override;
  cca::SnapshotInfo snapshot(c10::MempoolId_t mempool_id, bool include_traces) override;
  void beginAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                           std::function<bool(cudaStream_t)> filter) override;
  void endAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override;
  void releasePool(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override;
  int getPoolUseCount(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override;
  void createOrIncrefPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                          std::shared_ptr<cca::CUDAAllocator> allocator) override;
  void setUseOnOOM(c10::DeviceIndex device, c10::MempoolId_t mempool_id, bool use_on_oom) override;
  void setNoSplit(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override;
  bool checkPoolLiveAllocations(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                                const std::unordered_set<void*>& expected_live_allocations) override;
  cca::ShareableHandle shareIpcHandle(void* ptr) override;
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override;
  bool isHistoryEnabled() override;
  void recordHistory(bool enabled, cca::CreateContextFn context_recorder, size_t alloc_trace_max_entries,
                     cca::RecordContext when, bool clear_history,
                     const std::vector<std::string>& skip_actions) override;
  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) override;
  void attachAllocatorTraceTracker(cca::AllocatorTraceTracker tracker) override;
  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override;
  cudaError_t memcpyAsync(void* dst, int dst_device, const void* src, int src_device, size_t count,
                          cudaStream_t stream, bool p2p_enabled) override;
  std::shared_ptr<cca::AllocatorState> getCheckpointState(c10::DeviceIndex device, c10::MempoolId_t id) override;
  cca::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex device,
                                              std::shared_ptr<cca::AllocatorState> pps) override;
  std::string name() override;

  /// The free path (DataPtr deleter, raw_delete). Never throws: errors are logged.
  void free(void* ptr) noexcept;

 private:
  using PoolKey = std::pair<int, c10::MempoolId_t>;  // (device, pool id)
  struct Pool {
    c10::MempoolId_t id;
    int device = 0;
    int use_count = 0;
    std::atomic<std::int64_t> live_blocks{0};
    std::unique_ptr<CoreAllocator> allocator;
  };
  struct Route {
    int device;
    c10::MempoolId_t id;
    std::function<bool(cudaStream_t)> filter;
  };
  struct Owner {
    CoreAllocator* allocator;
    Pool* pool;  ///< nullptr: the device's default pool
    int device;
  };

  plugin::Runtime& runtime();
  void* malloc(std::size_t bytes, int device, cudaStream_t stream);
  /// The pool a capture or use_mem_pool routes (device, stream) to, or nullptr.
  Pool* routed_pool(int device, cudaStream_t stream);
  Pool& pool_create_or_incref(int device, c10::MempoolId_t id);  // caller holds pools_mutex_
  /// Destroys pools nobody uses and that hold no block, when no capture is underway.
  void collect_idle_pools();  // caller holds pools_mutex_
  [[noreturn]] void raise_out_of_memory(int device, const CoreAllocator& allocator, const std::string& what);
  /// Every allocator of `device` (default first), with its pool id; pools_mutex_ held by caller.
  std::vector<std::pair<CoreAllocator*, c10::MempoolId_t>> allocators_of(int device);
  std::optional<Owner> owner_of(const void* ptr) const;

  std::string conf_text_;
  std::atomic<bool> initialized_{false};
  std::atomic<bool> enabled_{true};
  std::atomic<int> captures_underway_{0};
  History history_;

  mutable std::mutex pools_mutex_;
  std::map<PoolKey, std::unique_ptr<Pool>> pools_;
  std::vector<Route> routes_;
  std::map<int, double> fractions_;

  mutable std::mutex owners_mutex_;
  std::unordered_map<void*, Owner> owners_;

  std::mutex observers_mutex_;
  std::vector<cca::OutOfMemoryObserver> oom_observers_;
};

}  // namespace cachealloc::torch_adapter
