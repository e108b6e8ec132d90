// defrag_engine.h: the state and internal interface of policy `defrag` (private to
// policies/src: defrag.cpp holds the fast path and the epochs, defrag_grow.cpp the growth and
// the page moves, defrag_check.cpp the invariants and snapshots). The design is in defrag.h and
// in the Notes at the top of defrag.cpp.
#pragma once

#include <cachealloc/hot_pages.h>
#include <cachealloc/ordered_index.h>
#include <cachealloc/policies/defrag.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <vector>

namespace cachealloc::detail {
/// Blocks start at, and their sizes are multiples of, 512 bytes (as cudaMalloc's).
inline constexpr std::size_t kAlignment = 512;
/// Other streams' mapped holes skipped (still pending) before a search gives up on that stream.
inline constexpr int kMaxPendingSkips = 32;
/// Unmapped holes slightly smaller than the request tried before the first that fits alone.
inline constexpr int kUnmappedCandidates = 8;
/// Fitting unmapped holes passed over because an unmap queued there has not run yet, before the
/// first of them is taken anyway (Note [Placing away from queued unmaps], defrag_grow.cpp).
inline constexpr int kQueuedSkips = 8;
/// Unmerged neighbour pairs remembered before the policy closes an epoch on its own.
inline constexpr std::size_t kDeferredLimit = 4096;
/// Note [Slack that adapts to moves] (defrag_grow.cpp): after this many growths that moved
/// pages, the policy checks how many allocations they took...
inline constexpr std::uint64_t kMoveWindow = 8;
/// ...and calls the window dense when that was fewer than this many allocations per growth that
/// moved...
inline constexpr std::uint64_t kAllocationsPerMove = 128;
/// ...and raises the slack after this many dense windows in a row.
inline constexpr std::uint32_t kDenseWindows = 3;
/// Note [A time budget for moves] (defrag_grow.cpp): moves are judged over at least
/// kMoveWindow moving growths and this much time...
inline constexpr std::uint64_t kBudgetMinWindowNs = 25'000'000;
/// ...or over this much time, whichever comes first.
inline constexpr std::uint64_t kBudgetMaxWindowNs = 1'000'000'000;
/// Note [Waits that switch to moving pending] (defrag_grow.cpp): a window over the budget in
/// which waiting for streams took more than this many tenths of the charged time switches.
inline constexpr std::uint64_t kPendingWaitTenths = 3;
/// Streams with large-block address ranges of their own; later streams share the last one's
/// (Note [Address ranges of their own for streams], defrag_grow.cpp).
inline constexpr std::uint32_t kStreamRanges = 8;
/// A growth creates about this many chunks (Note [Chunks], defrag_grow.cpp)...
inline constexpr std::size_t kChunksPerGrowth = 16;
/// Note [Quiet time pays for a burst] (defrag_grow.cpp): quiet time banked at most, in ns.
inline constexpr std::uint64_t kBudgetBankNs = 10'000'000'000;
/// ...of at least this many pages each (or the whole growth when it is smaller).
inline constexpr std::size_t kMinChunkPages = 2;
/// With several streams, frees after which the next allocation closes the epoch, while the
/// policy missed since the last such close (Note [Epochs on demand], defrag.cpp).
inline constexpr std::uint32_t kEpochFrees = 8;

/// What a range is (Note [Ranges tile the address space]); `dead` marks a recycled node.
/// `cached`: a freed small block on its stream's recent list (Note [Recently freed small blocks
/// in defrag], defrag.cpp): free for the front end, not merged, reused only at its exact size.
enum class State : std::uint8_t { live, mapped_free, unmapped_free, dead, cached };

struct Node;
struct Arena;

// Note [One word ranks a hole]
// A hole is indexed under (bucket, size, address): best fit is the first key not below
// (bucket, size, 0). Sizes are multiples of kAlignment, so bucket and size pack into one word,
// `rank` = bucket << kSizeBits | size / kAlignment, and a comparison is two words compared as
// one 128-bit number (cmp + sbb, no branch). With three fields compared in turn, the B+tree's
// code behind index_put was about a third of a cold call's instruction-cache misses
// (callgrind, cachealloc-cold-replay on the e2e pipeline recording, session 24); the key is
// also 24 bytes instead of 32, so a leaf of 16 keys spans 6 cache lines instead of 8.
// Bits: 43 for the size in 512-byte units (holes up to 4 PiB; va_reserve_gb allows 1 PiB),
// 21 for the bucket: mapped, the kind above 20 bits of the owner stream's class; unmapped, the
// kind. class_of() refuses a stream beyond kMaxClasses.
inline constexpr unsigned kSizeBits = 43;
inline constexpr unsigned kClassBits = 20;
inline constexpr std::uint32_t kMaxClasses = std::uint32_t{1} << kClassBits;
/// The largest request the policy places (1 PiB, the most va_reserve_gb reserves): larger ones
/// are refused as out of memory, so that no hole, and no range reserved for one, outgrows the
/// rank's 43 bits of size (a larger size would spill into the bucket's bits).
inline constexpr std::size_t kMaxBlockBytes = std::size_t{1} << 50;

struct IndexKey {
  std::uint64_t rank;  // bucket << kSizeBits | size / kAlignment
  std::uintptr_t addr;
  Node* node;
  static constexpr std::uint64_t mapped_bucket(std::uint32_t kind, std::uint32_t cls) noexcept {
    return std::uint64_t{kind} << kClassBits | cls;
  }
  /// Unmapped holes: the kind, and the stream class whose range it is (Note [Address ranges of
  /// their own for streams], defrag_grow.cpp; 0 for all without stream_ranges).
  static constexpr std::uint64_t unmapped_bucket(std::uint32_t kind, std::uint32_t home) noexcept {
    return std::uint64_t{home} << 1 | kind;
  }
  /// The rank of a hole of `size` bytes (a multiple of kAlignment) in `bucket`.
  static constexpr std::uint64_t rank_of(std::uint64_t bucket, std::size_t size) noexcept {
    return bucket << kSizeBits | size / kAlignment;
  }
  /// The first key of `bucket` for a hole of at least `size` bytes (any size: rounded up).
  static constexpr IndexKey at_least(std::uint64_t bucket, std::size_t size) noexcept {
    return IndexKey{rank_of(bucket, round_up(size, kAlignment)), 0, nullptr};
  }
  [[nodiscard]] constexpr std::uint64_t bucket() const noexcept { return rank >> kSizeBits; }
  [[nodiscard]] constexpr std::size_t size() const noexcept {
    return static_cast<std::size_t>(rank & ((std::uint64_t{1} << kSizeBits) - 1)) * kAlignment;
  }
  friend bool operator<(const IndexKey& a, const IndexKey& b) noexcept {
#if defined(__SIZEOF_INT128__)
    __extension__ typedef unsigned __int128 Wide;
    return (Wide{a.rank} << 64 | a.addr) < (Wide{b.rank} << 64 | b.addr);
#else
    return a.rank != b.rank ? a.rank < b.rank : a.addr < b.addr;
#endif
  }
};
static_assert(sizeof(IndexKey) == 24);
/// A B+tree (Note [A B+tree for best-fit searches]); a node remembers the key it is indexed under.
using Index = OrderedIndex<IndexKey>;

/// One range of an arena (Note [Ranges tile the address space]).
/// Note [A node's first line]: inside a training step each call finds the caches cold and pays
/// per line it touches (Note [Hot fields first], allocator.h). An allocation from a mapped hole
/// and a free that merges read and write the fields of the first 64 bytes of their nodes and of
/// the neighbours': address, size, links, the key it is indexed under, stamp, owner, state,
/// kind and the flags. The age list's links, the arena and `deferred` change only when a hole
/// gains or loses whole pages, at growths and at epochs: they sit on the second line. Nodes are
/// line aligned, so a node's hot fields are one line (96 unaligned bytes spanned two or three).
struct alignas(64) Node {
  std::uintptr_t addr = 0;
  std::size_t size = 0;
  Node* prev = nullptr;  // address neighbours in the arena
  Node* next = nullptr;
  // While indexed: the key it is indexed under (its entry is found by it), as indexed_key().
  std::uint64_t key_rank = 0;
  std::uintptr_t key_addr = 0;
  std::uint64_t stamp = 0;  // epoch of the last free merged into it (0: never used)
  std::uint32_t cls = 0;    // owner stream's class (live: the allocating stream)
  State state = State::dead;
  std::uint8_t kind = 0;    // arena->kind, here so that a key needs no read of the arena
  bool indexed = false;
  bool in_age = false;
  // ---- the second line ----
  Node* age_prev = nullptr;  // the age list: mapped holes holding at least one whole page
  Node* age_next = nullptr;
  Arena* arena = nullptr;
  bool deferred = false;  // listed in deferred_ (a stale entry of a recycled node may remain)
  [[nodiscard]] std::uintptr_t end() const noexcept { return addr + size; }
  /// Puts the node in `o`'s range: its arena, and the kind kept beside it (copied from `o`,
  /// whose first line is hot, rather than read from the arena: Note [A node's first line]).
  void same_range_as(const Node& o) noexcept {
    arena = o.arena;
    kind = o.kind;
  }
  [[nodiscard]] IndexKey indexed_key() const noexcept {
    return IndexKey{key_rank, key_addr, const_cast<Node*>(this)};
  }
  /// Back to a fresh node's values, field by field (the key matters only while indexed).
  /// `*this = Node{}` zeroed a temporary with `rep stos` and copied it with loads that straddled
  /// its last stores: a store-forwarding stall, half of carve()'s time in perf.
  void reset() noexcept {
    addr = 0;
    size = 0;
    prev = next = nullptr;
    stamp = 0;
    cls = 0;
    state = State::dead;
    kind = 0;
    indexed = false;
    in_age = false;
    age_prev = age_next = nullptr;
    arena = nullptr;
    deferred = false;
  }
};
static_assert(offsetof(Node, in_age) < 64 && offsetof(Node, age_prev) == 64);

struct Arena {
  std::uintptr_t base = 0;
  std::size_t size = 0;
  std::uint32_t kind = 0;
  /// The stream class whose growths are placed here (Note [Address ranges of their own for
  /// streams], defrag_grow.cpp); 0 for every range without stream_ranges, and for small ones.
  std::uint32_t home = 0;
  Node* head = nullptr;
  // The handle mapped at each page (a chunk's handle at each of its pages); grows to the highest
  // page ever mapped.
  std::vector<PhysicalHandle> pages;
};

/// Physical memory gathered for a placement: one handle of `pages` pages (Note [Chunks],
/// defrag_grow.cpp).
struct Chunk {
  PhysicalHandle handle;
  std::size_t pages;
  /// Mapped nowhere now (created, or unmapped with unmap_now): it may be released at once
  /// (Note [Coalescing moved chunks while maps are dear], defrag_grow.cpp).
  bool loose = false;
};

struct Fence {
  std::uint64_t epoch;
  EventId event;
};

/// Note [Recently freed small blocks in defrag] (defrag.cpp): the largest size kept (the bytes
/// kept over all streams are the keep_small_mb setting).
inline constexpr std::size_t kRecentMaxSize = std::size_t{1} << 20;
inline constexpr std::size_t kRecentSlots = kRecentMaxSize / kAlignment + 1;

/// Frees the recent lists' heads (Note [Bookkeeping on few pages], hot_pages.h).
struct RecentDelete {
  void operator()(Node** p) const noexcept {
    hot::deallocate(p, kRecentSlots * sizeof(Node*), alignof(Node*));
  }
};

/// A stream that allocated here (its index is the "class" stored in ranges).
struct StreamState {
  StreamId id = 0;
  std::deque<Fence, hot::Allocator<Fence>> fences;  // events recorded on the stream, oldest first
  std::uint64_t completed = 0;  // every epoch <= completed finished on this stream
  bool dirty = false;           // freed something during the open epoch
  /// Note [Recently freed small blocks in defrag]: one LIFO per 512-byte size up to
  /// kRecentMaxSize, linked through Node::age_next; allocated at the stream's first such free.
  std::unique_ptr<Node*[], RecentDelete> recent;
};


/// Lists of nodes, on the allocator's regions (Note [Bookkeeping on few pages], hot_pages.h).
using NodeList = std::vector<Node*, hot::Allocator<Node*>>;

/// Made with `new`, it lives on the regions too (hot::Object).
class alignas(64) DefragEngine : public hot::Object<DefragEngine> {
 public:
  DefragEngine(DeviceBackend& backend, const DefragSettings& settings);
  ~DefragEngine();
  DefragEngine(const DefragEngine&) = delete;
  DefragEngine& operator=(const DefragEngine&) = delete;

