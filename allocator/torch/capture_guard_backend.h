// capture_guard_backend.h: a DeviceBackend adaptor that keeps event waits out of CUDA graph capture.
//
// While a CUDA graph is being captured, cudaEventQuery, cudaEventSynchronize and cudaFree are
// illegal (in the default "global" capture mode, from any thread: the capture is invalidated),
// and an event recorded on a capturing stream is a graph node, not something that can be waited
// for. The front end and the policies call exactly these through the backend (Note [Cross-stream
// frees] in allocator.h; the policies' per-stream fences), so the LibTorch adapter wraps every
// non-stream-ordered backend in this adaptor (RMM-style: nobody above knows it is there).
//
// Note [Deferred events during capture]
// While `captures_underway` > 0 (the adapter counts beginAllocateToPool..endAllocateToPool, as
// PyTorch's allocator counts its captures_underway: conservative, since it includes
// torch.cuda.use_mem_pool):
//   * record_event() records nothing and returns a deferred id (top bit set) that remembers the
//     stream; the first query/wait after the capture records a real event on that stream then.
//     Recording later than asked only fences more work, never less, so reuse stays safe.
//   * query_event() answers "not yet" without calling the device: parked blocks stay parked.
//   * synchronize_event() cannot wait and throws DeviceError (only reached on the out-of-memory
//     retry path and by empty_cache, which the adapter refuses during capture).
//   * release() (cudaFree) is deferred to the first backend call after the capture.
// Virtual-memory calls are forwarded unchanged (cuMemMap/cuMemCreate are legal during capture).
#pragma once

#include <cachealloc/backend.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace cachealloc::torch_adapter {

class CaptureGuardBackend final : public DeviceBackend, private VirtualMemory {
 public:
  /// `captures_underway` must outlive the adaptor (the adapter's, which lives forever).
  CaptureGuardBackend(std::unique_ptr<DeviceBackend> inner, const std::atomic<int>& captures_underway);
  ~CaptureGuardBackend() override;
  CaptureGuardBackend(const CaptureGuardBackend&) = delete;
  CaptureGuardBackend& operator=(const CaptureGuardBackend&) = delete;

  [[nodiscard]] std::string_view name() const noexcept override { return inner_->name(); }
  [[nodiscard]] int device() const noexcept override { return inner_->device(); }
  [[nodiscard]] std::size_t total_memory() const override { return inner_->total_memory(); }
  [[nodiscard]] std::size_t free_memory() const override { return inner_->free_memory(); }

  [[nodiscard]] EventId record_event(StreamId stream) override;
  [[nodiscard]] bool query_event(EventId event) override;
  void synchronize_event(EventId event) override;
  void destroy_event(EventId event) noexcept override;

  [[nodiscard]] VirtualMemory* virtual_memory() noexcept override {
    return inner_vm_ != nullptr ? static_cast<VirtualMemory*>(this) : nullptr;
  }

  /// Device frees waiting for the end of a capture (for tests and statistics).
  [[nodiscard]] std::size_t deferred_releases() const noexcept { return deferred_releases_.size(); }

 protected:
  [[nodiscard]] void* do_reserve(std::size_t bytes) override;
  void do_release(void* ptr, std::size_t bytes) noexcept override;

 private:
  static constexpr EventId kDeferredBit = EventId{1} << 63;

  struct DeferredEvent {
    StreamId stream = 0;
    EventId real = 0;  ///< recorded once no capture is underway; 0 before
  };

  [[nodiscard]] bool capturing() const noexcept { return captures_.load(std::memory_order_acquire) > 0; }
  /// Runs the cudaFree calls deferred during a capture, once none is underway.
  void settle() noexcept;
  /// The real event behind a deferred id, recording it now if needed (no capture underway).
  EventId realize(EventId deferred);

  // ---- VirtualMemory, forwarded to the wrapped backend's ----
  [[nodiscard]] std::size_t granularity() const noexcept override { return inner_vm_->granularity(); }
  [[nodiscard]] std::uintptr_t reserve_address(std::size_t bytes) override {
    return inner_vm_->reserve_address(bytes);
  }
  void free_address(std::uintptr_t va, std::size_t bytes) noexcept override { inner_vm_->free_address(va, bytes); }
  [[nodiscard]] PhysicalHandle do_create_physical(std::size_t bytes) override;
  void do_release_physical(PhysicalHandle handle) noexcept override;
  void do_map(std::uintptr_t va, std::size_t bytes, PhysicalHandle handle) override { inner_vm_->map(va, bytes, handle); }
  void do_unmap(std::uintptr_t va, std::size_t bytes) override { inner_vm_->unmap(va, bytes); }

  std::unique_ptr<DeviceBackend> inner_;
  VirtualMemory* inner_vm_;
  const std::atomic<int>& captures_;
  std::unordered_map<EventId, DeferredEvent> deferred_events_;
  EventId next_deferred_ = 1;
  std::vector<std::pair<void*, std::size_t>> deferred_releases_;
  /// Sizes of live physical handles: release_physical() on the wrapped backend needs them.
  std::unordered_map<PhysicalHandle, std::size_t> physical_sizes_;
};

}  // namespace cachealloc::torch_adapter
