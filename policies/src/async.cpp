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
  return {"async_cache_mb", "async_cache_max_block", "async_release_threshold", "async_reuse_follow_event_dependencies",
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

AsyncPolicy::StreamCache& AsyncPolicy::cache(StreamId stream) {
  if (last_cache_ != nullptr && last_cache_->stream == stream) {
    return *last_cache_;
  }
  for (auto& c : caches_) {
    if (c->stream == stream) {
      last_cache_ = c.get();
      return *c;
    }
  }
  caches_.push_back(std::make_unique<StreamCache>(StreamCache{stream, {}}));
  last_cache_ = caches_.back().get();
  return *last_cache_;
}

Block AsyncPolicy::allocate(std::size_t bytes, StreamId stream) {
  const std::size_t size = rounded_size(bytes);
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
  void* ptr = pool_.allocate_async(size, stream);
  ++pool_calls_;
  if (ptr == nullptr && cached_bytes_ > 0) {
    drain_cache();  // Note [Out of memory in async]
    ptr = pool_.allocate_async(size, stream);
    ++pool_calls_;
  }
  refresh_reserved();
  if (ptr == nullptr) {
    return {};
  }
  live_bytes_ += size;
  return {ptr, size, nullptr};
}

void AsyncPolicy::deallocate(Block block, StreamId stream) noexcept {
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
  // No refresh_reserved() here: a free never changes the pool's reserved bytes (Note [Pool
  // attributes in the stats], allocator.h), and reading the attribute cost a driver call per free.
  free_to_pool(block.ptr, stream);
}

void AsyncPolicy::free_to_pool(void* ptr, StreamId stream) noexcept {
  pool_.free_async(ptr, stream);
  ++pool_calls_;
  if (std::find(freed_on_.begin(), freed_on_.end(), stream) == freed_on_.end()) {
    try {
      freed_on_.push_back(stream);
    } catch (...) {  // NOLINT(bugprone-empty-catch): release_cached then waits for fewer streams
    }
  }
}

void AsyncPolicy::drain_cache() noexcept {
  for (auto& c : caches_) {
    for (auto& [size, ptrs] : c->by_size) {
      for (void* p : ptrs) {
        free_to_pool(p, c->stream);
      }
      cached_bytes_ -= size * ptrs.size();
      ptrs.clear();
    }
  }
}

void AsyncPolicy::refresh_reserved() noexcept {
  try {
    reserved_ = pool_.reserved_current();
  } catch (...) {  // NOLINT(bugprone-empty-catch): keep the last value the pool reported
  }
}

std::size_t AsyncPolicy::release_cached() {
  drain_cache();
  // The pool releases only memory whose frees completed: wait for each stream we freed on (one
  // event each, never a device-wide synchronisation).
  while (!freed_on_.empty()) {
    const EventId event = backend_.record_event(freed_on_.back());
    try {
      backend_.synchronize_event(event);
    } catch (...) {
      backend_.destroy_event(event);
      throw;
    }
    backend_.destroy_event(event);
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
  CACHEALLOC_CHECK_INVARIANT(cached_bytes_ <= cache_limit_, "the front cache exceeds its limit");
  CACHEALLOC_CHECK_INVARIANT(cached_bytes_ + live_bytes_ <= pool_.used_current(),
                             "cached + live bytes exceed the pool's used bytes");
  pool_.check_invariants();
}

}  // namespace cachealloc
