// async.cpp: policy `async`, a per-stream front cache over a stream-ordered pool (see async.h).
#include <cachealloc/errors.h>
#include <cachealloc/policies/async.h>
#include <cachealloc/policies/size_class.h>

#include <algorithm>
#include <string>
#include <unordered_set>

namespace cachealloc {
namespace {

StreamOrderedMemory& require_pool(DeviceBackend& backend) {
  StreamOrderedMemory* pool = backend.stream_ordered();
  if (pool == nullptr) {
    throw ConfigError("policy 'async' needs a backend with a stream-ordered pool (cudaMallocAsync); "
                      "backend '" + std::string(backend.name()) + "' has none");
  }
  return *pool;
}

}  // namespace

std::vector<std::string_view> AsyncPolicy::config_keys() {
  return {"async_cache_mb", "async_cache_max_block", "async_small_slabs", "async_recent_blocks",
          "async_release_threshold",
          "async_reuse_follow_event_dependencies",
          "async_reuse_allow_opportunistic", "async_reuse_allow_internal_dependencies"};
}

AsyncPolicy::AsyncPolicy(DeviceBackend& backend, Config& config)
    : backend_(backend), pool_(require_pool(backend)) {
  if (auto mb = config.take_bytes("async_cache_mb")) {
    cache_limit_ = *mb;
  }
  if (auto max = config.take_bytes("async_cache_max_block")) {
    cache_max_block_ = *max;
  }
  if (auto slabs = config.take_bool("async_small_slabs")) {
    slabs_enabled_ = *slabs;
  }
  if (auto n = config.take_int("async_recent_blocks", 0, static_cast<std::int64_t>(kMaxRecent))) {
    recent_limit_ = static_cast<std::size_t>(*n);
  }
  if (cache_limit_ == 0) {
    recent_limit_ = 0;  // async_cache_mb:0: every block from the pool
  }
  // The CUDA backend already took these keys when it created its pool; taking them again is
  // harmless (same values) and is how the simulated pool gets them.
  StreamOrderedOptions o = pool_.pool_options();
  bool any = false;
  if (auto v = config.take_bytes("async_release_threshold")) {
    o.release_threshold = *v;
    any = true;
  }
  if (auto v = config.take_bool("async_reuse_follow_event_dependencies")) {
    o.reuse_follow_event_dependencies = *v;
    any = true;
  }
  if (auto v = config.take_bool("async_reuse_allow_opportunistic")) {
    o.reuse_allow_opportunistic = *v;
    any = true;
  }
  if (auto v = config.take_bool("async_reuse_allow_internal_dependencies")) {
    o.reuse_allow_internal_dependencies = *v;
    any = true;
  }
  if (any) {
    pool_.set_pool_options(o);
  }
  refresh_reserved();
}

AsyncPolicy::~AsyncPolicy() { drain_cache(); }

std::size_t AsyncPolicy::rounded_size(std::size_t bytes) noexcept {
  return bytes <= kSmallMax ? SizeClassPolicy::small_class_size(bytes) : round_up(bytes, 512);
}

AsyncPolicy::StreamCache* AsyncPolicy::find_cache(StreamId stream) noexcept {
  if (last_cache_ != nullptr && last_cache_->stream == stream) {
    return last_cache_;
  }
  for (auto& c : caches_) {
    if (c->stream == stream) {
      last_cache_ = c.get();
      return last_cache_;
    }
  }
  return nullptr;
}

AsyncPolicy::StreamCache& AsyncPolicy::cache(StreamId stream) {
  if (StreamCache* c = find_cache(stream)) {
    return *c;
  }
  drain_recent();  // a second stream: the recent FIFO is for single-stream jobs
  caches_.push_back(std::make_unique<StreamCache>(StreamCache{stream, {}, {}, nullptr}));
  last_cache_ = caches_.back().get();
  return *last_cache_;
}

// ---- small blocks from slabs (Note [Small blocks from slabs]) ----

AsyncPolicy::Slab* AsyncPolicy::new_slab(StreamId stream) {
  auto slab = std::make_unique<Slab>();
  void* base = pool_allocate(kSlabBytes, stream);
  if (base == nullptr) {
    return nullptr;
  }
  slab->base = reinterpret_cast<std::uintptr_t>(base);
  slab->stream = stream;
  try {
    slabs_.push_back(std::move(slab));
  } catch (...) {
    free_to_pool(base, stream);
    throw;
  }
  slab_bytes_ += kSlabBytes;
  return slabs_.back().get();  // reserved bytes are read lazily (Note [Reserved bytes read lazily])
}

Block AsyncPolicy::allocate_small(std::size_t size, StreamId stream) {
  StreamCache& c = cache(stream);
  auto& list = c.small_free[size];
  if (!list.empty()) {
    const auto [ptr, slab] = list.back();
    list.pop_back();
    ++slab->live;
    small_live_bytes_ += size;
    ++cache_hits_;
    return {ptr, size, slab};
  }
  Slab* slab = c.carving;
  if (slab == nullptr || kSlabBytes - slab->carved < size) {
    slab = new_slab(stream);
    if (slab == nullptr) {
      // Note [Out of memory in async]: give back what the policy holds unused, then try again.
      drain_cache();
      release_empty_slabs();
      slab = new_slab(stream);
      if (slab == nullptr) {
        return {};
      }
    }
    // The old slab (if any) keeps its uncarved tail until it empties and goes back whole.
    c.carving = slab;
  }
  void* ptr = reinterpret_cast<void*>(slab->base + slab->carved);
  slab->carved += size;
  ++slab->carved_blocks;
  ++slab->live;
  small_live_bytes_ += size;
  return {ptr, size, slab};
}

void AsyncPolicy::free_small(Block block) noexcept {
  auto* slab = static_cast<Slab*>(block.cookie);
  --slab->live;
  small_live_bytes_ -= block.size;
  // Never null: allocate_small created the stream's cache before it carved the slab.
  StreamCache* c = find_cache(slab->stream);
  if (slab->live == 0 && slab != c->carving) {
    // Its other blocks are on the lists; this one never gets there.
    release_slab(slab);
    return;
  }
  try {
    c->small_free[block.size].emplace_back(block.ptr, slab);
  } catch (...) {
    // No memory for the list entry: the block stays out of the lists, its slab never empties
    // (its memory stays with the policy until the allocator is destroyed: never handed out twice).
    ++slab->live;
    small_live_bytes_ += block.size;
  }
}

void AsyncPolicy::release_slab(Slab* slab) noexcept {
  StreamCache* c = find_cache(slab->stream);  // never null, as in free_small
  if (c->carving == slab) {
    c->carving = nullptr;
  }
  for (auto& [size, list] : c->small_free) {
    std::erase_if(list, [&](const std::pair<void*, Slab*>& e) { return e.second == slab; });
  }
  free_to_pool(reinterpret_cast<void*>(slab->base), slab->stream);
  slab_bytes_ -= kSlabBytes;
  std::erase_if(slabs_, [&](const std::unique_ptr<Slab>& s) { return s.get() == slab; });
}

void AsyncPolicy::release_empty_slabs() noexcept {
  // Backwards: release_slab erases slabs_[i], which leaves the ones before it in place.
  for (std::size_t i = slabs_.size(); i-- > 0;) {
    if (slabs_[i]->live == 0) {
      release_slab(slabs_[i].get());
    }
  }
}

// ---- every request ----

Block AsyncPolicy::allocate(std::size_t bytes, StreamId stream) {
  const std::size_t size = rounded_size(bytes);
  if (from_slab(size)) {
    return allocate_small(size, stream);
  }
  if (cached_bytes_ > 0) {
    StreamCache& c = cache(stream);
    if (auto it = c.by_size.find(size); it != c.by_size.end() && !it->second.empty()) {
      void* ptr = it->second.back();
      it->second.pop_back();
      cached_bytes_ -= size;
      live_bytes_ += size;
      ++cache_hits_;
      return {ptr, size, nullptr};
    }
  }
  if (recent_bytes_ > 0) {
    if (StreamCache* c = find_cache(stream); c != nullptr && c->recent_count > 0) {
      if (void* ptr = take_recent(*c, size)) {
        live_bytes_ += size;
        ++cache_hits_;
        return {ptr, size, nullptr};
      }
    }
    drain_recent();  // before the pool may grow
  }
  void* ptr = pool_allocate(size, stream);
  if (ptr == nullptr && cached_bytes_ + recent_bytes_ > 0) {
    drain_cache();  // Note [Out of memory in async]
    ptr = pool_allocate(size, stream);
  }
  if (ptr == nullptr) {
    return {};  // the front end's retry chain reads the reserved bytes before it reports
  }
  live_bytes_ += size;
  return {ptr, size, nullptr};
}

void AsyncPolicy::deallocate(const Block& block, StreamId stream) noexcept {
  if (block.cookie != nullptr) {
    free_small(block);
    return;
  }
  live_bytes_ -= block.size;
  if (block.size <= cache_max_block_ &&
      block.size <= cache_limit_ - std::min(cache_limit_, cached_bytes_)) {
    try {
      cache(stream).by_size[block.size].push_back(block.ptr);
      cached_bytes_ += block.size;
      return;
    } catch (...) {  // NOLINT(bugprone-empty-catch): no memory for the cache: give it to the pool
    }
  }
  if (recent_limit_ > 0 && caches_.size() <= 1) {  // one stream only (Note [Recently freed ...])
    try {
      push_recent(cache(stream), block.ptr, block.size);
      return;
    } catch (...) {  // NOLINT(bugprone-empty-catch): no memory for the stream's cache: to the pool
    }
  }
  free_to_pool(block.ptr, stream);
}

/// Adds the time of one pool call to a counter when the scope ends, exception or not.
class AsyncPolicy::PoolCallTimer {
 public:
  explicit PoolCallTimer(AsyncPolicy& p) noexcept : p_(p), start_(p.backend_.clock_ns()) {}
  ~PoolCallTimer() {
    ++p_.pool_calls_;
    p_.pool_ns_ += p_.backend_.clock_ns() - start_;
  }
  PoolCallTimer(const PoolCallTimer&) = delete;
  PoolCallTimer& operator=(const PoolCallTimer&) = delete;

