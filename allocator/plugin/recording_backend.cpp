// recording_backend.cpp: forwarding plus segment events (see recording_backend.h).
#include "recording_backend.h"

namespace cachealloc::plugin {

RecordingBackend::RecordingBackend(std::unique_ptr<DeviceBackend> inner, Recorder& recorder)
    : inner_(std::move(inner)), inner_vm_(inner_->virtual_memory()), recorder_(recorder) {
  if (inner_vm_ != nullptr) {
    attach(*this);
  }
}

RecordingBackend::~RecordingBackend() = default;

void* RecordingBackend::do_reserve(std::size_t bytes) {
  void* ptr = inner_->reserve(bytes);
  if (ptr != nullptr) {
    recorder_.record(trace::Action::segment_alloc, device(), reinterpret_cast<std::uintptr_t>(ptr),
                     bytes, 0);
  }
  return ptr;
}

void RecordingBackend::do_release(void* ptr, std::size_t bytes) noexcept {
  recorder_.record(trace::Action::segment_free, device(), reinterpret_cast<std::uintptr_t>(ptr),
                   bytes, 0);
  inner_->release(ptr, bytes);
}

void RecordingBackend::do_map(std::uintptr_t va, std::size_t bytes, PhysicalHandle handle) {
  inner_vm_->map(va, bytes, handle);
  recorder_.record(trace::Action::segment_map, device(), va, bytes, 0);
}

void RecordingBackend::do_map_run(std::uintptr_t va, std::span<const MapPiece> pieces) {
  inner_vm_->map_run(va, pieces);
  for (const MapPiece& p : pieces) {
    recorder_.record(trace::Action::segment_map, device(), va, p.bytes, 0);
    va += p.bytes;
  }
}

void RecordingBackend::do_unmap(std::uintptr_t va, std::size_t bytes) {
  inner_vm_->unmap(va, bytes);
  recorder_.record(trace::Action::segment_unmap, device(), va, bytes, 0);
}

void RecordingBackend::do_unmap_now(std::uintptr_t va, std::size_t bytes) {
  inner_vm_->unmap_now(va, bytes);
  recorder_.record(trace::Action::segment_unmap, device(), va, bytes, 0);
}

void RecordingBackend::do_unmap_after(std::uintptr_t va, std::size_t bytes, StreamId stream) {
  inner_vm_->unmap_after(va, bytes, stream);
  recorder_.record(trace::Action::segment_unmap, device(), va, bytes, 0);
}

}  // namespace cachealloc::plugin
