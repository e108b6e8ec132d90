// defrag.cpp: policy `defrag`, best-fit placement on virtual memory with page stitching
// (see defrag.h for the design, the settings and Note [Physical pages and the streams that
// used them]).
//
// Note [Ranges tile the address space]
// Each reserved address range (an Arena) is tiled, in address order, by ranges of three kinds:
//   live            a block handed out (512-byte multiple, at a 512-byte aligned address)
//   mapped_free     a free hole whose pages are all mapped; at a boundary with a live block it
//                   may cover only part of a page (the page is shared)
//   unmapped_free   a free hole of whole pages with no physical memory behind them
// A page is mapped exactly when it is not inside an unmapped_free range, so the mapping state
// needs no per-page bookkeeping besides the handle mapped there. Adjacent unmapped ranges are
// always merged; adjacent mapped ranges are merged unless they belong to different streams and
// one of them is still "pending" (Note [Physical pages ...]); such pairs are remembered and
// merged once their epoch completed.
//
// Note [Two indexes, one fast path]
// mapped_free ranges sit in a size-ordered set keyed (kind, owner stream, size, address);
// unmapped_free ranges in another keyed (kind, size, address). An allocation first takes the
// best fit among mapped holes usable by its stream: a lower_bound, no device call. Only when
// none fits does it look at unmapped holes, together with the usable mapped holes on either
// side (the partly used pages at the edges of a hole), and map the pages the block needs
// there. A repeating training loop finds every block in mapped holes after its first steps,
// so it maps nothing in steady state.
//
// Note [Where new pages come from]
// Pages for a block are, in this order: (1) new physical pages while the policy holds less than
// (1 + grow_slack) x live bytes; (2) the whole free pages of mapped holes whose streams are
// known to be done with them, oldest hole first (the "age list"), unmapped in one call per hole
// and mapped under the new block ("stitching"); (3) after closing the epoch and waiting for its
// events once (wait_for_streams), the recently freed pages; (4) new physical pages. Only pages
// entirely inside a free hole move; a page shared with a live block stays. So physical memory
// grows only while every page held carries live bytes (or within the slack), which bounds the
// peak by max((1 + slack) x peak live, live + partly used edge pages).
#include <cachealloc/errors.h>
#include <cachealloc/policies/defrag.h>

#include <algorithm>
#include <cmath>
#include <deque>
#include <limits>
#include <memory_resource>
#include <set>
#include <string>

namespace cachealloc {
namespace detail {
namespace {

constexpr std::size_t kAlignment = 512;
/// Other streams' mapped holes skipped (still pending) before a search gives up on that stream.
constexpr int kMaxPendingSkips = 32;
/// Unmapped holes slightly smaller than the request tried before the first that fits alone.
constexpr int kUnmappedCandidates = 8;
/// Unmerged neighbour pairs remembered before the policy closes an epoch on its own.
constexpr std::size_t kDeferredLimit = 4096;
/// With several streams, frees after which the next allocation closes the epoch.
constexpr std::uint32_t kEpochFrees = 8;

enum class State : std::uint8_t { live, mapped_free, unmapped_free, dead };

}  // namespace

struct Node;
struct Arena;

struct IndexKey {
  std::uint64_t bucket;  // mapped: kind << 32 | owner class; unmapped: kind
  // Mutable so that a key whose new value keeps its place in the order can be updated in the
  // tree without re-inserting it (DefragEngine::index_put).
  mutable std::size_t size;
  mutable std::uintptr_t addr;
  Node* node;
  friend bool operator<(const IndexKey& a, const IndexKey& b) noexcept {
    if (a.bucket != b.bucket) {
      return a.bucket < b.bucket;
    }
    if (a.size != b.size) {
      return a.size < b.size;
    }
    return a.addr < b.addr;
  }
};
using Index = std::pmr::set<IndexKey>;

/// One range of an arena (Note [Ranges tile the address space]).
struct Node {
  std::uintptr_t addr = 0;
  std::size_t size = 0;
  Node* prev = nullptr;  // address neighbours in the arena
  Node* next = nullptr;
  Node* age_prev = nullptr;  // the age list: mapped holes holding at least one whole page
  Node* age_next = nullptr;
  Arena* arena = nullptr;
  Index::iterator it{};
  std::uint64_t stamp = 0;  // epoch of the last free merged into it (0: never used)
  std::uint32_t cls = 0;    // owner stream's class (live: the allocating stream)
  State state = State::dead;
  bool indexed = false;
  bool in_age = false;
  [[nodiscard]] std::uintptr_t end() const noexcept { return addr + size; }
};

struct Arena {
  std::uintptr_t base = 0;
  std::size_t size = 0;
  std::uint32_t kind = 0;
  Node* head = nullptr;
  std::vector<PhysicalHandle> pages;  // handle mapped at each page; grows to the highest mapped
};

struct Fence {
  std::uint64_t epoch;
  EventId event;
};

/// A stream that allocated here (its index is the "class" stored in ranges).
struct StreamState {
  StreamId id = 0;
  std::deque<Fence> fences;  // events recorded on the stream, oldest first
  std::uint64_t completed = 0;  // every epoch <= completed finished on this stream
  bool dirty = false;           // freed something during the open epoch
};

class DefragEngine {
 public:
  DefragEngine(DeviceBackend& backend, const DefragSettings& settings);
  ~DefragEngine();
  DefragEngine(const DefragEngine&) = delete;
  DefragEngine& operator=(const DefragEngine&) = delete;