 private:
  AsyncPolicy& p_;
  std::uint64_t start_;
};

void* AsyncPolicy::pool_allocate(std::size_t bytes, StreamId stream) {
  PoolCallTimer timer(*this);
  return pool_.allocate_async(bytes, stream);
}

void AsyncPolicy::free_to_pool(void* ptr, StreamId stream) noexcept {
  {
    PoolCallTimer timer(*this);
    pool_.free_async(ptr, stream);
  }
  if (std::find(freed_on_.begin(), freed_on_.end(), stream) == freed_on_.end()) {
    try {
      freed_on_.push_back(stream);
    } catch (...) {  // NOLINT(bugprone-empty-catch): release_cached then waits for fewer streams
    }
  }
}

void* AsyncPolicy::remove_recent(StreamCache& c, std::size_t i) noexcept {
  const auto [ptr, size] = c.recent[i];
  std::copy(c.recent.begin() + static_cast<std::ptrdiff_t>(i) + 1,
            c.recent.begin() + static_cast<std::ptrdiff_t>(c.recent_count),
            c.recent.begin() + static_cast<std::ptrdiff_t>(i));
  --c.recent_count;
  recent_bytes_ -= size;
  return ptr;
}

void* AsyncPolicy::take_recent(StreamCache& c, std::size_t size) noexcept {
  for (std::size_t i = c.recent_count; i-- > 0;) {  // newest first
    if (c.recent[i].second == size) {
      return remove_recent(c, i);
    }
  }
  return nullptr;
}

void AsyncPolicy::push_recent(StreamCache& c, void* ptr, std::size_t size) noexcept {
  if (c.recent_count == recent_limit_) {  // the oldest goes to the pool
    free_to_pool(remove_recent(c, 0), c.stream);
  }
  c.recent[c.recent_count++] = {ptr, size};
  recent_bytes_ += size;
}

void AsyncPolicy::flush_recent(StreamCache& c) noexcept {
  for (std::size_t i = 0; i < c.recent_count; ++i) {
    free_to_pool(c.recent[i].first, c.stream);
    recent_bytes_ -= c.recent[i].second;
  }
  c.recent_count = 0;
}

void AsyncPolicy::drain_recent() noexcept {
  for (auto& c : caches_) {
    flush_recent(*c);
  }
}

void AsyncPolicy::drain_cache() noexcept {
  for (auto& c : caches_) {
    flush_recent(*c);
    for (auto& [size, ptrs] : c->by_size) {
      for (void* p : ptrs) {
        free_to_pool(p, c->stream);
      }
      cached_bytes_ -= size * ptrs.size();
      ptrs.clear();
    }
  }
}

void AsyncPolicy::refresh_reserved() const noexcept {
  try {
    reserved_ = pool_.reserved_current();
  } catch (...) {  // NOLINT(bugprone-empty-catch): keep the last value the pool reported
  }
}

std::size_t AsyncPolicy::reserved_high() const noexcept {
  try {
    return pool_.reserved_high();
  } catch (...) {
    return reserved_;  // the front end's own peak stands
  }
}

void AsyncPolicy::reset_reserved_high() noexcept {
  try {
    pool_.reset_high_watermarks();
  } catch (...) {  // NOLINT(bugprone-empty-catch): the pool's high stays; the front end's peak is reset
  }
}

std::size_t AsyncPolicy::release_cached() {
  drain_cache();
  release_empty_slabs();
  // The pool releases only memory whose frees completed: wait for each stream we freed on (one
  // event each, never a device-wide synchronisation), visibly to the pool.
  while (!freed_on_.empty()) {
    pool_.wait_for_frees(freed_on_.back());
    freed_on_.pop_back();
  }
  const std::size_t before = pool_.reserved_current();
  pool_.trim_to(0);
  refresh_reserved();
  return before > reserved_ ? before - reserved_ : 0;
}

void AsyncPolicy::check_invariants() const {
  std::size_t cached = 0;
  std::unordered_set<void*> seen;
  for (const auto& c : caches_) {
    for (const auto& [size, ptrs] : c->by_size) {
      CACHEALLOC_CHECK_INVARIANT(size == rounded_size(size), "a cache list of an unrounded size");
      for (void* p : ptrs) {
        CACHEALLOC_CHECK_INVARIANT(seen.insert(p).second, "a block is cached twice");
      }
      cached += size * ptrs.size();
    }
  }
  CACHEALLOC_CHECK_INVARIANT(cached == cached_bytes_, "cached_bytes is not the sum of the cache");
  std::size_t recent = 0;
  for (const auto& c : caches_) {
    CACHEALLOC_CHECK_INVARIANT(c->recent_count <= recent_limit_, "a recent FIFO holds more than its limit");
    for (std::size_t i = 0; i < c->recent_count; ++i) {
      const auto [p, size] = c->recent[i];
      CACHEALLOC_CHECK_INVARIANT(p != nullptr && size == rounded_size(size) && !from_slab(size),
                                 "a recent FIFO holds a block that is not a large rounded one");
      CACHEALLOC_CHECK_INVARIANT(seen.insert(p).second, "a recent block is also cached or listed");
      recent += size;
    }
  }
  CACHEALLOC_CHECK_INVARIANT(recent == recent_bytes_, "recent_bytes is not the sum of the FIFOs");
  CACHEALLOC_CHECK_INVARIANT(cached_bytes_ <= cache_limit_, "the front cache exceeds its limit");
  // Slabs: every carved byte is live or on its stream's list, once; lists hold only their
  // stream's slabs' blocks, inside the carved part.
  std::unordered_map<const Slab*, std::size_t> free_blocks;
  std::size_t free_small_bytes = 0;
  for (const auto& c : caches_) {
    for (const auto& [size, list] : c->small_free) {
      CACHEALLOC_CHECK_INVARIANT(size <= kSmallMax && size == rounded_size(size),
                                 "a small free list of a size that is not a class");
      for (const auto& [p, slab] : list) {
        const auto a = reinterpret_cast<std::uintptr_t>(p);
        CACHEALLOC_CHECK_INVARIANT(slab->stream == c->stream, "a small block on another stream's list");
        CACHEALLOC_CHECK_INVARIANT(a >= slab->base && a + size <= slab->base + slab->carved,
                                   "a listed small block outside its slab's carved bytes");
        CACHEALLOC_CHECK_INVARIANT(seen.insert(p).second, "a small block listed twice");
        ++free_blocks[slab];
        free_small_bytes += size;
      }
    }
    if (c->carving != nullptr) {
      CACHEALLOC_CHECK_INVARIANT(c->carving->stream == c->stream, "a stream carves another's slab");
    }
  }
  std::size_t carved = 0;
  for (const auto& s : slabs_) {
    CACHEALLOC_CHECK_INVARIANT(s->carved <= kSlabBytes, "a slab carved past its end");
    const std::size_t listed = free_blocks.count(s.get()) != 0 ? free_blocks[s.get()] : 0;
    CACHEALLOC_CHECK_INVARIANT(s->live + listed == s->carved_blocks,
                               "a slab's live and listed blocks differ from the blocks carved");
    carved += s->carved;
    free_blocks.erase(s.get());
  }
  CACHEALLOC_CHECK_INVARIANT(free_blocks.empty(), "a listed small block of a slab no longer held");
  CACHEALLOC_CHECK_INVARIANT(slab_bytes_ == slabs_.size() * kSlabBytes, "slab bytes out of step");
  CACHEALLOC_CHECK_INVARIANT(carved == small_live_bytes_ + free_small_bytes,
                             "carved bytes differ from live + listed small bytes");
  CACHEALLOC_CHECK_INVARIANT(cached_bytes_ + recent_bytes_ + live_bytes_ + slab_bytes_ <= pool_.used_current(),
                             "cached + recent + live + slab bytes exceed the pool's used bytes");
  pool_.check_invariants();
}

}  // namespace cachealloc