  Block allocate(std::size_t bytes, StreamId stream);
  /// `settled`: every stream finished its work on the block, its own too (stamped as done).
  void deallocate(const Block& block, bool settled = false) noexcept;
  void note_parked(std::size_t bytes) noexcept { parked_bytes_ = bytes; }
  /// The live bytes the program holds: those not parked by the front end for other streams.
  [[nodiscard]] std::size_t held_bytes() const noexcept {
    return live_bytes_ - std::min(parked_bytes_, live_bytes_);
  }
  void hold_growth(bool held) noexcept { growth_held_ = held; }
  std::size_t release_cached();
  [[nodiscard]] std::size_t reserved_bytes() const noexcept { return held_pages_ * page_; }
  [[nodiscard]] std::size_t live_bytes() const noexcept { return live_bytes_; }
  [[nodiscard]] std::size_t peak_live_bytes() const noexcept { return peak_live_; }
  [[nodiscard]] std::size_t peak_held_bytes() const noexcept { return peak_held_; }
  void check_invariants() const;
  [[nodiscard]] std::vector<SegmentView> segments() const;
  [[nodiscard]] DefragBreakdown breakdown() const;
  /// One stream class and no recent lists: where a block goes depends only on the live blocks
  /// and the mapped pages, never on which events completed (DefragPolicy::placement_repeats).
  [[nodiscard]] bool placement_repeats() const noexcept {
    return streams_.size() <= 1 && recent_max_ == 0;
  }
  void note_repeated(std::uint64_t allocations) noexcept { window_allocations_ += allocations; }
  [[nodiscard]] const DefragCounters& counters() const noexcept { return counters_; }
  [[nodiscard]] const DefragSettings& settings() const noexcept { return settings_; }
  [[nodiscard]] const std::vector<SlackEvent>& slack_history() const noexcept { return history_; }
  [[nodiscard]] std::uint64_t slack_events_dropped() const noexcept { return history_dropped_; }
  [[nodiscard]] const std::vector<CostlyGrowth>& growth_history() const noexcept { return growths_; }
  [[nodiscard]] std::uint64_t growths_dropped() const noexcept { return growths_dropped_; }
  [[nodiscard]] const std::vector<BudgetWindow>& window_history() const noexcept { return windows_; }
  [[nodiscard]] std::uint64_t windows_dropped() const noexcept { return windows_dropped_; }

