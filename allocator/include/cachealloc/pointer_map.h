// pointer_map.h: the front end's pointer -> allocation map.
//
// Open addressing with linear probing and backward-shift deletion (no tombstones), keys are
// device addresses (never 0). Lookups touch one or two cache lines, which is what keeps a
// cached alloc+free pair under a tenth of a microsecond; std::unordered_map allocates a node
// per insert and costs several times more.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include <cachealloc/hot_pages.h>

namespace cachealloc {

template <class V>
class PointerMap {
 public:
  PointerMap() { slots_.resize(kInitialCapacity); }

  [[nodiscard]] std::size_t size() const noexcept { return size_; }

  /// Inserts `key` (must be non-zero and absent).
  void insert(std::uintptr_t key, V value) {
    // At most a third full. At one half, a free's probe and its backward shift walked clusters
    // long enough that a third of the random micro benchmark (1,000 live blocks) went here;
    // a quarter full took 16% off that benchmark's time (size_class, 100 -> 84 ns locally).
    if ((size_ + 1) * 3 > slots_.size()) {
      grow();
    }
    place(key, std::move(value));
    ++size_;
  }

  [[nodiscard]] V* find(std::uintptr_t key) noexcept {
    if (key == 0) {
      return nullptr;  // 0 marks an empty slot: it would "match" one (record_stream(nullptr))
    }
    const std::size_t mask = slots_.size() - 1;
    for (std::size_t i = hash(key) & mask;; i = (i + 1) & mask) {
      Slot& s = slots_[i];
      if (s.key == key) {
        return &s.value;
      }
      if (s.key == 0) {
        return nullptr;
      }
    }
  }
  [[nodiscard]] const V* find(std::uintptr_t key) const noexcept {
    return const_cast<PointerMap*>(this)->find(key);
  }

  /// Removes `key` if present; returns whether it was.
  bool erase(std::uintptr_t key) noexcept {
    const std::size_t i = slot_of(key);
    if (i == kAbsent) {
      return false;
    }
    remove_slot(i);
    return true;
  }

  /// Moves the value of `key` into `out` and removes it, with one probe (a free's lookup and
  /// removal together); false, `out` untouched, when `key` is absent.
  bool take(std::uintptr_t key, V& out) noexcept {
    const std::size_t i = slot_of(key);
    if (i == kAbsent) {
      return false;
    }
    out = std::move(slots_[i].value);
    remove_slot(i);
    return true;
  }

  template <class F>
  void for_each(F&& f) const {
    for (const Slot& s : slots_) {
      if (s.key != 0) {
        f(s.key, s.value);
      }
    }
  }

 private:
  static constexpr std::size_t kAbsent = ~std::size_t{0};

  std::size_t slot_of(std::uintptr_t key) const noexcept {
    if (key == 0) {
      return kAbsent;
    }
    const std::size_t mask = slots_.size() - 1;
    for (std::size_t i = hash(key) & mask;; i = (i + 1) & mask) {
      if (slots_[i].key == key) {
        return i;
      }
      if (slots_[i].key == 0) {
        return kAbsent;
      }
    }
  }

  void remove_slot(std::size_t i) noexcept {
    const std::size_t mask = slots_.size() - 1;
    // Backward-shift: pull later members of the probe run into the hole.
    std::size_t hole = i;
    for (std::size_t j = (hole + 1) & mask; slots_[j].key != 0; j = (j + 1) & mask) {
      const std::size_t home = hash(slots_[j].key) & mask;
      // Move j into the hole when its home is not in (hole, j] (cyclically).
      const bool home_after_hole = ((j - home) & mask) >= ((j - hole) & mask);
      if (home_after_hole) {
        slots_[hole] = std::move(slots_[j]);
        hole = j;
      }
    }
    slots_[hole].key = 0;
    slots_[hole].value = V{};
    --size_;
  }

  // Small: a fresh allocator allocates, zeroes and (check_invariants) scans every slot, which
  // was a third of the config fuzzer's time per input at 1024; growing to 1024 takes 4 rehashes.
  static constexpr std::size_t kInitialCapacity = 64;
  struct Slot {
    std::uintptr_t key = 0;
    V value{};
  };

  static std::size_t hash(std::uintptr_t key) noexcept {
    // Device addresses are at least 512-byte aligned: mix the high bits down (Fibonacci hashing).
    return static_cast<std::size_t>((key >> 9) * 0x9E3779B97F4A7C15ull >> 20);
  }

  void place(std::uintptr_t key, V&& value) {
    const std::size_t mask = slots_.size() - 1;
    std::size_t i = hash(key) & mask;
    while (slots_[i].key != 0) {
      i = (i + 1) & mask;
    }
    slots_[i].key = key;
    slots_[i].value = std::move(value);
  }

  void grow() {
    Slots old(slots_.size() * 2);
    old.swap(slots_);
    for (Slot& s : old) {
      if (s.key != 0) {
        place(s.key, std::move(s.value));
      }
    }
  }

  // Note [Bookkeeping on few pages] (hot_pages.h): a lookup touches a random slot.
  using Slots = std::vector<Slot, hot::Allocator<Slot>>;
  Slots slots_;
  std::size_t size_ = 0;
};

}  // namespace cachealloc
