// native_detail.h: the native policy's internals (blocks, pools, segments), private to policies/.
//
// Note [Native bookkeeping]
// Every device reservation is a Segment: a cudaMalloc-like range from backend.reserve(), or an
// expandable address range from VirtualMemory::reserve_address() backed page by page. A segment
// is tiled by a doubly linked list of Blocks in address order (head = lowest address). A Block
// is allocated (handed out), free and mapped (cached in its pool's `free_blocks`, ordered by
// stream, size, address as PyTorch's BlockComparatorSize), or free and unmapped (expandable
// segments only, in `unmapped`, ordered by stream, address). Free neighbours with the same
// mapped state are always merged, so two of them are never adjacent. Blocks come from a free
// list (BlockArena), so the hot path does not call malloc except for set nodes.
#pragma once

#include <cachealloc/backend.h>
#include <cachealloc/errors.h>
#include <cachealloc/ordered_index.h>
#include <cachealloc/policies/native.h>
#include <cachealloc/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <set>
#include <vector>

namespace cachealloc::native_detail {

inline constexpr std::size_t kMinBlockSize = 512;         // every size rounds to 512 B at least
inline constexpr std::size_t kSmallSize = 1 * kMiB;       // largest small-pool request
inline constexpr std::size_t kSmallBuffer = 2 * kMiB;     // small-pool reservation / page
inline constexpr std::size_t kLargeBuffer = 20 * kMiB;    // large-pool reservation / page
inline constexpr std::size_t kMinLargeAlloc = 10 * kMiB;  // from here, reserve the request itself
inline constexpr std::size_t kRoundLarge = 2 * kMiB;      // ... rounded up to 2 MiB

struct Segment;
struct Pool;
struct Block;

/// Fixed-size slots for the nodes of the free-block sets, so caching and uncaching a block does
/// not go to malloc (slots are reused; memory returns when the arena dies). Core keeps at least
/// one slot per live Block (Note [No allocation on free]).
class NodeArena {
 public:
  static constexpr std::size_t kSlot = 64;
  /// Grows until the arena has at least `slots` slots in all.
  void reserve(std::size_t slots) {
    while (total_ < slots) {
      grow();
    }
  }
  void* take() {
    if (free_ == nullptr) {
      grow();
    }
    void* slot = free_;
    free_ = *static_cast<void**>(slot);
    return slot;
  }
  void give(void* slot) noexcept {
    *static_cast<void**>(slot) = free_;
    free_ = slot;
  }

