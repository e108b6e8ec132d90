// backend.cpp: the non-virtual half of the backend contract: counting and limits.
#include <cachealloc/backend.h>

#include <chrono>

namespace cachealloc {

// Note [Time in device calls]
// A policy's time inside the allocator is mostly its own code until it calls the device; then
// one call costs as much as hundreds of allocations (inside training steps on the H200:
// cuMemCreate 15-35 us, cuMemMap + cuMemSetAccess 33-45 us per handle, cuMemUnmap 124 us,
// cudaMalloc 228-262 us; bench/results/e2e_h200_2026-12-03_session14a_call_times.md). Which
// calls cost what inside a step decides what a policy should avoid, so the non-virtual entry
// points below time every call by kind (BackendCounters::*_ns), failed ones included, on the
// backend's clock (detail::TimedCall): two clock reads (tens of nanoseconds) against calls of
// microseconds.
using detail::TimedCall;

std::uint64_t DeviceBackend::clock_ns() const noexcept {
  return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                        std::chrono::steady_clock::now().time_since_epoch())
                                        .count());
}

void* DeviceBackend::reserve(std::size_t bytes) {
  if (!within_limit(bytes)) {
    ++counters_.failed_reserves;
    return nullptr;
  }
  void* ptr = nullptr;
  {
    const TimedCall timed(*this, counters_.reserve_ns);
    ptr = do_reserve(bytes);
  }
  if (ptr == nullptr) {
    ++counters_.failed_reserves;
    return nullptr;
  }
  ++counters_.reserve_calls;
  held_bytes_ += bytes;
  return ptr;
}

void DeviceBackend::release(void* ptr, std::size_t bytes) noexcept {
  {
    const TimedCall timed(*this, counters_.release_ns);
    do_release(ptr, bytes);
  }
  ++counters_.release_calls;
  held_bytes_ -= bytes;
}

PhysicalHandle VirtualMemory::create_physical(std::size_t bytes) {
  DeviceBackend& b = *owner_;
  if (!b.within_limit(bytes)) {
    ++b.counters_.failed_reserves;
    return 0;
  }
  PhysicalHandle h = 0;
  {
    const TimedCall timed(b, b.counters_.create_ns);
    h = do_create_physical(bytes);
  }
  if (h == 0) {
    ++b.counters_.failed_reserves;
    return 0;
  }
  ++b.counters_.physical_creates;
  b.held_bytes_ += bytes;
  physical_bytes_ += bytes;
  return h;
}

void VirtualMemory::release_physical(PhysicalHandle handle, std::size_t bytes) noexcept {
  release_handle(handle, bytes, /*unmapped=*/false);
}

void VirtualMemory::release_unmapped(PhysicalHandle handle, std::size_t bytes) noexcept {
  release_handle(handle, bytes, /*unmapped=*/true);
}

void VirtualMemory::release_handle(PhysicalHandle handle, std::size_t bytes, bool unmapped) noexcept {
  DeviceBackend& b = *owner_;
  {
    const TimedCall timed(b, b.counters_.release_physical_ns);
    if (unmapped) {
      do_release_unmapped(handle, bytes);
    } else {
      do_release_physical(handle, bytes);
    }
  }
  ++b.counters_.physical_releases;
  b.held_bytes_ -= bytes;
  physical_bytes_ -= bytes;
}

void VirtualMemory::map(std::uintptr_t va, std::size_t bytes, PhysicalHandle handle) {
  {
    const TimedCall timed(*owner_, owner_->counters_.map_ns);
    do_map(va, bytes, handle);
  }
  ++owner_->counters_.map_calls;
  owner_->counters_.mapped_bytes += bytes;
}

void VirtualMemory::map_run(std::uintptr_t va, std::span<const MapPiece> pieces) {
  {
    const TimedCall timed(*owner_, owner_->counters_.map_ns);
    do_map_run(va, pieces);
  }
  for (const MapPiece& p : pieces) {
    ++owner_->counters_.map_calls;
    owner_->counters_.mapped_bytes += p.bytes;
  }
}

void VirtualMemory::do_map_run(std::uintptr_t va, std::span<const MapPiece> pieces) {
  std::size_t done = 0;
  std::uintptr_t at = va;
  try {
    for (; done < pieces.size(); ++done) {
      do_map(at, pieces[done].bytes, pieces[done].handle);
      at += pieces[done].bytes;
    }
  } catch (...) {
    if (at > va) {
      try {
        do_unmap(va, at - va);
      } catch (...) {  // NOLINT(bugprone-empty-catch): the first error is the one to report
      }
    }
    throw;
  }
}

void VirtualMemory::do_unmap_after(std::uintptr_t va, std::size_t bytes, StreamId stream) {
  const EventId event = owner_->record_event(stream);
  try {
    owner_->synchronize_event(event);
  } catch (...) {
    owner_->destroy_event(event);
    throw;
  }
  owner_->destroy_event(event);
  do_unmap(va, bytes);
}

void VirtualMemory::unmap_after(std::uintptr_t va, std::size_t bytes, StreamId stream) {
  {
    const TimedCall timed(*owner_, owner_->counters_.unmap_ns);
    do_unmap_after(va, bytes, stream);
  }
  ++owner_->counters_.unmap_calls;
  owner_->counters_.unmapped_bytes += bytes;
}

void VirtualMemory::unmap_now(std::uintptr_t va, std::size_t bytes) {
  {
    const TimedCall timed(*owner_, owner_->counters_.unmap_ns);
    do_unmap_now(va, bytes);
  }
  ++owner_->counters_.unmap_calls;
  owner_->counters_.unmapped_bytes += bytes;
}

void VirtualMemory::unmap(std::uintptr_t va, std::size_t bytes) {
  {
    const TimedCall timed(*owner_, owner_->counters_.unmap_ns);
    do_unmap(va, bytes);
  }
  ++owner_->counters_.unmap_calls;
  owner_->counters_.unmapped_bytes += bytes;
}

}  // namespace cachealloc
