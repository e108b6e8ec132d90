// timed_allocator.h: a c10 CUDAAllocator that forwards every call to another one (the allocator
// PyTorch had installed) and times its allocation and free paths with the TickClock, so that
// PyTorch's own allocators (native, expandable segments, cudaMallocAsync) are measured the way
// cachealloc measures itself (`allocator_ns`). Installed by cachealloc::torch::time_native_install()
// (install.cpp); the e2e benchmark's `native+timed`, `expandable+timed`, `async+timed`.
//
// Note [Timing another allocator's frees]
// A tensor is freed by its DataPtr's deleter, a plain function pointer called with the DataPtr's
// context, which the wrapper must replace to see the free. allocate() therefore takes the inner
// allocator's DataPtr apart and hands out one with the same data pointer, context and device
// and a deleter of ours that calls the inner deleter, timed. This needs context == data pointer
// (checked on every allocation; an allocator that keeps state in its context cannot be wrapped:
// allocate() then fails naming it). The wrapper calls the inner DataPtr's own deleter rather than
// inner->raw_delete(): for PyTorch 2.11 the two free the same way for the caching allocator with
// caching on, and for cudaMallocAsync, but not when PYTORCH_NO_CUDA_MEMORY_CACHING=1 or after
// allocator.enable(false): then allocate() hands out the `uncached_delete` deleter (cudaFree) and
// the choice is made per allocation (Note [What PyTorch's deleters do] in timed_allocator.cpp).
// Since the deleter is a bare function pointer, each distinct inner deleter gets a slot in a small
// table with a trampoline function of its own (kMaxInnerDeleters of them, a handful are ever seen:
// PyTorch's native allocator has two).
//
// The deleter is also how PyTorch's allocators recognise their own tensors: the native
// recordStream() ignores a DataPtr whose deleter is not its `local_raw_delete`. recordStream()
// here therefore passes on a non-owning view with the inner deleter put back, and
// setCheckpointPoolState() re-wraps the DataPtrs it returns, so that every path sees what it
// would see without the wrapper. raw_deleter() answers our trampoline for the inner one, which
// keeps torch's `_has_Standard_Deleter` / `_free_And_Remove_DeleterFn` (CUDA graph trees) working.
//
// What is counted: every call of allocate(), raw_alloc(), raw_alloc_with_stream() (zero-byte ones
// too: they are calls into the allocator) and every free through raw_delete() or a DataPtr
// deleter; time is what the inner call took, exception or not. Process-wide, all devices.
#pragma once

#include "tick_clock.h"

#include <c10/cuda/CUDACachingAllocator.h>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

namespace cachealloc::torch_adapter {

namespace cca = ::c10::cuda::CUDACachingAllocator;

/// The wrapper's counters, converted to nanoseconds.
struct TimedTotals {
  std::uint64_t alloc_calls = 0;
  std::uint64_t free_calls = 0;
  std::uint64_t alloc_ns = 0;
  std::uint64_t free_ns = 0;
};

class TimedAllocator final : public cca::CUDAAllocator {
 public:
  /// How many distinct deleters of the inner allocator can be told apart.
  static constexpr std::size_t kMaxInnerDeleters = 4;

  /// Wraps `inner`, which must outlive the wrapper (PyTorch's allocators are static objects).
  explicit TimedAllocator(cca::CUDAAllocator* inner);
  ~TimedAllocator() override;
  TimedAllocator(const TimedAllocator&) = delete;
  TimedAllocator& operator=(const TimedAllocator&) = delete;

  /// The installed wrapper (the one our DataPtr deleters report to), or nullptr.
  static TimedAllocator* instance() noexcept;
  static void set_instance(TimedAllocator* allocator) noexcept;

  [[nodiscard]] TimedTotals totals() const noexcept;

  // ---- c10::Allocator ----
  c10::DataPtr allocate(size_t nbytes) override;
  [[nodiscard]] c10::DeleterFnPtr raw_deleter() const override;
  void copy_data(void* dest, const void* src, std::size_t count) const override;
  [[nodiscard]] bool is_simple_data_ptr(const c10::DataPtr& data_ptr) const override;

  // ---- c10::DeviceAllocator ----
  bool initialized() override;
  void emptyCache(c10::MempoolId_t mempool_id) override;
  cca::DeviceStats getDeviceStats(c10::DeviceIndex device) override;
  void resetAccumulatedStats(c10::DeviceIndex device) override;
  void resetPeakStats(c10::DeviceIndex device) override;
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override;

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
  void recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) override;
  void pushCompileContext(std::string& md) override;
  void popCompileContext() override;
  void setUserMetadata(const std::string& metadata) override;
  std::string getUserMetadata() override;
  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) override;
  void attachAllocatorTraceTracker(cca::AllocatorTraceTracker tracker) override;
  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override;
  cudaError_t memcpyAsync(void* dst, int dst_device, const void* src, int src_device, size_t count,
                          cudaStream_t stream, bool p2p_enabled) override;
  std::shared_ptr<cca::AllocatorState> getCheckpointState(c10::DeviceIndex device, c10::MempoolId_t id) override;
  cca::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex device,
                                              std::shared_ptr<cca::AllocatorState> pps) override;
  /// The inner allocator's name: torch.cuda.get_allocator_backend() reads it, and code that
  /// branches on it ("native", "cudaMallocAsync") must keep behaving as without the wrapper.
  std::string name() override;

  /// What our deleter in slot `slot` does: the inner deleter of that slot, timed and counted.
  void timed_inner_delete(std::size_t slot, void* context);

 private:
  /// The slot of an inner deleter, taking a free one the first time it is seen; throws when
  /// the table is full.
  std::size_t slot_of(c10::DeleterFnPtr inner_deleter) const;
  /// The slot whose trampoline `deleter` is, or kMaxInnerDeleters when it is not one of ours.
  static std::size_t trampoline_slot(c10::DeleterFnPtr deleter) noexcept;
  /// `inner`'s DataPtr with our deleter in place of its own (nullptr data: returned as it is).
  c10::DataPtr wrap(c10::DataPtr inner) const;

  cca::CUDAAllocator* inner_;
  plugin::TickClock clock_;
  mutable std::array<std::atomic<c10::DeleterFnPtr>, kMaxInnerDeleters> inner_deleters_{};
  std::atomic<std::uint64_t> alloc_calls_{0};
  std::atomic<std::uint64_t> free_calls_{0};
  std::atomic<std::uint64_t> alloc_ticks_{0};
  std::atomic<std::uint64_t> free_ticks_{0};
};

}  // namespace cachealloc::torch_adapter
