// defrag.cpp: policy `defrag`, best-fit placement on virtual memory with page stitching: the
// fast path (allocate from a mapped hole, free and merge), the stream epochs and the policy
// object. Growth and page moves are in defrag_grow.cpp, invariants and snapshots in
// defrag_check.cpp, the shared state in defrag_engine.h; the design summary and the settings
// are in defrag.h.
//
// Note [Ranges tile the address space]
// Each reserved address range (an Arena) is tiled, in address order, by ranges of three kinds:
//   live            a block handed out (512-byte multiple, at a 512-byte aligned address)
//   mapped_free     a free hole whose pages are all mapped; at a boundary with a live block it
//                   may cover only part of a page (the page is shared)
//   unmapped_free   a free hole of whole pages with no physical memory behind them
// A page is mapped exactly when it is not inside an unmapped_free range, so the mapping state
// needs no per-page bookkeeping besides the handle mapped there. Adjacent unmapped holes are
// always merged. Adjacent mapped holes are merged when they belong to one stream or are both
// safe (Note [Physical pages and the streams that used them], defrag.h); a pair kept apart is
// remembered and merged once its epochs completed.
//
// Note [Two indexes, one fast path]
// mapped_free holes sit in a size-ordered set keyed (kind, owner stream, size, address);
// unmapped_free holes in another keyed (kind, size, address). An allocation first takes the
// best fit among its own stream's mapped holes: one lower_bound, no device call. Only when none
// fits does it look at unmapped holes, together with the usable mapped holes on either side
// (the partly used pages at the edges of a hole), and map the pages the block needs there
// (defrag_grow.cpp). A repeating training loop finds every block in mapped holes after its
// first steps, so it maps nothing in steady state.
//
// Note [Stream affinity]
// A hole freed on stream S is S's cache: another stream takes it only once it is safe and only
// when the slack does not cover the new pages that stream needs anyway. Taking other streams'
// holes first (best fit over all streams) made streams take turns growing: on mlp_two_streams
// the side stream found its input buffer taken by the main stream every step (1.036 instead of
// 1.012 peak reserved / peak requested).
//
// Note [Epochs on demand]
// With several streams an epoch used to close every kEpochFrees frees, whatever the job did:
// the two-stream pipeline of bench/e2e recorded 10 events and queried 11 per 9 ms step on the
// H200 (2-3 us each inside a step, 45-70 us of its 140 us in the allocator when no page moved).
// They are worth it only to a job that misses: the next growth finds the pages freed before the
// last close known safe. A job whose steps find every block in a mapped hole asks nothing. So
// the periodic close happens only when the policy missed since the last one (a miss itself
// still polls and closes, as before): a job that settles stops recording events, and the first
// miss after a quiet stretch makes the epochs close every kEpochFrees frees again, once more
// after the last miss. Replayed (peak reserved / peak requested; events recorded, the simulated
// GPU lagging the trace's host by 0 / 0.5 / 1 / 2 / 5 ms):
//   e2e pipeline     every 8 frees  1.189 / 1.210 / 1.242 / 1.274 / 1.244   359-363 events
//                    on demand      1.244 / 1.244 / 1.253 / 1.235 / 1.250    51-70 events
//   mlp_two_streams  every 8 frees  1.010 / 1.060 / 1.060 / 1.060 / 1.040   333-341 events
//                    on demand      1.012 / 1.012 / 1.012 / 1.012 / 1.041    11-36 events
// (expandable segments: 1.244 on the pipeline at any lag). The pipeline, which ends at its
// largest slack (0.25) either way, lands on one of a few outcomes that a small change moves it
// between; the shared trace gains at any realistic lag: with epochs every 8 frees, the side
// stream's holes became safe only after the main stream had grown around them. On the H200
// (bench/results/e2e_h200_2026-12-03_session12f_lazy_epochs.md, 5 runs) the pipeline's quiet
// steps took 83-94 us instead of 113-170, 3.1 + 3.1 events per step instead of 10 + 11, at
// the same peak within the runs' spread; with this rule committed (..._session13a.md, binaries
// 61b04a7) 3.2 + 3.4 events per step (21 us) and a median step of 79.8 us, 0.85% of the step.
// One-stream jobs never closed epochs periodically.
#include <cachealloc/errors.h>

