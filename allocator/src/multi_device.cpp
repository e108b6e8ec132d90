// multi_device.cpp: per-device routing (see multi_device.h).
#include <cachealloc/errors.h>
#include <cachealloc/multi_device.h>

#include <cstdio>
#include <string>

namespace cachealloc {

MultiDeviceAllocator::MultiDeviceAllocator(int device_count, Factory factory)
    : factory_(std::move(factory)) {
  if (device_count < 0) {
    throw UsageError("device count must not be negative, got " + std::to_string(device_count));
  }
  slots_.reserve(static_cast<std::size_t>(device_count));
  for (int i = 0; i < device_count; ++i) {
    slots_.push_back(std::make_unique<Slot>());
  }
}

MultiDeviceAllocator::~MultiDeviceAllocator() = default;

void MultiDeviceAllocator::check_index(int device) const {
  if (device < 0 || device >= device_count()) {
    throw UsageError("cachealloc: device " + std::to_string(device) + " does not exist (" +
                     std::to_string(device_count()) + " device(s) visible)");
  }
}

DeviceAllocator& MultiDeviceAllocator::device(int device) {
  check_index(device);
  Slot& slot = *slots_[static_cast<std::size_t>(device)];
  if (DeviceAllocator* a = slot.allocator.load(std::memory_order_acquire)) {
    return *a;
  }
  std::call_once(slot.once, [&] {
    slot.owned = factory_(device);
    slot.allocator.store(slot.owned.get(), std::memory_order_release);
  });
  return *slot.allocator.load(std::memory_order_acquire);
}

DeviceAllocator* MultiDeviceAllocator::created(int device) const noexcept {
  if (device < 0 || device >= device_count()) {
    return nullptr;
  }
  return slots_[static_cast<std::size_t>(device)]->allocator.load(std::memory_order_acquire);
}

void* MultiDeviceAllocator::allocate(std::size_t bytes, int device_index, StreamId stream) {
  return device(device_index).allocate(bytes, stream);
}

int MultiDeviceAllocator::owner(const void* ptr) const {
  for (int d = 0; d < device_count(); ++d) {
    if (DeviceAllocator* a = created(d); a != nullptr && a->find(ptr)) {
      return d;
    }
  }
  return -1;
}

void MultiDeviceAllocator::deallocate(void* ptr, int device_index) {
  if (ptr == nullptr) {
    return;
  }
  check_index(device_index);
  DeviceAllocator* a = created(device_index);
  if (a != nullptr && a->find(ptr)) {
    a->deallocate(ptr);
    return;
  }
  const int actual = owner(ptr);
  char addr[32];
  std::snprintf(addr, sizeof addr, "%p", ptr);
  if (actual >= 0) {
    throw UsageError("cachealloc: pointer " + std::string(addr) + " was freed on device " +
                     std::to_string(device_index) + " but belongs to device " +
                     std::to_string(actual) + "; free it on its own device. Nothing was changed.");
  }
  throw UsageError("cachealloc: free of pointer " + std::string(addr) + " on device " +
                   std::to_string(device_index) +
                   ", which is not a live allocation of any device (double free or foreign "
                   "pointer). Nothing was changed.");
}

void MultiDeviceAllocator::deallocate(void* ptr) {
  if (ptr == nullptr) {
    return;
  }
  const int d = owner(ptr);
  if (d < 0) {
    char addr[32];
    std::snprintf(addr, sizeof addr, "%p", ptr);
    throw UsageError("cachealloc: free of pointer " + std::string(addr) +
                     ", which is not a live allocation of any device (double free or foreign "
                     "pointer). Nothing was changed.");
  }
  created(d)->deallocate(ptr);
}

void MultiDeviceAllocator::record_stream(void* ptr, StreamId stream) {
  const int d = owner(ptr);
  if (d < 0) {
    throw UsageError("cachealloc: record_stream of a pointer that is not a live allocation");
  }
  created(d)->record_stream(ptr, stream);
}

void MultiDeviceAllocator::empty_cache(int device_index) {
  check_index(device_index);
  if (DeviceAllocator* a = created(device_index)) {
    a->empty_cache();
  }
}

void MultiDeviceAllocator::empty_cache_all() {
  for (int d = 0; d < device_count(); ++d) {
    empty_cache(d);
  }
}

Stats MultiDeviceAllocator::stats(int device_index) {
  check_index(device_index);
  DeviceAllocator* a = created(device_index);
  return a != nullptr ? a->stats() : Stats{};
}

}  // namespace cachealloc