 private:
  static constexpr std::uint32_t kLarge = 0;
  static constexpr std::uint32_t kSmall = 1;

  // ---- geometry ----
  [[nodiscard]] std::uintptr_t page_down(std::uintptr_t a) const noexcept { return a & ~(page_ - 1); }
  [[nodiscard]] std::uintptr_t page_up(std::uintptr_t a) const noexcept {
    return (a + page_ - 1) & ~(page_ - 1);
  }
  [[nodiscard]] std::size_t whole_pages(const Node* n) const noexcept {
    const std::uintptr_t lo = page_up(n->addr);
    const std::uintptr_t hi = page_down(n->end());
    return hi > lo ? (hi - lo) / page_ : 0;
  }
  [[nodiscard]] std::size_t page_index(const Arena& a, std::uintptr_t va) const noexcept {
    return (va - a.base) / page_;
  }

  // ---- streams and epochs ----
  /// The stream's class; the last stream's answer inline, others found (or added) out of line:
  /// a call that also carried the lookup's loop and vector growth saved six registers first,
  /// 2.5 code lines per cold call (callgrind, session 24).
  std::uint32_t class_of(StreamId stream) {
    if (have_last_ && stream == last_stream_) {
      return last_cls_;
    }
    return find_class(stream);
  }
  std::uint32_t find_class(StreamId stream);
  /// A hole is safe once its owner stream finished the work queued before the hole's last free
  /// (other streams' uses finished before the free: policy.h, item 4).
  [[nodiscard]] bool safe(const Node* n) const noexcept {
    return n->stamp <= streams_[n->cls].completed;
  }
  [[nodiscard]] bool usable(const Node* n, std::uint32_t cls) const noexcept {
    return n != nullptr && n->state == State::mapped_free && (n->cls == cls || safe(n));
  }
  /// Two free neighbours merge when they are unmapped, or belong to one stream, or are both
  /// safe. A pending hole is not merged with a safe hole of another stream: the result would be
  /// pending, and a small free could lock a large hole away from every other stream.
  [[nodiscard]] bool mergeable(const Node* a, const Node* b) const noexcept {
    return a->state == State::unmapped_free || a->cls == b->cls || (safe(a) && safe(b));
  }
  void mark_dirty(std::uint32_t cls) noexcept;

