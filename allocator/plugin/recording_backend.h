// recording_backend.h: a DeviceBackend adaptor that records segment events for the trace.
//
// Wraps the real backend (RMM-style adaptor: the policy and the front end do not know it is
// there) and forwards every call; reserve/release become segment_alloc/segment_free entries,
// virtual-memory map/unmap become segment_map/segment_unmap entries, exactly as PyTorch's
// trace shows cudaMalloc segments and expandable-segment pages. It is only put in place when
// recording is on, so the normal path has no extra indirection.
//
// Note [Accounting in the adaptor]
// The adaptor is a DeviceBackend itself, so its non-virtual entry points count calls and
// enforce the limit (backend.h, Note [Accounting and limits live in the base class]); the
// wrapped backend counts the same calls again, unlimited. The front end reads the adaptor's
// counters and sets the adaptor's limit, so statistics and set_memory_fraction behave exactly
// as without recording.
//
// Not for stream-ordered backends: their policy talks to the concrete backend type (the
// stream-ordered entry points are not part of DeviceBackend), so the plugin records those
// without segment events.
#pragma once

#include "recorder.h"

#include <cachealloc/backend.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>

namespace cachealloc::plugin {

class RecordingBackend final : public DeviceBackend, private VirtualMemory {
 public:
  RecordingBackend(std::unique_ptr<DeviceBackend> inner, Recorder& recorder);
  ~RecordingBackend() override;

  [[nodiscard]] std::string_view name() const noexcept override { return inner_->name(); }
  [[nodiscard]] int device() const noexcept override { return inner_->device(); }
  [[nodiscard]] std::size_t total_memory() const override { return inner_->total_memory(); }
  [[nodiscard]] std::size_t free_memory() const override { return inner_->free_memory(); }
  /// The wrapped backend's clock (a simulated one in replays: Note [Simulated time]).
  [[nodiscard]] std::uint64_t clock_ns() const noexcept override { return inner_->clock_ns(); }

  [[nodiscard]] EventId record_event(StreamId stream) override { return inner_->record_event(stream); }
  [[nodiscard]] bool query_event(EventId event) override { return inner_->query_event(event); }
  void synchronize_event(EventId event) override { inner_->synchronize_event(event); }
  [[nodiscard]] bool stream_wait_event(StreamId stream, EventId event) override {
    return inner_->stream_wait_event(stream, event);
  }
  void destroy_event(EventId event) noexcept override { inner_->destroy_event(event); }

  [[nodiscard]] VirtualMemory* virtual_memory() noexcept override {
    return inner_vm_ != nullptr ? static_cast<VirtualMemory*>(this) : nullptr;
  }
  [[nodiscard]] BackgroundWork background_work() const noexcept override {
    return inner_->background_work();
  }
  [[nodiscard]] bool unmaps_after_streams() const noexcept override {
    return inner_vm_ != nullptr && inner_vm_->unmaps_after_streams();
  }
  [[nodiscard]] std::uintptr_t queued_unmap_end(std::uintptr_t va,
                                                std::size_t bytes) const noexcept override {
    return inner_vm_ != nullptr ? inner_vm_->queued_unmap_end(va, bytes) : 0;
  }

  [[nodiscard]] DeviceBackend& inner() noexcept { return *inner_; }

 protected:
  [[nodiscard]] void* do_reserve(std::size_t bytes) override;
  void do_release(void* ptr, std::size_t bytes) noexcept override;

 private:
  // ---- VirtualMemory, forwarded to the wrapped backend's ----
  [[nodiscard]] std::size_t granularity() const noexcept override { return inner_vm_->granularity(); }
  [[nodiscard]] std::uintptr_t reserve_address(std::size_t bytes) override {
    return inner_vm_->reserve_address(bytes);
  }
  void free_address(std::uintptr_t va, std::size_t bytes) noexcept override {
    inner_vm_->free_address(va, bytes);
  }
  [[nodiscard]] PhysicalHandle do_create_physical(std::size_t bytes) override {
    return inner_vm_->create_physical(bytes);
  }
  void do_release_physical(PhysicalHandle handle, std::size_t bytes) noexcept override {
    inner_vm_->release_physical(handle, bytes);
  }
  void do_map(std::uintptr_t va, std::size_t bytes, PhysicalHandle handle) override;
  void do_unmap(std::uintptr_t va, std::size_t bytes) override;
  void do_unmap_after(std::uintptr_t va, std::size_t bytes, StreamId stream) override;
  void do_unmap_now(std::uintptr_t va, std::size_t bytes) override;
  [[nodiscard]] std::uint64_t unmap_wait_ns() const noexcept override { return inner_vm_->unmap_wait_ns(); }
  void do_release_unmapped(PhysicalHandle handle, std::size_t bytes) noexcept override {
    inner_vm_->release_unmapped(handle, bytes);
  }
  void do_map_run(std::uintptr_t va, std::span<const MapPiece> pieces) override;

  std::unique_ptr<DeviceBackend> inner_;
  VirtualMemory* inner_vm_;
  Recorder& recorder_;
};

}  // namespace cachealloc::plugin