 private:
  void grow() {
    constexpr std::size_t kSlots = 512;
    chunks_.push_back(std::make_unique<std::byte[]>(kSlot * kSlots));
    std::byte* chunk = chunks_.back().get();
    for (std::size_t i = kSlots; i-- > 0;) {
      give(chunk + i * kSlot);
    }
    total_ += kSlots;
  }
  std::vector<std::unique_ptr<std::byte[]>> chunks_;
  void* free_ = nullptr;
  std::size_t total_ = 0;
};

template <class T>
struct ArenaAllocator {
  using value_type = T;
  explicit ArenaAllocator(NodeArena* a) noexcept : arena(a) {}
  template <class U>
  ArenaAllocator(const ArenaAllocator<U>& other) noexcept : arena(other.arena) {}  // NOLINT: rebind
  static constexpr bool fits(std::size_t n) noexcept {
    return n == 1 && sizeof(T) <= NodeArena::kSlot && alignof(T) <= alignof(std::max_align_t);
  }
  T* allocate(std::size_t n) {
    return fits(n) ? static_cast<T*>(arena->take()) : std::allocator<T>{}.allocate(n);
  }
  void deallocate(T* p, std::size_t n) noexcept {
    if (fits(n)) {
      arena->give(p);
    } else {
      std::allocator<T>{}.deallocate(p, n);
    }
  }
  friend bool operator==(const ArenaAllocator& a, const ArenaAllocator& b) noexcept {
    return a.arena == b.arena;
  }
  NodeArena* arena;
};

/// A cached block's entry in its pool's free set: the (stream, size, address) key is stored in the
/// node, so best-fit searches compare without touching the blocks.
struct FreeEntry {
  StreamId stream;
  std::size_t size;
  std::uintptr_t addr;
  Block* block;
};
struct SizeKey {
  StreamId stream;
  std::size_t size;
  std::uintptr_t addr;
};
/// PyTorch's BlockComparatorSize: (stream, size, address).
struct BySize {
  using is_transparent = void;
  template <class A, class B>
  bool operator()(const A& a, const B& b) const noexcept {
    if (a.stream != b.stream) {
      return a.stream < b.stream;
    }
    if (a.size != b.size) {
      return a.size < b.size;
    }
    return a.addr < b.addr;
  }
};
/// PyTorch's BlockComparatorAddress: (stream, address).
struct ByAddress {
  using is_transparent = void;
  static bool less(StreamId s1, std::uintptr_t a1, StreamId s2, std::uintptr_t a2) noexcept {
    return s1 != s2 ? s1 < s2 : a1 < a2;
  }
  bool operator()(const Block* a, const Block* b) const noexcept;
  bool operator()(const Block* a, const SizeKey& k) const noexcept;
  bool operator()(const SizeKey& k, const Block* b) const noexcept;
};

/// A B+tree (Note [A B+tree for best-fit searches]); entries are erased by key.
using FreeBlocks = OrderedIndex<FreeEntry, BySize>;
using UnmappedBlocks = std::set<Block*, ByAddress, ArenaAllocator<Block*>>;

struct Block {
  std::uintptr_t addr = 0;
  std::size_t size = 0;
  StreamId stream = 0;
  Block* prev = nullptr;  // neighbour at lower address in the same segment
  Block* next = nullptr;  // neighbour at higher address
  Segment* segment = nullptr;
  Pool* pool = nullptr;
  std::int64_t gc_count_base = 0;  // pool's get_free_block count when it was last cached
  bool allocated = false;
  bool mapped = true;  // false only for unmapped ranges of expandable segments

  [[nodiscard]] bool is_split() const noexcept { return prev != nullptr || next != nullptr; }
};

inline bool ByAddress::operator()(const Block* a, const Block* b) const noexcept {
  return less(a->stream, a->addr, b->stream, b->addr);
}
inline bool ByAddress::operator()(const Block* a, const SizeKey& k) const noexcept {
  return less(a->stream, a->addr, k.stream, k.addr);
}
inline bool ByAddress::operator()(const SizeKey& k, const Block* b) const noexcept {
  return less(k.stream, k.addr, b->stream, b->addr);
}

/// PyTorch's BlockPool: the small or the large pool.
struct Pool {
  Pool(bool is_small, NodeArena& nodes)
      : unmapped(ByAddress{}, ArenaAllocator<Block*>(&nodes)),
        small(is_small) {}
  FreeBlocks free_blocks;
  UnmappedBlocks unmapped;
  bool small;
  std::int64_t get_free_block_calls = 0;  // ages cached blocks for garbage collection
};

/// One device reservation, or one expandable address range.
struct Segment {
  std::uintptr_t addr = 0;
  std::size_t size = 0;  // reservation size, or the whole address range when expandable
  StreamId stream = 0;
  Pool* pool = nullptr;
  Block* head = nullptr;
  std::size_t index = 0;  // position in Core::segments_
  // expandable segments only
  bool expandable = false;
  std::size_t page_size = 0;
  std::vector<PhysicalHandle> pages;  // pages[i] != 0: page i is mapped
  std::size_t mapped_bytes = 0;
};

/// Fixed-size free list of Blocks (addresses stay stable; memory returns at destruction).
class BlockArena {
 public:
  /// Grows until at least `spare` Blocks can be made without allocating.
  void reserve(std::size_t spare) {
    while (spare_ < spare) {
      grow();
    }
  }
  Block* make() {
    if (free_ == nullptr) {
      grow();
    }
    Block* b = free_;
    free_ = b->next;
    *b = Block{};
    ++live_;
    --spare_;
    return b;
  }
  void destroy(Block* b) noexcept {
    b->next = free_;
    free_ = b;
    --live_;
    ++spare_;
  }
  [[nodiscard]] std::size_t live() const noexcept { return live_; }