  Block allocate(std::size_t bytes, StreamId stream);
  void deallocate(Block block) noexcept;
  std::size_t release_cached();
  [[nodiscard]] std::size_t reserved_bytes() const noexcept { return held_pages_ * page_; }
  [[nodiscard]] std::size_t live_bytes() const noexcept { return live_bytes_; }
  void check_invariants() const;
  [[nodiscard]] std::vector<SegmentView> segments() const;
  [[nodiscard]] DefragBreakdown breakdown() const;
  [[nodiscard]] const DefragCounters& counters() const noexcept { return counters_; }
  [[nodiscard]] const DefragSettings& settings() const noexcept { return settings_; }

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
  std::uint32_t class_of(StreamId stream);
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
  void defer(Node* left) noexcept {
    try {
      deferred_.push_back(left);
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
  void index_put(Node* n);
  void index_remove(Node* n) noexcept;
  void age_remove(Node* n) noexcept;
  void age_update(Node* n) noexcept;
  void age_touch(Node* n) noexcept;
  /// Merges neighbours `left` and `right` (both free, same state, mergeable) into one of them
  /// (an indexed one when there is one: it keeps its tree node) and returns it. When their
  /// owners differ the result belongs to the pending one's, or (both safe) to `owner`.
  Node* absorb(Node* left, Node* right, std::uint32_t owner) noexcept;
  /// Merges free range `n` with every mergeable neighbour, remembers the pairs that must stay
  /// apart for now, and (re)indexes the result, which it returns. With `for_owner`, merges only
  /// with neighbours usable by stream class `owner`, so that the result stays usable by it.
  Node* merge_around(Node* n, std::uint32_t owner, bool for_owner = false) noexcept;

  // ---- placement ----
  /// Best fit among the stream's own mapped holes.
  Node* find_own(std::uint32_t kind, std::uint32_t cls, std::size_t size) const;
  /// Best fit among other streams' mapped holes that are safe.
  Node* find_other(std::uint32_t kind, std::uint32_t cls, std::size_t size) const;
  Node* carve(Node* f, std::uintptr_t start, std::size_t size, std::uint32_t cls);
  Node* grow(std::uint32_t kind, std::uint32_t cls, std::size_t size);
  struct Placement {
    Node* hole = nullptr;  // the unmapped hole
    std::uintptr_t start = 0;
  };
  Placement place_unmapped(std::uint32_t kind, std::uint32_t cls, std::size_t size) const;
  Arena* new_arena(std::uint32_t kind, std::size_t at_least);
  /// Pages for a block (Note [Where new pages come from]); false when the device is full.
  bool gather_pages(std::size_t count, std::size_t size, const Node* hole, std::uint32_t cls);
  void create_pages(std::size_t count);
  /// New pages the slack allows for a request of `size` bytes.
  [[nodiscard]] std::size_t pages_within_slack(std::size_t size) const noexcept;
  std::size_t steal(std::size_t want, const Node* hole);
  /// The oldest epoch after whose completion on stream class `cls` `count` more whole free
  /// pages of that stream (outside the hole's neighbours) could move; 0 when none could.
  [[nodiscard]] std::uint64_t epoch_for_pages(std::size_t count, const Node* hole,
                                              std::uint32_t cls) const;
  /// Unmaps up to `want` whole pages at the top of mapped hole `n` into scratch_.
  std::size_t take_pages(Node* n, std::size_t want);
  void release_scratch() noexcept;
  /// Turns [hole.addr, end) of an unmapped hole into a fresh mapped hole (merged with usable
  /// neighbours) and returns the resulting mapped hole.
  Node* make_fresh(Node* hole, std::uintptr_t end, std::uint32_t cls);

  DeviceBackend& backend_;
  VirtualMemory& vm_;
  DefragSettings settings_;
  std::size_t page_;
  std::size_t va_reserve_;

  std::pmr::unsynchronized_pool_resource pool_;
  Index mapped_{&pool_};
  Index unmapped_{&pool_};
  std::deque<Node> node_storage_;
  std::vector<Node*> node_free_;
  std::vector<std::unique_ptr<Arena>> arenas_;
  Node* age_head_ = nullptr;
  Node* age_tail_ = nullptr;

  std::vector<StreamState> streams_;  // few streams: linear search
  StreamId last_stream_ = 0;
  std::uint32_t last_cls_ = 0;
  bool have_last_ = false;
  std::vector<std::uint32_t> dirty_list_;
  std::uint64_t epoch_ = 1;  // the open epoch: frees now are stamped with it
  std::uint32_t frees_in_epoch_ = 0;
  std::vector<Node*> deferred_;  // left halves of unmerged mapped neighbours

  std::vector<PhysicalHandle> scratch_;
  std::size_t held_pages_ = 0;
  std::size_t live_bytes_ = 0;
  std::size_t live_blocks_ = 0;
  std::size_t peak_live_ = 0;  // highest live_bytes_ (+ the request) seen when growing
  std::uint64_t unsafe_unmaps_ = 0;
  DefragCounters counters_;
};

// ============================================================================ construction

DefragEngine::DefragEngine(DeviceBackend& backend, const DefragSettings& settings)
    : backend_(backend),
      vm_([&]() -> VirtualMemory& {
        VirtualMemory* vm = backend.virtual_memory();
        if (vm == nullptr) {
          throw ConfigError("policy defrag needs a backend with CUDA virtual memory "
                            "(cuMemCreate/cuMemMap), but backend '" + std::string(backend.name()) +
                            "' has none; use the sim or cuda_vmm backend, or another policy");
        }
        return *vm;
      }()),
      settings_(settings),
      page_(vm_.granularity()) {
  if (page_ < kAlignment || (page_ & (page_ - 1)) != 0) {
    throw ConfigError("policy defrag needs a power-of-two granularity of at least 512 bytes, got " +
                      std::to_string(page_));
  }
  va_reserve_ = settings_.va_reserve_bytes != 0 ? settings_.va_reserve_bytes
                                                : 2 * backend.total_memory();
  va_reserve_ = std::max(page_up(va_reserve_), page_);
  new_arena(kLarge, page_);
}

DefragEngine::~DefragEngine() {
  for (const auto& a : arenas_) {
    // Unmap runs of consecutive mapped pages in one call each, then release every handle.
    std::size_t p = 0;
    while (p < a->pages.size()) {
      if (a->pages[p] == 0) {
        ++p;
        continue;
      }
      std::size_t q = p;
      while (q < a->pages.size() && a->pages[q] != 0) {
        ++q;
      }
      try {
        vm_.unmap(a->base + p * page_, (q - p) * page_);
      } catch (...) {  // NOLINT(bugprone-empty-catch): destructors must not throw
      }
      for (std::size_t i = p; i < q; ++i) {
        vm_.release_physical(a->pages[i], page_);
      }
      p = q;
    }
    vm_.free_address(a->base, a->size);
  }
  for (const StreamState& s : streams_) {
    for (const Fence& f : s.fences) {
      backend_.destroy_event(f.event);
    }
  }
}

Arena* DefragEngine::new_arena(std::uint32_t kind, std::size_t at_least) {
  const std::size_t bytes = std::max(va_reserve_, page_up(at_least + page_));
  auto arena = std::make_unique<Arena>();
  arena->base = vm_.reserve_address(bytes);
  arena->size = bytes;
  arena->kind = kind;
  try {
    Node* n = new_node();
    n->addr = arena->base;
    n->size = bytes;
    n->arena = arena.get();
    n->state = State::unmapped_free;
    arena->head = n;
    arenas_.push_back(std::move(arena));
    index_put(n);
  } catch (...) {
    if (!arenas_.empty() && arenas_.back().get() == arena.get()) {
      arenas_.pop_back();
    }
    vm_.free_address(arena->base, arena->size);
    throw;
  }
  ++counters_.address_ranges;
  return arenas_.back().get();
}

// ============================================================================ streams, epochs

std::uint32_t DefragEngine::class_of(StreamId stream) {
  if (have_last_ && stream == last_stream_) {
    return last_cls_;
  }
  std::uint32_t cls = 0;
  while (cls < streams_.size() && streams_[cls].id != stream) {
    ++cls;
  }
  if (cls == streams_.size()) {
    StreamState s;
    s.id = stream;
    s.completed = epoch_ - 1;
    streams_.push_back(std::move(s));
    dirty_list_.reserve(streams_.size());  // so that mark_dirty (in deallocate) never allocates
  }
  last_stream_ = stream;
  last_cls_ = cls;
  have_last_ = true;
  return cls;
}

void DefragEngine::mark_dirty(std::uint32_t cls) noexcept {
  if (!streams_[cls].dirty) {
    streams_[cls].dirty = true;
    dirty_list_.push_back(cls);
  }
}

void DefragEngine::update_completed(StreamState& s) const noexcept {
  // A stream with no event outstanding finished everything up to the last closed epoch.
  s.completed = s.fences.empty() ? epoch_ - 1 : s.fences.front().epoch - 1;
}

void DefragEngine::close_epoch() {
  if (dirty_list_.empty()) {
    return;  // nothing is stamped with the open epoch
  }
  std::vector<EventId> events;
  events.reserve(dirty_list_.size());
  try {
    for (std::uint32_t cls : dirty_list_) {
      events.push_back(backend_.record_event(streams_[cls].id));
    }
  } catch (...) {
    for (EventId e : events) {
      backend_.destroy_event(e);
    }
    throw;
  }
  for (std::size_t i = 0; i < events.size(); ++i) {
    StreamState& st = streams_[dirty_list_[i]];
    st.fences.push_back(Fence{epoch_, events[i]});
    st.dirty = false;
  }
  counters_.events_recorded += events.size();
  dirty_list_.clear();
  frees_in_epoch_ = 0;
  ++epoch_;
  for (StreamState& st : streams_) {
    update_completed(st);
  }
}

bool DefragEngine::poll() {
  bool advanced = false;
  for (StreamState& st : streams_) {
    while (!st.fences.empty() && backend_.query_event(st.fences.front().event)) {
      backend_.destroy_event(st.fences.front().event);
      st.fences.pop_front();
      update_completed(st);
      advanced = true;
    }
  }
  return advanced;
}

void DefragEngine::wait_all() {
  close_epoch();
  for (std::uint32_t cls = 0; cls < streams_.size(); ++cls) {
    wait_until(cls, epoch_ - 1);
  }
}

void DefragEngine::wait_until(std::uint32_t cls, std::uint64_t epoch) {
  if (epoch >= epoch_) {
    close_epoch();
  }
  StreamState& st = streams_[cls];
  if (st.fences.empty() || st.fences.front().epoch > epoch) {
    return;
  }
  ++counters_.stream_waits;
  while (!st.fences.empty() && st.fences.front().epoch <= epoch) {
    backend_.synchronize_event(st.fences.front().event);
    backend_.destroy_event(st.fences.front().event);
    st.fences.pop_front();
    update_completed(st);
  }
}

void DefragEngine::process_deferred() noexcept {
  std::vector<Node*> pairs;
  pairs.swap(deferred_);  // merge_around() may defer pairs again
  for (Node* n : pairs) {
    // n may have been recycled and reused since: any pair of mapped holes is fine to look at.
    if (n->state == State::mapped_free && n->next != nullptr &&
        n->next->state == State::mapped_free) {
      if (mergeable(n, n->next)) {
        merge_around(n, n->cls);
      } else {
        defer(n);  // both still pending: try again at the next completion
      }
    }
  }
}

// ============================================================================ nodes and indexes

Node* DefragEngine::new_node() {
  if (!node_free_.empty()) {
    Node* n = node_free_.back();
    node_free_.pop_back();
    *n = Node{};
    return n;
  }
  node_storage_.emplace_back();
  node_free_.reserve(node_storage_.size());  // recycle() must not allocate
  return &node_storage_.back();
}

void DefragEngine::recycle(Node* n) noexcept {
  n->state = State::dead;
  n->prev = n->next = nullptr;
  node_free_.push_back(n);
}

void DefragEngine::link_after(Node* pos, Node* n) noexcept {
  n->arena = pos->arena;
  n->prev = pos;
  n->next = pos->next;
  if (pos->next != nullptr) {
    pos->next->prev = n;
  }
  pos->next = n;
}

void DefragEngine::link_before(Node* pos, Node* n) noexcept {
  n->arena = pos->arena;
  n->next = pos;
  n->prev = pos->prev;
  if (pos->prev != nullptr) {
    pos->prev->next = n;
  } else {
    pos->arena->head = n;
  }
  pos->prev = n;
}

void DefragEngine::unlink(Node* n) noexcept {
  if (n->prev != nullptr) {
    n->prev->next = n->next;
  } else {
    n->arena->head = n->next;
  }
  if (n->next != nullptr) {
    n->next->prev = n->prev;
  }
}

IndexKey DefragEngine::key_of(const Node* n) const noexcept {
  const std::uint64_t kind = n->arena->kind;
  const std::uint64_t bucket = n->state == State::unmapped_free ? kind : (kind << 32 | n->cls);
  return IndexKey{bucket, n->size, n->addr, const_cast<Node*>(n)};
}

void DefragEngine::index_put(Node* n) {
  Index& index = index_of(n);
  if (n->indexed) {
    const IndexKey key = key_of(n);
    if (key.bucket == n->it->bucket) {
      // Most changes keep the key between its neighbours: update it where it is.
      const bool after_prev = n->it == index.begin() || *std::prev(n->it) < key;
      const auto next = std::next(n->it);
      if (after_prev && (next == index.end() || key < *next)) {
        n->it->size = key.size;
        n->it->addr = key.addr;
        return;
      }
    }
    // Otherwise extract and re-insert the same tree node (no allocation).
    auto handle = index.extract(n->it);
    handle.value() = key_of(n);
    n->it = index.insert(std::move(handle)).position;
  } else {
    n->it = index.insert(key_of(n)).first;
    n->indexed = true;
  }
}

void DefragEngine::index_remove(Node* n) noexcept {
  if (n->indexed) {
    index_of(n).erase(n->it);
    n->indexed = false;
  }
}

void DefragEngine::age_remove(Node* n) noexcept {
  if (!n->in_age) {
    return;
  }
  (n->age_prev != nullptr ? n->age_prev->age_next : age_head_) = n->age_next;
  (n->age_next != nullptr ? n->age_next->age_prev : age_tail_) = n->age_prev;
  n->age_prev = n->age_next = nullptr;
  n->in_age = false;
}

void DefragEngine::age_update(Node* n) noexcept {
  const bool wanted = n->state == State::mapped_free && whole_pages(n) > 0;
  if (wanted == n->in_age) {
    return;
  }
  if (!wanted) {
    age_remove(n);
    return;
  }
  n->age_prev = age_tail_;
  n->age_next = nullptr;
  (age_tail_ != nullptr ? age_tail_->age_next : age_head_) = n;
  age_tail_ = n;
  n->in_age = true;
}

void DefragEngine::age_touch(Node* n) noexcept {
  age_remove(n);
  age_update(n);
}

Node* DefragEngine::absorb(Node* left, Node* right, std::uint32_t owner) noexcept {
  std::uint32_t cls = left->cls;
  if (left->cls != right->cls) {
    if (!safe(right)) {
      cls = right->cls;
    } else if (safe(left)) {
      cls = owner;  // both safe: any stream may own the result
    }
  }
  const bool keep_left = left->indexed || !right->indexed;
  Node* keep = keep_left ? left : right;
  Node* gone = keep_left ? right : left;
  index_remove(gone);
  age_remove(gone);
  keep->cls = cls;
  keep->stamp = std::max(left->stamp, right->stamp);
  keep->addr = left->addr;
  keep->size = left->size + right->size;
  unlink(gone);
  recycle(gone);
  return keep;
}

Node* DefragEngine::merge_around(Node* n, std::uint32_t owner, bool for_owner) noexcept {
  // for_owner: the fresh pages of a placement join every neighbour usable by its stream, even a
  // safe hole of another stream next to a pending hole of its own (Note [Where new pages come
  // from]: the block spans them).
  const auto joins = [&](const Node* a, const Node* b, const Node* neighbour) {
    if (b->state != a->state) {
      return false;
    }
    if (!for_owner || a->state == State::unmapped_free) {
      return mergeable(a, b);
    }
    const Node* other = neighbour == a ? b : a;
    return usable(neighbour, owner) && usable(other, owner);
  };
  // Merging can change the owner, which can make another neighbour mergeable: loop.
  for (;;) {
    if (Node* prev = n->prev; prev != nullptr && joins(prev, n, prev)) {
      n = absorb(prev, n, owner);
      continue;
    }
    if (Node* next = n->next; next != nullptr && joins(n, next, next)) {
      n = absorb(n, next, owner);
      continue;
    }
    break;
  }
  if (n->state == State::mapped_free) {
    if (n->prev != nullptr && n->prev->state == State::mapped_free) {
      defer(n->prev);
    }
    if (n->next != nullptr && n->next->state == State::mapped_free) {
      defer(n);
    }
  }
  try {
    index_put(n);
  } catch (...) {
    // Only a fresh insert allocates (from the pool); if that fails the hole stays out of the
    // index (never reused, still correct) until a neighbour's free merges it back in.
  }
  age_touch(n);
  return n;
}

// ============================================================================ allocate / free

Block DefragEngine::allocate(std::size_t bytes, StreamId stream) {
  if (bytes == 0 || bytes > (std::numeric_limits<std::size_t>::max() >> 2)) {
    return {};
  }
  const std::size_t size = round_up(bytes, kAlignment);
  const std::uint32_t kind =
      settings_.small_size != 0 && size <= settings_.small_size ? kSmall : kLarge;
  const std::uint32_t cls = class_of(stream);
  if ((streams_.size() > 1 && frees_in_epoch_ >= kEpochFrees) ||
      deferred_.size() > kDeferredLimit) {
    // Note [Physical pages and the streams that used them]: closing epochs as frees accumulate
    // (not only at misses) lets the next miss find most free pages known safe without waiting.
    try {
      if (poll()) {
        process_deferred();
      }
      close_epoch();
    } catch (const DeviceError&) {  // only an optimisation here: the next miss tries again
    }
  }
  Node* block = nullptr;
  if (Node* f = find_own(kind, cls, size)) {
    block = carve(f, f->addr, size, cls);
  } else {
    // A miss: learn which epochs finished and close the open one, so that pages freed until now
    // can be moved (and other streams' holes reused) at the next miss without waiting.
    if (poll()) {
      process_deferred();
    }
    close_epoch();
    block = grow(kind, cls, size);
    if (block == nullptr) {
      return {};
    }
  }
  return Block{reinterpret_cast<void*>(block->addr), block->size, block};
}

void DefragEngine::deallocate(Block block) noexcept {
  Node* n = static_cast<Node*>(block.cookie);
  live_bytes_ -= n->size;
  --live_blocks_;
  n->state = State::mapped_free;
  n->stamp = epoch_;
  mark_dirty(n->cls);
  ++frees_in_epoch_;
  merge_around(n, n->cls);
}

Node* DefragEngine::find_own(std::uint32_t kind, std::uint32_t cls, std::size_t size) const {
  const std::uint64_t own = std::uint64_t{kind} << 32 | cls;
  auto it = mapped_.lower_bound(IndexKey{own, size, 0, nullptr});
  return it != mapped_.end() && it->bucket == own ? it->node : nullptr;
}

Node* DefragEngine::find_other(std::uint32_t kind, std::uint32_t cls, std::size_t size) const {
  Node* best = nullptr;
  {
    // Other streams' holes qualify once the epoch that freed them completed.
    for (std::uint32_t other = 0; other < streams_.size(); ++other) {
      if (other == cls) {
        continue;
      }
      const std::uint64_t bucket = std::uint64_t{kind} << 32 | other;
      int skips = 0;
      for (auto jt = mapped_.lower_bound(IndexKey{bucket, size, 0, nullptr});
           jt != mapped_.end() && jt->bucket == bucket && skips < kMaxPendingSkips; ++jt, ++skips) {
        if (best != nullptr &&
            (jt->size > best->size || (jt->size == best->size && jt->addr > best->addr))) {
          break;
        }
        if (safe(jt->node)) {
          best = jt->node;
          break;
        }
      }
    }
  }
  return best;
}

Node* DefragEngine::carve(Node* f, std::uintptr_t start, std::size_t size, std::uint32_t cls) {
  const std::uintptr_t end = start + size;
  Node* b = nullptr;
  if (start == f->addr && end == f->end()) {
    index_remove(f);
    age_remove(f);
    b = f;
  } else {
    b = new_node();
    if (start == f->addr) {
      link_before(f, b);
      f->addr = end;
      f->size -= size;
    } else {
      Node* right = nullptr;
      if (end < f->end()) {
        right = new_node();  // before any change: an allocation failure leaves f as it was
      }
      link_after(f, b);
      if (right != nullptr) {
        right->addr = end;
        right->size = f->end() - end;
        right->state = State::mapped_free;
        right->cls = f->cls;
        right->stamp = f->stamp;
        link_after(b, right);
        index_put(right);
        age_update(right);
      }
      f->size = start - f->addr;
    }
    index_put(f);
    age_update(f);
  }
  b->addr = start;
  b->size = size;
  b->state = State::live;
  b->cls = cls;
  b->stamp = 0;
  live_bytes_ += size;
  ++live_blocks_;
  return b;
}

// ============================================================================ growth

DefragEngine::Placement DefragEngine::place_unmapped(std::uint32_t kind, std::uint32_t cls,
                                                     std::size_t size) const {
  // Usable mapped holes on either side extend an unmapped hole (they are the partly used pages
  // at its edges), so a hole up to two pages smaller than the request may do.
  const std::size_t lowest = size > 2 * page_ ? size - 2 * page_ : 0;
  auto it = unmapped_.lower_bound(IndexKey{kind, lowest, 0, nullptr});
  for (int tried = 0; it != unmapped_.end() && it->bucket == kind; ++it, ++tried) {
    if (tried == kUnmappedCandidates && it->size < size) {
      it = unmapped_.lower_bound(IndexKey{kind, size, 0, nullptr});
      if (it == unmapped_.end() || it->bucket != kind) {
        break;
      }
    }
    Node* hole = it->node;
    const Node* left = usable(hole->prev, cls) ? hole->prev : nullptr;
    const Node* right = usable(hole->next, cls) ? hole->next : nullptr;
    const std::uintptr_t start = left != nullptr ? left->addr : hole->addr;
    const std::uintptr_t limit = right != nullptr ? right->end() : hole->end();
    if (start + size <= limit) {
      return Placement{hole, start};
    }
  }
  return {};
}

Node* DefragEngine::grow(std::uint32_t kind, std::uint32_t cls, std::size_t size) {
  Placement where = place_unmapped(kind, cls, size);
  if (where.hole == nullptr) {
    new_arena(kind, size);
    where = place_unmapped(kind, cls, size);
  }
  Node* hole = where.hole;
  const std::uintptr_t start = where.start;
  // Pages [hole.addr, window_end) get mapped; beyond the hole the block lies in a mapped hole.
  const std::uintptr_t window_end =
      std::clamp(page_up(start + size), hole->addr, hole->end());
  const std::size_t count = (window_end - hole->addr) / page_;
  Node* f = nullptr;
  if (count == 0) {
    f = hole->prev;  // the block fits in the usable mapped hole on the left
  } else {
    // Note [Stream affinity]: another stream's safe hole is taken only when the slack does not
    // cover the new pages: it is that stream's cache, and taking it early makes that stream grow.
    if (pages_within_slack(size) < count) {
      if (Node* other = find_other(kind, cls, size)) {
        return carve(other, other->addr, size, cls);
      }
    }
    ++counters_.grow_allocations;
    if (!gather_pages(count, size, hole, cls)) {
      return nullptr;
    }
    Arena& arena = *hole->arena;
    const std::size_t first = page_index(arena, hole->addr);
    if (arena.pages.size() < first + count) {
      try {
        arena.pages.resize(first + count, 0);
      } catch (...) {
        release_scratch();
        throw;
      }
    }
    std::size_t mapped = 0;
    try {
      for (; mapped < count; ++mapped) {
        vm_.map(hole->addr + mapped * page_, page_, scratch_[mapped]);
        arena.pages[first + mapped] = scratch_[mapped];
      }
    } catch (...) {
      // Keep what got mapped as a fresh hole; give back the rest (state stays consistent).
      scratch_.erase(scratch_.begin(), scratch_.begin() + static_cast<std::ptrdiff_t>(mapped));
      release_scratch();
      counters_.pages_mapped += mapped;
      if (mapped > 0) {
        make_fresh(hole, hole->addr + mapped * page_, cls);
      }
      throw;
    }
    counters_.pages_mapped += count;
    scratch_.clear();
    f = make_fresh(hole, window_end, cls);
  }
  if (f->addr > start || f->end() < start + size) {
    throw InvariantError("policy defrag: the mapped hole does not cover its placement");
  }
  return carve(f, start, size, cls);
}

bool DefragEngine::gather_pages(std::size_t count, std::size_t size, const Node* hole,
                                std::uint32_t cls) {
  scratch_.clear();
  try {
    create_pages(std::min(count, pages_within_slack(size)));
    peak_live_ = std::max(peak_live_, live_bytes_ + size);
    if (scratch_.size() < count) {
      steal(count - scratch_.size(), hole);
    }
    if (scratch_.size() < count && settings_.wait_for_streams) {
      // Wait for the allocating stream only (never block on another stream's work), and only
      // for the oldest epochs that free enough pages.
      const std::uint64_t epoch = epoch_for_pages(count - scratch_.size(), hole, cls);
      if (epoch != 0) {
        wait_until(cls, epoch);
        steal(count - scratch_.size(), hole);
      }
    }
    if (scratch_.size() < count) {
      create_pages(count - scratch_.size());
    }
  } catch (...) {
    release_scratch();
    throw;
  }
  if (scratch_.size() < count) {
    release_scratch();
    return false;
  }
  return true;
}

std::size_t DefragEngine::pages_within_slack(std::size_t size) const noexcept {
  // Note [Where new pages come from]: the slack is measured against the peak of live bytes so
  // far, which bounds the peak reserved exactly as well and moves fewer pages below the peak.
  const std::size_t peak = std::max(peak_live_, live_bytes_ + size);
  const double allowed = (1.0 + settings_.grow_slack) * static_cast<double>(peak) -
                         static_cast<double>(reserved_bytes());
  return allowed > 0 ? static_cast<std::size_t>(allowed / static_cast<double>(page_)) : 0;
}

void DefragEngine::create_pages(std::size_t count) {
  scratch_.reserve(scratch_.size() + count);
  for (std::size_t i = 0; i < count; ++i) {
    const PhysicalHandle h = vm_.create_physical(page_);
    if (h == 0) {
      return;
    }
    scratch_.push_back(h);
    ++held_pages_;
    ++counters_.pages_created;
  }
}

void DefragEngine::release_scratch() noexcept {
  for (PhysicalHandle h : scratch_) {
    vm_.release_physical(h, page_);
    --held_pages_;
    ++counters_.pages_released;
  }
  scratch_.clear();
}

std::uint64_t DefragEngine::epoch_for_pages(std::size_t count, const Node* hole,
                                            std::uint32_t cls) const {
  std::vector<std::pair<std::uint64_t, std::size_t>> pending;  // (stamp, whole pages)
  for (const Node* n = age_head_; n != nullptr; n = n->age_next) {
    if (n != hole->prev && n != hole->next && n->cls == cls && !safe(n)) {
      pending.emplace_back(n->stamp, whole_pages(n));
    }
  }
  if (pending.empty()) {
    return 0;
  }
  std::sort(pending.begin(), pending.end());
  std::size_t pages = 0;
  for (const auto& [stamp, whole] : pending) {
    pages += whole;
    if (pages >= count) {
      return stamp;
    }
  }
  return pending.back().first;  // not enough: take all there is, create the rest
}

std::size_t DefragEngine::steal(std::size_t want, const Node* hole) {
  // The hole's own neighbours stay: they are part of the placement (and moving their pages
  // would merge the hole away).
  std::size_t taken = 0;
  for (Node* n = age_head_; n != nullptr && taken < want;) {
    Node* next = n->age_next;  // take_pages never recycles another age-list node
    if (n != hole->prev && n != hole->next && safe(n)) {
      const std::size_t k = take_pages(n, want - taken);
      taken += k;
      counters_.pages_moved += k;
    }
    n = next;
  }
  return taken;
}

std::size_t DefragEngine::take_pages(Node* n, std::size_t want) {
  const std::size_t k = std::min(want, whole_pages(n));
  if (k == 0) {
    return 0;
  }
  if (!safe(n)) {
    ++unsafe_unmaps_;  // never: callers check; check_invariants() reports it
  }
  const std::uintptr_t hi = page_down(n->end());
  const std::uintptr_t cut = hi - k * page_;
  // Nodes first (the only allocations), then the device call, then nothing can fail.
  Node* right = hi < n->end() ? new_node() : nullptr;
  Node* mid = nullptr;
  try {
    mid = cut > n->addr ? new_node() : n;
    scratch_.reserve(scratch_.size() + k);
    vm_.unmap(cut, k * page_);
  } catch (...) {
    if (right != nullptr) {
      recycle(right);
    }
    if (mid != nullptr && mid != n) {
      recycle(mid);
    }
    throw;
  }
  ++counters_.unmap_batches;
  Arena& arena = *n->arena;
  const std::size_t first = page_index(arena, cut);
  for (std::size_t i = 0; i < k; ++i) {
    scratch_.push_back(arena.pages[first + i]);
    arena.pages[first + i] = 0;
  }
  const std::uintptr_t old_end = n->end();
  const std::uint32_t owner = n->cls;  // n may turn into the unmapped part below
  const std::uint64_t stamp = n->stamp;
  if (mid == n) {
    index_remove(n);
    age_remove(n);
    n->size = hi - cut;
  } else {
    link_after(n, mid);
    mid->addr = cut;
    mid->size = hi - cut;
    n->size = cut - n->addr;
  }
  mid->state = State::unmapped_free;
  mid->cls = 0;
  mid->stamp = 0;
  if (right != nullptr) {
    link_after(mid, right);
    right->addr = hi;
    right->size = old_end - hi;
    right->state = State::mapped_free;
    right->cls = owner;
    right->stamp = stamp;
  }
  try {
    if (mid != n) {
      index_put(n);  // re-key: no allocation
      age_update(n);
    }
    if (right != nullptr) {
      index_put(right);
    }
    merge_around(mid, 0);
  } catch (...) {
    // An index insert failed (out of host memory): the ranges are right, an unindexed hole is
    // only never reused. Report it rather than hide it.
    throw;
  }
  return k;
}

Node* DefragEngine::make_fresh(Node* hole, std::uintptr_t end, std::uint32_t cls) {
  Node* f = nullptr;
  if (end < hole->end()) {
    f = new_node();
    f->addr = hole->addr;
    f->size = end - hole->addr;
    link_before(hole, f);
    hole->addr = end;
    hole->size -= f->size;
    index_put(hole);
  } else {
    index_remove(hole);
    f = hole;
  }
  f->state = State::mapped_free;
  f->cls = cls;
  f->stamp = 0;
  return merge_around(f, cls, /*for_owner=*/true);
}

// ============================================================================ release

std::size_t DefragEngine::release_cached() {
  wait_all();
  // Every hole is safe now: merge all neighbours the streams kept apart.
  deferred_.clear();
  for (const auto& a : arenas_) {
    for (Node* n = a->head; n != nullptr; n = n->next) {
      if (n->state == State::mapped_free && n->next != nullptr &&
          n->next->state == State::mapped_free) {
        n = merge_around(n, n->cls);
      }
    }
  }
  deferred_.clear();
  std::size_t released = 0;
  scratch_.clear();
  for (Node* n = age_head_; n != nullptr;) {
    Node* next = n->age_next;
    try {
      take_pages(n, std::numeric_limits<std::size_t>::max());
    } catch (...) {
      released += scratch_.size();
      release_scratch();
      throw;
    }
    released += scratch_.size();
    release_scratch();
    n = next;
  }
  return released * page_;
}

// ============================================================================ inspection

void DefragEngine::check_invariants() const {
  std::size_t live = 0;
  std::size_t live_blocks = 0;
  std::size_t mapped_nodes = 0;
  std::size_t unmapped_nodes = 0;
  std::size_t age_nodes = 0;
  std::vector<PhysicalHandle> handles;
  for (const auto& a : arenas_) {
    CACHEALLOC_CHECK_INVARIANT(a->head != nullptr && a->head->prev == nullptr, "arena without head");
    std::uintptr_t cursor = a->base;
    for (const Node* n = a->head; n != nullptr; n = n->next) {
      const std::string where = " at " + std::to_string(n->addr);
      CACHEALLOC_CHECK_INVARIANT(n->arena == a.get(), "range in the wrong arena" + where);
      CACHEALLOC_CHECK_INVARIANT(n->addr == cursor, "gap or overlap between ranges" + where);
      CACHEALLOC_CHECK_INVARIANT(n->size > 0 && n->size % kAlignment == 0 && n->addr % kAlignment == 0,
                                 "range not 512-byte aligned or empty" + where);
      CACHEALLOC_CHECK_INVARIANT(n->next == nullptr || n->next->prev == n, "broken links" + where);
      CACHEALLOC_CHECK_INVARIANT(n->stamp <= epoch_, "stamp from the future" + where);
      const bool unmapped = n->state == State::unmapped_free;
      switch (n->state) {
        case State::live:
          live += n->size;
          ++live_blocks;
          CACHEALLOC_CHECK_INVARIANT(!n->indexed && !n->in_age, "live block in a free index" + where);
          break;
        case State::mapped_free: {
          ++mapped_nodes;
          CACHEALLOC_CHECK_INVARIANT(n->indexed, "mapped hole missing from the index" + where);
          if (n->next != nullptr && n->next->state == State::mapped_free) {
            CACHEALLOC_CHECK_INVARIANT(n->cls != n->next->cls,
                                       "unmerged mapped holes of one stream" + where);
          }
          CACHEALLOC_CHECK_INVARIANT(n->in_age == (whole_pages(n) > 0),
                                     "age list disagrees with the hole's whole pages" + where);
          break;
        }
        case State::unmapped_free:
          ++unmapped_nodes;
          CACHEALLOC_CHECK_INVARIANT(n->indexed, "unmapped hole missing from the index" + where);
          CACHEALLOC_CHECK_INVARIANT(n->addr % page_ == 0 && n->size % page_ == 0,
                                     "unmapped hole not page aligned" + where);
          CACHEALLOC_CHECK_INVARIANT(n->next == nullptr || n->next->state != State::unmapped_free,
                                     "unmerged unmapped holes" + where);
          CACHEALLOC_CHECK_INVARIANT(!n->in_age, "unmapped hole in the age list" + where);
          break;
        case State::dead:
          CACHEALLOC_CHECK_INVARIANT(false, "recycled node still linked" + where);
      }
      if (n->indexed) {
        const IndexKey& k = *n->it;
        CACHEALLOC_CHECK_INVARIANT(k.node == n && k.size == n->size && k.addr == n->addr,
                                   "index key out of date" + where);
        const IndexKey expected = key_of(n);
        CACHEALLOC_CHECK_INVARIANT(k.bucket == expected.bucket, "index bucket out of date" + where);
      }
      // Pages: mapped exactly outside unmapped holes.
      for (std::uintptr_t p = page_down(n->addr); p < n->end(); p += page_) {
        const std::size_t i = page_index(*a, p);
        const PhysicalHandle h = i < a->pages.size() ? a->pages[i] : 0;
        if (unmapped) {
          CACHEALLOC_CHECK_INVARIANT(h == 0, "page mapped inside an unmapped hole" + where);
          if (i >= a->pages.size()) {
            break;  // beyond the highest page ever mapped: all unmapped
          }
        } else {
          CACHEALLOC_CHECK_INVARIANT(h != 0, "page under a block or mapped hole is unmapped" + where);
          if (p >= n->addr) {  // count each page once: at the range where it starts
            handles.push_back(h);
          }
        }
      }
      cursor = n->end();
    }
    CACHEALLOC_CHECK_INVARIANT(cursor == a->base + a->size, "ranges do not cover their arena");
  }
  for (const Node* n = age_head_; n != nullptr; n = n->age_next) {
    ++age_nodes;
    CACHEALLOC_CHECK_INVARIANT(n->in_age && n->state == State::mapped_free, "age list holds a non-hole");
    CACHEALLOC_CHECK_INVARIANT(n->age_next != nullptr || n == age_tail_, "age list tail wrong");
  }
  std::size_t in_age = 0;
  for (const auto& a : arenas_) {
    for (const Node* n = a->head; n != nullptr; n = n->next) {
      in_age += n->in_age ? 1 : 0;
    }
  }
  CACHEALLOC_CHECK_INVARIANT(age_nodes == in_age, "age list length disagrees with its members");
  CACHEALLOC_CHECK_INVARIANT(mapped_nodes == mapped_.size(), "stale entries in the mapped index");
  CACHEALLOC_CHECK_INVARIANT(unmapped_nodes == unmapped_.size(), "stale entries in the unmapped index");
  CACHEALLOC_CHECK_INVARIANT(live == live_bytes_ && live_blocks == live_blocks_,
                             "live bytes disagree with the blocks");
  std::sort(handles.begin(), handles.end());
  CACHEALLOC_CHECK_INVARIANT(std::adjacent_find(handles.begin(), handles.end()) == handles.end(),
                             "a physical page is mapped twice");
  CACHEALLOC_CHECK_INVARIANT(handles.size() == held_pages_,
                             "mapped pages (" + std::to_string(handles.size()) +
                                 ") differ from the pages held (" + std::to_string(held_pages_) + ")");
  CACHEALLOC_CHECK_INVARIANT(vm_.physical_bytes() >= reserved_bytes(),
                             "the policy reports more physical memory than the backend holds");
  CACHEALLOC_CHECK_INVARIANT(unsafe_unmaps_ == 0,
                             "a page was unmapped while a stream use recorded on it was unfinished");
  std::size_t dirty = 0;
  for (const StreamState& st : streams_) {
    std::uint64_t last = 0;
    for (const Fence& f : st.fences) {
      CACHEALLOC_CHECK_INVARIANT(f.epoch > last && f.epoch < epoch_, "fences out of order");
      last = f.epoch;
    }
    CACHEALLOC_CHECK_INVARIANT(
        st.completed == (st.fences.empty() ? epoch_ - 1 : st.fences.front().epoch - 1),
        "a stream's completed epoch disagrees with its oldest fence");
    dirty += st.dirty ? 1 : 0;
  }
  CACHEALLOC_CHECK_INVARIANT(dirty == dirty_list_.size(), "dirty streams out of step");
}

std::vector<SegmentView> DefragEngine::segments() const {
  std::vector<SegmentView> out;
  for (const auto& a : arenas_) {
    SegmentView* seg = nullptr;
    for (const Node* n = a->head; n != nullptr; n = n->next) {
      if (n->state == State::unmapped_free) {
        seg = nullptr;
        continue;
      }
      if (seg == nullptr) {
        out.push_back(SegmentView{n->addr, 0, 0, a->kind == kSmall, {}});
        seg = &out.back();
      }
      seg->size += n->size;
      seg->blocks.push_back(BlockView{n->addr, n->size, n->state == State::live});
    }
  }
  return out;
}

DefragBreakdown DefragEngine::breakdown() const {
  DefragBreakdown out;
  for (const auto& a : arenas_) {
    for (const Node* n = a->head; n != nullptr; n = n->next) {
      if (n->state == State::live) {
        out.live_bytes += n->size;
        ++out.live_blocks;
      } else if (n->state == State::mapped_free) {
        const std::size_t whole = whole_pages(n) * page_;
        out.cached_free_bytes += whole;
        out.edge_free_bytes += n->size - whole;
        ++out.free_holes;
      }
    }
  }
  return out;
}

}  // namespace detail

// ============================================================================ the policy

std::vector<std::string_view> DefragPolicy::config_keys() {
  return {"va_reserve_gb", "grow_slack", "small_size", "wait_for_streams"};
}

DefragSettings DefragPolicy::parse_settings(Config& config) {
  DefragSettings s;
  if (auto gb = config.take_double("va_reserve_gb", 1.0 / 1024, 1 << 20)) {
    s.va_reserve_bytes = static_cast<std::size_t>(*gb * static_cast<double>(kGiB));
  }
  if (auto slack = config.take_double("grow_slack", 0.0, 1.0)) {
    s.grow_slack = *slack;
  }
  if (auto small = config.take_bytes("small_size")) {
    if (*small > kGiB) {
      throw ConfigError("CACHEALLOC_CONF: 'small_size' must be at most 1GB, got " +
                        std::to_string(*small));
    }
    s.small_size = *small;
  }
  if (auto wait = config.take_bool("wait_for_streams")) {
    s.wait_for_streams = *wait;
  }
  return s;
}

DefragPolicy::DefragPolicy(DeviceBackend& backend, Config& config)
    : DefragPolicy(backend, parse_settings(config)) {}

DefragPolicy::DefragPolicy(DeviceBackend& backend, const DefragSettings& settings)
    : engine_(std::make_unique<detail::DefragEngine>(backend, settings)) {}

DefragPolicy::~DefragPolicy() = default;

Block DefragPolicy::allocate(std::size_t bytes, StreamId stream) {
  return engine_->allocate(bytes, stream);
}

void DefragPolicy::deallocate(Block block, StreamId /*stream*/) noexcept {
  // The block's own stream is recorded in it at allocation; policy.h item 4 says they agree.
  engine_->deallocate(block);
}

std::size_t DefragPolicy::release_cached() { return engine_->release_cached(); }
std::size_t DefragPolicy::reserved_bytes() const noexcept { return engine_->reserved_bytes(); }
void DefragPolicy::check_invariants() const { engine_->check_invariants(); }
DefragCounters DefragPolicy::counters() const noexcept { return engine_->counters(); }
const DefragSettings& DefragPolicy::settings() const noexcept { return engine_->settings(); }
std::size_t DefragPolicy::live_bytes() const noexcept { return engine_->live_bytes(); }
DefragBreakdown DefragPolicy::breakdown() const { return engine_->breakdown(); }
std::vector<SegmentView> DefragPolicy::segment_views() const { return engine_->segments(); }

}  // namespace cachealloc