  void close_epoch();
  bool poll();
  void wait_all();
  /// Waits until stream class `cls` finished every epoch <= `epoch` (closing the open epoch if
  /// it is included).
  void wait_until(std::uint32_t cls, std::uint64_t epoch);
  void update_completed(StreamState& s) const noexcept;
  void process_deferred() noexcept;
  /// Remembers an unmerged pair of mapped holes (`left` and its right neighbour).
  /// Remembers an unmerged pair once: a node already listed is not listed again (every free
  /// next to the same pending neighbour used to add an entry, so the list grew by one per free
  /// and each pass re-deferred them all).
  void defer(Node* left) noexcept {
    if (left->deferred) {
      return;
    }
    try {
      deferred_.push_back(left);
      left->deferred = true;
    } catch (...) {  // out of host memory: the pair merges at release_cached() instead
    }
  }

  // ---- nodes, indexes, age list ----
  Node* new_node();
  void recycle(Node* n) noexcept;
  void link_after(Node* pos, Node* n) noexcept;
  void link_before(Node* pos, Node* n) noexcept;
  void unlink(Node* n) noexcept;
  [[nodiscard]] IndexKey key_of(const Node* n) const noexcept;
  Index& index_of(const Node* n) noexcept { return n->state == State::unmapped_free ? unmapped_ : mapped_; }
  const Index& index_of(const Node* n) const noexcept {
    return n->state == State::unmapped_free ? unmapped_ : mapped_;
  }
  void index_put(Node* n);
  void index_remove(Node* n) noexcept;
  void age_remove(Node* n) noexcept;
  /// Puts mapped hole `n` on the age list, or takes it off, as it holds whole pages or not. The
  /// check inline (most calls change nothing), the list's update out of line (session 24: the
  /// call alone was 2 code lines per cold call).
  void age_update(Node* n) noexcept {
    const bool wanted = n->state == State::mapped_free && whole_pages(n) > 0;
    if (wanted != n->in_age) {
      age_set(n, wanted);
    }
  }
  void age_set(Node* n, bool wanted) noexcept;
  void age_touch(Node* n) noexcept;
  /// Merges neighbours `left` and `right` (both free, same state, mergeable) into one of them
  /// (an indexed one when there is one: it keeps its tree node) and returns it. When their
  /// owners differ the result belongs to the pending one's, or (both safe) to `owner`.
  Node* absorb(Node* left, Node* right, std::uint32_t owner) noexcept;
  /// Merges free range `n` with every mergeable neighbour, remembers the pairs that must stay
  /// apart for now, and (re)indexes the result, which it returns. With `for_owner`, merges only
  /// with neighbours usable by stream class `owner`, so that the result stays usable by it.
  Node* merge_around(Node* n, std::uint32_t owner, bool for_owner = false) noexcept;

