// multi_device.h: one allocator per device, created lazily, routed by the device the caller names.
//
// The caller's device argument decides where memory comes from (never the "current" device),
// a pointer is freed on the device that owns it, and a pointer named with the wrong device is
// rejected with a message naming both devices, before anything changes.
#pragma once

#include <cachealloc/allocator.h>
#include <cachealloc/stats.h>
#include <cachealloc/types.h>

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

namespace cachealloc {

class MultiDeviceAllocator {
 public:
  /// Builds the allocator of `device` on first use (called at most once per device).
  using Factory = std::function<std::unique_ptr<DeviceAllocator>(int device)>;

  MultiDeviceAllocator(int device_count, Factory factory);
  ~MultiDeviceAllocator();
  MultiDeviceAllocator(const MultiDeviceAllocator&) = delete;
  MultiDeviceAllocator& operator=(const MultiDeviceAllocator&) = delete;

  [[nodiscard]] int device_count() const noexcept { return static_cast<int>(slots_.size()); }

  /// The allocator of `device`, created on first use. Throws UsageError for a bad index.
  DeviceAllocator& device(int device);
  /// The allocator of `device` if it was created, else nullptr.
  [[nodiscard]] DeviceAllocator* created(int device) const noexcept;

  [[nodiscard]] void* allocate(std::size_t bytes, int device, StreamId stream);
  /// Frees `ptr`, which must belong to `device`. A pointer of another device, or of none, throws
  /// UsageError naming the owner (if any); nothing changes.
  void deallocate(void* ptr, int device);
  /// Frees `ptr` on whichever device owns it (from any thread); UsageError if none does.
  void deallocate(void* ptr);
  /// The device owning `ptr`, or -1.
  [[nodiscard]] int owner(const void* ptr) const;
  void record_stream(void* ptr, StreamId stream);
  void empty_cache(int device);
  void empty_cache_all();
  [[nodiscard]] Stats stats(int device);

 private:
  struct Slot {
    std::once_flag once;
    std::atomic<DeviceAllocator*> allocator{nullptr};
    std::unique_ptr<DeviceAllocator> owned;
  };
  void check_index(int device) const;

  Factory factory_;
  std::vector<std::unique_ptr<Slot>> slots_;
};

}  // namespace cachealloc