#include "defrag_engine.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <new>
#include <string>

namespace cachealloc {
namespace detail {

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
      page_(vm_.granularity()),
      small_limit_(settings.small_size),
      keep_limit_(settings.keep_small_bytes),
      settings_(settings) {
  if (page_ < kAlignment || (page_ & (page_ - 1)) != 0) {
    throw ConfigError("policy defrag needs a power-of-two granularity of at least 512 bytes, got " +
                      std::to_string(page_));
  }
  va_reserve_ = settings_.va_reserve_bytes != 0 ? settings_.va_reserve_bytes
                                                : 2 * backend.total_memory();
  va_reserve_ = std::max(page_up(va_reserve_), page_);
  max_chunk_pages_ = std::max<std::size_t>(settings_.max_chunk_bytes / page_, 1);
  recent_max_ = settings_.small_size != 0 && settings_.keep_small_bytes != 0
                    ? std::min(settings_.small_size, kRecentMaxSize)
                    : 0;
  slack_ = settings_.grow_slack;
  counters_.slack = slack_;
  new_arena(kLarge, page_, 0);
}

DefragEngine::~DefragEngine() {
  for (const auto& a : arenas_) {
    // Unmap runs of consecutive mapped pages in one call each, then release every chunk (the
    // run of pages carrying its handle).
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
      for (std::size_t i = p; i < q;) {
        std::size_t j = i + 1;
        while (j < q && a->pages[j] == a->pages[i]) {
          ++j;
        }
        vm_.release_physical(a->pages[i], (j - i) * page_);
        i = j;
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

Arena* DefragEngine::new_arena(std::uint32_t kind, std::size_t at_least, std::uint32_t home) {
  const std::size_t bytes = std::max(va_reserve_, page_up(at_least + page_));
  auto owned = std::make_unique<Arena>();
  Arena* arena = owned.get();
  arena->size = bytes;
  arena->kind = kind;
  arena->home = home;
  const std::uintptr_t base = vm_.reserve_address(bytes);  // throws DeviceError: nothing to undo
  arena->base = base;
  Node* n = nullptr;
  try {
    n = new_node();
    n->addr = base;
    n->size = bytes;
    n->arena = arena;
    n->kind = static_cast<std::uint8_t>(kind);
    n->state = State::unmapped_free;
    arena->head = n;
    arenas_.push_back(std::move(owned));
    index_put(n);
  } catch (...) {  // out of host memory: leave no trace of the range
    if (!arenas_.empty() && arenas_.back().get() == arena) {
      arenas_.pop_back();  // destroys the arena
    }
    if (n != nullptr) {
      recycle(n);
    }
    vm_.free_address(base, bytes);
    throw;
  }
  ++counters_.address_ranges;
  return arena;
}

// ============================================================================ streams, epochs

#if defined(__GNUC__)
__attribute__((noinline, cold))
#endif
std::uint32_t DefragEngine::find_class(StreamId stream) {
  std::uint32_t cls = 0;
  while (cls < streams_.size() && streams_[cls].id != stream) {
    ++cls;
  }
  if (cls == streams_.size()) {
    if (cls == kMaxClasses) {  // Note [One word ranks a hole]: the key holds 20 bits of class
      throw UsageError("policy defrag: more than " + std::to_string(kMaxClasses) +
                       " streams allocated on one device; it ranks holes by stream in 20 bits");
    }
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
  const std::uint64_t started = backend_.clock_ns();
  while (!st.fences.empty() && st.fences.front().epoch <= epoch) {
    backend_.synchronize_event(st.fences.front().event);
    backend_.destroy_event(st.fences.front().event);
    st.fences.pop_front();
    update_completed(st);
  }
  const std::uint64_t now = backend_.clock_ns();
  counters_.wait_ns += now > started ? now - started : 0;
}

void DefragEngine::process_deferred() noexcept {
  NodeList pairs;
  pairs.swap(deferred_);  // merge_around() may defer pairs again
  for (Node* n : pairs) {
    n->deferred = false;
  }
  for (Node* n : pairs) {
    if (n->deferred) {
      continue;  // a second entry of a node deferred again in this pass
    }
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
    n->reset();
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
  n->same_range_as(*pos);
  n->prev = pos;
  n->next = pos->next;
  if (pos->next != nullptr) {
    pos->next->prev = n;
  }
  pos->next = n;
}

void DefragEngine::link_before(Node* pos, Node* n) noexcept {
  n->same_range_as(*pos);
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
  const std::uint64_t bucket = n->state == State::unmapped_free
                                   ? IndexKey::unmapped_bucket(n->kind, n->arena->home)
                                   : IndexKey::mapped_bucket(n->kind, n->cls);
  return IndexKey{IndexKey::rank_of(bucket, n->size), n->addr, const_cast<Node*>(n)};
}

void DefragEngine::index_put(Node* n) {
  Index& index = index_of(n);
  const IndexKey now = key_of(n);
  if (n->indexed && n->key_rank == now.rank && n->key_addr == now.addr) {
    return;
  }
  const IndexKey old = n->indexed_key();
  const bool was_indexed = n->indexed;
  n->indexed = false;  // until the index holds the new key (an insert may fail)
  n->key_rank = now.rank;
  n->key_addr = now.addr;
  if (was_indexed) {
    // Most changes keep the key between its neighbours: update() changes it where it is, else
    // erases it and inserts the new key.
    index.update(old, now);
  } else {
    index.insert(now);
  }
  n->indexed = true;
}

void DefragEngine::index_remove(Node* n) noexcept {
  if (n->indexed) {
    index_of(n).erase(n->indexed_key());
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

void DefragEngine::age_set(Node* n, bool wanted) noexcept {
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
    // Only an insert that splits a tree node allocates. Out of host memory, the hole stays out
    // of the index: never reused, so still safe, and check_invariants() reports it.
  }
  age_touch(n);
  return n;
}

// ============================================================================ allocate / free

Block DefragEngine::allocate(std::size_t bytes, StreamId stream) {
  if (bytes == 0 || bytes > kMaxBlockBytes) {  // Note [One word ranks a hole]
    return {};
  }
  const std::size_t size = round_up(bytes, kAlignment);
  ++window_allocations_;
  const std::uint32_t kind =
      size <= small_limit_ ? kSmall : kLarge;  // small_limit_ 0: none are small
  const std::uint32_t cls = class_of(stream);
  if ((streams_.size() > 1 && frees_in_epoch_ >= kEpochFrees && missed_since_close_) ||
      deferred_.size() > kDeferredLimit) {
    // Note [Epochs on demand]: closing epochs as frees accumulate (not only at misses) lets the
    // next miss find most free pages known safe without waiting, while the job misses at all.
    missed_since_close_ = false;
    try {
      if (poll()) {
        process_deferred();
      }
      close_epoch();
    } catch (const DeviceError&) {  // only an optimisation here: the next miss tries again
    }
  }
  if (size <= recent_max_ && recent_bytes_ != 0) {
    if (Node* n = take_recent(cls, size)) {
      return Block{reinterpret_cast<void*>(n->addr), n->size, n};
    }
  }
  Node* block = nullptr;
  Node* f = find_own(kind, cls, size);
  if (f == nullptr && recent_bytes_ != 0) {
    flush_recent();  // kept blocks never make memory grow
    f = find_own(kind, cls, size);
  }
  if (f != nullptr) {
    block = carve(f, f->addr, size, cls);
  } else {
    // A miss: learn which epochs finished and close the open one, so that pages freed until now
    // can be moved (and other streams' holes reused) at the next miss without waiting.
    missed_since_close_ = true;
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

void DefragEngine::deallocate(const Block& block, bool settled) noexcept {
  Node* n = static_cast<Node*>(block.cookie);
  live_bytes_ -= n->size;
  --live_blocks_;
  if (settled) {
    n->stamp = 0;  // safe from every stream's work now: no epoch to wait for
  } else {
    n->stamp = epoch_;
    mark_dirty(n->cls);
    ++frees_in_epoch_;
  }
  if (n->size <= recent_max_ && keep_recent(n)) {
    return;
  }
  n->state = State::mapped_free;
  merge_around(n, n->cls);
}

// Note [Recently freed small blocks in defrag]
// Most calls of a training step are small (two thirds of resnet50's are <= 1 MiB) and repeat
// their sizes step after step. Freed and merged into a hole, then carved out again, each such
// pair costs two B+tree updates, the neighbours' nodes and the age list: about 65 cache lines
// per pair, nearly all of them missed when PyTorch ran in between (cachegrind on the resnet50
// trace with the caches flushed before every call), which made defrag's time per call on the
// H200 e2e run about 1.5x size_class's. With keep_small_mb, as size_class does for its large
// blocks (Note [Recently freed large blocks], size_class.h), a freed block of at most
// kRecentMaxSize (and small_size) goes, unmerged, to its stream's LIFO for its exact size, up
// to keep_small_mb over all streams; a request of that size on that stream takes it back
// without a search (62% of the e2e resnet50 recording's allocations, 32 MiB). The block
// keeps its free stamp, and its stream is marked dirty as for any free, so when the lists are
// flushed it becomes a hole exactly as if it had been freed then. They are flushed (every block
// merged into the holes) before any allocation searches for pages: a miss of the stream's own
// mapped holes, which would grow or move pages, first flushes and searches again. So kept
// blocks never make memory grow or pages move: they only postpone merges. release_cached()
// flushes first. A kept block serves only its own stream (stream order makes that safe at
// once), as a hole of that stream would.
// It is off by default because it costs memory all the same: blocks kept unmerged make later
// small requests carve fresh holes, which spreads the small range over more partly used pages
// (peak reserved / peak requested, keep_small_mb 0 -> 32: e2e resnet50 recording 1.014 ->
// 1.019, e2e gpt2 1.004 -> 1.005; shared traces unchanged; growing KV caches at a fixed slack
// 1.022 -> 1.044; 2 MiB kept: resnet50 1.018). Flushing at every miss of the lists, as
// size_class does, keeps memory as it was but leaves 11% of resnet50's small allocations hits
// instead of 62%.
Node* DefragEngine::take_recent(std::uint32_t cls, std::size_t size) noexcept {
  StreamState& st = streams_[cls];
  if (!st.recent) {
    return nullptr;
  }
  Node*& head = st.recent[size / kAlignment];
  Node* n = head;
  if (n == nullptr) {
    return nullptr;
  }
  head = n->age_next;
  n->age_next = nullptr;
  recent_bytes_ -= size;
  --recent_blocks_;
  make_live(n);
  ++counters_.recent_hits;
  return n;
}

bool DefragEngine::keep_recent(Node* n) noexcept {
  if (recent_bytes_ + n->size > keep_limit_) {
    return false;
  }
  StreamState& st = streams_[n->cls];
  if (!st.recent) {
    try {
      auto** heads = static_cast<Node**>(hot::allocate(kRecentSlots * sizeof(Node*), alignof(Node*)));
      std::fill_n(heads, kRecentSlots, nullptr);
      st.recent.reset(heads);
    } catch (const std::bad_alloc&) {
      return false;
    }
  }
  Node*& head = st.recent[n->size / kAlignment];
  n->state = State::cached;
  n->age_next = head;
  head = n;
  recent_bytes_ += n->size;
  ++recent_blocks_;
  return true;
}

void DefragEngine::flush_recent() noexcept {
  if (recent_blocks_ == 0) {
    return;
  }
  for (StreamState& st : streams_) {
    if (!st.recent) {
      continue;
    }
    for (std::size_t i = 0; i < kRecentSlots && recent_blocks_ != 0; ++i) {
      while (Node* n = st.recent[i]) {
        st.recent[i] = n->age_next;
        n->age_next = nullptr;
        n->state = State::mapped_free;
        recent_bytes_ -= n->size;
        --recent_blocks_;
        merge_around(n, n->cls);
      }
    }
  }
  ++counters_.recent_flushes;
}

Node* DefragEngine::find_own(std::uint32_t kind, std::uint32_t cls, std::size_t size) const {
  const std::uint64_t own = IndexKey::mapped_bucket(kind, cls);
  auto it = mapped_.lower_bound(IndexKey::at_least(own, size));
  return it != mapped_.end() && it->bucket() == own ? it->node : nullptr;
}

Node* DefragEngine::find_other(std::uint32_t kind, std::uint32_t cls, std::size_t size) const {
  // Other streams' holes qualify once their owner finished the epoch that freed them; a few
  // pending ones (the most recent frees) are skipped per stream.
  Node* best = nullptr;
  for (std::uint32_t other = 0; other < streams_.size(); ++other) {
    if (other == cls) {
      continue;
    }
    const std::uint64_t bucket = IndexKey::mapped_bucket(kind, other);
    int skips = 0;
    for (auto jt = mapped_.lower_bound(IndexKey::at_least(bucket, size));
         jt != mapped_.end() && jt->bucket() == bucket && skips < kMaxPendingSkips; ++jt, ++skips) {
      if (best != nullptr &&
          (jt->size() > best->size || (jt->size() == best->size && jt->addr > best->addr))) {
        break;
      }
      if (safe(jt->node)) {
        best = jt->node;
        break;
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
    // Everything that can fail (host allocations) happens before f changes.
    b = new_node();
    Node* right = nullptr;
    if (start != f->addr && end < f->end()) {
      try {
        right = new_node();
        right->addr = end;
        right->size = f->end() - end;
        right->state = State::mapped_free;
        right->cls = f->cls;
        right->stamp = f->stamp;
        right->same_range_as(*f);
        index_put(right);
      } catch (...) {
        if (right != nullptr) {
          recycle(right);
        }
        recycle(b);
        throw;
      }
    }
    if (start == f->addr) {
      link_before(f, b);
      f->addr = end;
      f->size -= size;
    } else {
      link_after(f, b);
      if (right != nullptr) {
        link_after(b, right);
        age_update(right);
      }
      f->size = start - f->addr;
    }
    index_put(f);  // re-keys in place, or erase + insert (which may allocate a tree node)
    age_update(f);
  }
  b->addr = start;
  b->size = size;
  b->cls = cls;
  make_live(b);
  return b;
}

void DefragEngine::make_live(Node* n) noexcept {
  n->state = State::live;
  n->stamp = 0;
  live_bytes_ += n->size;
  peak_live_ = std::max(peak_live_, live_bytes_);
  peak_held_ = std::max(peak_held_, held_bytes());
  ++live_blocks_;
}

}  // namespace detail

// ============================================================================ the policy

std::vector<std::string_view> DefragPolicy::config_keys() {
  return {"va_reserve_gb", "grow_slack", "max_grow_slack", "move_budget", "small_size",
          "wait_for_streams", "move_pending", "pending_on_waits", "avoid_queued_unmaps",
          "max_chunk_mb", "keep_small_mb", "stream_ranges", "slack_counts_parked", "top_at_limit",
          "coalesce_map_us"};
}

DefragSettings DefragPolicy::parse_settings(Config& config) {
  DefragSettings s;
  if (auto gb = config.take_double("va_reserve_gb", 1.0 / 1024, 1 << 20)) {
    s.va_reserve_bytes = static_cast<std::size_t>(*gb * static_cast<double>(kGiB));
  }
  if (auto slack = config.take_double("grow_slack", 0.0, 1.0)) {
    s.grow_slack = *slack;
  }
  if (auto slack = config.take_double("max_grow_slack", 0.0, 1.0)) {
    s.max_grow_slack = *slack;
  }
  s.max_grow_slack = std::max(s.max_grow_slack, s.grow_slack);
  if (auto budget = config.take_double("move_budget", 0.0, 1.0)) {
    s.move_budget = *budget;
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
  if (auto pending = config.take_bool("move_pending")) {
    s.move_pending = *pending;
  }
  if (auto on_waits = config.take_bool("pending_on_waits")) {
    s.pending_on_waits = *on_waits;
  }
  if (auto avoid = config.take_bool("avoid_queued_unmaps")) {
    s.avoid_queued_unmaps = *avoid;
  }
  if (auto mb = config.take_double("max_chunk_mb", 0.5, 1 << 20)) {
    s.max_chunk_bytes = static_cast<std::size_t>(*mb * static_cast<double>(kMiB));
  }
  if (auto mb = config.take_double("keep_small_mb", 0.0, 1 << 20)) {
    s.keep_small_bytes = static_cast<std::size_t>(*mb * static_cast<double>(kMiB));
  }
  if (auto own = config.take_bool("stream_ranges")) {
    s.stream_ranges = *own;
  }
  if (auto counts = config.take_bool("slack_counts_parked")) {
    s.slack_counts_parked = *counts;
  }
  if (auto top = config.take_bool("top_at_limit")) {
    s.top_at_limit = *top;
  }
  if (auto us = config.take_double("coalesce_map_us", 0.0, 1e9)) {
    s.coalesce_map_ns = static_cast<std::uint64_t>(*us * 1e3);
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

void DefragPolicy::deallocate(const Block& block, StreamId /*stream*/) noexcept {
  // The block's own stream is recorded in it at allocation; policy.h item 4 says they agree.
  engine_->deallocate(block);
}

void DefragPolicy::deallocate_settled(const Block& block, StreamId /*stream*/) noexcept {
  engine_->deallocate(block, /*settled=*/true);
}

void DefragPolicy::note_parked(std::size_t bytes) noexcept { engine_->note_parked(bytes); }
void DefragPolicy::hold_growth(bool held) noexcept { engine_->hold_growth(held); }

std::size_t DefragPolicy::release_cached() { return engine_->release_cached(); }
std::size_t DefragPolicy::reserved_bytes() const noexcept { return engine_->reserved_bytes(); }
void DefragPolicy::check_invariants() const { engine_->check_invariants(); }
DefragCounters DefragPolicy::counters() const noexcept { return engine_->counters(); }
const std::vector<SlackEvent>& DefragPolicy::slack_history() const noexcept {
  return engine_->slack_history();
}
std::uint64_t DefragPolicy::slack_events_dropped() const noexcept {
  return engine_->slack_events_dropped();
}
const std::vector<CostlyGrowth>& DefragPolicy::growth_history() const noexcept {
  return engine_->growth_history();
}
std::uint64_t DefragPolicy::growths_dropped() const noexcept { return engine_->growths_dropped(); }
const std::vector<BudgetWindow>& DefragPolicy::window_history() const noexcept {
  return engine_->window_history();
}
std::uint64_t DefragPolicy::windows_dropped() const noexcept { return engine_->windows_dropped(); }

std::string DefragPolicy::report_json() const {
  std::string json = "{\"slack_history\": [";
  bool first = true;
  for (const SlackEvent& e : slack_history()) {
    const std::string_view id = slack_event_id(e.kind);
    using ull = unsigned long long;
    char line[512];
    std::snprintf(line, sizeof line,
                  "%s{\"event\": \"%.*s\", \"time_ns\": %llu, \"slack_before\": %.9g, "
                  "\"slack_after\": %.9g, \"live_bytes\": %llu, \"peak_live_bytes\": %llu, "
                  "\"reserved_bytes\": %llu, \"pages\": %llu, \"parked_bytes\": %llu, "
                  "\"stream\": %llu, \"unsafe_pages\": %llu, \"unsafe_other_pages\": %llu}",
                  first ? "" : ", ", static_cast<int>(id.size()), id.data(), static_cast<ull>(e.time_ns),
                  e.slack_before, e.slack_after, static_cast<ull>(e.live_bytes),
                  static_cast<ull>(e.peak_live_bytes), static_cast<ull>(e.reserved_bytes),
                  static_cast<ull>(e.pages), static_cast<ull>(e.parked_bytes), static_cast<ull>(e.stream),
                  static_cast<ull>(e.unsafe_pages), static_cast<ull>(e.unsafe_other_pages));
    json += line;
    first = false;
  }
  json += "], \"slack_history_dropped\": " + std::to_string(slack_events_dropped());
  // Note [A history of the time budget]
  json += ", \"growths\": [";
  first = true;
  for (const CostlyGrowth& g : growth_history()) {
    using ull = unsigned long long;
    char line[320];
    std::snprintf(line, sizeof line,
                  "%s{\"time_ns\": %llu, \"took_ns\": %llu, \"waited_ns\": %llu, \"waits\": %u, "
                  "\"pages_moved\": %u, \"pages_created\": %u, \"stream\": %llu, \"new_peak\": %s, "
                  "\"pending\": %s}",
                  first ? "" : ", ", static_cast<ull>(g.time_ns), static_cast<ull>(g.took_ns),
                  static_cast<ull>(g.waited_ns), g.waits, g.pages_moved, g.pages_created,
                  static_cast<ull>(g.stream), g.new_peak ? "true" : "false", g.pending ? "true" : "false");
    json += line;
    first = false;
  }
  json += "], \"growths_dropped\": " + std::to_string(growths_dropped()) + ", \"windows\": [";
  first = true;
  for (const BudgetWindow& w : window_history()) {
    using ull = unsigned long long;
    const std::string_view close = window_close_id(w.close);
    const std::string_view verdict = window_verdict_id(w.verdict);
    char line[512];
    std::snprintf(line, sizeof line,
                  "%s{\"open_ns\": %llu, \"close_ns\": %llu, \"growths\": %u, \"charged_ns\": %llu, "
                  "\"waited_ns\": %llu, \"spent_ns\": %llu, \"allowed_ns\": %llu, "
                  "\"uncharged_waits\": %u, \"uncharged_wait_ns\": %llu, \"slack_after\": %.9g, "
                  "\"close\": \"%.*s\", \"verdict\": \"%.*s\"}",
                  first ? "" : ", ", static_cast<ull>(w.open_ns), static_cast<ull>(w.close_ns), w.growths,
                  static_cast<ull>(w.charged_ns), static_cast<ull>(w.waited_ns), static_cast<ull>(w.spent_ns),
                  static_cast<ull>(w.allowed_ns), w.uncharged_waits, static_cast<ull>(w.uncharged_wait_ns),
                  w.slack_after, static_cast<int>(close.size()), close.data(), static_cast<int>(verdict.size()),
                  verdict.data());
    json += line;
    first = false;
  }
  json += "], \"windows_dropped\": " + std::to_string(windows_dropped()) + "}";
  return json;
}

std::string_view window_close_id(BudgetWindow::Close close) noexcept {
  switch (close) {
    case BudgetWindow::Close::full: return "full";
    case BudgetWindow::Close::early: return "early";
    case BudgetWindow::Close::aged: return "aged";
  }
  return "unknown";
}

std::string_view window_verdict_id(BudgetWindow::Verdict verdict) noexcept {
  switch (verdict) {
    case BudgetWindow::Verdict::within: return "within";
    case BudgetWindow::Verdict::raised: return "raised";
    case BudgetWindow::Verdict::switched: return "switched";
    case BudgetWindow::Verdict::top_at_limit: return "top_at_limit";
    case BudgetWindow::Verdict::over: return "over";
  }
  return "unknown";
}

std::string_view slack_event_id(SlackEvent::Kind kind) noexcept {
  switch (kind) {
    case SlackEvent::Kind::count_raise: return "count_raise";
    case SlackEvent::Kind::time_raise: return "time_raise";
    case SlackEvent::Kind::return_raise: return "return_raise";
    case SlackEvent::Kind::returned: return "returned";
    case SlackEvent::Kind::pending_switch: return "pending_switch";
    case SlackEvent::Kind::top_at_limit: return "top_at_limit";
    case SlackEvent::Kind::beyond_slack: return "beyond_slack";
  }
  return "unknown";
}

std::string_view slack_event_name(SlackEvent::Kind kind) noexcept {
  switch (kind) {
    case SlackEvent::Kind::count_raise: return "raised (dense moves)";
    case SlackEvent::Kind::time_raise: return "raised (moves over the time budget)";
    case SlackEvent::Kind::return_raise: return "raised (pages that came back stay)";
    case SlackEvent::Kind::returned: return "raise undone after quiet";
    case SlackEvent::Kind::pending_switch: return "switched to moving pending";
    case SlackEvent::Kind::top_at_limit: return "moves over the budget at the limit: growths at the top";
    case SlackEvent::Kind::beyond_slack: return "pages created beyond the slack";
  }
  return "?";
}

std::vector<std::pair<std::string, std::int64_t>> DefragPolicy::stat_counters() const {
  const DefragCounters& c = engine_->counters();
  const auto v = [](std::uint64_t x) { return static_cast<std::int64_t>(x); };
  return {{"defrag.pages_created", v(c.pages_created)},   {"defrag.chunks_created", v(c.chunks_created)},
          {"defrag.pages_moved", v(c.pages_moved)},       {"defrag.chunks_moved", v(c.chunks_moved)},
          {"defrag.pages_moved_pending", v(c.pages_moved_pending)},
          {"defrag.coalesced_growths", v(c.coalesced_growths)},
          {"defrag.chunks_coalesced", v(c.chunks_coalesced)},
          {"defrag.placed_past_queued", v(c.placed_past_queued)},
          {"defrag.placed_above_queued", v(c.placed_above_queued)},
          {"defrag.placed_at_top", v(c.placed_at_top)},
          {"defrag.placed_top_at_limit", v(c.placed_top_at_limit)},
          {"defrag.unmap_batches", v(c.unmap_batches)},   {"defrag.grow_allocations", v(c.grow_allocations)},
          {"defrag.stream_waits", v(c.stream_waits)},     {"defrag.wait_ns", v(c.wait_ns)},
          {"defrag.move_ns", v(c.move_ns)},               {"defrag.slack_raises", v(c.slack_raises)},
          {"defrag.budget_raises", v(c.budget_raises)},   {"defrag.return_raises", v(c.return_raises)},
          {"defrag.slack_returns", v(c.slack_returns)},   {"defrag.pending_switches", v(c.pending_switches)},
          {"defrag.beyond_slack_growths", v(c.beyond_slack_growths)},
          {"defrag.beyond_slack_pages", v(c.beyond_slack_pages)},
          {"defrag.stuck_unsafe_pages", v(c.stuck_unsafe_pages)},
          {"defrag.stuck_unsafe_other_pages", v(c.stuck_unsafe_other_pages)},
          {"defrag.stuck_pinned_pages", v(c.stuck_pinned_pages)},
          {"defrag.stuck_beside_pages", v(c.stuck_beside_pages)},
          {"defrag.stuck_other_pages", v(c.stuck_other_pages)},
          {"defrag.recent_hits", v(c.recent_hits)},
          {"defrag.held_growths", v(c.held_growths)},
          {"defrag.slack_ppm", static_cast<std::int64_t>(c.slack * 1e6 + 0.5)}};
}
const DefragSettings& DefragPolicy::settings() const noexcept { return engine_->settings(); }
std::size_t DefragPolicy::live_bytes() const noexcept { return engine_->live_bytes(); }
std::size_t DefragPolicy::peak_live_bytes() const noexcept { return engine_->peak_live_bytes(); }
std::size_t DefragPolicy::peak_held_bytes() const noexcept { return engine_->peak_held_bytes(); }
DefragBreakdown DefragPolicy::breakdown() const { return engine_->breakdown(); }
bool DefragPolicy::placement_repeats() const noexcept { return engine_->placement_repeats(); }
void DefragPolicy::note_repeated(std::uint64_t allocations) noexcept {
  engine_->note_repeated(allocations);
}
std::vector<SegmentView> DefragPolicy::segment_views() const { return engine_->segments(); }

}  // namespace cachealloc