 private:
  void grow() {
    constexpr std::size_t kChunk = 1024;
    chunks_.push_back(std::make_unique<Block[]>(kChunk));
    Block* chunk = chunks_.back().get();
    for (std::size_t i = kChunk; i-- > 0;) {
      chunk[i].next = free_;
      free_ = &chunk[i];
    }
    spare_ += kChunk;
  }
  std::vector<std::unique_ptr<Block[]>> chunks_;
  Block* free_ = nullptr;
  std::size_t live_ = 0;
  std::size_t spare_ = 0;
};

/// The allocator proper; NativePolicy forwards to it.
class Core {
 public:
  Core(DeviceBackend& backend, const NativeSettings& settings);
  ~Core();
  Core(const Core&) = delete;
  Core& operator=(const Core&) = delete;

  cachealloc::Block allocate(std::size_t bytes, StreamId stream);
  void deallocate(Block* block) noexcept;
  std::size_t release_cached();
  void check_invariants() const;
  void visit_segments(const std::function<void(const SegmentView&)>& visitor) const;

  [[nodiscard]] std::size_t reserved() const noexcept { return reserved_; }
  [[nodiscard]] std::size_t cached() const noexcept { return cached_; }
  [[nodiscard]] std::size_t segment_count() const noexcept { return segments_.size(); }
  [[nodiscard]] const NativeSettings& settings() const noexcept { return settings_; }
  [[nodiscard]] const NativeCounters& counters() const noexcept { return counters_; }
  void set_record(bool on) noexcept { record_ = on; }
  [[nodiscard]] const std::vector<SegmentEvent>& events() const noexcept { return events_; }
  void clear_events() noexcept { events_.clear(); }

 private:
  // ---- the steps of malloc() (native.cpp) ----
  Block* get_free_block(Pool& pool, std::size_t size, StreamId stream);
  Block* alloc_block(Pool& pool, std::size_t size, std::size_t alloc_size, StreamId stream);
  bool release_available_cached_blocks(Pool& pool, std::size_t size, StreamId stream);
  void release_cached_blocks();
  void garbage_collect_cached_blocks();
  [[nodiscard]] bool should_split(const Block* block, std::size_t size) const noexcept;
  Block* alloc_found_block(Block* block, std::size_t size, bool split_remainder);
  // ---- pool and list surgery ----
  void cache(Block* block);  // insert into the pool's free set (PyTorch's insert_into_blocks)
  void uncache(Block* block) noexcept;
  std::size_t try_merge(Block* dst, Block* src) noexcept;
  void release_block(Block* block) noexcept;  // cudaFree of a whole free segment
  void release_blocks(Pool& pool);
  void remove_segment(Segment* segment) noexcept;
  Segment* add_segment(std::uintptr_t addr, std::size_t size, StreamId stream, Pool& pool);
  void record(SegmentEvent::Kind kind, std::uint64_t size, std::uint64_t addr,
              StreamId stream) noexcept;
  void reserve_spares(std::size_t blocks, std::size_t events);
  [[nodiscard]] bool gc_enabled() const noexcept {
    return settings_.garbage_collection_threshold > 0.0;
  }
  // ---- expandable segments (native_expandable.cpp) ----
  Block* try_allocate_expandable_block(Pool& pool, std::size_t size, StreamId stream);
  Block* find_expandable_block(Pool& pool, std::size_t size, StreamId stream);
  bool map_block(Block* to_map, std::size_t size);
  void unmap_block(Block* block);
  void release_expandable_segment(Block* block) noexcept;
  void check_expandable_segment(const Segment& segment) const;
  void release_everything() noexcept;  // destructor: give all memory back

  DeviceBackend& backend_;
  VirtualMemory* vm_ = nullptr;
  NativeSettings settings_;
  NodeArena nodes_;  // before the pools: their sets give their nodes back when they die
  Pool small_{true, nodes_};
  Pool large_{false, nodes_};
  BlockArena arena_;
  std::vector<std::unique_ptr<Segment>> segments_;
  std::size_t reserved_ = 0;  // PyTorch's total_allocated_memory / reserved_bytes
  std::size_t cached_ = 0;    // bytes in free mapped blocks
  NativeCounters counters_;
  bool record_ = false;
  std::vector<SegmentEvent> events_;
};

}  // namespace cachealloc::native_detail
