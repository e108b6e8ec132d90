// native.cpp: policy `native` (PyTorch 2.11's CUDACachingAllocator): settings, rounding, the
// malloc/free path and its retry chain, garbage collection and invariant checks.
// Expandable segments live in native_expandable.cpp; the data structures in native_detail.h.
#include <cachealloc/errors.h>
#include <cachealloc/policies/native.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "native_detail.h"

namespace cachealloc {

using native_detail::Core;
using native_detail::kLargeBuffer;
using native_detail::kMinBlockSize;
using native_detail::kMinLargeAlloc;
using native_detail::kRoundLarge;
using native_detail::kSmallBuffer;
using native_detail::kSmallSize;

// ------------------------------------------------------------------------------------------------
// Settings
// ------------------------------------------------------------------------------------------------

namespace {

constexpr std::string_view kMaxSplit = "max_split_size_mb";
constexpr std::string_view kMaxNonSplitRounding = "max_non_split_rounding_mb";
constexpr std::string_view kRoundupDivisions = "roundup_power2_divisions";
constexpr std::string_view kGcThreshold = "garbage_collection_threshold";
constexpr std::string_view kExpandable = "expandable_segments";

std::size_t parse_count(std::string_view key, const std::string& text) {
  std::size_t value = 0;
  std::size_t used = 0;
  try {
    value = std::stoull(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size() || text.front() == '-') {
    throw ConfigError("CACHEALLOC_CONF: " + std::string(key) +
                      ": expected a non-negative integer, got '" + text + "'");
  }
  return value;
}

/// PyTorch's parseRoundUpPower2Divisions: `N` (every interval) or `[MB:N,...,>:N]`, where MB is a
/// power-of-two interval start in MiB and N a power of two (0 in a list disables rounding there).
std::array<std::size_t, NativeSettings::kDivisionIntervals> parse_divisions(
    const std::vector<std::pair<std::string, std::string>>& items) {
  std::array<std::size_t, NativeSettings::kDivisionIntervals> table{};
  const std::string key(kRoundupDivisions);
  if (items.size() == 1 && items.front().first.empty()) {  // scalar form
    const std::size_t n = parse_count(key, items.front().second);
    if (!std::has_single_bit(n)) {
      throw ConfigError("CACHEALLOC_CONF: " + key + ": the divisions must be a power of 2, got " +
                        std::to_string(n));
    }
    table.fill(n);
    return table;
  }
  bool first = true;
  std::size_t last_index = 0;
  for (const auto& [interval, count] : items) {
    const std::size_t n = parse_count(key, count);
    if (n != 0 && !std::has_single_bit(n)) {
      throw ConfigError("CACHEALLOC_CONF: " + key +
                        ": the divisions must be a power of 2 or 0 (no "
                        "rounding), got " +
                        std::to_string(n) + " for '" + interval + "'");
    }
    if (interval == ">") {
      // Every interval above the last one named.
      for (std::size_t i = last_index + 1; i < table.size(); ++i) {
        table[i] = n;
      }
      continue;
    }
    const std::size_t start_mb = parse_count(key, interval);
    if (!std::has_single_bit(start_mb)) {
      throw ConfigError("CACHEALLOC_CONF: " + key +
                        ": interval starts must be powers of 2 (in MiB), "
                        "got '" +
                        interval + "'");
    }
    const std::size_t index = std::min<std::size_t>(
        static_cast<std::size_t>(std::bit_width(start_mb) - 1), table.size() - 1);
    if (first) {  // the first interval named also covers everything below it
      std::fill(table.begin(), table.begin() + static_cast<std::ptrdiff_t>(index), n);
      first = false;
    }
    table[index] = n;
    last_index = index;
  }
  return table;
}

}  // namespace

NativeSettings NativeSettings::from_config(Config& config) {
  NativeSettings s;
  // PyTorch: max_split_size_mb and max_non_split_rounding_mb must be at least kLargeBuffer (20
  // MiB).
  if (auto v = config.take_bytes(kMaxSplit)) {
    if (*v < kLargeBuffer) {
      throw ConfigError(
          "CACHEALLOC_CONF: max_split_size_mb too small, must be >= 20 (MiB, the "
          "large-pool segment size, as PyTorch requires), got " +
          std::to_string(*v / kMiB) + (*v % kMiB != 0 ? "+ MiB" : " MiB"));
    }
    s.max_split_size = *v;
  }
  if (auto v = config.take_bytes(kMaxNonSplitRounding)) {
    if (*v < kLargeBuffer) {
      throw ConfigError(
          "CACHEALLOC_CONF: max_non_split_rounding_mb too small, must be >= 20 (MiB, "
          "as PyTorch requires), got " +
          std::to_string(*v / kMiB) + " MiB");
    }
    s.max_non_split_rounding_size = *v;
  }
  if (auto items = config.take_list(kRoundupDivisions)) {
    s.roundup_power2_divisions = parse_divisions(*items);
  }
  if (auto v = config.take_double(kGcThreshold, 0.0, 1.0)) {
    if (!(*v > 0.0 && *v < 1.0)) {
      throw ConfigError(
          "CACHEALLOC_CONF: garbage_collection_threshold is invalid, set it in (0.0, "
          "1.0) (exclusive, as PyTorch requires), got " +
          std::to_string(*v));
    }
    s.garbage_collection_threshold = *v;
  }
  if (auto v = config.take_bool(kExpandable)) {
    s.expandable_segments = *v;
  }
  return s;
}

std::vector<std::string_view> NativePolicy::config_keys() {
  return {kMaxSplit, kMaxNonSplitRounding, kRoundupDivisions, kGcThreshold, kExpandable};
}

// ------------------------------------------------------------------------------------------------
// Sizes
// ------------------------------------------------------------------------------------------------

namespace {

std::size_t divisions_for(std::size_t size, const NativeSettings& s) noexcept {
  // Interval i covers [2^(20+i), 2^(21+i)); everything below 1 MiB uses interval 0, everything
  // from 32 GiB the last.
  const auto log2 = static_cast<std::size_t>(std::bit_width(size) - 1);
  const std::size_t index =
      log2 > 20 ? std::min<std::size_t>(log2 - 20, s.roundup_power2_divisions.size() - 1) : 0;
  return s.roundup_power2_divisions[index];
}

/// The next of `divisions` equal steps between the powers of two around `size`
/// (1200 with 4 divisions: steps 1024, 1280, 1536, 1792 -> 1280).
std::size_t next_power2_division(std::size_t size, std::size_t divisions) noexcept {
  if (std::has_single_bit(size)) {
    return size;
  }
  const std::size_t floor = std::bit_floor(size);
  const std::size_t step = floor >> (std::bit_width(divisions) - 1);
  if (step == 0) {
    return floor << 1;
  }
  const std::size_t rounded_down = size & ~(step - 1);
  return rounded_down == size ? size : rounded_down + step;
}

}  // namespace

std::size_t native_round_size(std::size_t bytes, const NativeSettings& settings) {
  if (bytes < kMinBlockSize) {
    return kMinBlockSize;
  }
  const std::size_t divisions = divisions_for(bytes, settings);
  if (divisions > 1 && bytes > kMinBlockSize * divisions) {
    return next_power2_division(bytes, divisions);
  }
  return round_up(bytes, kMinBlockSize);
}

std::size_t native_allocation_size(std::size_t rounded_bytes) noexcept {
  if (rounded_bytes <= kSmallSize) {
    return kSmallBuffer;
  }
  if (rounded_bytes < kMinLargeAlloc) {
    return kLargeBuffer;
  }
  return round_up(rounded_bytes, kRoundLarge);
}

// ------------------------------------------------------------------------------------------------
// Core: malloc and free
// ------------------------------------------------------------------------------------------------

namespace native_detail {

Core::Core(DeviceBackend& backend, const NativeSettings& settings)
    : backend_(backend), settings_(settings) {
  if (settings_.expandable_segments) {
    vm_ = backend_.virtual_memory();
    if (vm_ == nullptr) {
      throw ConfigError(
          "CACHEALLOC_CONF: expandable_segments:True needs a backend with virtual "
          "memory (cuMemMap); backend '" +
          std::string(backend_.name()) + "' has none");
    }
    const std::size_t g = vm_->granularity();
    if (g == 0 || kSmallBuffer % g != 0 || kLargeBuffer % g != 0) {
      throw ConfigError(
          "CACHEALLOC_CONF: expandable_segments:True needs a page granularity that "
          "divides 2 MiB; backend '" +
          std::string(backend_.name()) + "' has " + std::to_string(g) + " bytes");
    }
  }
}

Core::~Core() { release_everything(); }

/// Note [The native malloc path]
/// 1. round the request (native_round_size) and pick the pool (small: <= 1 MiB);
/// 2. get_free_block: best fit in the stream's free set, subject to the max_split_size rules;
/// 3. otherwise: garbage collection (if enabled), then a new reservation (alloc_block);
///    on failure release oversize cached blocks and retry; then release every cached block and
///    retry; then give up (empty Block).
/// 4. alloc_found_block: split off the remainder when should_split says so.
cachealloc::Block Core::allocate(std::size_t bytes, StreamId stream) {
  if (bytes > (std::numeric_limits<std::size_t>::max() >> 2)) {
    ++counters_.failures;  // no device has that much; rounding it would overflow
    return {};
  }
  reserve_spares(4, 2 * segments_.size() + 8);
  const std::size_t size = native_round_size(bytes, settings_);
  Pool& pool = size <= kSmallSize ? small_ : large_;
  const std::size_t alloc_size = native_allocation_size(size);

  Block* block = get_free_block(pool, size, stream);
  if (block == nullptr) {
    if (gc_enabled()) {
      garbage_collect_cached_blocks();
    }
    block = alloc_block(pool, size, alloc_size, stream);
    if (block == nullptr && release_available_cached_blocks(pool, size, stream)) {
      block = alloc_block(pool, size, alloc_size, stream);
    }
    if (block == nullptr) {
      release_cached_blocks();
      ++counters_.alloc_retries;
      block = alloc_block(pool, size, alloc_size, stream);
    }
    if (block == nullptr) {
      ++counters_.failures;
      return {};
    }
  }
  block = alloc_found_block(block, size, should_split(block, size));
  return cachealloc::Block{reinterpret_cast<void*>(block->addr), block->size, block};
}

void Core::deallocate(Block* block) noexcept {
  // PyTorch's free_block: merge with the free neighbours (lower address first), then cache.
  block->allocated = false;
  try_merge(block, block->prev);
  try_merge(block, block->next);
  cache(block);
}

Block* Core::get_free_block(Pool& pool, std::size_t size, StreamId stream) {
  if (gc_enabled()) {
    ++pool.get_free_block_calls;  // ages every cached block by one
  }
  auto it = pool.free_blocks.lower_bound(SizeKey{stream, size, 0});
  if (it == pool.free_blocks.end() || it->stream != stream) {
    return nullptr;
  }
  if (it->block->segment->expandable) {
    // Best fit by the size a block can grow to: a block followed by unmapped pages can take any
    // size, so prefer a larger block that cannot grow (keeps the segment's tail for growth).
    auto expandable_size = [](const Block* b) {
      return b->size + (b->next != nullptr && !b->next->mapped ? b->next->size : 0);
    };
    auto next = std::next(it);
    while (it->block->segment->expandable && next != pool.free_blocks.end() &&
           next->stream == stream && expandable_size(next->block) < expandable_size(it->block)) {
      it = next++;
    }
  }
  const std::size_t found = it->size;
  if (size < settings_.max_split_size && found >= settings_.max_split_size) {
    return nullptr;  // an oversize block never serves a small request
  }
  if (size >= settings_.max_split_size && found >= size + settings_.max_non_split_rounding_size) {
    return nullptr;  // ... and serves a large one only if it wastes less than the rounding limit
  }
  Block* block = it->block;
  cached_ -= block->size;
  pool.free_blocks.erase(it);
  return block;
}

bool Core::should_split(const Block* block, std::size_t size) const noexcept {
  const std::size_t remaining = block->size - size;
  if (block->pool->small || settings_.expandable_segments) {
    return remaining >= kMinBlockSize;
  }
  return size < settings_.max_split_size && remaining > kSmallSize;
}

Block* Core::alloc_found_block(Block* block, std::size_t size, bool split_remainder) {
  if (split_remainder) {
    // The front `size` bytes become a new allocated block; `block` keeps the rest and is cached.
    Block* remaining = block;
    Block* front = arena_.make();
    front->addr = remaining->addr;
    front->size = size;
    front->stream = remaining->stream;
    front->segment = remaining->segment;
    front->pool = remaining->pool;
    front->prev = remaining->prev;
    if (front->prev != nullptr) {
      front->prev->next = front;
    } else {
      front->segment->head = front;
    }
    front->next = remaining;
    remaining->prev = front;
    remaining->addr += size;
    remaining->size -= size;
    cache(remaining);
    block = front;
  }
  block->allocated = true;
  return block;
}

void Core::cache(Block* block) {
  block->gc_count_base = block->pool->get_free_block_calls;
  block->pool->free_blocks.insert(FreeEntry{block->stream, block->size, block->addr, block});
  cached_ += block->size;
}

void Core::uncache(Block* block) noexcept {
  if (block->mapped) {
    // The key is the one cache() inserted: a cached block's address and size never change.
    block->pool->free_blocks.erase(SizeKey{block->stream, block->size, block->addr});
    cached_ -= block->size;
  } else {
    block->pool->unmapped.erase(block);
  }
}

/// Merges free `src` into `dst` (its neighbour) when their states allow; returns bytes absorbed.
std::size_t Core::try_merge(Block* dst, Block* src) noexcept {
  if (src == nullptr || src->allocated || dst->mapped != src->mapped) {
    return 0;
  }
  uncache(src);
  if (dst->prev == src) {  // [src dst]
    dst->addr = src->addr;
    dst->prev = src->prev;
    if (dst->prev != nullptr) {
      dst->prev->next = dst;
    } else {
      dst->segment->head = dst;
    }
  } else {  // [dst src]
    dst->next = src->next;
    if (dst->next != nullptr) {
      dst->next->prev = dst;
    }
  }
  const std::size_t absorbed = src->size;
  dst->size += absorbed;
  arena_.destroy(src);
  return absorbed;
}

// ------------------------------------------------------------------------------------------------
// Core: reservations and their release
// ------------------------------------------------------------------------------------------------

void Core::record(SegmentEvent::Kind kind, std::uint64_t size, std::uint64_t addr,
                  StreamId stream) noexcept {
  if (record_) {
    try {
      events_.push_back(SegmentEvent{kind, size, addr, stream});
    } catch (...) {  // reserve_spares makes room first; this is the last line of defence
      ++counters_.events_lost;
    }
  }
}

/// Note [No allocation on free]
/// deallocate() is noexcept and must not run out of memory halfway through merging. Every set
/// node of the unmapped sets comes from `nodes_`, and a Block sits in at most one set, so keeping
/// at least one node slot per live Block means that set never allocates on free. The free indexes
/// are B+trees: reserve_total makes every insert allocation-free until they hold every live
/// Block (a free index never holds more). The calls that create Blocks (allocate, the unmapping
/// in release_cached) first make room for the Blocks, nodes and segment events they may need,
/// before they change anything, so a bad_alloc leaves the state intact.
void Core::reserve_spares(std::size_t blocks, std::size_t events) {
  arena_.reserve(blocks);
  nodes_.reserve(arena_.live() + blocks);
  small_.free_blocks.reserve_total(arena_.live() + blocks);
  large_.free_blocks.reserve_total(arena_.live() + blocks);
  if (record_ && events_.capacity() - events_.size() < events) {
    events_.reserve(std::max(2 * events_.capacity(), events_.size() + events));  // geometric
  }
}

Segment* Core::add_segment(std::uintptr_t addr, std::size_t size, StreamId stream, Pool& pool) {
  auto segment = std::make_unique<Segment>();
  segment->addr = addr;
  segment->size = size;
  segment->stream = stream;
  segment->pool = &pool;
  segment->index = segments_.size();
  segments_.push_back(std::move(segment));
  return segments_.back().get();
}

void Core::remove_segment(Segment* segment) noexcept {
  const std::size_t i = segment->index;
  if (i + 1 != segments_.size()) {
    segments_[i] = std::move(segments_.back());
    segments_[i]->index = i;
  }
  segments_.pop_back();
}

/// PyTorch's alloc_block: a new reservation of `alloc_size` (or expandable growth), not cached.
Block* Core::alloc_block(Pool& pool, std::size_t size, std::size_t alloc_size, StreamId stream) {
  if (settings_.expandable_segments) {
    // PyTorch checks the memory fraction against the full allocation size here too.
    if (backend_.limit() != DeviceBackend::kNoLimit && reserved_ + alloc_size > backend_.limit()) {
      return nullptr;
    }
    return try_allocate_expandable_block(pool, size, stream);
  }
  void* ptr = backend_.reserve(alloc_size);
  if (ptr == nullptr) {
    return nullptr;
  }
  Segment* segment = nullptr;
  Block* block = nullptr;
  try {
    segment = add_segment(reinterpret_cast<std::uintptr_t>(ptr), alloc_size, stream, pool);
    block = arena_.make();
  } catch (...) {  // bad_alloc: give the reservation back, leave the state as it was
    if (segment != nullptr) {
      remove_segment(segment);
    }
    backend_.release(ptr, alloc_size);
    throw;
  }
  block->addr = segment->addr;
  block->size = alloc_size;
  block->stream = stream;
  block->segment = segment;
  block->pool = &pool;
  segment->head = block;
  reserved_ += alloc_size;
  ++counters_.segment_allocs;
  record(SegmentEvent::alloc, alloc_size, segment->addr, stream);
  return block;
}

/// PyTorch's release_block: gives a whole free (unsplit, cached) reservation back.
void Core::release_block(Block* block) noexcept {
  Segment* segment = block->segment;
  uncache(block);
  record(SegmentEvent::free, segment->size, segment->addr, segment->stream);
  backend_.release(reinterpret_cast<void*>(segment->addr), segment->size);
  reserved_ -= segment->size;
  ++counters_.segment_frees;
  arena_.destroy(block);
  remove_segment(segment);
}

/// PyTorch's release_available_cached_blocks: only with max_split_size set, frees the smallest
/// oversize block of this stream that is at least max(size, max_split_size), or else the largest
/// oversize blocks until that many bytes were freed. True when enough was freed.
bool Core::release_available_cached_blocks(Pool& pool, std::size_t size, StreamId stream) {
  if (settings_.max_split_size == NativeSettings::kUnlimited) {
    return false;
  }
  const std::size_t wanted = std::max(size, settings_.max_split_size);
  auto it = pool.free_blocks.lower_bound(SizeKey{stream, wanted, 0});
  if (it == pool.free_blocks.end() || it->stream != stream || it->block->segment->expandable) {
    if (it == pool.free_blocks.begin()) {
      return false;
    }
    // Walk down from the largest block below `wanted`, collecting first: releasing changes the
    // free index, which invalidates its iterators.
    std::size_t released = 0;
    std::vector<Block*> release;
    --it;  // the largest block below `wanted`, hopefully on this stream
    while (released < wanted && it->size >= settings_.max_split_size && it->stream == stream) {
      // An oversize block is normally a whole reservation; a split one (possible only in corner
      // cases) cannot be given back on its own, so it is skipped rather than freed partially.
      Block* block = it->block;
      if (!block->segment->expandable && !block->is_split()) {
        released += block->size;
        release.push_back(block);
      }
      if (it == pool.free_blocks.begin()) {
        break;
      }
      --it;
    }
    for (Block* block : release) {  // PyTorch frees them even when they fall short
      release_block(block);
    }
    if (released < wanted) {
      return false;
    }
  } else {
    if (it->block->is_split()) {
      return false;
    }
    release_block(it->block);
  }
  ++counters_.oversize_releases;
  return true;
}

/// PyTorch's release_blocks: frees every unsplit cached reservation of `pool` and unmaps the free
/// pages of its expandable segments (dropping a segment once nothing in it is mapped).
void Core::release_blocks(Pool& pool) {
  std::vector<Block*> to_unmap;
  std::vector<Block*> to_release;  // collected first: releasing changes the free index
  for (const FreeEntry& e : pool.free_blocks) {
    Block* block = e.block;
    if (block->segment->expandable) {
      to_unmap.push_back(block);
    } else if (!block->is_split()) {
      to_release.push_back(block);
    }
  }
  for (Block* block : to_release) {
    release_block(block);
  }
  for (Block* block : to_unmap) {
    unmap_block(block);
    if (!block->is_split()) {
      release_expandable_segment(block);
    }
  }
}

/// PyTorch's release_cached_blocks (the front end has already waited for cross-stream frees).
void Core::release_cached_blocks() {
  ++counters_.full_releases;
  release_blocks(large_);
  release_blocks(small_);
}

std::size_t Core::release_cached() {
  reserve_spares(0, 2 * segments_.size() + small_.free_blocks.size() + large_.free_blocks.size());
  const std::size_t before = reserved_;
  release_cached_blocks();
  return before - reserved_;
}

/// Note [Garbage collection]
/// PyTorch ages every cached block by the number of get_free_block calls on its pool since it was
/// cached. When reserved memory exceeds threshold * allowed memory, it frees whole cached
/// large-pool reservations at least as old as the average, repeating with the new average until
/// it reclaimed the excess (or nothing is left to free). PyTorch only does this under a memory
/// fraction; here the allowed memory is the backend's usable memory (its limit, else its total).
void Core::garbage_collect_cached_blocks() {
  const auto gc_threshold = static_cast<std::size_t>(settings_.garbage_collection_threshold *
                                                     static_cast<double>(backend_.usable_memory()));
  if (reserved_ <= gc_threshold) {
    return;
  }
  const std::size_t target = reserved_ - gc_threshold;
  auto age = [this](const Block* b) {
    return static_cast<std::size_t>(large_.get_free_block_calls - b->gc_count_base);
  };
  std::size_t total_age = 0;
  std::size_t freeable = 0;
  for (const FreeEntry& e : large_.free_blocks) {
    if (!e.block->is_split()) {
      total_age += age(e.block);
      ++freeable;
    }
  }
  if (freeable == 0) {
    return;
  }
  std::size_t reclaimed = 0;
  bool freed_any = true;
  bool released = false;
  while (reclaimed < target && freed_any && freeable > 0) {
    const double age_threshold = static_cast<double>(total_age) / static_cast<double>(freeable);
    freed_any = false;
    std::vector<Block*> old_enough;  // collected first: releasing changes the free index
    for (const FreeEntry& e : large_.free_blocks) {
      if (!e.block->is_split() && !e.block->segment->expandable &&
          static_cast<double>(age(e.block)) >= age_threshold) {
        old_enough.push_back(e.block);
      }
    }
    for (Block* block : old_enough) {
      freed_any = true;
      released = true;
      reclaimed += block->size;
      total_age -= age(block);
      --freeable;
      release_block(block);
    }
  }
  if (released) {
    ++counters_.gc_runs;
  }
}

// ------------------------------------------------------------------------------------------------
// Core: inspection
// ------------------------------------------------------------------------------------------------

void Core::visit_segments(const std::function<void(const SegmentView&)>& visitor) const {
  for (const auto& segment : segments_) {
    if (!segment->expandable) {
      SegmentView view{segment->addr, segment->size, segment->stream, segment->pool->small, {}};
      for (const Block* b = segment->head; b != nullptr; b = b->next) {
        view.blocks.push_back(BlockView{b->addr, b->size, b->allocated});
      }
      visitor(view);
      continue;
    }
    // An expandable segment shows as one segment per contiguous mapped range, as PyTorch's
    // snapshot does.
    const Block* b = segment->head;
    while (b != nullptr) {
      if (!b->mapped) {
        b = b->next;
        continue;
      }
      SegmentView view{b->addr, 0, segment->stream, segment->pool->small, {}};
      for (; b != nullptr && b->mapped; b = b->next) {
        view.size += b->size;
        view.blocks.push_back(BlockView{b->addr, b->size, b->allocated});
      }
      visitor(view);
    }
  }
}

/// Checks (throwing InvariantError): every segment is tiled by its block list without gaps or
/// overlap; the head is the first block; blocks agree with their segment on stream and pool; free
/// neighbours of equal mapped state never touch; every free mapped block is in its pool's free set
/// and every unmapped one in the unmapped set, and nothing else is; reserved and cached totals
/// match; expandable page tables agree with the blocks.
void Core::check_invariants() const {
  std::size_t reserved = 0;
  std::size_t cached = 0;
  std::size_t free_small = 0;
  std::size_t free_large = 0;
  std::size_t unmapped_small = 0;
  std::size_t unmapped_large = 0;
  std::size_t blocks = 0;
  for (std::size_t i = 0; i < segments_.size(); ++i) {
    const Segment& s = *segments_[i];
    CACHEALLOC_CHECK_INVARIANT(s.index == i, "segment index out of date");
    CACHEALLOC_CHECK_INVARIANT(s.head != nullptr && s.head->prev == nullptr,
                               "segment head is not first");
    CACHEALLOC_CHECK_INVARIANT(s.head->addr == s.addr, "segment head does not start the segment");
    std::uintptr_t expect = s.addr;
    const Block* prev = nullptr;
    for (const Block* b = s.head; b != nullptr; b = b->next) {
      ++blocks;
      CACHEALLOC_CHECK_INVARIANT(b->segment == &s, "block points to another segment");
      CACHEALLOC_CHECK_INVARIANT(b->prev == prev, "broken prev link");
      CACHEALLOC_CHECK_INVARIANT(b->addr == expect, "gap or overlap between neighbouring blocks");
      CACHEALLOC_CHECK_INVARIANT(b->size > 0, "empty block");
      CACHEALLOC_CHECK_INVARIANT(b->stream == s.stream, "block stream differs from its segment's");
      CACHEALLOC_CHECK_INVARIANT(b->pool == s.pool, "block pool differs from its segment's");
      CACHEALLOC_CHECK_INVARIANT(s.expandable || b->mapped,
                                 "unmapped block in a plain reservation");
      CACHEALLOC_CHECK_INVARIANT(!(b->allocated && !b->mapped), "allocated block is not mapped");
      if (prev != nullptr && !prev->allocated && !b->allocated) {
        CACHEALLOC_CHECK_INVARIANT(prev->mapped != b->mapped,
                                   "two free neighbours were not merged");
      }
      if (!b->allocated) {
        if (b->mapped) {
          auto entry = b->pool->free_blocks.find(SizeKey{b->stream, b->size, b->addr});
          CACHEALLOC_CHECK_INVARIANT(
              entry != b->pool->free_blocks.end() && entry->block == b,
              "free block missing from its pool");
          cached += b->size;
          ++(b->pool->small ? free_small : free_large);
        } else {
          CACHEALLOC_CHECK_INVARIANT(b->pool->unmapped.count(const_cast<Block*>(b)) == 1,
                                     "unmapped block missing from its pool");
          ++(b->pool->small ? unmapped_small : unmapped_large);
        }
      }
      expect += b->size;
      prev = b;
    }
    CACHEALLOC_CHECK_INVARIANT(expect == s.addr + s.size, "blocks do not cover their segment");
    if (s.expandable) {
      check_expandable_segment(s);
      reserved += s.mapped_bytes;
    } else {
      reserved += s.size;
    }
  }
  for (const Pool* pool : {&small_, &large_}) {
    try {
      pool->free_blocks.check();
    } catch (const std::logic_error& e) {
      throw InvariantError(std::string("native: a pool's free index is broken: ") + e.what());
    }
  }
  CACHEALLOC_CHECK_INVARIANT(
      free_small == small_.free_blocks.size() && free_large == large_.free_blocks.size(),
      "a pool's free set holds blocks that are not free");
  CACHEALLOC_CHECK_INVARIANT(
      unmapped_small == small_.unmapped.size() && unmapped_large == large_.unmapped.size(),
      "a pool's unmapped set holds blocks that are not unmapped");
  CACHEALLOC_CHECK_INVARIANT(blocks == arena_.live(), "block leaked or double-counted");
  CACHEALLOC_CHECK_INVARIANT(reserved == reserved_,
                             "running reserved total is wrong: " + std::to_string(reserved_) +
                                 " vs " + std::to_string(reserved));
  CACHEALLOC_CHECK_INVARIANT(cached == cached_, "running cached total is wrong");
}

}  // namespace native_detail

// ------------------------------------------------------------------------------------------------
// NativePolicy: the contract, forwarding to Core
// ------------------------------------------------------------------------------------------------

NativePolicy::NativePolicy(DeviceBackend& backend, Config& config)
    : NativePolicy(backend, NativeSettings::from_config(config)) {}

NativePolicy::NativePolicy(DeviceBackend& backend, const NativeSettings& settings)
    : core_(std::make_unique<Core>(backend, settings)) {}

NativePolicy::~NativePolicy() = default;

Block NativePolicy::allocate(std::size_t bytes, StreamId stream) {
  return core_->allocate(bytes, stream);
}

void NativePolicy::deallocate(const Block& block, StreamId /*stream*/) noexcept {
  core_->deallocate(static_cast<native_detail::Block*>(block.cookie));
}

std::size_t NativePolicy::release_cached() { return core_->release_cached(); }
std::size_t NativePolicy::reserved_bytes() const noexcept { return core_->reserved(); }
void NativePolicy::check_invariants() const { core_->check_invariants(); }

void NativePolicy::visit_segments_impl(
    const std::function<void(const SegmentView&)>& visitor) const {
  core_->visit_segments(visitor);
}

std::string_view NativePolicy::oom_hint() {
  return "If reserved but unallocated memory is large, try CACHEALLOC_CONF=policy:native,"
         "expandable_segments:True to avoid fragmentation (PyTorch's own advice for its "
         "allocator).";
}

const NativeSettings& NativePolicy::settings() const noexcept { return core_->settings(); }
const NativeCounters& NativePolicy::counters() const noexcept { return core_->counters(); }
std::size_t NativePolicy::cached_bytes() const noexcept { return core_->cached(); }
std::size_t NativePolicy::segment_count() const noexcept { return core_->segment_count(); }
void NativePolicy::set_record_segments(bool on) { core_->set_record(on); }
const std::vector<SegmentEvent>& NativePolicy::segment_events() const noexcept {
  return core_->events();
}
void NativePolicy::clear_segment_events() noexcept { core_->clear_events(); }

}  // namespace cachealloc