  // ---- recently freed small blocks (Note [Recently freed small blocks in defrag]) ----
  /// The block of exactly `size` bytes stream class `cls` freed last, made live again; or null.
  Node* take_recent(std::uint32_t cls, std::size_t size) noexcept;
  /// Keeps freed block `n` (already counted free and stamped) on its stream's list; false when
  /// it does not qualify or there is no room.
  bool keep_recent(Node* n) noexcept;
  /// Every kept block becomes a mapped hole, merged with its neighbours.
  void flush_recent() noexcept;

  // ---- placement ----
  /// Best fit among the stream's own mapped holes.
  Node* find_own(std::uint32_t kind, std::uint32_t cls, std::size_t size) const;
  /// Best fit among other streams' mapped holes that are safe.
  Node* find_other(std::uint32_t kind, std::uint32_t cls, std::size_t size) const;
  Node* carve(Node* f, std::uintptr_t start, std::size_t size, std::uint32_t cls);
  /// Hands out range `n` (addr, size and cls set): live, and counted in the live bytes.
  void make_live(Node* n) noexcept;
  Node* grow(std::uint32_t kind, std::uint32_t cls, std::size_t size);
  struct Placement {
    Node* hole = nullptr;  // the unmapped hole
    std::uintptr_t start = 0;
    bool passed_queued = false;  // a better fit was passed over for a queued unmap
    /// Nonzero: the pages go from here up, above the unmaps queued in the hole's lower part
    /// (Note [Placing away from queued unmaps]); the hole's part below stays unmapped.
    std::uintptr_t above = 0;
    /// At the top of its range because of top_at_limit (Note [Growing at the top once moves
    /// cost too much at the limit], defrag_grow.cpp).
    bool top = false;
  };
  /// Where a block that needs pages mapped goes: one of the two below.
  Placement place_unmapped(std::uint32_t kind, std::uint32_t cls, std::size_t size) const;
  /// The best-fitting unmapped hole, extended by the usable mapped holes beside it (Note [Where
  /// new pages come from], defrag_grow.cpp).
  Placement place_best_fit(std::uint32_t kind, std::uint32_t cls, std::size_t size) const;
  /// The top of the range (Note [Growing at the top once moves cost too much at the limit]).
  Placement place_top(std::uint32_t kind, std::uint32_t cls, std::size_t size) const;
  /// Where a block placed in unmapped `hole` starts: in the usable mapped hole on its left (its
  /// partly used pages), else at the hole.
  [[nodiscard]] std::uintptr_t start_in(const Node* hole, std::uint32_t cls) const noexcept;
  /// Note [Placing away from queued unmaps] (defrag_grow.cpp): whether the pages a block from
  /// `start` maps in `hole` would wait for an unmap queued behind a stream (with
  /// avoid_queued_unmaps; false without).
  [[nodiscard]] bool waits_for_unmap(const Node* hole, std::uintptr_t start, std::size_t size) const noexcept;
  /// The first page of `hole` above its queued unmaps where the block alone fits with no queued
  /// unmap under it; 0 if there is none.
  [[nodiscard]] std::uintptr_t above_unmaps(const Node* hole, std::size_t size) const noexcept;
  /// The largest unmapped hole where a block of `kind` for class `cls` goes (null: none).
  [[nodiscard]] Node* largest_unmapped(std::uint32_t kind, std::uint32_t cls) const;
  /// Whether growths go to the top now (place_top).
  [[nodiscard]] bool top_at_limit() const noexcept {
    return settings_.top_at_limit && over_at_limit_ && slack_ >= settings_.max_grow_slack;
  }
  Arena* new_arena(std::uint32_t kind, std::size_t at_least, std::uint32_t home);
  /// The ranges where a block of `kind` for stream class `cls` is placed when it needs pages
  /// mapped (Note [Address ranges of their own for streams], defrag_grow.cpp).
  [[nodiscard]] std::uint32_t home_of(std::uint32_t kind, std::uint32_t cls) const noexcept {
    return settings_.stream_ranges && kind == kLarge ? std::min(cls, kStreamRanges - 1) : 0;
  }
  /// Counts a growth that creates `pages` beyond the slack and why the free pages held did not
  /// move (Note [Why pages were created beyond the slack]).
  void note_beyond_slack(std::size_t pages, const Node* hole, std::uint32_t cls) noexcept;
  /// At least `count` and at most `room` pages for a block, in whole chunks (Note [Where new
  /// pages come from], Note [Chunks]); false when the device is full. Without `beyond_slack`,
  /// step 5 is left to the caller (create_beyond_slack), and it may return with fewer.
  bool gather_pages(std::size_t count, std::size_t room, std::size_t size, const Node* hole,
                    std::uint32_t cls, bool beyond_slack = true);
  /// Step 5 of Note [Where new pages come from]: creates what scratch_ lacks of `count` pages,
  /// counted as beyond the slack; false (scratch_ released) when the device is full.
  bool create_beyond_slack(std::size_t count, const Node* hole, std::uint32_t cls);
  /// Creates `count` pages in chunks of at most max_chunk_pages_ into scratch_ (fewer when the
  /// device is full).
  void create_pages(std::size_t count);
  /// One physical handle of `pages` pages, or, when the device lacks pieces that large, of the
  /// first that fits as `pages` halves down to one (`pages` then says how many); 0 when none.
  [[nodiscard]] PhysicalHandle create_chunk(std::size_t& pages);
  /// Gives chunk `c` back to the device and counts it; `unmapped`: mapped nowhere now
  /// (VirtualMemory::release_unmapped, no wait for the backend's queued unmaps).
  void release_chunk(const Chunk& c, bool unmapped) noexcept;
  /// Note [Coalescing moved chunks while maps are dear]: for a block of `size` bytes at `start`
  /// whose `count` pages get mapped from `lo` (or, `at_top`, up to the end of `hole`), replaces
  /// the loose chunks of scratch_ by new ones (coalesce_scratch) of the pages the run needs:
  /// those before the pages wholly under the block, those, and those after. False (scratch_
  /// released) when the device cannot hold them again.
  bool coalesce_for(const Node* hole, std::uintptr_t lo, bool at_top, std::size_t count,
                    std::uintptr_t start, std::size_t size);
  /// Replaces the loose chunks by new chunks of `parts` pages each (split at max_chunk_pages_),
  /// when that makes fewer chunks; false (scratch_ released) when the device is full.
  bool coalesce_scratch(std::span<const std::size_t> parts);
  /// Folds the time of a map of `handles` handles into map_ns_per_handle_.
  void note_map_time(std::uint64_t ns, std::size_t handles) noexcept;
  /// New pages the slack allows for a request of `size` bytes.
  [[nodiscard]] std::size_t pages_within_slack(std::size_t size) const noexcept;
  /// Moves whole chunks of safe free holes into scratch_ until `want` pages, taking none that
  /// would bring the pages gathered beyond `room`, and none from the other kind's ranges unless
  /// `other_kinds`. With `pending_of` (Note [Moving pages a stream still uses],
  /// background_unmapper.h): instead from that stream class's own holes that are not safe yet,
  /// unmapped once its queued work is done (VirtualMemory::unmap_after), without waiting.
  std::size_t steal(std::size_t want, std::size_t room, const Node* hole, bool other_kinds,
                    const std::uint32_t* pending_of = nullptr);
  /// The oldest epoch after whose completion on stream class `cls` `count` more whole free
  /// pages of that stream (outside the hole's neighbours) could move; 0 when none could.
  [[nodiscard]] std::uint64_t epoch_for_pages(std::size_t count, const Node* hole,
                                              std::uint32_t cls) const;
  /// Unmaps the chunks lying wholly at the top of mapped hole `n`, from the top down, into
  /// scratch_ while fewer than `want` pages were taken and the next chunk fits in `room`.
  /// With `after_stream`, unmaps once that stream's queued work is done (unmap_after).
  std::size_t take_pages(Node* n, std::size_t want, std::size_t room,
                         const StreamId* after_stream = nullptr);
  [[nodiscard]] std::size_t scratch_pages() const noexcept;
  void release_scratch() noexcept;
  /// Turns [begin, end) of an unmapped hole into a fresh mapped hole (merged with usable
  /// neighbours) and returns the resulting mapped hole. With begin above hole.addr, `below`
  /// (a fresh node) becomes the unmapped part [hole.addr, begin).
  Node* make_fresh(Node* hole, std::uintptr_t begin, std::uintptr_t end, std::uint32_t cls,
                   Node* below);

