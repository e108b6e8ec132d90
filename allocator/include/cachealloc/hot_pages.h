// hot_pages.h: the allocator's own bookkeeping (pointer map, B+tree nodes, defrag's ranges, the
// front end itself) kept together in memory the kernel may back with 2 MiB pages.
//
// Note [Bookkeeping on few pages]
// Inside a training step every allocator call finds the CPU's caches cold (Note [Hot fields
// first], allocator.h), and its translation caches (TLBs) too: between two calls Python, the
// dispatcher and the driver run megabytes of code over many pages. A call then pays a page walk
// for each 4 KiB page it touches, two-dimensional on a virtual machine, as the GPU hosts are.
// Counted with valgrind's lackey on the e2e pipeline's recording, a defrag call touched 7 code
// pages and 11-14 data pages of the heap: the front end, the pointer map's slots, B+tree leaves
// and range nodes allocated one by one among the program's other heap blocks. With
// cachealloc-cold-replay --evict-pages (which evicts the TLBs before every call) a defrag
// alloc+free pair cost 2.8 us against 1.6 us with the caches alone evicted, on an H100 host
// (bench/results/defrag_session54_2026-12-07.md).
//
// So that bookkeeping comes from here: regions of 2 MiB, aligned to 2 MiB and advised
// MADV_HUGEPAGE, carved into size classes (multiples of 64 bytes up to 4 KiB, powers of two from
// 4 KiB to 1 MiB) with a free list per class. Where the kernel grants a huge page (transparent
// huge pages "always", or "madvise" as on the GPU hosts), one TLB entry covers all of a region;
// where it does not, the bookkeeping is still packed on a few small pages instead of spread over
// the heap.
// Blocks are never returned to the kernel (a job's bookkeeping stays near its peak anyway); a
// request above 1 MiB, or one that finds no room once kMaxRegions are in use, goes to
// ::operator new, and deallocate() tells the two apart by address.
//
// CACHEALLOC_HOT_PAGES (read once, at the first allocation): `huge` (default) as above; `small`
// the same regions without the advice (packed 4 KiB pages); `off` every request from
// ::operator new, as before session 54. Unknown values are reported on stderr and mean the
// default. Under AddressSanitizer the default is `off`, so that it keeps its redzones around the
// bookkeeping's blocks.
// Thread-safe: one lock, taken only when a container grows or a node is made, never on an
// allocator call's common path.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <new>
#include <string>

namespace cachealloc::hot {

enum class Mode : unsigned char { huge, small, off };

/// The mode in force (CACHEALLOC_HOT_PAGES, read at the first call of any function here).
[[nodiscard]] Mode mode() noexcept;
[[nodiscard]] const char* mode_name(Mode m) noexcept;

/// `bytes` with alignment `align` (a power of two, at most 4096): from a region, or from
/// ::operator new. Throws std::bad_alloc as operator new does.
[[nodiscard]] void* allocate(std::size_t bytes, std::size_t align = alignof(std::max_align_t));
/// Gives back what allocate(bytes, align) returned (the same bytes and align).
void deallocate(void* p, std::size_t bytes, std::size_t align = alignof(std::max_align_t)) noexcept;

/// Whether `p` lies in one of the regions.
[[nodiscard]] bool owns(const void* p) noexcept;

struct Usage {
  Mode mode = Mode::huge;
  std::size_t regions = 0;        ///< 2 MiB regions mapped
  std::size_t bytes_in_use = 0;   ///< handed out from the regions and not given back
  std::size_t bytes_carved = 0;   ///< of the regions, carved into blocks so far
  std::size_t fallback_allocations = 0;  ///< requests served by ::operator new in a region mode
  std::size_t huge_bytes = 0;     ///< of the regions, backed by huge pages (/proc/self/smaps)
  bool huge_bytes_known = false;  ///< whether /proc/self/smaps could be read
};
/// A snapshot, with the regions' huge-page backing read from /proc/self/smaps (up to milliseconds
/// in a process with many mappings: for diagnostics, not for a hot path or memory_stats).
[[nodiscard]] Usage usage();

/// Largest request served from a region.
inline constexpr std::size_t kMaxBlock = std::size_t{1} << 20;
inline constexpr std::size_t kRegionBytes = std::size_t{2} << 20;
inline constexpr std::size_t kMaxRegions = 64;

/// A standard allocator on the regions (stateless: every instance is the same).
template <class T>
struct Allocator {
  using value_type = T;
  Allocator() noexcept = default;
  template <class U>
  Allocator(const Allocator<U>& /*other*/) noexcept {}  // NOLINT(google-explicit-constructor)
  [[nodiscard]] T* allocate(std::size_t n) {
    if (n > std::numeric_limits<std::size_t>::max() / sizeof(T)) {
      throw std::bad_array_new_length();
    }
    return static_cast<T*>(hot::allocate(n * sizeof(T), alignof(T)));
  }
  void deallocate(T* p, std::size_t n) noexcept { hot::deallocate(p, n * sizeof(T), alignof(T)); }
  friend bool operator==(const Allocator&, const Allocator&) noexcept { return true; }
};

/// Deleter for unique_ptr of objects made with make<T>().
template <class T>
struct Delete {
  void operator()(T* p) const noexcept {
    p->~T();
    hot::deallocate(p, sizeof(T), alignof(T));
  }
};
template <class T>
using Ptr = std::unique_ptr<T, Delete<T>>;

template <class T, class... Args>
[[nodiscard]] Ptr<T> make(Args&&... args) {
  void* p = hot::allocate(sizeof(T), alignof(T));
  try {
    return Ptr<T>(new (p) T(std::forward<Args>(args)...));
  } catch (...) {
    hot::deallocate(p, sizeof(T), alignof(T));
    throw;
  }
}

/// Base for classes whose objects live on the regions when made with `new` (the front end,
/// defrag's engine): class-specific operator new and delete for `Derived` (CRTP), which must be
/// the most derived type. Every usual form of operator delete is declared, sized or not, aligned
/// or not, so that the one a new-expression calls when the constructor throws gives the block
/// back: with only the sized forms, GCC 12 called none and the block leaked (ASan, session 54).
/// Each form knows the block from sizeof and alignof Derived.
template <class Derived>
struct Object {
  static void* operator new(std::size_t bytes) { return allocate_for(bytes); }
  static void* operator new(std::size_t bytes, std::align_val_t /*align*/) { return allocate_for(bytes); }
  static void operator delete(void* p) noexcept { give_back(p); }
  static void operator delete(void* p, std::size_t /*bytes*/) noexcept { give_back(p); }
  static void operator delete(void* p, std::align_val_t /*align*/) noexcept { give_back(p); }
  static void operator delete(void* p, std::size_t /*bytes*/, std::align_val_t /*align*/) noexcept { give_back(p); }

 private:
  static void* allocate_for(std::size_t bytes) {
    if (bytes != sizeof(Derived)) {  // a class derived from Derived: not what this base serves
      throw std::bad_alloc();
    }
    return hot::allocate(sizeof(Derived), alignof(Derived));
  }
  static void give_back(void* p) noexcept { hot::deallocate(p, sizeof(Derived), alignof(Derived)); }
};

}  // namespace cachealloc::hot
