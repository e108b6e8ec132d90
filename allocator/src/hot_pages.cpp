// hot_pages.cpp: Note [Bookkeeping on few pages] (hot_pages.h).
#include <cachealloc/hot_pages.h>

#include <pthread.h>
#include <sys/mman.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <string_view>

namespace cachealloc::hot {
namespace {

constexpr std::size_t kLine = 64;
constexpr std::size_t kPage = 4096;
constexpr std::size_t kLineClasses = kPage / kLine;     // 64, 128, ..., 4096 bytes
constexpr std::size_t kPageClasses = 9;                  // 4 KiB, 8 KiB, 16 KiB, ..., 1 MiB
static_assert(kPage << (kPageClasses - 1) == kMaxBlock);

struct FreeBlock {
  FreeBlock* next;
};

#if defined(__SANITIZE_ADDRESS__)
#define CACHEALLOC_HOT_PAGES_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define CACHEALLOC_HOT_PAGES_ASAN 1
#endif
#endif

/// Under AddressSanitizer the regions would hide the bookkeeping's overflows from it (no redzones
/// between their blocks): the heap by default there.
#ifdef CACHEALLOC_HOT_PAGES_ASAN
constexpr Mode kDefaultMode = Mode::off;
#else
constexpr Mode kDefaultMode = Mode::huge;
#endif

Mode read_mode() noexcept {
  const char* v = std::getenv("CACHEALLOC_HOT_PAGES");
  if (v == nullptr || *v == '\0') {
    return kDefaultMode;
  }
  const std::string_view s(v);
  if (s == "huge") {
    return Mode::huge;
  }
  if (s == "small") {
    return Mode::small;
  }
  if (s == "off") {
    return Mode::off;
  }
  std::fprintf(stderr,
               "cachealloc: CACHEALLOC_HOT_PAGES=%s is not one of huge, small, off; using %s "
               "(Note [Bookkeeping on few pages], hot_pages.h)\n",
               v, kDefaultMode == Mode::huge ? "huge" : "off");
  return kDefaultMode;
}

class Regions {
 public:
  Mode mode() const noexcept { return mode_; }

  void* allocate(std::size_t bytes, std::size_t align) {
    if (mode_ == Mode::off || bytes > kMaxBlock || align > kPage) {
      return fallback(bytes, align);
    }
    std::lock_guard lock(mutex_);
    const auto [cls, block] = class_of(bytes, align);
    if (FreeBlock* f = free_[cls]; f != nullptr) {
      free_[cls] = f->next;
      in_use_ += block;
      return f;
    }
    void* p = carve(block, block > kPage || align > kLine ? kPage : kLine);
    if (p == nullptr) {
      ++fallbacks_;
      return fallback(bytes, align);
    }
    in_use_ += block;
    return p;
  }

  void deallocate(void* p, std::size_t bytes, std::size_t align) noexcept {
    if (p == nullptr) {
      return;
    }
    if (!owns(p)) {
      // The unsized forms: clang before 19 does not declare the sized ones by default.
      if (align > __STDCPP_DEFAULT_NEW_ALIGNMENT__) {
        ::operator delete(p, std::align_val_t(align));
      } else {
        ::operator delete(p);
      }
      return;
    }
    std::lock_guard lock(mutex_);
    const auto [cls, block] = class_of(bytes, align);
    auto* f = static_cast<FreeBlock*>(p);
    f->next = free_[cls];
    free_[cls] = f;
    in_use_ -= block;
  }

  bool owns(const void* p) const noexcept {
    const auto a = reinterpret_cast<std::uintptr_t>(p) & ~(kRegionBytes - 1);
    const std::size_t n = count_.load(std::memory_order_acquire);
    for (std::size_t i = 0; i < n; ++i) {
      if (bases_[i] == a) {
        return true;
      }
    }
    return false;
  }

  Usage usage() {
    Usage u;
    std::array<std::uintptr_t, kMaxRegions> bases{};
    std::size_t n = 0;
    {
      std::lock_guard lock(mutex_);
      u.mode = mode_;
      n = count_.load(std::memory_order_relaxed);
      u.regions = n;
      u.bytes_in_use = in_use_;
      u.bytes_carved = n == 0 ? 0 : (n - 1) * kRegionBytes + bump_;
      u.fallback_allocations = fallbacks_;
      std::copy_n(bases_.begin(), n, bases.begin());
    }
    // /proc/self/smaps: a mapping's header line "start-end perms ...", then "AnonHugePages: N kB".
    std::ifstream in("/proc/self/smaps");
    if (!in) {
      return u;
    }
    u.huge_bytes_known = true;
    bool ours = false;
    std::size_t huge = 0;
    for (std::string line; std::getline(in, line);) {
      // A mapping's header: "start-end perms offset dev inode [path]" (no ':' before the dev).
      const std::size_t dash = line.find('-');
      if (dash != std::string::npos && dash > 0 && line.find(' ') > dash &&
          std::isxdigit(static_cast<unsigned char>(line[0])) != 0) {
        const std::uintptr_t start = std::strtoull(line.c_str(), nullptr, 16);
        const std::uintptr_t end = std::strtoull(line.c_str() + dash + 1, nullptr, 16);
        ours = false;
        for (std::size_t i = 0; i < n; ++i) {
          ours = ours || (start < bases[i] + kRegionBytes && end > bases[i]);
        }
        continue;
      }
      if (ours && line.rfind("AnonHugePages:", 0) == 0) {
        huge += std::strtoull(line.c_str() + 14, nullptr, 10) * 1024;
      }
    }
    // A mapping may hold more than regions (the kernel merges neighbours with equal flags).
    u.huge_bytes = std::min(huge, n * kRegionBytes);
    return u;
  }