  DeviceBackend& backend_;
  VirtualMemory& vm_;
  // Note [Hot fields first] (allocator.h): inside a training step every call finds the caches
  // cold, so the fields an allocation or a free from a mapped hole touches come first, on the
  // object's first three cache lines (the class is aligned to a line), and the rest after.
  std::size_t page_;
  std::size_t held_pages_ = 0;
  std::size_t small_limit_ = 0;   // settings_.small_size (0: none are small)
  std::size_t recent_max_ = 0;    // largest size kept on the recent lists (0: none)
  std::size_t recent_bytes_ = 0;  // bytes on the recent lists
  std::size_t keep_limit_ = 0;    // settings_.keep_small_bytes
  std::size_t live_bytes_ = 0;
  std::size_t peak_live_ = 0;  // highest live_bytes_ so far (the slack's base)
  std::size_t parked_bytes_ = 0;  // of live_bytes_, freed but parked by the front end
  std::size_t peak_held_ = 0;     // highest live_bytes_ - parked_bytes_ so far
  bool growth_held_ = false;      // create no pages (DefragPolicy::hold_growth)
  std::size_t live_blocks_ = 0;
  std::size_t recent_blocks_ = 0;
  std::uint64_t epoch_ = 1;  // the open epoch: frees now are stamped with it
  StreamId last_stream_ = 0;
  std::uint32_t last_cls_ = 0;
  std::uint32_t frees_in_epoch_ = 0;
  /// Note [Epochs on demand] (defrag.cpp): a miss since the last epoch closed every kEpochFrees.
  bool missed_since_close_ = true;
  bool have_last_ = false;
  Node* age_head_ = nullptr;
  Node* age_tail_ = nullptr;
  std::uint64_t window_allocations_ = 0;
  NodeList node_free_;
  std::vector<StreamState, hot::Allocator<StreamState>> streams_;  // few streams: linear search
  NodeList deferred_;  // left halves of unmerged mapped neighbours
  std::vector<std::uint32_t, hot::Allocator<std::uint32_t>> dirty_list_;
  Index mapped_;

