// size_class.h: policy `size_class`, our general-purpose caching policy.
//
// Small requests (<= 1 MiB) are rounded to one of ~40 size classes (512 B steps up to 4 KiB,
// then four classes per doubling) and carved, bump-pointer style, from shared 2 MiB segments;
// a freed small block goes back on its class's free list (O(1) both ways). Large requests are
// rounded to 512 B and placed best-fit (O(log n) in a size-ordered set) in segments of 20 MiB
// (requests under 10 MiB) or of the request rounded to 2 MiB, split when the remainder could
// serve another large request (> 1 MiB), and coalesced with free neighbours on free.
//
// Note [Recently freed large blocks]
// A training step frees and re-requests the same large sizes over and over; splitting a block
// out of its segment and coalescing it back on free costs three tree updates per pair (as much
// as the rest of the pair together). So a freed large block first goes, uncoalesced and outside
// the free set, to its stream's short FIFO of recent frees (kRecent); a request of exactly its
// size on that stream takes it back in O(1). The oldest entry, and every entry as soon as the
// stream's request misses the FIFO, is coalesced into the free set, so best-fit searches,
// growth decisions and migrations see the same coalesced free space as without the FIFO: a
// recent block only ever serves a request of its exact size.
//
// Note [Stream-aware reuse in size_class]
// A freed block is owned by the stream it was freed on and is reused at once by that stream
// only. When another stream misses, the policy records one event per owning stream (an
// "epoch") covering every block freed there so far; once the event completed, those blocks are
// moved to the shared pool that any stream may use. One event per stream per epoch, never one
// per block, keeps event traffic off the fast path.
#pragma once

#include <cachealloc/backend.h>
#include <cachealloc/config.h>
#include <cachealloc/ordered_index.h>
#include <cachealloc/policy.h>
#include <cachealloc/types.h>

#include <array>
#include <cstdint>
#include <deque>
#include <memory>
#include <string_view>
#include <vector>

namespace cachealloc {

class SizeClassPolicy {
 public:
  static constexpr std::string_view kName = "size_class";
  static std::vector<std::string_view> config_keys();
  static std::string_view oom_hint() {
    return "If reserved-but-unallocated memory is large, try CACHEALLOC_CONF=policy:defrag, or "
           "size_class_large_segment_mb to change the large-segment size.";
  }

  SizeClassPolicy(DeviceBackend& backend, Config& config);
  ~SizeClassPolicy();
  SizeClassPolicy(const SizeClassPolicy&) = delete;
  SizeClassPolicy& operator=(const SizeClassPolicy&) = delete;

  [[nodiscard]] Block allocate(std::size_t bytes, StreamId stream);
  void deallocate(const Block& block, StreamId stream) noexcept;
  std::size_t release_cached();
  [[nodiscard]] std::size_t reserved_bytes() const noexcept { return reserved_; }
  void check_invariants() const;

  template <class F>
  void visit_segments(F&& f) const {
    for (const auto& seg : segments_) {
      if (seg) {
        f(segment_view(*seg));
      }
    }
  }

  static constexpr std::size_t kSmallMax = 1 * kMiB;
  static constexpr std::size_t kSmallSegment = 2 * kMiB;
  static constexpr StreamId kAnyStream = ~StreamId{0};
  /// The size class a small request is rounded to.
  [[nodiscard]] static std::size_t small_class_size(std::size_t bytes) noexcept;

 private:
  struct Segment;
  struct BlockMeta;
  /// A free large block's entry in its pool's index: the (size, address) key lives in the index,
  /// so a best-fit search compares without touching the blocks (a B+tree: Note [A B+tree for
  /// best-fit searches] in ordered_index.h).
  struct LargeKey {
    std::size_t size;
    std::uintptr_t addr;
    BlockMeta* meta;
    friend bool operator<(const LargeKey& a, const LargeKey& b) noexcept {
      return a.size != b.size ? a.size < b.size : a.addr < b.addr;
    }
  };
  using LargeSet = OrderedIndex<LargeKey>;
  struct BlockMeta {
    std::uintptr_t addr;
    std::size_t size;
    Segment* segment;
    BlockMeta* prev;  // large: address neighbours in the segment
    BlockMeta* next;
    StreamId owner;   // stream whose pool holds it while free (kAnyStream = shared)
    std::uint64_t free_seq;
    std::uint16_t size_class;  // small only
    bool small;
    bool free;
    bool recent = false;  // large, free, in its owner pool's `recent` (not in `large`)
  };
  struct Segment {
    std::uintptr_t base;
    std::size_t size;
    bool small;
    std::size_t carved = 0;       // small: bytes carved so far (bump pointer)
    std::size_t live_blocks = 0;  // small: carved blocks not free
    std::size_t index;            // in segments_
    BlockMeta* head = nullptr;    // large: the block at `base`
    std::vector<BlockMeta*> small_blocks;
  };
  static constexpr std::size_t kClassCount = 48;
  static constexpr std::size_t kRecent = 4;  ///< Note [Recently freed large blocks]
  struct Pool {
    StreamId stream = 0;
    LargeSet large;
    std::array<BlockMeta*, kRecent> recent{};  // oldest first
    std::size_t recent_count = 0;
    std::array<std::vector<BlockMeta*>, kClassCount> small;
    std::uint64_t epoch_event = 0;  // EventId of an in-flight migration, 0 = none
    std::uint64_t epoch_seq = 0;    // blocks freed up to this sequence are covered by it
  };

  Block allocate_small(std::size_t bytes, StreamId stream);
  Block allocate_large(std::size_t bytes, StreamId stream);
  Pool& pool(StreamId stream);
  Pool* find_pool(StreamId stream) noexcept;
  void insert_free(BlockMeta* b);
  /// Merges `b` with free neighbours of the same owner and puts it on its owner's free set.
  void coalesce_and_insert(BlockMeta* b);
  /// A freed large block onto its owner's recent FIFO (Note [Recently freed large blocks]).
  void push_recent(BlockMeta* b);
  /// Takes the FIFO's i-th block off it (the later ones move up) and returns it.
  static BlockMeta* remove_recent(Pool& p, std::size_t i) noexcept;
  /// The recent block of exactly `size` on `p`, taken off the FIFO; nullptr when none.
  static BlockMeta* take_recent(Pool& p, std::size_t size) noexcept;
  /// Coalesces every recent block of `p` into its free set.
  void flush_recent(Pool& p);
  void flush_all_recent();
  void erase_free(BlockMeta* b);
  /// Completes finished migration epochs and starts new ones (Note [Stream-aware reuse]).
  bool migrate_epochs(StreamId requester);
  BlockMeta* new_meta();
  void drop_meta(BlockMeta* b) noexcept;
  Segment* new_segment(std::size_t bytes, bool small);
  void release_segment(Segment* seg) noexcept;
  [[nodiscard]] SegmentView segment_view(const Segment& seg) const;

  DeviceBackend& backend_;
  std::size_t large_segment_ = 20 * kMiB;
  std::size_t large_direct_threshold_ = 10 * kMiB;
  std::vector<std::unique_ptr<Pool>> pools_;  // few streams: linear search
  Pool* last_pool_ = nullptr;
  std::vector<std::unique_ptr<Segment>> segments_;
  std::vector<std::size_t> free_segment_slots_;
  Segment* small_current_ = nullptr;  // the shared small segment being carved
  std::deque<BlockMeta> meta_storage_;
  std::vector<BlockMeta*> meta_free_;
  std::size_t reserved_ = 0;
  std::uint64_t free_seq_ = 0;
};

static_assert(Policy<SizeClassPolicy>);

}  // namespace cachealloc