  static Regions& get() {
    static Regions* r = new Regions();  // never destroyed: blocks may be given back at exit
    return *r;
  }

 private:
  Regions() : mode_(read_mode()) {
    // A fork while another thread holds the lock would leave the child's copy locked forever.
    pthread_atfork([] { get().mutex_.lock(); }, [] { get().mutex_.unlock(); },
                   [] { get().mutex_.unlock(); });
  }

  /// The size class of a request and the bytes of its blocks.
  static std::pair<std::size_t, std::size_t> class_of(std::size_t bytes, std::size_t align) noexcept {
    if (bytes <= kPage && align <= kLine) {
      const std::size_t lines = bytes == 0 ? 1 : (bytes + kLine - 1) / kLine;
      return {lines - 1, lines * kLine};
    }
    // Powers of two: a freed block serves any request of its class (the containers that ask
    // for pages grow geometrically anyway), so random sizes do not strand blocks.
    std::size_t cls = 0;
    while ((kPage << cls) < bytes) {
      ++cls;
    }
    return {kLineClasses + cls, kPage << cls};
  }

  static void* fallback(std::size_t bytes, std::size_t align) {
    if (align > __STDCPP_DEFAULT_NEW_ALIGNMENT__) {
      return ::operator new(bytes, std::align_val_t(align));
    }
    return ::operator new(bytes);
  }

  /// `block` bytes at `align` from the current region, or a new one; nullptr when none can be
  /// mapped. The tail of a region too short for a request goes to the free lists.
  void* carve(std::size_t block, std::size_t align) {
    std::size_t n = count_.load(std::memory_order_relaxed);
    if (n != 0) {
      const std::size_t at = (bump_ + align - 1) & ~(align - 1);
      if (at + block <= kRegionBytes) {
        give_away(bump_, at);
        bump_ = at + block;
        return reinterpret_cast<void*>(bases_[n - 1] + at);
      }
      give_away(bump_, kRegionBytes);
      bump_ = kRegionBytes;
    }
    if (n == kMaxRegions || !map_region()) {
      return nullptr;
    }
    bump_ = block;
    return reinterpret_cast<void*>(bases_[count_.load(std::memory_order_relaxed) - 1]);
  }

  /// Puts [from, to) of the current region on the line classes' free lists (line aligned pieces).
  void give_away(std::size_t from, std::size_t to) noexcept {
    const std::size_t n = count_.load(std::memory_order_relaxed);
    from = (from + kLine - 1) & ~(kLine - 1);
    while (from + kLine <= to) {
      // The largest line class that fits, so that the free lists get few, large pieces.
      const std::size_t piece = std::min(kPage, (to - from) & ~(kLine - 1));
      auto* f = reinterpret_cast<FreeBlock*>(bases_[n - 1] + from);
      const std::size_t cls = piece / kLine - 1;
      f->next = free_[cls];
      free_[cls] = f;
      from += piece;
    }
  }

  bool map_region() noexcept {
    // Map twice the size, keep the 2 MiB-aligned middle.
    void* raw = mmap(nullptr, 2 * kRegionBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) {
      return false;
    }
    const auto start = reinterpret_cast<std::uintptr_t>(raw);
    const std::uintptr_t base = (start + kRegionBytes - 1) & ~(kRegionBytes - 1);
    if (base > start) {
      munmap(raw, base - start);
    }
    const std::uintptr_t end = start + 2 * kRegionBytes;
    if (end > base + kRegionBytes) {
      munmap(reinterpret_cast<void*>(base + kRegionBytes), end - (base + kRegionBytes));
    }
#if defined(MADV_HUGEPAGE)
    if (mode_ == Mode::huge) {
      madvise(reinterpret_cast<void*>(base), kRegionBytes, MADV_HUGEPAGE);  // advice: failure is fine
    }
#endif
    const std::size_t n = count_.load(std::memory_order_relaxed);
    bases_[n] = base;
    count_.store(n + 1, std::memory_order_release);
    return true;
  }

  const Mode mode_;
  std::mutex mutex_;
  std::array<FreeBlock*, kLineClasses + kPageClasses> free_{};
  std::array<std::uintptr_t, kMaxRegions> bases_{};  // written before count_ is raised
  std::atomic<std::size_t> count_{0};
  std::size_t bump_ = 0;  // carved bytes of the last region
  std::size_t in_use_ = 0;
  std::size_t fallbacks_ = 0;
};

}  // namespace

Mode mode() noexcept { return Regions::get().mode(); }

const char* mode_name(Mode m) noexcept {
  switch (m) {
    case Mode::huge:
      return "huge";
    case Mode::small:
      return "small";
    case Mode::off:
      return "off";
  }
  return "?";
}

void* allocate(std::size_t bytes, std::size_t align) { return Regions::get().allocate(bytes, align); }

void deallocate(void* p, std::size_t bytes, std::size_t align) noexcept {
  Regions::get().deallocate(p, bytes, align);
}

bool owns(const void* p) noexcept { return Regions::get().owns(p); }

Usage usage() { return Regions::get().usage(); }

}  // namespace cachealloc::hot