  // ---- colder: growth, moves, other indexes, settings ----
  Index unmapped_;
  std::deque<Node, hot::Allocator<Node>> node_storage_;
  std::vector<std::unique_ptr<Arena>> arenas_;
  DefragSettings settings_;
  std::size_t va_reserve_;

  /// Note [Slack that adapts to moves]: the slack in force, and the window it is judged on.
  double slack_ = 0.0;
  std::uint64_t window_moves_ = 0;
  std::uint32_t dense_windows_ = 0;
  void note_move() noexcept;
  /// Note [A time budget for moves]: the time spent moving pages in the open window.
  std::uint64_t budget_start_ns_ = 0;
  std::uint64_t budget_spent_ns_ = 0;
  std::uint64_t budget_moves_ = 0;
  std::uint64_t budget_wait_ns_ = 0;  ///< of budget_spent_ns_ before the bank paid, the waits
  std::uint64_t budget_raw_ns_ = 0;   ///< budget_spent_ns_ before the bank paid
  bool budget_open_ = false;
  /// Note [Waits that switch to moving pending]: moving pending from now on.
  bool pending_mode_ = false;
  /// A window of moves went over the budget with the slack at its limit (Note [Growing at the
  /// top once moves cost too much at the limit], defrag_grow.cpp); cleared when the slack returns.
  bool over_at_limit_ = false;
  /// Note [A raise that comes back]: the quiet time (no charged growth: one below the peak that
  /// moved pages or waited) after which the slack returns to slack_before_budget_ (0: no raise
  /// to undo), and when the last such growth ended.
  std::uint64_t budget_quiet_ns_ = 0;
  std::uint64_t last_move_ns_ = 0;
  double slack_before_budget_ = 0.0;
  /// Note [Quiet time pays for a burst]: budget earned in quiet time and not yet spent, in ns.
  double bank_ns_ = 0.0;
  void lower_slack_if_quiet(std::uint64_t now_ns) noexcept;
  void note_move_time(std::uint64_t now_ns, std::uint64_t spent_ns,
                      std::uint64_t waited_ns) noexcept;
  /// The slack times `factor` (at least 0.005, at most max_grow_slack), counted as a raise.
  void raise_slack(SlackEvent::Kind why, double factor = 2.0) noexcept;
  /// Sets the slack, counted as a raise (slack_raises, and the slack figure in counters_).
  void raise_slack_to(SlackEvent::Kind why, double slack) noexcept;
  /// Note [A history of the slack]: appends to history_ (never throws; counts what it drops).
  void note_slack_event(SlackEvent::Kind kind, double before, double after,
                        std::uint64_t pages = 0) noexcept;
  std::vector<SlackEvent> history_;
  std::uint64_t history_dropped_ = 0;
  /// Note [A history of the time budget]: costly growths, judged windows, and the waits of
  /// uncharged (new-peak) growths while the window is open.
  void note_costly_growth(const CostlyGrowth& g) noexcept;
  void note_window(BudgetWindow::Close close, BudgetWindow::Verdict verdict, std::uint64_t close_ns,
                   double allowed) noexcept;
  std::vector<CostlyGrowth> growths_;
  std::uint64_t growths_dropped_ = 0;
  std::vector<BudgetWindow> windows_;
  std::uint64_t windows_dropped_ = 0;
  std::uint32_t window_uncharged_waits_ = 0;
  std::uint64_t window_uncharged_wait_ns_ = 0;

  std::vector<Chunk> scratch_;
  /// Note [Coalescing moved chunks while maps are dear]: the moving average of a handle's map
  /// time, and whether the growth under way coalesces.
  double map_ns_per_handle_ = 0.0;
  bool coalescing_ = false;
  std::vector<MapPiece> pieces_;  // scratch_ as map_run wants it (kept to reuse its storage)
  std::size_t max_chunk_pages_ = 1;
  /// Note [Pages that come back] (defrag_grow.cpp): the kind whose range gave pages in the last
  /// move between kinds (none yet: a value no kind has), whether that growth was below the peak
  /// of live bytes, and whether the growth under way is.
  std::uint32_t lender_ = ~std::uint32_t{0};
  bool lent_below_peak_ = false;
  bool growing_below_peak_ = false;
  double returned_slack_ = 0.0;  // the slack those raises added (at most grow_slack)
  std::size_t held_chunks_ = 0;
  std::uint64_t unsafe_unmaps_ = 0;
  DefragCounters counters_;
};

}  // namespace cachealloc::detail
