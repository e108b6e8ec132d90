// size_class.cpp: policy `size_class` (see size_class.h for the design).
#include <cachealloc/errors.h>
#include <cachealloc/policies/size_class.h>

#include <algorithm>
#include <stdexcept>
#include <string>

namespace cachealloc {
namespace {

constexpr std::size_t kRound = 512;

// Class sizes: 512..4096 in 512 B steps, then 4 classes per doubling up to 1 MiB.
struct ClassTable {
  std::array<std::size_t, 64> sizes{};
  std::size_t count = 0;
  std::array<std::uint8_t, SizeClassPolicy::kSmallMax / kRound + 1> by_units{};

  constexpr ClassTable() {
    for (std::size_t s = kRound; s <= 4096; s += kRound) {
      sizes[count++] = s;
    }
    for (std::size_t p = 4096; p < SizeClassPolicy::kSmallMax; p *= 2) {
      for (std::size_t q = 1; q <= 4; ++q) {
        sizes[count++] = round_up(p + p * q / 4, kRound);
      }
    }
    std::size_t c = 0;
    for (std::size_t units = 0; units < by_units.size(); ++units) {
      while (sizes[c] < units * kRound) {
        ++c;
      }
      by_units[units] = static_cast<std::uint8_t>(c);
    }
  }
};
constexpr ClassTable kClasses;

std::size_t class_index(std::size_t bytes) noexcept {
  return kClasses.by_units[(bytes + kRound - 1) / kRound];
}

}  // namespace

std::vector<std::string_view> SizeClassPolicy::config_keys() {
  return {"size_class_large_segment_mb"};
}

std::size_t SizeClassPolicy::small_class_size(std::size_t bytes) noexcept {
  return kClasses.sizes[class_index(bytes)];
}

SizeClassPolicy::SizeClassPolicy(DeviceBackend& backend, Config& config) : backend_(backend) {
  static_assert(kClasses.count <= kClassCount);
  if (auto mb = config.take_bytes("size_class_large_segment_mb")) {
    if (*mb < 2 * kMiB || *mb % (2 * kMiB) != 0) {
      throw ConfigError("CACHEALLOC_CONF: 'size_class_large_segment_mb' must be a positive "
                        "multiple of 2 (MiB), got " + std::to_string(*mb / kMiB));
    }
    large_segment_ = *mb;
    large_direct_threshold_ = *mb / 2;
  }
  // The shared pool exists from the start so that migrate_epochs() never grows pools_ while
  // iterating it.
  (void)pool(kAnyStream);
}

SizeClassPolicy::~SizeClassPolicy() {
  for (auto& seg : segments_) {
    if (seg) {
      backend_.release(reinterpret_cast<void*>(seg->base), seg->size);
    }
  }
}

SizeClassPolicy::Pool* SizeClassPolicy::find_pool(StreamId stream) noexcept {
  if (last_pool_ != nullptr && last_pool_->stream == stream) {
    return last_pool_;
  }
  for (auto& p : pools_) {
    if (p->stream == stream) {
      last_pool_ = p.get();
      return last_pool_;
    }
  }
  return nullptr;
}

SizeClassPolicy::Pool& SizeClassPolicy::pool(StreamId stream) {
  if (Pool* p = find_pool(stream)) {
    return *p;
  }
  pools_.push_back(std::make_unique<Pool>());
  pools_.back()->stream = stream;
  last_pool_ = pools_.back().get();
  return *last_pool_;
}

SizeClassPolicy::BlockMeta* SizeClassPolicy::new_meta() {
  if (!meta_free_.empty()) {
    BlockMeta* b = meta_free_.back();
    meta_free_.pop_back();
    return b;
  }
  return &meta_storage_.emplace_back();
}

void SizeClassPolicy::drop_meta(BlockMeta* b) noexcept {
  try {
    meta_free_.push_back(b);
  } catch (...) {  // NOLINT(bugprone-empty-catch): losing a metadata slot only costs memory
  }
}

SizeClassPolicy::Segment* SizeClassPolicy::new_segment(std::size_t bytes, bool small) {
  void* ptr = backend_.reserve(bytes);
  if (ptr == nullptr) {
    return nullptr;
  }
  auto seg = std::make_unique<Segment>();
  seg->base = reinterpret_cast<std::uintptr_t>(ptr);
  seg->size = bytes;
  seg->small = small;
  Segment* raw = seg.get();
  try {
    if (!free_segment_slots_.empty()) {
      seg->index = free_segment_slots_.back();
      segments_[seg->index] = std::move(seg);
      free_segment_slots_.pop_back();
    } else {
      seg->index = segments_.size();
      segments_.push_back(std::move(seg));
    }
  } catch (...) {
    backend_.release(ptr, bytes);
    throw;
  }
  reserved_ += bytes;
  return raw;
}

void SizeClassPolicy::release_segment(Segment* seg) noexcept {
  backend_.release(reinterpret_cast<void*>(seg->base), seg->size);
  reserved_ -= seg->size;
  if (small_current_ == seg) {
    small_current_ = nullptr;
  }
  const std::size_t index = seg->index;
  segments_[index].reset();
  try {
    free_segment_slots_.push_back(index);
  } catch (...) {  // NOLINT(bugprone-empty-catch): the slot stays empty, only costs a pointer
  }
}

void SizeClassPolicy::insert_free(BlockMeta* b) {
  b->free = true;
  b->free_seq = ++free_seq_;
  Pool& p = pool(b->owner);
  if (b->small) {
    p.small[b->size_class].push_back(b);
  } else {
    p.large.insert(LargeKey{b->size, b->addr, b});
  }
}

void SizeClassPolicy::erase_free(BlockMeta* b) {
  Pool* p = find_pool(b->owner);
  if (b->small) {
    auto& list = p->small[b->size_class];
    list.erase(std::find(list.begin(), list.end(), b));
  } else {
    p->large.erase(LargeKey{b->size, b->addr, b});
  }
}

Block SizeClassPolicy::allocate(std::size_t bytes, StreamId stream) {
  return bytes <= kSmallMax ? allocate_small(bytes, stream) : allocate_large(bytes, stream);
}

Block SizeClassPolicy::allocate_small(std::size_t bytes, StreamId stream) {
  const std::size_t cls = class_index(bytes);
  const std::size_t size = kClasses.sizes[cls];
  for (int attempt = 0; attempt < 2; ++attempt) {
    for (StreamId owner : {stream, kAnyStream}) {
      if (Pool* p = find_pool(owner)) {
        auto& list = p->small[cls];
        if (!list.empty()) {
          BlockMeta* b = list.back();
          list.pop_back();
          b->free = false;
          ++b->segment->live_blocks;
          return Block{reinterpret_cast<void*>(b->addr), b->size, b};
        }
      }
    }
    // Carve a fresh block from the shared small segment.
    Segment* seg = small_current_;
    if (seg == nullptr || seg->size - seg->carved < size) {
      if (attempt == 0 && migrate_epochs(stream)) {
        continue;
      }
      seg = new_segment(kSmallSegment, /*small=*/true);
      if (seg == nullptr) {
        return {};
      }
      small_current_ = seg;
    }
    BlockMeta* b = new_meta();
    *b = BlockMeta{seg->base + seg->carved, size, seg, nullptr, nullptr, stream, 0,
                   static_cast<std::uint16_t>(cls), true, false};
    seg->small_blocks.push_back(b);
    seg->carved += size;
    ++seg->live_blocks;
    return Block{reinterpret_cast<void*>(b->addr), size, b};
  }
  return {};
}

SizeClassPolicy::BlockMeta* SizeClassPolicy::remove_recent(Pool& p, std::size_t i) noexcept {
  BlockMeta* b = p.recent[i];
  std::copy(p.recent.begin() + static_cast<std::ptrdiff_t>(i) + 1,
            p.recent.begin() + static_cast<std::ptrdiff_t>(p.recent_count),
            p.recent.begin() + static_cast<std::ptrdiff_t>(i));
  --p.recent_count;
  b->recent = false;
  return b;
}

SizeClassPolicy::BlockMeta* SizeClassPolicy::take_recent(Pool& p, std::size_t size) noexcept {
  // Newest first: the block freed last is the likeliest to be asked for again.
  for (std::size_t i = p.recent_count; i-- > 0;) {
    if (p.recent[i]->size == size) {
      return remove_recent(p, i);
    }
  }
  return nullptr;
}

void SizeClassPolicy::push_recent(BlockMeta* b) {
  Pool& p = pool(b->owner);
  if (p.recent_count == kRecent) {
    // Before `b` counts as free: the oldest may be its neighbour and must not merge with it.
    coalesce_and_insert(remove_recent(p, 0));
  }
  b->free = true;
  b->recent = true;
  b->free_seq = ++free_seq_;
  p.recent[p.recent_count++] = b;
}

void SizeClassPolicy::flush_recent(Pool& p) {
  while (p.recent_count > 0) {
    // insert_free gives it a newer free sequence number than its free had: a migration epoch
    // then covers it later than it could, never earlier.
    coalesce_and_insert(remove_recent(p, p.recent_count - 1));
  }
}

void SizeClassPolicy::flush_all_recent() {
  for (auto& p : pools_) {
    flush_recent(*p);
  }
}

Block SizeClassPolicy::allocate_large(std::size_t bytes, StreamId stream) {
  const std::size_t size = round_up(bytes, kRound);
  Pool* own = find_pool(stream);
  if (own != nullptr && own->recent_count > 0) {
    if (BlockMeta* b = take_recent(*own, size)) {
      b->free = false;
      return Block{reinterpret_cast<void*>(b->addr), b->size, b};
    }
    flush_recent(*own);
  }
  const LargeKey key{size, 0, nullptr};
  BlockMeta* best = nullptr;
  for (int attempt = 0; attempt < 2 && best == nullptr; ++attempt) {
    for (StreamId owner : {stream, kAnyStream}) {
      if (Pool* p = find_pool(owner)) {
        auto it = p->large.lower_bound(key);
        if (it != p->large.end() && (best == nullptr || it->size < best->size)) {
          best = it->meta;
        }
      }
    }
    if (best == nullptr && (attempt > 0 || !migrate_epochs(stream))) {
      break;
    }
  }
  if (best != nullptr) {
    erase_free(best);
  } else {
    const std::size_t seg_size =
        size < large_direct_threshold_ ? large_segment_ : round_up(size, 2 * kMiB);
    Segment* seg = new_segment(seg_size, /*small=*/false);
    if (seg == nullptr) {
      return {};
    }
    best = new_meta();
    *best = BlockMeta{seg->base, seg_size, seg, nullptr, nullptr, stream, 0, 0, false, true};
    seg->head = best;
  }
  // Split when the remainder could serve another large request.
  if (best->size - size > kSmallMax) {
    BlockMeta* rest = new_meta();
    *rest = BlockMeta{best->addr + size, best->size - size, best->segment, best, best->next,
                      best->owner, 0, 0, false, true};
    if (best->next != nullptr) {
      best->next->prev = rest;
    }
    best->next = rest;
    best->size = size;
    insert_free(rest);
  }
  best->free = false;
  best->owner = stream;
  return Block{reinterpret_cast<void*>(best->addr), best->size, best};
}

void SizeClassPolicy::deallocate(const Block& block, StreamId stream) noexcept {
  auto* b = static_cast<BlockMeta*>(block.cookie);
  b->owner = stream;
  try {
    if (b->small) {
      --b->segment->live_blocks;
      insert_free(b);
    } else {
      push_recent(b);
    }
  } catch (...) {  // NOLINT(bugprone-empty-catch)
    // Only std::bad_alloc from a container can land here; the block then stays out of the free
    // lists (its memory stays reserved and is never handed out twice).
  }
}

void SizeClassPolicy::coalesce_and_insert(BlockMeta* b) {
  for (BlockMeta* n : {b->prev, b->next}) {
    if (n == nullptr || !n->free || n->recent || n->owner != b->owner) {
      continue;
    }
    erase_free(n);
    if (n == b->prev) {
      b->addr = n->addr;
      b->prev = n->prev;
      if (n->prev != nullptr) {
        n->prev->next = b;
      } else {
        b->segment->head = b;
      }
    } else {
      b->next = n->next;
      if (n->next != nullptr) {
        n->next->prev = b;
      }
    }
    b->size += n->size;
    drop_meta(n);
  }
  insert_free(b);
}

bool SizeClassPolicy::migrate_epochs(StreamId requester) {
  // Recent blocks are outside the free sets the epochs move: put them in first, so that the
  // event recorded below covers them too (Note [Recently freed large blocks]).
  flush_all_recent();
  bool moved = false;
  for (auto& up : pools_) {
    Pool& p = *up;
    if (p.stream == requester || p.stream == kAnyStream) {
      continue;
    }
    if (p.epoch_event != 0) {
      bool done = false;
      try {
        done = backend_.query_event(p.epoch_event);
      } catch (const DeviceError&) {
        done = false;  // ask again at the next miss
      }
      if (done) {
        backend_.destroy_event(p.epoch_event);
        p.epoch_event = 0;
        // Every block freed on p.stream up to epoch_seq is idle on the device: share it.
        std::vector<BlockMeta*> move;
        for (const LargeKey& k : p.large) {
          BlockMeta* b = k.meta;
          if (b->free_seq <= p.epoch_seq) {
            move.push_back(b);
          }
        }
        for (auto& list : p.small) {
          for (BlockMeta* b : list) {
            if (b->free_seq <= p.epoch_seq) {
              move.push_back(b);
            }
          }
        }
        for (BlockMeta* b : move) {
          if (!b->free || b->owner != p.stream) {
            continue;  // already merged into a neighbour moved before it
          }
          erase_free(b);
          b->owner = kAnyStream;
          if (b->small) {
            insert_free(b);
          } else {
            // Coalesce with shared neighbours so freed space regains its full extent.
            coalesce_and_insert(b);
          }
        }
        moved = moved || !move.empty();
      }
    }
    bool has_free = !p.large.empty();
    for (const auto& list : p.small) {
      has_free = has_free || !list.empty();
    }
    if (p.epoch_event == 0 && has_free) {
      try {
        p.epoch_event = backend_.record_event(p.stream);
        p.epoch_seq = free_seq_;
      } catch (const DeviceError&) {
        p.epoch_event = 0;  // no migration this time; the blocks stay with their stream
      }
    }
  }
  return moved;
}

std::size_t SizeClassPolicy::release_cached() {
  // A segment goes back when every block in it is free, whichever streams' pools hold them:
  // cudaFree synchronizes the device, so no stream can still be using them afterwards.
  flush_all_recent();
  std::size_t released = 0;
  for (auto& up : segments_) {
    Segment* seg = up.get();
    if (seg == nullptr) {
      continue;
    }
    if (seg->small) {
      if (seg->live_blocks != 0) {
        continue;
      }
      for (BlockMeta* b : seg->small_blocks) {
        erase_free(b);
        drop_meta(b);
      }
    } else {
      bool all_free = true;
      for (const BlockMeta* b = seg->head; b != nullptr && all_free; b = b->next) {
        all_free = b->free;
      }
      if (!all_free) {
        continue;
      }
      for (BlockMeta* b = seg->head; b != nullptr;) {
        BlockMeta* next = b->next;
        erase_free(b);
        drop_meta(b);
        b = next;
      }
    }
    released += seg->size;
    release_segment(seg);
  }
  return released;
}

void SizeClassPolicy::check_invariants() const {
  std::size_t reserved = 0;
  std::size_t free_small = 0;
  std::size_t free_large = 0;
  std::size_t recent_large = 0;
  for (const auto& up : segments_) {
    if (!up) {
      continue;
    }
    const Segment& seg = *up;
    reserved += seg.size;
    if (seg.small) {
      CACHEALLOC_CHECK_INVARIANT(seg.carved <= seg.size, "small segment over-carved");
      std::uintptr_t expect = seg.base;
      std::size_t live = 0;
      for (const BlockMeta* b : seg.small_blocks) {
        CACHEALLOC_CHECK_INVARIANT(b->addr == expect, "small blocks not contiguous in carve order");
        CACHEALLOC_CHECK_INVARIANT(b->segment == &seg && b->small, "small block in wrong segment");
        CACHEALLOC_CHECK_INVARIANT(b->size == kClasses.sizes[b->size_class], "small block size");
        expect += b->size;
        live += b->free ? 0 : 1;
        free_small += b->free ? 1 : 0;
      }
      CACHEALLOC_CHECK_INVARIANT(expect == seg.base + seg.carved, "carved bytes unaccounted");
      CACHEALLOC_CHECK_INVARIANT(live == seg.live_blocks, "small live count wrong");
      continue;
    }
    // Large: the block chain from the head tiles the segment exactly.
    CACHEALLOC_CHECK_INVARIANT(seg.head != nullptr && seg.head->prev == nullptr &&
                                   seg.head->addr == seg.base,
                               "large segment head missing or not at base");
    std::uintptr_t expect = seg.base;
    for (const BlockMeta* b = seg.head; b != nullptr; b = b->next) {
      CACHEALLOC_CHECK_INVARIANT(b->addr == expect, "gap or overlap between large blocks");
      CACHEALLOC_CHECK_INVARIANT(b->next == nullptr || b->next->prev == b, "broken block links");
      CACHEALLOC_CHECK_INVARIANT(b->segment == &seg && !b->small, "block chain crosses segments");
      CACHEALLOC_CHECK_INVARIANT(!b->recent || b->free, "a recent block that is not free");
      CACHEALLOC_CHECK_INVARIANT(
          !(b->free && !b->recent && b->next != nullptr && b->next->free && !b->next->recent &&
            b->next->owner == b->owner),
          "two free neighbours of one owner not coalesced");
      free_large += b->free && !b->recent ? 1 : 0;
      recent_large += b->recent ? 1 : 0;
      expect += b->size;
    }
    CACHEALLOC_CHECK_INVARIANT(expect == seg.base + seg.size, "large blocks do not tile their segment");
  }
  std::size_t listed_small = 0;
  std::size_t listed_large = 0;
  std::size_t listed_recent = 0;
  for (const auto& p : pools_) {
    CACHEALLOC_CHECK_INVARIANT(p->recent_count <= kRecent, "recent FIFO overfull");
    for (std::size_t i = 0; i < p->recent_count; ++i) {
      const BlockMeta* b = p->recent[i];
      CACHEALLOC_CHECK_INVARIANT(b->recent && b->free && !b->small && b->owner == p->stream,
                                 "recent FIFO holds a wrong block");
      CACHEALLOC_CHECK_INVARIANT(
          std::find(p->recent.begin(), p->recent.begin() + static_cast<std::ptrdiff_t>(i), b) ==
              p->recent.begin() + static_cast<std::ptrdiff_t>(i),
          "a block twice in a recent FIFO");
      ++listed_recent;
    }
    try {
      p->large.check();
    } catch (const std::logic_error& e) {
      throw InvariantError(std::string("size_class: the large free index is broken: ") + e.what());
    }
    for (const LargeKey& k : p->large) {
      const BlockMeta* b = k.meta;
      CACHEALLOC_CHECK_INVARIANT(b->free && !b->small && b->owner == p->stream,
                                 "large free set holds a wrong block");
      CACHEALLOC_CHECK_INVARIANT(k.size == b->size && k.addr == b->addr,
                                 "large free set key differs from its block");
      ++listed_large;
    }
    for (std::size_t c = 0; c < kClassCount; ++c) {
      for (const BlockMeta* b : p->small[c]) {
        CACHEALLOC_CHECK_INVARIANT(b->free && b->small && b->size_class == c && b->owner == p->stream,
                                   "small free list holds a wrong block");
        ++listed_small;
      }
    }
  }
  CACHEALLOC_CHECK_INVARIANT(listed_small == free_small, "a free small block is on no free list");
  CACHEALLOC_CHECK_INVARIANT(listed_large == free_large, "a free large block is on no free set");
  CACHEALLOC_CHECK_INVARIANT(listed_recent == recent_large, "a recent block is on no recent FIFO");
  CACHEALLOC_CHECK_INVARIANT(reserved == reserved_, "reserved bytes disagree with segments");
  CACHEALLOC_CHECK_INVARIANT(backend_.held_bytes() >= reserved_,
                             "backend holds less than the policy reserved");
}

SegmentView SizeClassPolicy::segment_view(const Segment& seg) const {
  SegmentView v{seg.base, seg.size, 0, seg.small, {}};
  if (!seg.small) {
    for (const BlockMeta* b = seg.head; b != nullptr; b = b->next) {
      v.blocks.push_back({b->addr, b->size, !b->free});
    }
  } else {
    for (const BlockMeta* b : seg.small_blocks) {
      v.blocks.push_back({b->addr, b->size, !b->free});
    }
    if (seg.carved < seg.size) {
      v.blocks.push_back({seg.base + seg.carved, seg.size - seg.carved, false});
    }
  }
  return v;
}

}  // namespace cachealloc
