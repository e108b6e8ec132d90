// capture_guard_backend.cpp: event deferral during CUDA graph capture (capture_guard_backend.h).
#include "capture_guard_backend.h"

#include <cachealloc/errors.h>

#include <string>

namespace cachealloc::torch_adapter {

CaptureGuardBackend::CaptureGuardBackend(std::unique_ptr<DeviceBackend> inner,
                                         const std::atomic<int>& captures_underway, CaptureMode mode)
    : inner_(std::move(inner)), inner_vm_(inner_->virtual_memory()), captures_(captures_underway), mode_(mode) {
  if (inner_vm_ != nullptr) {
    attach(*this);
  }
}

CaptureGuardBackend::~CaptureGuardBackend() {
  // The allocator above is being destroyed, so no stream work it handed out is pending any more
  // (the adapter destroys private pools only when no capture is underway).
  for (auto& [ptr, bytes] : deferred_releases_) {
    inner_->release(ptr, bytes);
  }
  for (auto& [id, ev] : deferred_events_) {
    if (ev.real != 0) {
      inner_->destroy_event(ev.real);
    }
  }
}

void CaptureGuardBackend::settle() noexcept {
  if (deferred_releases_.empty() || capturing()) {
    return;
  }
  for (auto& [ptr, bytes] : deferred_releases_) {
    inner_->release(ptr, bytes);
  }
  deferred_releases_.clear();
}

EventId CaptureGuardBackend::record_event(StreamId stream) {
  if (!capturing()) {
    settle();
    return inner_->record_event(stream);
  }
  const EventId id = kDeferredBit | next_deferred_++;
  deferred_events_.emplace(id, DeferredEvent{stream, 0});
  return id;
}

EventId CaptureGuardBackend::realize(EventId deferred) {
  DeferredEvent& ev = deferred_events_.at(deferred);
  if (ev.real == 0) {
    ev.real = inner_->record_event(ev.stream);
  }
  return ev.real;
}

bool CaptureGuardBackend::query_event(EventId event) {
  if (capturing()) {
    return false;  // Note [Deferred events during capture]: ask again after the capture
  }
  settle();
  return inner_->query_event((event & kDeferredBit) != 0 ? realize(event) : event);
}

bool CaptureGuardBackend::stream_wait_event(StreamId stream, EventId event) {
  if (capturing()) {
    return false;
  }
  settle();
  return inner_->stream_wait_event(stream, (event & kDeferredBit) != 0 ? realize(event) : event);
}

void CaptureGuardBackend::synchronize_event(EventId event) {
  if (capturing()) {
    throw DeviceError(
        "cachealloc: cannot wait for another stream's work while a CUDA graph is being captured "
        "(a block freed after record_stream() is still in use); free it after the capture, or give "
        "the graph more memory");
  }
  settle();
  inner_->synchronize_event((event & kDeferredBit) != 0 ? realize(event) : event);
}

void CaptureGuardBackend::destroy_event(EventId event) noexcept {
  if ((event & kDeferredBit) == 0) {
    inner_->destroy_event(event);
    return;
  }
  const auto it = deferred_events_.find(event);
  if (it == deferred_events_.end()) {
    return;
  }
  if (it->second.real != 0) {
    inner_->destroy_event(it->second.real);
  }
  deferred_events_.erase(it);
}

void* CaptureGuardBackend::do_reserve(std::size_t bytes) {
  settle();
  const Relaxed relaxed(*this);
  return inner_->reserve(bytes);
}

void CaptureGuardBackend::do_release(void* ptr, std::size_t bytes) noexcept {
  if (capturing()) {
    try {
      deferred_releases_.emplace_back(ptr, bytes);
      return;
    } catch (...) {  // NOLINT(bugprone-empty-catch): out of host memory: free at once below
    }
  }
  settle();
  inner_->release(ptr, bytes);
}

PhysicalHandle CaptureGuardBackend::do_create_physical(std::size_t bytes) {
  const Relaxed relaxed(*this);
  return inner_vm_->create_physical(bytes);
}

void CaptureGuardBackend::do_map(std::uintptr_t va, std::size_t bytes, PhysicalHandle handle) {
  const Relaxed relaxed(*this);
  inner_vm_->map(va, bytes, handle);
}

void CaptureGuardBackend::do_map_run(std::uintptr_t va, std::span<const MapPiece> pieces) {
  const Relaxed relaxed(*this);
  inner_vm_->map_run(va, pieces);
}

void CaptureGuardBackend::do_unmap(std::uintptr_t va, std::size_t bytes) {
  const Relaxed relaxed(*this);
  inner_vm_->unmap(va, bytes);
}

void CaptureGuardBackend::do_unmap_now(std::uintptr_t va, std::size_t bytes) {
  const Relaxed relaxed(*this);
  inner_vm_->unmap_now(va, bytes);
}

void CaptureGuardBackend::do_unmap_after(std::uintptr_t va, std::size_t bytes, StreamId stream) {
  if (capturing()) {
    VirtualMemory::do_unmap_after(va, bytes, stream);  // waits: throws, as synchronize_event does
    return;
  }
  settle();
  inner_vm_->unmap_after(va, bytes, stream);
}

}  // namespace cachealloc::torch_adapter
