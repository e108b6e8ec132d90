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
// Device calls that stay (cudaMalloc, cuMemCreate, cuMemMap, ...) run with this thread's capture
// mode exchanged to relaxed while a capture is underway (the `CaptureMode` hooks), as PyTorch's
// allocator does around cudaMalloc: in the default global mode a capture on any thread makes
// cudaMalloc fail with cudaErrorStreamCaptureUnsupported and invalidates the capture (seen on
// the H200). Memory a capture allocates is never freed before its graph is released (the
// private pool keeps it), which is what makes allocating during a capture sound.
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

/// Exchanges this thread's CUDA stream-capture mode: relax() switches to relaxed and returns the
/// previous mode, restore() puts it back. Empty hooks (tests on the simulated device) do nothing.
struct CaptureMode {
  int (*relax)() = nullptr;
  void (*restore)(int previous) = nullptr;
};

class CaptureGuardBackend final : public DeviceBackend, private VirtualMemory {
 public:
  /// `captures_underway` must outlive the adaptor (the adapter's, which lives forever).
  CaptureGuardBackend(std::unique_ptr<DeviceBackend> inner, const std::atomic<int>& captures_underway,
                      CaptureMode mode = {});
  ~CaptureGuardBackend() override;
  CaptureGuardBackend(const CaptureGuardBackend&) = delete;
  CaptureGuardBackend& operator=(const CaptureGuardBackend&) = delete;

  [[nodiscard]] std::string_view name() const noexcept override { return inner_->name(); }
  [[nodiscard]] int device() const noexcept override { return inner_->device(); }
  [[nodiscard]] std::size_t total_memory() const override { return inner_->total_memory(); }
  [[nodiscard]] std::size_t free_memory() const override { return inner_->free_memory(); }
  /// The wrapped backend's clock (a simulated one in replays: Note [Simulated time]).
  [[nodiscard]] std::uint64_t clock_ns() const noexcept override { return inner_->clock_ns(); }

  [[nodiscard]] EventId record_event(StreamId stream) override;
  [[nodiscard]] bool query_event(EventId event) override;
  void synchronize_event(EventId event) override;
  /// Not while a capture is underway (a wait on work outside the graph): false, the caller
  /// then needs the event complete, which query_event() does not say before the capture ends.
  [[nodiscard]] bool stream_wait_event(StreamId stream, EventId event) override;
  void destroy_event(EventId event) noexcept override;

  [[nodiscard]] VirtualMemory* virtual_memory() noexcept override {
    return inner_vm_ != nullptr ? static_cast<VirtualMemory*>(this) : nullptr;
  }
  [[nodiscard]] BackgroundWork background_work() const noexcept override {
    return inner_->background_work();
  }
  /// Not while a capture is underway: an event recorded on a capturing stream is a graph node,
  /// nothing the unmap thread could wait for (Note [Deferred events during capture]).
  [[nodiscard]] bool unmaps_after_streams() const noexcept override {
    return !capturing() && inner_vm_ != nullptr && inner_vm_->unmaps_after_streams();
  }
  [[nodiscard]] std::uintptr_t queued_unmap_end(std::uintptr_t va,
                                                std::size_t bytes) const noexcept override {
    return inner_vm_ != nullptr ? inner_vm_->queued_unmap_end(va, bytes) : 0;
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
  void do_release_physical(PhysicalHandle handle, std::size_t bytes) noexcept override {
    inner_vm_->release_physical(handle, bytes);
  }
  void do_map(std::uintptr_t va, std::size_t bytes, PhysicalHandle handle) override;
  void do_map_run(std::uintptr_t va, std::span<const MapPiece> pieces) override;
  void do_unmap(std::uintptr_t va, std::size_t bytes) override;
  void do_unmap_after(std::uintptr_t va, std::size_t bytes, StreamId stream) override;
  void do_unmap_now(std::uintptr_t va, std::size_t bytes) override;
  [[nodiscard]] std::uint64_t unmap_wait_ns() const noexcept override { return inner_vm_->unmap_wait_ns(); }
  void do_release_unmapped(PhysicalHandle handle, std::size_t bytes) noexcept override {
    inner_vm_->release_unmapped(handle, bytes);
  }

  /// Relaxed capture mode for the guard's lifetime while a capture is underway.
  class Relaxed {
   public:
    explicit Relaxed(const CaptureGuardBackend& b) : b_(b), on_(b.capturing() && b.mode_.relax != nullptr) {
      if (on_) {
        previous_ = b_.mode_.relax();
      }
    }
    ~Relaxed() {
      if (on_) {
        b_.mode_.restore(previous_);
      }
    }
    Relaxed(const Relaxed&) = delete;
    Relaxed& operator=(const Relaxed&) = delete;

   private:
    const CaptureGuardBackend& b_;
    bool on_;
    int previous_ = 0;
  };

  std::unique_ptr<DeviceBackend> inner_;
  VirtualMemory* inner_vm_;
  const std::atomic<int>& captures_;
  CaptureMode mode_;
  std::unordered_map<EventId, DeferredEvent> deferred_events_;
  EventId next_deferred_ = 1;
  std::vector<std::pair<void*, std::size_t>> deferred_releases_;
};

}  // namespace cachealloc::torch_adapter
